"""The critic-free policy-gradient family for language models: REINFORCE, RLOO, GRPO and its variants.

Shapes: ``B`` completions (``B = num_prompts * num_generations``, the ``K = num_generations``
completions of one prompt next to each other, as TRL lays them out), ``T`` completion tokens.
``rewards`` is ``(B,)``, one scalar per completion (the bandit view: the whole completion is one
action). ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are ``(B, T)``.

Three steps make every algorithm of the family:

1. an **advantage** per completion from the rewards (:func:`group_advantages` and, for several
   reward functions, :func:`multi_objective_advantages`; :func:`leave_one_out_advantages`,
   :func:`batch_mean_advantages`, :func:`moving_average_baseline`, :func:`remax_advantages`,
   :func:`reinforce_plus_plus_advantages`);
2. a **per-token loss** from the importance ratio and the advantage (:func:`per_token_loss`),
   with the ratio taken per token or per sequence (:func:`importance_weights`, GSPO);
3. an **aggregation** of the per-token losses into one scalar (:func:`aggregate_loss`): this is
   where GRPO, BNPO, Dr. GRPO and DAPO differ, and where length bias comes from.

The names of settings are TRL's (``num_generations``, ``epsilon``, ``epsilon_high``, ``beta``,
``loss_type``, ``importance_sampling_level``, ``scale_rewards``); ``tests/test_trl_parity_grpo.py``
runs TRL 1.16's GRPOTrainer and RLOOTrainer on the same inputs and checks every number here.
"""
from __future__ import annotations

import torch

from rlcourse.kl import LOG_RATIO_BOUND, as_mask, kl_k3
from rlcourse.returns import check_integer
from rlcourse.losses.policy_gradient import (check_logprobs_mask, importance_ratio, ppo_clip_objective,
                                             trajectory_importance_weight)

__all__ = [
    "GRPO_LOSS_TYPES",
    "group_advantages",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "multi_objective_advantages",
    "leave_one_out_advantages",
    "batch_mean_advantages",
    "moving_average_baseline",
    "remax_advantages",
    "reinforce_plus_plus_advantages",
    "importance_weights",
    "per_token_loss",
    "aggregate_loss",
    "rloo_loss",
    "clip_fractions",
]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
LOSS_TYPES = GRPO_LOSS_TYPES  # the short name inside this module


def _rewards_1d(rewards) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor (one reward per completion), "
                         f"got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite, got NaN or inf: score every completion with a real number "
                         "first (an inf, e.g. log 0, would make every advantage of its group NaN)")
    return rewards.detach()


def _groups(rewards: torch.Tensor, num_generations: int, minimum: int = 1) -> torch.Tensor:
    num_generations = check_integer("num_generations", num_generations, minimum)
    if rewards.numel() % num_generations:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of "
                         f"num_generations={num_generations}")
    return rewards.view(-1, num_generations)


