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
take milliseconds, and bias and variance of REINFORCE, RLOO, ReMax, REINFORCE++ and GRPO are
measured against the exact gradient (lessons 09-10). Two closed forms check the measurements:
RLOO's variance (:func:`rloo_variance`) and the objective an undetached KL-shaped advantage
climbs (:func:`undetached_kl_objective`).
"""
from __future__ import annotations

import itertools

import torch

from rlcourse.losses.grpo import (group_advantages, leave_one_out_advantages, reinforce_plus_plus_advantages,
                                  remax_advantages)

__all__ = ["EnumerablePolicy", "ESTIMATORS", "gradient_estimates", "estimator_stats",
           "expected_gradient", "rloo_variance", "undetached_kl_objective"]

ESTIMATORS = ("reinforce", "batch_mean", "rloo", "grpo", "grpo_no_std", "remax", "reinforce_pp",
              "reinforce_pp_baseline")


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
        self.index = {w: c for c, w in enumerate(words)}
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

    def greedy_completions(self) -> torch.Tensor:
        """Index of the greedy completion of each prompt, ``(P,)``: the argmax token at every step
        (ties to the lower id, as ``torch.argmax``), until ``<eos>`` or ``max_len``. ReMax's baseline."""
        best = self.logits.detach().argmax(-1)                               # (P, S)
        out = []
        for p in range(self.n_prompts):
            prefix = ()
            while len(prefix) < self.max_len:
                token = int(best[p, self.state_index[prefix]])
                prefix = prefix + (token,)
                if token == 0:
                    break
            out.append(self.index[prefix])
        return torch.tensor(out)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Indices of ``n`` completions drawn from ``pi(.|x)`` for each prompt, ``(P, n)``.

        Drawing a whole completion from its exact probability is the same distribution as drawing
        it token by token.
        """
        with torch.no_grad():
            return torch.multinomial(self.probs(), n, replacement=True, generator=generator)


def _advantages(estimator: str, rewards: torch.Tensor, K: int, greedy: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages of ``rewards`` ``(M, P, K)`` (M batches of P groups) with the named estimator.

    ``greedy`` ``(M, P)``: the reward of each prompt's greedy completion (ReMax); ``lengths``
    ``(M, P, K)``: token counts (REINFORCE++ normalises over the tokens of each batch of ``P K``).
    """
    flat = rewards.reshape(-1)
    batches = rewards.reshape(rewards.shape[0], -1)
    if estimator == "remax":
        return remax_advantages(batches, greedy, K).reshape(rewards.shape)
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        groups = 1 if estimator == "reinforce_pp" else K
        return reinforce_plus_plus_advantages(batches, groups, lengths=lengths.reshape(batches.shape)
                                              ).reshape(rewards.shape)
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
    ``K/(K-1) (R_i - mean)``, the same numbers; ``remax``: ``R_i - R(greedy completion)``;
    ``reinforce_pp``: REINFORCE++, the ``P K`` rewards of an estimate normalised over their tokens;
    ``reinforce_pp_baseline``: REINFORCE++ with baseline, group-centred first).
    ``scores`` may pass a precomputed :meth:`score_matrix`.
    """
    if not isinstance(K, int) or K < 1 or (estimator != "reinforce" and K < 2):
        raise ValueError(f"K must be a positive integer (>= 2 for a baseline from the group), got {K!r}")
    rewards = policy._rewards(rewards).detach()
    scores = policy.score_matrix() if scores is None else scores
    P = policy.n_prompts
    draws = torch.stack([policy.sample(K * n_groups, generator)[p].view(n_groups, K) for p in range(P)], 1)
    r = torch.stack([rewards[p][draws[:, p]] for p in range(P)], 1)           # (M, P, K)
    greedy = rewards[torch.arange(P), policy.greedy_completions()].expand(n_groups, P)
    adv = _advantages(estimator, r, K, greedy, policy.lengths[draws])
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


def rloo_variance(policy: EnumerablePolicy, rewards, K: int) -> float:
    """The exact variance (trace of the covariance) of RLOO's estimate with ``K`` completions per prompt.

    For one prompt, with ``s = grad log pi(y)``, ``J = E[r]``, ``g = E[r s]`` (its gradient),
    ``sigma_r^2 = Var r`` and ``sigma_c^2 = E[(r - J)^2 ||s||^2] - ||g||^2`` (the variance of one
    REINFORCE sample with the ideal constant baseline ``J``), the estimate
    ``(1/K) sum_i (r_i - mean_{j != i} r_j) s_i = 1/(K(K-1)) sum_{i != j} (r_i - r_j) s_i`` has

        Var = sigma_c^2 / K + (sigma_r^2 E||s||^2 + ||g||^2) / (K (K-1))
            = sigma_c^2 / (K-1) + (2 ||g||^2 - Cov((r - J)^2, ||s||^2)) / (K (K-1)):

    each baseline averages only ``K - 1`` rewards, and its noise ``sigma_r^2 / (K-1)`` rides on
    every sample, so the leading term falls like ``1/(K-1)``, not ``1/K``. Prompts are independent
    and the estimate is their mean: ``Var = (1/P^2) sum_x Var_x``.
    """
    if isinstance(K, bool) or not isinstance(K, int) or K < 2:
        raise ValueError(f"K must be an integer >= 2 (a leave-one-out baseline needs a sibling), got {K!r}")
    rewards = policy._rewards(rewards).detach()
    probs, scores = policy.probs().detach(), policy.score_matrix()          # (P, C), (P, C, D)
    total = 0.0
    for p in range(policy.n_prompts):
        pi, r, s = probs[p], rewards[p], scores[p]
        J = (pi * r).sum()
        g = (pi[:, None] * r[:, None] * s).sum(0)
        sq = (s ** 2).sum(1)
        var_r = (pi * (r - J) ** 2).sum()
        sigma_c = (pi * (r - J) ** 2 * sq).sum() - g @ g
        total += float(sigma_c / K + (var_r * (pi * sq).sum() + g @ g) / (K * (K - 1)))
    return total / policy.n_prompts ** 2


def undetached_kl_objective(policy: EnumerablePolicy, rewards, ref_logprobs: torch.Tensor,
                            beta: float) -> torch.Tensor:
    """``J - beta KL(pi || pi_ref) + beta H(pi)``: what a KL-shaped advantage left undetached climbs.

    With ``A_i = R_i - b - beta (log pi(y_i) - log pi_ref(y_i))`` (``b`` a baseline that does not
    depend on ``theta``) in ``L = -(1/B) sum_i A_i log pi(y_i)``, autograd also differentiates
    ``A_i``; the gradient gains

        -(1/B) sum_i log pi(y_i) grad A_i = (beta/B) sum_i log pi(y_i) grad log pi(y_i)
                                          = grad [ (beta / 2B) sum_i (log pi(y_i))^2 ],

    whose mean over samples is ``beta E[log pi grad log pi] = -beta grad H(pi)``. So the undetached
    loss descends, in expectation, minus this objective (an entropy bonus ``beta H`` on top of the
    KL-regularised one), whose maximiser is ``pi ~ pi_ref^(1/2) exp(R / (2 beta))``, not
    ``pi* ~ pi_ref exp(R / beta)``. Differentiable; mean over prompts.
    """
    logp = policy.logprobs()
    entropy = -(logp.exp() * logp).sum(1).mean()
    return policy.regularised_objective(rewards, ref_logprobs, beta) + beta * entropy
