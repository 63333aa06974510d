"""An enumerable preference problem where the KL-regularised optimum is known in closed form.

A *categorical bandit*: a few prompts ``x``, a handful of answers ``y`` per prompt, a reference
policy ``pi_ref(y | x)`` (a table of probabilities) and a hidden reward ``r(x, y)``. Everything
DPO's derivation (Rafailov et al. 2023, arXiv 2305.18290) talks about can be computed exactly:

* the optimum of ``max_pi E_{y~pi}[r(x, y)] - beta KL(pi(.|x) || pi_ref(.|x))`` is

      pi*(y | x) = pi_ref(y | x) exp(r(x, y) / beta) / Z(x),
      Z(x) = sum_y pi_ref(y | x) exp(r(x, y) / beta);

* the reward written through that policy, ``r = beta log(pi* / pi_ref) + beta log Z(x)``;
* Bradley-Terry preferences ``P(y_a > y_b | x) = sigmoid(r(x, y_a) - r(x, y_b))``, from which
  preference data is drawn (or deterministic preferences: the better answer always wins).

A *tabular* policy, one free logit per (prompt, answer), trained by DPO on those pairs, is the
learner of lesson 11: the log-ratio margin of a pair is linear in the logits, so DPO is a convex
(logistic-regression) problem here and its minimiser is the Bradley-Terry maximum-likelihood
reward fitted to the data, put through the closed form above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlcourse.kl import exact_kl
from rlcourse.regularised_optimum import kl_regularised_optimum
from rlcourse.losses.dpo import _check_beta, preference_loss

__all__ = ["CategoricalBandit", "train_tabular_policy"]


@dataclass
class CategoricalBandit:
    """``P`` prompts with ``K`` answers each: ``ref_logprobs`` (P, K) and ``reward`` (P, K)."""

    ref_logprobs: torch.Tensor
    reward: torch.Tensor

    def __post_init__(self):
        self.ref_logprobs = torch.as_tensor(self.ref_logprobs, dtype=torch.float64)
        self.reward = torch.as_tensor(self.reward, dtype=torch.float64)
        if self.ref_logprobs.dim() != 2 or self.ref_logprobs.shape[1] < 2:
            raise ValueError(f"ref_logprobs must have shape (prompts, answers >= 2), got {tuple(self.ref_logprobs.shape)}")
        if self.reward.shape != self.ref_logprobs.shape:
            raise ValueError(f"reward must have ref_logprobs' shape {tuple(self.ref_logprobs.shape)}, "
                             f"got {tuple(self.reward.shape)}")
        if not torch.isfinite(self.reward).all():
            raise ValueError("reward must be finite everywhere")
        if not torch.allclose(self.ref_logprobs.exp().sum(-1), torch.ones(self.n_prompts, dtype=torch.float64)):
            raise ValueError("ref_logprobs must be normalised: exp(ref_logprobs) must sum to 1 over each row")

    @classmethod
    def random(cls, n_prompts: int = 3, n_answers: int = 5, reward_scale: float = 1.0,
               seed: int = 0) -> "CategoricalBandit":
        """A random bandit: reference logits ~ N(0, 1), rewards ~ reward_scale * N(0, 1)."""
        if n_prompts < 1 or n_answers < 2:
            raise ValueError(f"need n_prompts >= 1 and n_answers >= 2, got {n_prompts} and {n_answers}")
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(n_prompts, n_answers, generator=gen, dtype=torch.float64)
        reward = reward_scale * torch.randn(n_prompts, n_answers, generator=gen, dtype=torch.float64)
        return cls(torch.log_softmax(logits, -1), reward)

    @property
    def n_prompts(self) -> int:
        return self.ref_logprobs.shape[0]

    @property
    def n_answers(self) -> int:
        return self.ref_logprobs.shape[1]

    # --- the closed form -------------------------------------------------------------------------

    def log_partition(self, beta: float) -> torch.Tensor:
        """``log Z(x) = log sum_y pi_ref(y|x) exp(r(x, y) / beta)``, shape (P,)."""
        _check_beta(beta)
        return torch.logsumexp(self.ref_logprobs + self.reward / beta, dim=-1)

    def optimal_logprobs(self, beta: float) -> torch.Tensor:
        """``log pi*(y|x) = log pi_ref(y|x) + r(x, y) / beta - log Z(x)``, shape (P, K)."""
        _check_beta(beta)
        return kl_regularised_optimum(self.ref_logprobs, self.reward, beta)

    def objective(self, logprobs, beta: float) -> torch.Tensor:
        """``E_{y~pi}[r] - beta KL(pi || pi_ref)`` for each prompt, shape (P,)."""
        logprobs = torch.as_tensor(logprobs, dtype=torch.float64)
        return (logprobs.exp() * self.reward).sum(-1) - beta * self.kl(logprobs)

    def kl(self, logprobs, ref=None) -> torch.Tensor:
        """Exact ``KL(pi(.|x) || ref(.|x))`` per prompt (``ref`` defaults to ``pi_ref``), shape (P,)."""
        ref = self.ref_logprobs if ref is None else torch.as_tensor(ref, dtype=torch.float64)
        return exact_kl(torch.as_tensor(logprobs, dtype=torch.float64), ref)

    def implicit_reward(self, logprobs, beta: float) -> torch.Tensor:
        """``beta * (log pi(y|x) - log pi_ref(y|x))``, shape (P, K): the reward a policy implies,
        up to the per-prompt constant ``beta log Z(x)``."""
        _check_beta(beta)
        return beta * (torch.as_tensor(logprobs, dtype=torch.float64) - self.ref_logprobs)

    # --- preference data -------------------------------------------------------------------------

    def preference_probability(self, prompt, a, b) -> torch.Tensor:
        """Bradley-Terry ``P(a > b | x) = sigmoid(r(x, a) - r(x, b))`` (index tensors of one shape)."""
        prompt, a, b = (torch.as_tensor(v) for v in (prompt, a, b))
        return torch.sigmoid(self.reward[prompt, a] - self.reward[prompt, b])

    def sample_pairs(self, n: int, rng=None, deterministic: bool = False) -> dict[str, torch.Tensor]:
        """``n`` comparisons ``{"prompt", "chosen", "rejected"}`` (index tensors of shape (n,)).

        Prompts are uniform, the two answers are two *different* draws from ``pi_ref``, and the
        chosen one is drawn from Bradley-Terry, or (``deterministic=True``) is always the answer
        with the higher reward.
        """
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        cdf = self.ref_logprobs.exp().cumsum(-1).numpy()
        prompt = rng.integers(0, self.n_prompts, size=n)

        def draw(rows):  # inverse-CDF draws from pi_ref(.|x) for the prompts `rows`
            u = rng.random(len(rows))[:, None]
            return np.minimum((u > cdf[rows]).sum(-1), self.n_answers - 1)

        a, b = draw(prompt), draw(prompt)
        while np.any(same := a == b):   # redraw the second answer until the two differ
            b[same] = draw(prompt[same])
        p_a = self.preference_probability(torch.as_tensor(prompt), torch.as_tensor(a), torch.as_tensor(b)).numpy()
        a_wins = p_a > 0.5 if deterministic else rng.random(n) < p_a
        if deterministic and np.any(p_a == 0.5):
            raise ValueError("deterministic preferences need distinct rewards within each prompt")
        chosen, rejected = np.where(a_wins, a, b), np.where(a_wins, b, a)
        return {"prompt": torch.as_tensor(prompt), "chosen": torch.as_tensor(chosen),
                "rejected": torch.as_tensor(rejected)}


def train_tabular_policy(bandit: CategoricalBandit, pairs: dict, beta: float, loss_type="sigmoid",
                         steps: int = 500, lr: float = 0.5, record_every: int = 0) -> dict:
    """Fit a tabular softmax policy (one logit per prompt and answer, started at ``pi_ref``) to the
    preference pairs by full-batch Adam on :func:`rlcourse.losses.preference_loss`.

    Returns ``{"logprobs": (P, K) final log-policy, "steps": the recorded steps}`` and, at each
    recorded step (every ``record_every``, and the last): ``"margins"`` the mean log-ratio margin of
    the pairs, ``"rejected_logps"`` the mean log-prob of their rejected answers, ``"kl"`` the mean
    KL to ``pi_ref`` over prompts.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    prompt, chosen, rejected = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=lr)
    ref = bandit.ref_logprobs
    history = {"steps": [], "margins": [], "rejected_logps": [], "kl": []}
    for step in range(steps + 1):
        logp = torch.log_softmax(logits, -1)
        chosen_logps, rejected_logps = logp[prompt, chosen], logp[prompt, rejected]
        ref_chosen, ref_rejected = ref[prompt, chosen], ref[prompt, rejected]
        if record_every and (step % record_every == 0 or step == steps):
            with torch.no_grad():
                margin = (chosen_logps - ref_chosen) - (rejected_logps - ref_rejected)
                history["steps"].append(step)
                history["margins"].append(float(margin.mean()))
                history["rejected_logps"].append(float(rejected_logps.mean()))
                history["kl"].append(float(bandit.kl(logp).mean()))
        if step == steps:
            break
        loss = preference_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected,
                               beta=beta, loss_type=loss_type)
        opt.zero_grad()
        loss.backward()
        opt.step()
    history["logprobs"] = torch.log_softmax(logits.detach(), -1)
    return history