def group_advantages(rewards, num_generations: int, scale_rewards: str = "group",
                     std_floor: float = 1e-4, zero_equal_groups: bool = True,
                     singleton: str = "zero") -> torch.Tensor:
    """GRPO's group-normalised advantage (Shao et al., 2024, arXiv 2402.03300), shape ``(B,)``.

    ``A_i = (r_i - mean_g(r)) / (std + std_floor)``

    with ``mean_g`` the mean of the ``K = num_generations`` rewards of completion ``i``'s group,
    and ``std`` (with Bessel's correction, as TRL computes it) taken over the group
    (``scale_rewards="group"``), over the whole batch (``"batch"``: the group mean is kept, one
    scale is shared by all prompts) or not at all (``"none"``: Dr. GRPO,
    arXiv 2503.20783, which only centres).

    ``std_floor`` is added to the denominator (TRL adds ``1e-4``). Without it a group whose
    rewards differ only by float leftovers (``0.3`` sixteen times, one of them a rounding step
    higher) has a std of ~1e-8 and its advantages blow up to order 1. A group whose
    rewards are *exactly* equal gets exactly 0 here, whatever the dtype: where TRL's mean leaves a
    rounding residue (``(r - mean) / 1e-4`` of order 1e-4), ours does not. With rewards like 0/1
    the two agree bit for bit.

    Two conventions of other engines, for comparison (lesson 13 measures both):

    * ``zero_equal_groups=False`` drops that exact zero and computes ``(r - mean) / (std + std_floor)``
      as written, in the rewards' dtype. A float32 group of eight rewards 0.3 then has
      ``r - mean = 3e-8`` and ``std = 3.2e-8``: OpenRLHF's ``group_norm`` (``std_floor = 1e-9``)
      gives each completion an advantage of about 0.9, verl's ``1e-6`` about 0.03, TRL's ``1e-4``
      about 3e-4;
    * ``singleton`` decides a group of one completion (``num_generations = 1``), which has nothing
      to be compared with: ``"zero"`` (the default) gives it advantage 0; ``"reward"`` is verl's
      rule (``compute_grpo_outcome_advantage``: mean 0 and std 1 for a group of one), so
      ``A = r / (1 + std_floor)``, the raw reward as advantage (``A = r`` with ``scale_rewards="none"``).
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    if std_floor < 0:
        raise ValueError(f"std_floor must be >= 0, got {std_floor!r}")
    if singleton not in ("zero", "reward"):
        raise ValueError(f"singleton must be 'zero' or 'reward', got {singleton!r}")
    rewards = _rewards_1d(rewards)
    grouped = _groups(rewards, num_generations)
    if num_generations == 1 and singleton == "reward":
        centred = grouped                                    # verl: a group of one has mean 0 ...
        std = torch.ones_like(grouped)                       # ... and std 1
        if scale_rewards == "none":
            return centred.reshape(-1)
        if scale_rewards == "batch":
            std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
        return (centred / (std + std_floor)).reshape(-1)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if zero_equal_groups:
        all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
        centred = torch.where(all_equal, torch.zeros_like(centred), centred)
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(centred)
    elif scale_rewards == "batch":
        std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
    else:
        return centred.reshape(-1)
    return (centred / (std + std_floor)).reshape(-1)


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def multi_objective_advantages(rewards_per_func, num_generations: int, reward_weights=None, *,
                               multi_objective_aggregation: str = "sum_then_normalize", scale_rewards: str = "group",
                               std_floor: float = 1e-4) -> torch.Tensor:
    """GRPO's advantage from several reward functions, shape ``(B,)``: TRL's ``multi_objective_aggregation``.

    With ``R`` the ``(B, F)`` rewards of ``F`` reward functions and ``w`` their ``reward_weights``:

    * ``"sum_then_normalize"`` (TRL's default): ``r_i = sum_k w_k R_ik``, then
      :func:`group_advantages` of ``r`` with ``scale_rewards``. The objective whose weighted reward
      varies most within a group sets the advantage; one with a small spread (or a small scale) is
      drowned;
    * ``"normalize_then_sum"`` (GDPO, Liu et al., 2026, arXiv 2601.05242): each function first gets
      its own group advantage, ``Ahat_ik = (R_ik - mean_g(R_k)) / (std_g(R_k) + std_floor)``, then
      ``s_i = sum_k w_k Ahat_ik``, then one normalisation over the **whole batch**,
      ``A_i = (s_i - mean(s)) / (std(s) + std_floor)`` (Bessel's correction everywhere, as TRL). Each
      objective enters with unit spread in every group where it varies, whatever its scale, so
      ``w`` alone sets the objectives' shares, and multiplying one function's rewards by a positive
      constant changes nothing (up to the floor). ``scale_rewards`` is not read: TRL 1.16 ignores it
      on this path too.

    Groups (and batches) whose values are exactly equal get exactly 0, as in :func:`group_advantages`:
    an objective that is constant within a group adds nothing to that group.

    Args: ``rewards_per_func`` ``(B, F)``, the ``K = num_generations`` completions of a prompt in
    consecutive rows; ``reward_weights`` ``(F,)`` or None (all 1). Returns ``(B,)``, detached.
    """
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, "
                         f"got {multi_objective_aggregation!r}")
    table = torch.as_tensor(rewards_per_func)
    if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] == 0:
        raise ValueError(f"rewards_per_func must be a (B, F) table, one column per reward function, got shape "
                         f"{tuple(table.shape)}")
    if not table.is_floating_point():
        table = table.to(torch.get_default_dtype())
    weights = torch.ones(table.shape[1], dtype=table.dtype) if reward_weights is None else \
        torch.as_tensor(reward_weights, dtype=table.dtype, device=table.device)
    if weights.shape != (table.shape[1],) or not bool(torch.isfinite(weights).all()):
        raise ValueError(f"reward_weights must hold one finite weight per reward function ({table.shape[1]}), "
                         f"got {reward_weights!r}")
    if multi_objective_aggregation == "sum_then_normalize":
        return group_advantages(table @ weights, num_generations, scale_rewards, std_floor)
    per_func = torch.stack([group_advantages(table[:, k], num_generations, "group", std_floor)
                            for k in range(table.shape[1])], dim=1)
    summed = per_func @ weights
    # one scale for the batch (scale_rewards="batch" with a single group of every row)
    return group_advantages(summed, summed.numel(), "group", std_floor) if summed.numel() > 1 \
        else torch.zeros_like(summed)


def leave_one_out_advantages(rewards, num_generations: int) -> torch.Tensor:
    """RLOO's advantage (Kool et al., 2019; Ahmadian et al., 2024, arXiv 2402.14740), shape ``(B,)``.

    ``A_i = r_i - 1/(K-1) sum_{j != i} r_j = K/(K-1) (r_i - mean_g(r))``

    The baseline of completion ``i`` is the mean of its ``K - 1`` siblings: it does not depend on
    ``r_i``, so the estimator stays unbiased. ``K = 1`` has no siblings and is rejected.
    """
    rewards = _rewards_1d(rewards)
    grouped = _groups(rewards, num_generations, minimum=2)       # a leave-one-out baseline needs siblings
    K = grouped.shape[1]
    siblings = (grouped.sum(dim=1, keepdim=True) - grouped) / (K - 1)
    advantages = grouped - siblings
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).reshape(-1)


def batch_mean_advantages(rewards) -> torch.Tensor:
    """``A_i = r_i - mean(r)``, the batch mean as a baseline (it includes ``r_i`` itself).

    Because the sample is inside its own baseline, ``E[A_i grad log pi(y_i)] = (1 - 1/B) grad J``:
    the gradient shrinks by ``(B-1)/B``, a bias that vanishes only as ``B`` grows (lesson 09
    measures it against the exact gradient).
    """
    rewards = _rewards_1d(rewards)
    return rewards - rewards.mean()


def remax_advantages(rewards, greedy_rewards, num_generations: int = 1) -> torch.Tensor:
    """ReMax's advantage (Li et al., 2023, arXiv 2310.10505): the greedy completion's reward as baseline.

    ``A_i = r_i - r(x, y_greedy(x))``

    with ``y_greedy(x)`` the completion decoded greedily (argmax token by token) for completion
    ``i``'s prompt ``x``. The greedy completion depends on the policy but not on the sampled
    ``y_i``, so the baseline leaves the estimator unbiased, for any ``K``, ``K = 1`` included: it
    costs one extra greedy generation per prompt instead of siblings.

    Args: ``rewards`` ``(..., B)`` with the ``K = num_generations`` completions of a prompt next to
    each other; ``greedy_rewards`` ``(..., B // K)``, one per prompt (leading dimensions: independent
    batches). Returns ``(..., B)``.
    """
    rewards, greedy = torch.as_tensor(rewards), torch.as_tensor(greedy_rewards)
    K = check_integer("num_generations", num_generations)
    if rewards.ndim == 0 or rewards.shape[-1] % K or greedy.shape != (*rewards.shape[:-1], rewards.shape[-1] // K):
        raise ValueError(f"rewards (..., B) with B a multiple of num_generations={K} and greedy_rewards "
                         f"(..., B // {K}) (one per prompt) are needed, got {tuple(rewards.shape)} and "
                         f"{tuple(greedy.shape)}")
    if not (bool(torch.isfinite(rewards).all()) and bool(torch.isfinite(greedy).all())):
        raise ValueError("rewards and greedy_rewards must be finite, got NaN or inf")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, greedy.dtype), torch.get_default_dtype())
    return (rewards.to(dtype) - greedy.to(dtype).repeat_interleave(K, dim=-1)).detach()


def reinforce_plus_plus_advantages(rewards, num_generations: int = 1, *, lengths=None,
                                   std_floor: float = 1e-4) -> torch.Tensor:
    """REINFORCE++'s globally normalised advantage (Hu et al., 2025, arXiv 2501.03262).

    ``A'_i = r_i``                   (``num_generations = 1``: REINFORCE++)
    ``A'_i = r_i - mean_g(r)``       (``num_generations = K > 1``: REINFORCE++ with baseline)
    ``A_i  = (A'_i - mean(A')) / (std(A') + std_floor)``

    ``mean_g`` is over the ``K`` completions of ``i``'s prompt; ``mean`` and ``std`` (Bessel's
    correction) are over the **whole batch**, every prompt at once, never per group: one shared
    scale, where GRPO divides each group by its own std.

    The paper writes the advantage per token and takes mean and std over every token of the
    batch. With one scalar per completion every token of completion ``i`` carries ``A'_i``, so the
    token statistics weigh each completion by its length ``L_i``: ``mean = sum L_i A'_i / sum L_i``,
    ``var = sum L_i (A'_i - mean)^2 / (sum L_i - 1)``. Pass ``lengths`` for them;
    ``lengths=None`` counts each completion once.

    Args: ``rewards`` ``(..., B)``, one scalar per completion (an outcome reward, or a KL penalty
    already summed over the completion), the ``K`` completions of a prompt next to each other;
    leading dimensions are independent batches, normalised separately. ``lengths``: ``None`` or
    token counts of ``rewards``' shape. Returns ``rewards``' shape. A batch whose ``A'`` are all
    equal gets exactly 0 (no scale to divide by).

    In TRL 1.16: ``RLOOTrainer`` with ``normalize_advantages=True`` normalises the leave-one-out
    advantages ``K/(K-1) A'_i`` over the batch (sequence statistics, floor ``1e-4``): with the
    ``K/(K-1)`` cancelled, REINFORCE++ with baseline up to the floor. GRPO's ``scale_rewards="batch"``
    is not it: it divides ``r_i - mean_g(r)`` by the batch std of the *raw* rewards.
    """
    rewards = torch.as_tensor(rewards)
    K = check_integer("num_generations", num_generations)
    if rewards.ndim == 0 or rewards.shape[-1] < 2 or rewards.shape[-1] % K:
        raise ValueError(f"rewards must be (..., B) with B >= 2 completions, a multiple of num_generations={K}, "
                         f"got shape {tuple(rewards.shape)}")
    if std_floor < 0:
        raise ValueError(f"std_floor must be >= 0, got {std_floor!r}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite, got NaN or inf")
    rewards = rewards.detach()
    if lengths is None:
        weights = torch.ones_like(rewards)
    else:
        weights = torch.as_tensor(lengths).to(rewards.dtype)
        if weights.shape != rewards.shape or bool((weights < 1).any()):
            raise ValueError(f"lengths must hold token counts >= 1 of rewards' shape {tuple(rewards.shape)}, "
                             f"got {tuple(weights.shape)}")
    # K > 1: centred in its group (an all-equal group exactly 0); K = 1: the reward itself
    centred = group_advantages(rewards.reshape(-1), K, scale_rewards="none", singleton="reward").reshape(rewards.shape)
    total = weights.sum(-1, keepdim=True)
    mean = (weights * centred).sum(-1, keepdim=True) / total
    std = ((weights * (centred - mean) ** 2).sum(-1, keepdim=True) / (total - 1)).sqrt()
    normalised = (centred - mean) / (std + std_floor)
    all_equal = (centred == centred[..., :1]).all(-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(normalised), normalised)


def moving_average_baseline(baseline: float | None, rewards, decay: float = 0.9) -> float:
    """REINFORCE's running baseline: ``b <- decay * b + (1 - decay) * mean(r)`` (``mean(r)`` at the start).

    Use the baseline from *before* a batch for that batch's advantages ``A_i = r_i - b``: it then
    does not depend on the batch's own rewards and the estimator stays unbiased. Returns a float.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    mean = float(_rewards_1d(rewards).mean())
    return mean if baseline is None else decay * float(baseline) + (1.0 - decay) * mean


def _token_inputs(logprobs, old_logprobs, mask, ref_logprobs=None):
    """The checked bool mask and the token tensors with padded entries replaced by 0.

    One check for every loss of the package (:func:`~rlcourse.losses.policy_gradient.check_logprobs_mask`:
    a ``(B, T)`` float tensor, a mask of its shape holding only 0/1). Padding may hold anything
    (NaN, inf, garbage); it is replaced *before* any arithmetic, so it reaches neither a loss nor,
    through the backward pass, a gradient (0 * NaN is NaN in both directions).
    """
    m = check_logprobs_mask(logprobs, mask)
    cleaned = []
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is None:
            cleaned.append(None)
            continue
        if not isinstance(t, torch.Tensor) or t.shape != logprobs.shape:
            raise ValueError(f"{name} must be a tensor of logprobs' shape {tuple(logprobs.shape)}, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
        cleaned.append(torch.where(m, t, torch.zeros_like(t)))
    return m, torch.where(m, logprobs, torch.zeros_like(logprobs)), cleaned[0], cleaned[1]


def importance_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                       level: str = "token") -> torch.Tensor:
    """The importance ratio of the new policy to the one that sampled, per token or per sequence.

    * ``"token"`` (PPO, GRPO): ``r_t = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)``, shape ``(B, T)``;
    * ``"sequence"`` (GSPO, Zheng et al., 2025, arXiv 2507.18071): the length-normalised sequence
      ratio ``s = (pi(y|x) / pi_old(y|x))^(1/|y|) = exp(mean_t log r_t)``, shape ``(B, 1)``: one
      ratio per completion, so one clip decision per completion, and no single token's noisy ratio
      decides alone.

    Masked tokens do not count in the sequence mean (padding may hold anything); an empty row gets
    ``s = 1``. Both log-ratios are clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (20) before the
    exponential, so a ratio cannot overflow float32 (``exp(88.7) = inf``, and ``inf * 0`` would make
    a group of equal rewards' loss NaN). TRL 1.16 clamps neither: inside the bound (a ratio between
    2e-9 and 4.9e8, far outside any clip range) the two agree exactly; beyond it ours is flat
    (gradient 0) where TRL's grows without bound or overflows.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level (importance_sampling_level) must be 'token' or 'sequence', got {level!r}")
    m, logprobs, old_logprobs, _ = _token_inputs(logprobs, old_logprobs, mask)
    if level == "token":
        return importance_ratio(logprobs, old_logprobs)
    log_ratio = logprobs - old_logprobs.detach()
    mean_log_ratio = log_ratio.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.exp(torch.clamp(mean_log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def per_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, loss_type: str = "dapo", epsilon: float = 0.2,
                   epsilon_high: float | None = None, importance_sampling_level: str = "token",
                   beta: float = 0.0, ref_logprobs: torch.Tensor | None = None,
                   sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                   use_bias_correction_kl: bool = True, dual_clip: float | None = None,
                   cispo_clip: str = "upper", kl_bound: float | None = None) -> torch.Tensor:
    """The loss of every token before aggregation, ``(B, T)`` (or ``(B, 1)`` at sequence level with
    ``beta = 0``); 0 on masked tokens. ``advantages`` is ``(B,)``, one per completion. ``w`` is
    the ratio of :func:`importance_weights` and ``A`` the advantage (detached):

    * ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``: PPO's clipped surrogate
      ``-min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)`` (:func:`ppo_clip_objective`);
      ``epsilon_high > epsilon`` is DAPO's clip-higher (Yu et al., 2025, arXiv 2503.14476);
    * ``cispo`` (MiniMax-M1, arXiv 2506.13585): ``-stopgrad(min(w, epsilon_high)) A log pi``:
      the ratio is clipped *and detached*, so every token keeps a REINFORCE gradient, only
      reweighted; as in TRL, ``epsilon_high`` is here the absolute cap on ``w`` (e.g. 5.0);
    * ``sapo`` (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth
      gate instead of a hard clip, ``-(4 / tau) sigmoid(tau (w - 1)) A``, with
      ``tau = sapo_temperature_pos`` where ``A > 0`` and ``sapo_temperature_neg`` elsewhere; its
      gradient ``sigma'(tau(w-1)) * 4 * w * grad log pi`` equals the plain one at ``w = 1`` and fades
      smoothly as ``w`` leaves 1.

    With ``beta > 0`` the k3 estimate of ``KL(pi || pi_ref)`` at each token is added:
    ``+ beta * ((ref/pi - 1) - log(ref/pi))`` (GRPO puts the KL in the loss, not in the reward).
    With ``use_bias_correction_kl`` (TRL 1.16's default, from DeepSeek-V3.2, arXiv 2512.02556) that
    term is multiplied by the ratio ``w``: its value is unchanged on-policy (``w = 1``) but its
    gradient gains ``k3 * grad log pi``, the score-function term that the plain k3 lacks. Without it,
    ``E[grad k3] = -sum_y pi_ref(y) grad log pi(y)``, the gradient of ``KL(pi_ref || pi)``, not of
    ``KL(pi || pi_ref)``: lesson 10 measures this on the exact oracle.

    Three conventions of other engines; the defaults are TRL 1.16's (lesson 13 measures each):

    * ``dual_clip = c`` (clipped-surrogate types only) caps the loss of a token with ``A < 0`` at
      ``c |A|`` (:func:`ppo_clip_objective`); verl applies ``c = 3`` by default;
    * ``cispo_clip``: ``"upper"`` weighs by ``stopgrad(min(w, epsilon_high))`` (TRL: an absolute cap,
      no lower bound); ``"two_sided"`` by ``stopgrad(clip(w, 1 - epsilon, 1 + epsilon_high))``
      (verl's ``compute_policy_loss_cispo``: relative bounds, both sides);
    * ``kl_bound = b`` clamps each token's k3 estimate to ``[-b, b]`` (:func:`rlcourse.kl.kl_k3`; verl
      and OpenRLHF use 10): a token past ``b`` nats adds ``beta * b`` and no gradient.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon!r}, {epsilon_high!r}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if loss_type == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError(f"sapo_temperature_pos and sapo_temperature_neg must be > 0 (the gate is "
                         f"sigmoid(tau (w - 1)) * 4 / tau), got {sapo_temperature_pos!r}, {sapo_temperature_neg!r}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs of logprobs' shape")
    if cispo_clip not in ("upper", "two_sided"):
        raise ValueError(f"cispo_clip must be 'upper' (TRL) or 'two_sided' (verl), got {cispo_clip!r}")
    if dual_clip is not None and loss_type in ("cispo", "sapo"):
        raise ValueError(f"dual_clip bounds PPO's clipped surrogate; loss_type={loss_type!r} has none")
    high = epsilon if epsilon_high is None else epsilon_high
    mask, logprobs, old_logprobs, ref_logprobs = _token_inputs(logprobs, old_logprobs, mask,
                                                               ref_logprobs if beta != 0.0 else None)
    ratio = importance_weights(logprobs, old_logprobs, mask, importance_sampling_level)
    advantages = torch.as_tensor(advantages, dtype=logprobs.dtype, device=logprobs.device).detach()
    if advantages.ndim != 1 or advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(f"advantages must have shape (B,) = ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    adv = advantages[:, None].expand_as(ratio)
    if loss_type == "cispo":
        weight = torch.clamp(ratio, max=high) if cispo_clip == "upper" else torch.clamp(ratio, 1.0 - epsilon, 1.0 + high)
        loss = -weight.detach() * adv * logprobs
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, sapo_temperature_pos),
                          torch.full_like(adv, sapo_temperature_neg))
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    else:
        loss = -ppo_clip_objective(ratio, adv, epsilon, high, dual_clip)
    if beta != 0.0:
        kl = kl_k3(logprobs, ref_logprobs.detach(), mask, bound=kl_bound)
        loss = loss + beta * (kl * ratio if use_bias_correction_kl else kl)
    if loss.shape[1] == logprobs.shape[1]:
        loss = torch.where(mask, loss, torch.zeros_like(loss))
    return loss


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str = "dapo",
                   max_completion_length: int | None = None, drop_empty: bool = False,
                   divide_by_batch: bool = True) -> torch.Tensor:
    """One scalar from the per-token losses: the normalisation that defines each variant.

    With ``m`` the mask, ``|y_i| = sum_t m_it`` and ``l_it`` the per-token loss:

    * ``grpo``, ``sapo`` (sequence mean): ``1/B sum_i (1/|y_i|) sum_t m_it l_it``. Each
      completion weighs the same, so a token of a long completion weighs less: a long *wrong*
      answer is penalised less per token, which lets wrong answers grow (Dr. GRPO's length bias);
    * ``bnpo``, ``dapo``, ``cispo`` (token mean): ``sum_it m_it l_it / sum_it m_it``: every token
      weighs the same (DAPO's token-level loss). TRL's ``dapo`` divides by the tokens of the whole
      generation batch and ``bnpo`` by those of the local batch: identical without gradient
      accumulation, as here;
    * ``dr_grpo`` (constant): ``sum_it m_it l_it / (B * max_completion_length)``: no length
      normalisation at all, so the gradient of every token is independent of the lengths.

    A ``(B, 1)`` input (sequence-level ratio, no KL) is one loss per completion, broadcast over its
    tokens. Rows with no real token contribute 0 (as in TRL, which clamps lengths at 1).

    Two conventions of other engines (defaults: TRL 1.16's):

    * ``drop_empty=True`` (``grpo``, ``sapo``): an empty completion is left out of the mean over
      completions, ``sum_i (1/|y_i|) sum_t m_it l_it / #{i : |y_i| > 0}``, as verl's
      ``seq-mean-token-mean`` and OpenRLHF's ``aggregate_loss(token_level_loss=False)`` do; TRL
      (and the default) counts it in ``B`` with loss 0, so the other completions weigh less;
    * ``divide_by_batch=False`` (``dr_grpo``): ``sum_it m_it l_it / max_completion_length``, verl's
      ``seq-mean-token-sum-norm`` per micro-batch: no ``1/B``, so the loss and its gradient grow
      with the (micro-)batch size.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or not isinstance(per_token, torch.Tensor) \
            or per_token.ndim != 2 or per_token.shape[0] != mask.shape[0] or per_token.shape[1] not in (1, mask.shape[1]):
        raise ValueError(f"per_token must be (B, T) or (B, 1) with mask (B, T); got "
                         f"{tuple(getattr(per_token, 'shape', ()))} and {tuple(getattr(mask, 'shape', ()))}")
    mask = as_mask(mask, torch.empty(mask.shape, device=per_token.device))
    m = mask.to(per_token.dtype)
    masked = torch.where(mask, per_token.expand_as(m), torch.zeros_like(m))
    if loss_type in ("grpo", "sapo"):
        per_sequence = masked.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        if drop_empty:
            return per_sequence.sum() / mask.any(dim=1).sum().clamp(min=1).to(per_sequence.dtype)
        return per_sequence.mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None or max_completion_length < 1:
            raise ValueError(f"dr_grpo needs max_completion_length >= 1, got {max_completion_length!r}")
        return masked.sum() / ((mask.shape[0] if divide_by_batch else 1) * max_completion_length)
    return masked.sum() / m.sum().clamp(min=1.0)


def rloo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, epsilon: float = 0.2, epsilon_high: float | None = None) -> torch.Tensor:
    """RLOO's loss as TRL's RLOOTrainer computes it: PPO's clip on the *whole-sequence* ratio.

    ``L = -1/B sum_i min(rho_i A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) A_i)``, with
    ``rho_i = pi(y_i|x) / pi_old(y_i|x) = exp(sum_t m_it (log pi - log pi_old))``
    (:func:`trajectory_importance_weight`, not length-normalised, unlike GSPO). On the first
    iteration ``rho = 1`` and this is REINFORCE with the leave-one-out baseline; its gradient is
    ``-1/B sum_i A_i grad log pi(y_i|x)``.
    """
    mask, logprobs, old_logprobs, _ = _token_inputs(logprobs, old_logprobs, mask)
    high = epsilon if epsilon_high is None else epsilon_high
    rho = trajectory_importance_weight(logprobs, old_logprobs.detach(), mask)
    advantages = torch.as_tensor(advantages, dtype=logprobs.dtype, device=logprobs.device).detach()
    if advantages.shape != rho.shape:
        raise ValueError(f"advantages must have shape (B,) = {tuple(rho.shape)}, got {tuple(advantages.shape)}")
    return -ppo_clip_objective(rho, advantages, epsilon, high).mean()


@torch.no_grad()
def clip_fractions(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float = 0.2,
                   epsilon_high: float | None = None) -> dict:
    """TRL's ``clip_ratio/low_mean`` and ``clip_ratio/high_mean``: the share of tokens (of completions,
    for a ``(B, 1)`` sequence ratio) whose clipped branch is active, i.e. that no longer learn.

    low: ``w < 1 - epsilon`` and ``A < 0``; high: ``w > 1 + epsilon_high`` and ``A > 0``.
    """
    high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.detach()[:, None].expand_as(ratio)
    low_hit = (ratio < 1.0 - epsilon) & (adv < 0)
    high_hit = (ratio > 1.0 + high) & (adv > 0)
    if ratio.shape[1] == 1:
        weight = torch.ones_like(ratio)
    else:
        weight = mask.to(ratio.dtype)
    total = weight.sum().clamp(min=1.0)
    return {"clip_ratio/low_mean": float((low_hit * weight).sum() / total),
            "clip_ratio/high_mean": float((high_hit * weight).sum() / total)}


# --- LUSPO and VESPO: TRL 1.16's two sequence-level loss types (loss_type="luspo", "vespo") ---------
# Not in GRPO_LOSS_TYPES: the trainers do not take them; lesson 10 computes them on one batch.

def luspo_aggregate(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LUSPO's aggregation (Length-Unbiased Sequence Policy Optimization, arXiv 2602.05261): TRL's
    ``loss_type="luspo"``.

    ``L = 1/B sum_i sum_t m_it l_it``

    With GSPO's one loss per completion (``per_token`` of shape ``(B, 1)``, from
    :func:`per_token_loss` with ``importance_sampling_level="sequence"`` and ``loss_type="grpo"``),
    this is ``1/B sum_i |y_i| l_i``: each completion's loss scaled by its length, where GSPO's
    sequence mean (``grpo``) weighs every completion once. It is :func:`aggregate_loss`'s
    ``dr_grpo`` times ``max_completion_length`` (no length normalisation, and no ``L_max``).

    Args: ``per_token`` ``(B, T)`` or ``(B, 1)``; ``mask`` ``(B, T)``. Returns a scalar; padding
    is selected away before the sum.
    """
    return aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=1)


