"""An exact-gradient oracle for language-model policies: a policy whose completions can be enumerated.

A real LM has ``V^T`` completions; this one has few enough to list. The vocabulary holds ``V``
tokens, token 0 is ``<eos>``, and a completion has at most ``max_len`` tokens: it stops at the
first ``<eos>`` or is cut at ``max_len``. With ``V = 4`` and ``max_len = 2`` the completions are
``<eos>``, ``a <eos>``, ``a b`` ... : ``1 + 3 * 4 = 13`` of them. The policy is tabular softmax: one
row of ``V`` logits per (prompt, prefix) state, so

    pi(y | x) = prod_t softmax(theta[x, prefix(y_<t)])[y_t]

is the same token-by-token factorisation as a transformer's, and every expectation over
completions is a finite sum. That gives, exactly and by autograd:

* ``J(theta) = mean_x sum_y pi(y|x) R(x, y)`` and ``grad J``;
* the KL-regularised objective ``J - beta KL(pi || pi_ref)`` and its gradient;
* the *expected* gradient of any per-completion surrogate, ``E_{y~pi}[grad f(y)]``, which tells
  which objective a loss term really descends (lesson 10's view of k1/k2/k3).

The score matrix ``grad_theta log pi(y|x)`` of every completion is computed once, so a Monte-Carlo
gradient estimate from a group of K samples is a weighted sum of its rows: thousands of groups
take milliseconds, and bias and variance of REINFORCE, RLOO and GRPO are measured against the
exact gradient (lessons 09-10).
"""
from __future__ import annotations

import itertools

import torch

from rlcourse.losses.grpo import group_advantages, leave_one_out_advantages

__all__ = ["EnumerablePolicy", "ESTIMATORS", "gradient_estimates", "estimator_stats",
           "expected_gradient"]

ESTIMATORS = ("reinforce", "batch_mean", "rloo", "grpo", "grpo_no_std")