VESPO_LOG_W_MIN = -18.420680743952367    # log(1e-8): TRL's lower clamp of VESPO's sequence log-weight


@torch.no_grad()
def vespo_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, *, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
                  lambda_neg: float = 2.0, sampler_weights: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's gate on the sequence ratio (Variational Sequence-Level Soft Policy Optimization,
    arXiv 2602.10693), as TRL 1.16's ``GRPOTrainer.get_gamma_weights`` computes it.

    ``log w_i = clamp(sum_t m_it clamp(log pi - log pi_old, -20, 20), log 1e-8, 20)``
    ``phi(w) = w^k exp(lambda (1 - w))``    (a Gamma density's shape, scaled so that ``phi(1) = 1``)

    with ``(k, lambda) = (k_pos, lambda_pos)`` where ``A_i >= 0`` and ``(k_neg, lambda_neg)`` where
    ``A_i < 0`` (TRL's ``vespo_k_pos`` ... defaults). ``w_i`` is the *whole* sequence ratio
    ``pi(y_i) / pi_old(y_i)``, not GSPO's length-normalised one. ``phi`` is largest at ``w = k /
    lambda`` and falls to 0 on both sides: a soft, asymmetric window instead of a clip.

    ``sampler_weights`` ``(B, T)``: TRL's token-level sampler correction (``importance_sampling_ratio``
    in a ``token_*`` mode, :func:`~rlcourse.losses.off_policy.sampler_importance_weights`); its logs,
    clamped to ``[log 1e-8, 20]``, are added to ``log w_i`` over the real tokens, so ``w`` becomes
    ``pi / mu``. Detached (computed without gradient). Args: ``logprobs``, ``old_logprobs``,
    ``mask`` ``(B, T)``; ``advantages`` ``(B,)``. Returns ``(B, 1)``.
    """
    for name, value in (("k_pos", k_pos), ("lambda_pos", lambda_pos), ("k_neg", k_neg), ("lambda_neg", lambda_neg)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    m, logprobs, old_logprobs, _ = _token_inputs(logprobs, old_logprobs, mask)
    advantages = torch.as_tensor(advantages, dtype=logprobs.dtype, device=logprobs.device)
    if advantages.shape != (logprobs.shape[0],):
        raise ValueError(f"advantages must have shape (B,) = ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_w = log_ratio.sum(dim=1, keepdim=True)
    if sampler_weights is not None:
        if not isinstance(sampler_weights, torch.Tensor) or sampler_weights.shape != logprobs.shape:
            raise ValueError(f"sampler_weights must be token weights of logprobs' shape {tuple(logprobs.shape)}, "
                             f"got {tuple(getattr(sampler_weights, 'shape', ()))}")
        log_is = torch.clamp(torch.log(sampler_weights.to(logprobs.dtype)), VESPO_LOG_W_MIN, LOG_RATIO_BOUND)
        log_w = log_w + torch.where(m, log_is, torch.zeros_like(log_is)).sum(dim=1, keepdim=True)
    log_w = torch.clamp(log_w, VESPO_LOG_W_MIN, LOG_RATIO_BOUND)
    positive = advantages[:, None] >= 0
    k = torch.where(positive, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(positive, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_per_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                         mask: torch.Tensor, **gate) -> torch.Tensor:
    """VESPO's per-token loss, TRL's ``loss_type="vespo"``: ``l_it = -phi(w_i) A_i log pi(y_it)``.

    ``phi`` is :func:`vespo_weights` (``gate``: its keyword settings), detached, so the gradient is
    ``phi(w_i) A_i grad log pi``: a REINFORCE term scaled per completion, never zeroed by a clip
    (compare CISPO's per-token cap). TRL aggregates it as a token mean (``dapo``, :func:`aggregate_loss`).
    Returns ``(B, T)``, 0 on padding.
    """
    phi = vespo_weights(logprobs, old_logprobs, advantages, mask, **gate)
    m, clean, _, _ = _token_inputs(logprobs, old_logprobs, mask)
    adv = torch.as_tensor(advantages, dtype=clean.dtype, device=clean.device).detach()[:, None]
    loss = -phi * adv * clean
    return torch.where(m, loss, torch.zeros_like(loss))


__all__ += ["luspo_aggregate", "vespo_weights", "vespo_per_token_loss"]