class EnumerablePolicy(torch.nn.Module):
    """A tabular softmax policy over completions of at most ``max_len`` tokens (see the module docstring).

    Attributes: ``completions`` ``(C, max_len)`` token ids (0 after the end), ``mask`` ``(C, max_len)``
    (1 on real tokens, ``<eos>`` included), ``logits`` the parameter ``(n_prompts, n_states, V)``.
    """

    def __init__(self, vocab_size: int = 4, max_len: int = 2, n_prompts: int = 1, init_scale: float = 1.0,
                 seed: int = 0):
        super().__init__()
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2 (<eos> and one more token), got {vocab_size!r}")
        if not isinstance(max_len, int) or max_len < 1 or (vocab_size - 1) ** max_len > 20_000:
            raise ValueError(f"max_len must be a positive integer with (vocab_size - 1) ** max_len <= 20000 "
                             f"completions to enumerate, got max_len={max_len!r} with vocab_size={vocab_size}")
        if not isinstance(n_prompts, int) or n_prompts < 1:
            raise ValueError(f"n_prompts must be a positive integer, got {n_prompts!r}")
        self.vocab_size, self.max_len, self.n_prompts = vocab_size, max_len, n_prompts
        words = [(0,)] if max_len >= 1 else []
        prefixes = [()]                                    # states: prefixes without <eos>
        for length in range(1, max_len + 1):
            for body in itertools.product(range(1, vocab_size), repeat=length):
                if length < max_len:
                    words.append(body + (0,))
                    prefixes.append(body)
                else:
                    words.append(body)                     # cut at max_len (truncated)
            if length == max_len:
                break
        words = sorted(set(words), key=lambda w: (len(w), w))
        self.state_index = {p: i for i, p in enumerate(prefixes)}
        ids = torch.zeros(len(words), max_len, dtype=torch.long)
        mask = torch.zeros(len(words), max_len, dtype=torch.long)
        states = torch.zeros(len(words), max_len, dtype=torch.long)
        for c, w in enumerate(words):
            ids[c, :len(w)] = torch.tensor(w)
            mask[c, :len(w)] = 1
            for t in range(len(w)):
                states[c, t] = self.state_index[w[:t]]
        self.register_buffer("completions", ids)
        self.register_buffer("mask", mask)
        self.register_buffer("states", states)
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(init_scale * torch.randn(n_prompts, len(prefixes), vocab_size,
                                                                  generator=gen))

    @property
    def n_completions(self) -> int:
        return self.completions.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """Number of tokens of each completion, ``(C,)``."""
        return self.mask.sum(1)

    def token_logprobs(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        """``log pi(y_t | x, y_<t)`` of every token of every completion, ``(P, C, max_len)``, 0 after the end."""
        logits = self.logits if logits is None else logits
        logp_states = torch.log_softmax(logits, dim=-1)                 # (P, S, V)
        per_token = logp_states[:, self.states, self.completions]      # (P, C, L)
        return per_token * self.mask.to(per_token.dtype)

    def logprobs(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        """``log pi(y | x)`` of every completion, ``(P, C)``."""
        return self.token_logprobs(logits).sum(-1)

    def probs(self) -> torch.Tensor:
        """``pi(y | x)``, ``(P, C)``: each row sums to 1."""
        return self.logprobs().exp()

    def _rewards(self, rewards) -> torch.Tensor:
        rewards = torch.as_tensor(rewards, dtype=self.logits.dtype)
        if rewards.shape != (self.n_prompts, self.n_completions):
            raise ValueError(f"rewards must have shape (n_prompts, n_completions) = "
                             f"({self.n_prompts}, {self.n_completions}), got {tuple(rewards.shape)}")
        return rewards

    def objective(self, rewards) -> torch.Tensor:
        """``J(theta) = mean_x sum_y pi(y|x) R(x, y)`` (differentiable)."""
        return (self.probs() * self._rewards(rewards)).sum(1).mean()

    def kl(self, ref_logprobs: torch.Tensor, reverse: bool = True) -> torch.Tensor:
        """Exact ``KL(pi || pi_ref)`` over whole completions (``reverse=False``: ``KL(pi_ref || pi)``), mean over prompts."""
        logp, ref = self.logprobs(), ref_logprobs.detach()
        if reverse:
            return (logp.exp() * (logp - ref)).sum(1).mean()
        return (ref.exp() * (ref - logp)).sum(1).mean()

    def regularised_objective(self, rewards, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
        """``J(theta) - beta KL(pi || pi_ref)``: what RLHF-style training maximises."""
        return self.objective(rewards) - beta * self.kl(ref_logprobs)

    def flat_grad(self, scalar: torch.Tensor) -> torch.Tensor:
        """``d scalar / d theta`` as a flat vector (the parameters' own ``.grad`` is left alone)."""
        (grad,) = torch.autograd.grad(scalar, self.logits)
        return grad.reshape(-1)

    def score_matrix(self) -> torch.Tensor:
        """``grad_theta log pi(y | x)`` of every (prompt, completion): ``(P, C, D)``, ``D = logits.numel()``.

        Cached for the logits' current *values*: any change (an optimiser step, ``logits.data += ...``,
        which no version counter sees, or a copy of the oracle) recomputes it. The logits are small,
        so comparing them costs far less than the Jacobian.
        """
        now = self.logits.detach()
        cached = getattr(self, "_score_cache", None)
        if cached is None or cached[0].shape != now.shape or not torch.equal(cached[0], now):
            jac = torch.autograd.functional.jacobian(lambda th: self.logprobs(th), now)
            self._score_cache = (now.clone(), jac.reshape(self.n_prompts, self.n_completions, -1))
        return self._score_cache[1]

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Indices of ``n`` completions drawn from ``pi(.|x)`` for each prompt, ``(P, n)``.

        Drawing a whole completion from its exact probability is the same distribution as drawing
        it token by token.
        """
        with torch.no_grad():
            return torch.multinomial(self.probs(), n, replacement=True, generator=generator)


def _advantages(estimator: str, rewards: torch.Tensor, K: int) -> torch.Tensor:
    """Advantages of ``rewards`` ``(..., K)`` (one group per row) with the named estimator."""
    flat = rewards.reshape(-1)
    if estimator == "reinforce":
        adv = flat
    elif estimator == "batch_mean":      # r_i - mean of the K, r_i included (= batch_mean_advantages per group)
        adv = group_advantages(flat, K, scale_rewards="none")
    elif estimator == "rloo":
        adv = leave_one_out_advantages(flat, K)
    elif estimator == "grpo":
        adv = group_advantages(flat, K, scale_rewards="group")
    elif estimator == "grpo_no_std":
        adv = group_advantages(flat, K, scale_rewards="none") * K / (K - 1)
    else:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    return adv.reshape(rewards.shape)


def gradient_estimates(policy: EnumerablePolicy, rewards, K: int, estimator: str, n_groups: int,
                       generator: torch.Generator | None = None, scores: torch.Tensor | None = None) -> torch.Tensor:
    """``n_groups`` independent Monte-Carlo estimates of ``grad J``, ``(n_groups, D)``.

    Each estimate draws K completions per prompt and forms ``mean_x (1/K) sum_i A_i grad log pi(y_i|x)``
    with the estimator's advantage ``A_i`` (``reinforce``: ``R_i``; ``batch_mean``: ``R_i - mean(R)``;
    ``rloo``: leave-one-out; ``grpo``: group-normalised; ``grpo_no_std``: RLOO written as
    ``K/(K-1) (R_i - mean)``, the same numbers). ``scores`` may pass a precomputed :meth:`score_matrix`.
    """
    if not isinstance(K, int) or K < 1 or (estimator != "reinforce" and K < 2):
        raise ValueError(f"K must be a positive integer (>= 2 for a baseline from the group), got {K!r}")
    rewards = policy._rewards(rewards).detach()
    scores = policy.score_matrix() if scores is None else scores
    P = policy.n_prompts
    draws = torch.stack([policy.sample(K * n_groups, generator)[p].view(n_groups, K) for p in range(P)], 1)
    r = torch.stack([rewards[p][draws[:, p]] for p in range(P)], 1)           # (M, P, K)
    adv = _advantages(estimator, r, K)
    g = torch.stack([scores[p][draws[:, p]] for p in range(P)], 1)           # (M, P, K, D)
    return (adv.unsqueeze(-1) * g).mean(2).mean(1)


def estimator_stats(estimates: torch.Tensor, exact: torch.Tensor) -> dict:
    """Bias and variance of gradient estimates ``(M, D)`` against the exact gradient ``(D,)``.

    * ``variance``: ``trace Cov = E||g - E g||^2`` (sum of per-coordinate variances);
    * ``bias``: ``||mean(g) - grad J||``, and its standard error ``bias_se`` (the bias one would see
      from noise alone is about ``sqrt(variance / M)``);
    * ``scale``: ``<mean(g), grad J> / ||grad J||^2`` (1 for an unbiased estimator, ``(K-1)/K`` for
      the batch mean), and ``cosine`` between ``mean(g)`` and ``grad J``.
    """
    mean = estimates.mean(0)
    variance = float(((estimates - mean) ** 2).sum(1).mean())
    return {"bias": float((mean - exact).norm()), "bias_se": (variance / estimates.shape[0]) ** 0.5,
            "variance": variance, "scale": float(mean @ exact / (exact @ exact)),
            "cosine": float(torch.nn.functional.cosine_similarity(mean, exact, dim=0))}


def expected_gradient(policy: EnumerablePolicy, per_completion) -> torch.Tensor:
    """``E_{y ~ pi}[grad_theta f(y)]`` exactly, for a differentiable ``f`` of every completion.

    ``per_completion(policy)`` returns ``(P, C)`` values with grad; the expectation weighs them by the
    *detached* ``pi(y|x)``, as sampling does: the gradient does not flow through the sampling
    distribution, only through ``f``. This is what a loss term in a training loop descends on average.
    """
    values = per_completion(policy)
    if values.shape != (policy.n_prompts, policy.n_completions):
        raise ValueError(f"per_completion must return (n_prompts, n_completions) values, got {tuple(values.shape)}")
    weights = policy.probs().detach()
    return policy.flat_grad((weights * values).sum(1).mean())
