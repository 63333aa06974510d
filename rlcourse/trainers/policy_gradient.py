"""One critic-free policy-gradient trainer for causal LMs: REINFORCE, RLOO, GRPO and its variants.

Pseudocode of one step (every formula lives in :mod:`rlcourse.losses.grpo`):

    prompts  <- n prompts, each repeated num_generations times (a group)
    y        <- sample(pi_theta, prompts) at `temperature`            # rlcourse.lm.sample
    r        <- task.reward(prompts, y)                               # one scalar per completion
    [dynamic_sampling (DAPO): keep the groups whose r are not all equal, draw fresh prompts and
     repeat until n such groups or max_num_gen_batches draws; keep the first n]
                                                      # rlcourse.trainers.dynamic_sampling.fill_batch
    r        <- r + overlong_penalty(|y|)             (overlong_buffer_len > 0: DAPO's soft punishment)
    r        <- r - beta * sum_t k1_t                 (kl_in_reward: RLOO's KL in the reward)
    A        <- advantages(r)                         (grpo | rloo | batch_mean | moving_average;
                 normalize_then_sum: each reward function normalised in its group first, GDPO)
    logp_old <- log pi_theta(y) now, without grad     (only when num_iterations > 1)
    repeat num_iterations times:
        logp <- log pi_theta(y) at `temperature`       # rlcourse.lm.logprobs
        loss <- aggregate(per_token_loss(logp, logp_old, A, ...), loss_type)
        loss <- loss - c * mean entropy               (entropy_coef; c adaptive: use_adaptive_entropy)
        one optimiser step
        c    <- c +- entropy_coef_delta               (use_adaptive_entropy: rlcourse.losses.rlvr)

Settings are named as TRL's ``GRPOConfig`` / ``RLOOConfig`` (see :class:`PolicyGradientConfig`) and
the logged metrics use TRL's names. Any ``transformers`` causal LM with a tokenizer that defines
``eos_token`` and ``pad_token`` works.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from rlcourse.kl import entropy as exact_entropy
from rlcourse.kl import kl_k1, kl_k3
from rlcourse.trainers.dynamic_sampling import fill_batch, informative_groups
from rlcourse.lm.model import frozen_copy
from rlcourse.lm.logprobs import completion_logits, token_logprobs_from_logits
from rlcourse.lm.sampling import sample
from rlcourse.losses import entropy_bonus, masked_mean
from rlcourse.losses.off_policy import (SAMPLER_IS_MODES, check_is_bounds, check_sampler_logprobs,
                                        off_policy_sequence_mask, sampler_gap_stats, sampler_importance_weights)
from rlcourse.losses.grpo import (LOSS_TYPES, MULTI_OBJECTIVE_AGGREGATIONS, aggregate_loss, batch_mean_advantages,
                                  clip_fractions, group_advantages, importance_weights, leave_one_out_advantages,
                                  moving_average_baseline, multi_objective_advantages, per_token_loss, rloo_loss)
from rlcourse.losses.rlvr import adaptive_entropy_coef, applied_entropy_coef, high_entropy_mask, overlong_penalty

__all__ = ["PolicyGradientConfig", "PolicyGradientTrainer", "ADVANTAGE_ESTIMATORS", "advantages", "attach_sampler_logprobs",
           "checked_rewards", "reward_table", "logits_and_logprobs", "loss_and_stats", "draw_metrics",
           "entropy_coef_now", "entropy_coef_after"]

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "batch_mean", "moving_average")


@dataclass
class PolicyGradientConfig:
    """Settings, named as in TRL's ``GRPOConfig`` / ``RLOOConfig``. Defaults that differ from TRL's:

    * ``learning_rate`` 1e-4 (TRL: 1e-6, sized for billion-parameter models; the tiny GPT needs more);
    * ``per_device_train_batch_size`` 64 completions per step (TRL: 8);
    * ``max_completion_length`` ``None`` = the task's ``max_new_tokens`` (TRL: 512);
    * ``std_floor`` is ours (TRL adds a fixed 1e-4 to the std); groups of exactly equal rewards
      get exactly 0 advantage here;
    * ``advantage_estimator``, ``baseline_decay``, ``kl_in_reward``, ``dynamic_sampling`` and
      ``max_num_gen_batches`` are ours: TRL picks the estimator by trainer class (GRPOTrainer:
      ``grpo``; RLOOTrainer: ``rloo`` with the KL in the reward and its one loss, which rlcourse
      names ``loss_type="rloo"``: TRL 1.16's ``RLOOConfig`` has no ``loss_type`` field), and has no
      dynamic sampling.

    ``kl_in_reward`` (with ``beta > 0``) is TRL's RLOOTrainer's penalty: each completion's reward
    becomes ``r - beta * sum_t (log pi_old(y_t) - log pi_ref(y_t))``, the k1 estimator summed over
    the completion's loss-mask tokens (truncated completions count 0 tokens under
    ``mask_truncated_completions``), subtracted *before* the advantage is computed; the loss then
    has no KL term. GRPOTrainer's ``beta`` instead puts k3 in the loss (``kl_in_reward=False``).

    ``dynamic_sampling=True`` is DAPO's (Yu et al., 2025, arXiv 2503.14476): groups whose task
    rewards are all equal are dropped, and fresh prompts are drawn, one generation batch of
    ``per_device_train_batch_size // num_generations`` prompts at a time, until that many groups
    with unequal rewards are collected or ``max_num_gen_batches`` generation batches were drawn
    (verl's name; an integer >= 1, default 4; verl's 0 = "no cap" is refused here). A full batch is
    trained on exactly (extra groups of the last draw are left out); after the cap, whatever was
    collected is, and a step with nothing collected is skipped. ``num_gen_batches`` logs the draws;
    ``reward``, ``reward_std``, ``frac_reward_zero_std`` and the ``completions/*`` metrics are over
    every completion drawn in the step. ``max_num_gen_batches=1`` only drops (the batch shrinks).
    The filter reads the task's rewards before the overlong penalty (verl's DAPO filters on accuracy);
    the kept groups train on the penalised ones.

    Lesson 10b's settings, TRL's names and defaults: ``multi_objective_aggregation="normalize_then_sum"``
    (GDPO) normalises each reward function of a :class:`rlcourse.tasks.verifiers.RewardedTask` in its
    group before the weighted sum (:func:`rlcourse.losses.grpo.multi_objective_advantages`; GRPO's group
    advantage only, and not with the overlong penalty, ``kl_in_reward`` or dynamic sampling, which act on
    the summed reward; ``scale_rewards`` is not read, as in TRL). ``use_adaptive_entropy`` runs Skywork-OR1's controller on ``entropy_coef`` once
    per optimiser step (:func:`rlcourse.losses.rlvr.adaptive_entropy_coef`; ``entropy_coef`` is then its
    start value) and applies the bonus only while the entropy is at or below ``entropy_target``
    (:func:`~rlcourse.losses.rlvr.applied_entropy_coef`).

    ``loss_type`` is one of ``grpo, bnpo, dr_grpo, dapo, cispo, sapo`` (TRL's default ``dapo``) or
    ``rloo`` (rlcourse's name for RLOOTrainer's only loss: PPO-clip on the whole-sequence ratio).

    Off-policy settings (lesson 10c). With a ``sampler`` (see :class:`PolicyGradientTrainer`) the
    completions come with the sampler's log-probs ``mu``; the trainer recomputes ``pi_old`` with its
    own forward, as TRL does under vLLM. ``vllm_importance_sampling_correction`` then multiplies each
    per-token policy loss by TRL's weight ``pi_old / mu`` in ``vllm_importance_sampling_mode``
    (``token_truncate``, ``token_mask``, ``sequence_truncate``, ``sequence_mask``) with the bounds
    ``vllm_importance_sampling_clip_min`` / ``_clip_max``
    (:func:`rlcourse.losses.off_policy.sampler_importance_weights`); as TRL's ``GRPOConfig``, a ``*_truncate``
    mode needs at least one bound and ``clip_min`` must be below ``clip_max``. Our default is ``False``: TRL's
    is ``True``, and TRL applies it only with ``use_vllm``; here it applies only with a sampler.
    ``off_policy_mask_threshold`` is DeepSeek-V3.2's sequence mask
    (:func:`rlcourse.losses.off_policy.off_policy_sequence_mask`; TRL's default ``None``, off), against
    the sampler's log-probs when there is a sampler and against ``pi_old`` otherwise, as in TRL.
    ``ratio_against_sampler`` is ours: the PPO ratio becomes ``pi_theta / mu`` (the sampler's own
    log-probs as ``pi_old``, as TRL's experimental ``AsyncGRPOTrainer`` and PPO with a stale
    behaviour policy do) instead of ``pi_theta / pi_old`` with ``pi_old`` recomputed; it excludes the
    importance weights (they would be exactly 1).

    Several seeds of one configuration advance together in
    :class:`rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer` (``num_seeds`` or ``seeds`` there).
    """

    learning_rate: float = 1e-4
    per_device_train_batch_size: int = 64
    num_generations: int = 8
    max_completion_length: int | None = None
    temperature: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    max_steps: int = 100
    seed: int = 0
    std_floor: float = 1e-4
    advantage_estimator: str = "grpo"
    baseline_decay: float = 0.9
    kl_in_reward: bool = False
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 4
    max_grad_norm: float | None = 1.0
    # Off-policy correction (lesson 10c, rlcourse.losses.off_policy), TRL's names; the importance
    # weights apply only when the trainer is given a ``sampler`` (see the class docstring).
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    ratio_against_sampler: bool = False
    # Verifiable rewards (lesson 10b, rlcourse.losses.rlvr): TRL's entropy knobs (defaults TRL's: off)
    # and DAPO's soft overlong punishment (verl's overlong_buffer; TRL's get_soft_overlong_punishment).
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    # Skywork-OR1's adaptive entropy control (TRL's names and defaults), and GDPO's aggregation of several
    # reward functions (TRL's multi_objective_aggregation; "sum_then_normalize" is TRL's default).
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    multi_objective_aggregation: str = "sum_then_normalize"

    def __post_init__(self):
        if self.loss_type not in (*LOSS_TYPES, "rloo"):
            raise ValueError(f"loss_type must be one of {(*LOSS_TYPES, 'rloo')}, got {self.loss_type!r}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, "
                             f"got {self.advantage_estimator!r}")
        if self.num_generations < 1 or self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size ({self.per_device_train_batch_size}) must be a "
                             f"multiple of num_generations ({self.num_generations})")
        if self.advantage_estimator in ("grpo", "rloo") and self.num_generations < 2:
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r} needs num_generations >= 2")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta!r}")
        if self.loss_type == "rloo" and self.beta > 0 and not self.kl_in_reward:
            # rloo_loss has no KL term: beta would be ignored while a "kl" metric is still logged.
            raise ValueError(f"loss_type='rloo' with beta={self.beta!r} needs kl_in_reward=True: the RLOO loss has "
                             f"no KL term, and TRL's RLOOTrainer subtracts beta * KL from the reward (or set beta=0)")
        if not (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0):
            raise ValueError(f"sapo_temperature_pos and sapo_temperature_neg must be > 0, got "
                             f"{self.sapo_temperature_pos!r}, {self.sapo_temperature_neg!r}")
        if (not isinstance(self.max_num_gen_batches, int) or isinstance(self.max_num_gen_batches, bool)
                or self.max_num_gen_batches < 1):
            raise ValueError(f"max_num_gen_batches must be an integer >= 1 (a cap on generation batches per "
                             f"step; there is no 'unlimited'), got {self.max_num_gen_batches!r}")
        if self.vllm_importance_sampling_mode not in SAMPLER_IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {SAMPLER_IS_MODES}, "
                             f"got {self.vllm_importance_sampling_mode!r}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise ValueError(f"off_policy_mask_threshold must be None or >= 0, got {self.off_policy_mask_threshold!r}")
        check_is_bounds(self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max,
                        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low == high:   # refused by TRL's GRPOConfig too (it wants clip_min < clip_max)
            raise ValueError(f"vllm_importance_sampling_clip_min ({low!r}) must be below "
                             f"vllm_importance_sampling_clip_max ({high!r}): equal bounds truncate every ratio to one "
                             f"constant or mask all but one value")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("truncate")
                and low is None and high is None):   # TRL's GRPOConfig refuses it: a truncation with no bound
            raise ValueError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates the "
                             f"ratio: set vllm_importance_sampling_clip_max (e.g. TRL's 3.0) and/or "
                             f"vllm_importance_sampling_clip_min; with neither the weight is the raw, unbounded ratio")
        if self.ratio_against_sampler and self.vllm_importance_sampling_correction:
            raise ValueError("ratio_against_sampler=True takes the sampler's log-probs as pi_old, so the importance "
                             "weight pi_old / mu would be 1 everywhere: set vllm_importance_sampling_correction=False")
        if not 0.0 <= self.top_entropy_quantile <= 1.0 or (self.loss_type == "rloo" and (
                self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0 or self.use_adaptive_entropy)):
            raise ValueError(f"top_entropy_quantile must be in [0, 1], and with loss_type='rloo' (a loss per sequence) "
                             f"top_entropy_quantile=1, entropy_coef=0 and no adaptive entropy; got "
                             f"{self.top_entropy_quantile!r}, {self.entropy_coef!r}, {self.use_adaptive_entropy!r}")
        if self.use_adaptive_entropy and not (self.entropy_coef_delta >= 0 and self.entropy_coef_min <= self.entropy_coef_max):
            raise ValueError(f"use_adaptive_entropy needs entropy_coef_delta >= 0 and entropy_coef_min <= entropy_coef_max, "
                             f"got {self.entropy_coef_delta!r}, [{self.entropy_coef_min!r}, {self.entropy_coef_max!r}]")
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, "
                             f"got {self.multi_objective_aggregation!r}")
        if self.multi_objective_aggregation == "normalize_then_sum" and (
                self.advantage_estimator != "grpo" or self.kl_in_reward or self.overlong_buffer_len or self.dynamic_sampling):
            raise ValueError("multi_objective_aggregation='normalize_then_sum' normalises each reward function in its "
                             "group (GRPO's advantage): it needs advantage_estimator='grpo', and no kl_in_reward, "
                             "overlong_buffer_len or dynamic_sampling, which act on the summed reward")
        if not (isinstance(self.overlong_buffer_len, int) and self.overlong_buffer_len >= 0 and self.overlong_penalty_factor >= 0):
            raise ValueError(f"overlong_buffer_len must be an integer >= 0 and overlong_penalty_factor >= 0, got "
                             f"{self.overlong_buffer_len!r}, {self.overlong_penalty_factor!r}")
        if self.dynamic_sampling and self.num_generations < 2:
            raise ValueError("dynamic_sampling needs num_generations >= 2: a group of one completion always "
                             "has all-equal rewards, so every group would be dropped")


def advantages(config: PolicyGradientConfig, rewards: torch.Tensor, baseline: float | None = None,
               table: tuple | None = None) -> tuple[torch.Tensor, float | None]:
    """One run's advantages from its rewards, by ``config.advantage_estimator``; and the new baseline.

    ``baseline`` is the moving average carried from step to step (``moving_average`` only; None
    before the first batch, which is then its own baseline). The advantage uses the baseline from
    *before* this batch. ``table`` is :func:`reward_table`'s ``(rewards per function, weights)``, read
    only with ``multi_objective_aggregation="normalize_then_sum"``.
    """
    c = config
    if c.multi_objective_aggregation == "normalize_then_sum":
        if table is None:
            raise ValueError("multi_objective_aggregation='normalize_then_sum' needs each reward function's rewards "
                             "(reward_table(task))")
        per_func, weights = table
        return multi_objective_advantages(per_func.to(rewards.device), c.num_generations, weights,
                                          multi_objective_aggregation=c.multi_objective_aggregation,
                                          std_floor=c.std_floor), baseline
    if c.advantage_estimator == "grpo":
        return group_advantages(rewards, c.num_generations, c.scale_rewards, c.std_floor), baseline
    if c.advantage_estimator == "rloo":
        return leave_one_out_advantages(rewards, c.num_generations), baseline
    if c.advantage_estimator == "batch_mean":
        return batch_mean_advantages(rewards), baseline
    before = baseline if baseline is not None else float(rewards.mean())
    return rewards - before, moving_average_baseline(baseline, rewards, c.baseline_decay)


def checked_rewards(task, prompts: list[str], completions: list[str], device) -> torch.Tensor:
    """``task.reward(prompts, completions)`` as a float32 tensor, refused unless one finite reward per completion."""
    rewards = torch.as_tensor(task.reward(prompts, completions), dtype=torch.float32).to(device)
    if rewards.shape != (len(prompts),) or not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"task.reward must return one finite reward per completion (no NaN, no +-inf), "
                         f"got {rewards}")
    return rewards


def reward_table(task) -> tuple[torch.Tensor, list[float]]:
    """The rewards of ``task``'s latest call per reward function, ``(B, F)`` float32, and their weights.

    ``task`` is a :class:`rlcourse.tasks.verifiers.RewardedTask` (its ``last_rewards``, in the order of
    its ``reward_funcs``); GDPO's aggregation needs the functions apart, not their weighted sum.
    """
    funcs, last = getattr(task, "reward_funcs", None), getattr(task, "last_rewards", None)
    if not funcs or not last or len(last) != len(funcs):
        raise ValueError(f"multi_objective_aggregation='normalize_then_sum' needs a task that keeps each reward "
                         f"function's rewards (rlcourse.tasks.verifiers.RewardedTask), got {task!r}")
    weights = getattr(task, "reward_weights", None)
    return torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in last.values()], dim=1), \
        [1.0] * len(funcs) if weights is None else [float(w) for w in weights]


def entropy_coef_now(config: PolicyGradientConfig, coef: float, last_entropy: float) -> float:
    """The entropy bonus's coefficient in this optimiser step's loss: ``entropy_coef``, or with
    ``use_adaptive_entropy`` the controller's ``coef`` gated on the last measured entropy
    (:func:`rlcourse.losses.rlvr.applied_entropy_coef`)."""
    if not config.use_adaptive_entropy:
        return config.entropy_coef
    return applied_entropy_coef(coef, last_entropy, config.entropy_target)


def entropy_coef_after(config: PolicyGradientConfig, coef: float, last_entropy: float, stats: dict) -> tuple[float, float]:
    """The controller's ``(coef, last_entropy)`` after an optimiser step whose :func:`loss_and_stats` gave
    ``stats`` (:func:`rlcourse.losses.rlvr.adaptive_entropy_coef` on ``stats["entropy_bonus/entropy"]``,
    the mean entropy of the tokens the bonus acts on); unchanged without ``use_adaptive_entropy``."""
    if not config.use_adaptive_entropy or "entropy_bonus/entropy" not in stats:
        return coef, last_entropy
    entropy = stats["entropy_bonus/entropy"]
    return adaptive_entropy_coef(coef, entropy, entropy_target=config.entropy_target,
                                 entropy_coef_delta=config.entropy_coef_delta, entropy_coef_min=config.entropy_coef_min,
                                 entropy_coef_max=config.entropy_coef_max), entropy


@dataclass
class _Batch:
    prompt_ids: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    completion_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    rewards: torch.Tensor | None = None        # what the advantages come from (after kl_in_reward)
    advantages: torch.Tensor | None = None     # None: nothing to learn from, the step is skipped
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    metrics: dict = field(default_factory=dict)
    sampler_logprobs: torch.Tensor | None = None   # off-policy (lesson 10c): the sampler's log-probs
    is_weights: torch.Tensor | None = None         # and TRL's importance_sampling_ratio from them

    def rows(self, rows: slice) -> "_Batch":
        """The same batch restricted to ``rows`` (one seed's block of a seed-batched batch)."""
        cut = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return _Batch(**cut)


def logits_and_logprobs(model, b: _Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s logits (B, T, V) on ``b``'s completions and the tokens' log-probs at ``temperature``, 0 off the loss mask."""
    logits = completion_logits(model, b.prompt_ids, b.completion_ids, b.prompt_mask, b.loss_mask)
    logp = token_logprobs_from_logits(logits, b.completion_ids, temperature)
    return logits, logp * b.loss_mask.to(logp.dtype)


def attach_sampler_logprobs(config: PolicyGradientConfig, model, b: _Batch, sampler_logprobs) -> None:
    """The off-policy path (lesson 10c): store the sampler's per-token log-probs in ``b``, score the
    completions with the trainer's ``model`` as ``pi_old`` (TRL always does when a sampler is used),
    and, with ``vllm_importance_sampling_correction``, TRL's weights ``pi_old / mu``
    (:func:`rlcourse.losses.off_policy.sampler_importance_weights`). ``sampler_logprobs`` of the
    wrong shape, or with NaN on a real token, is refused with an error naming it."""
    c = config
    if c.loss_type == "rloo" and (c.vllm_importance_sampling_correction or c.off_policy_mask_threshold is not None):
        raise ValueError("the off-policy corrections apply to the GRPO family's per-token loss, not to loss_type='rloo'")
    mu = check_sampler_logprobs(sampler_logprobs, b.completion_ids, b.loss_mask).detach()
    b.sampler_logprobs = mu.to(torch.float32) * b.loss_mask
    if b.old_logprobs is None:
        b.old_logprobs = logits_and_logprobs(model, b, c.temperature)[1]
    if c.vllm_importance_sampling_correction:
        b.is_weights = sampler_importance_weights(b.old_logprobs, b.sampler_logprobs, b.loss_mask,
                                                  c.vllm_importance_sampling_mode,
                                                  c.vllm_importance_sampling_clip_min,
                                                  c.vllm_importance_sampling_clip_max)


def loss_and_stats(config: PolicyGradientConfig, logits: torch.Tensor, logp: torch.Tensor, b: _Batch,
                   max_len: int, entropy_coef: float | None = None) -> tuple[torch.Tensor, dict]:
    """One run's loss from the current policy's ``logits`` and masked log-probs ``logp`` on batch ``b``.

    The loss is ``config.loss_type``'s (:func:`rlcourse.losses.grpo.per_token_loss` then
    :func:`~rlcourse.losses.grpo.aggregate_loss`, or :func:`~rlcourse.losses.grpo.rloo_loss`); the
    stats are TRL's ``entropy``, ``clip_ratio/*`` and, with a reference, ``kl``. ``entropy_coef``
    overrides ``config.entropy_coef`` (the adaptive controller's value, :func:`entropy_coef_now`); with
    an entropy bonus the stats add ``entropy_bonus/entropy``, the mean entropy of the tokens it acts on.
    """
    c = config
    bonus = c.entropy_coef != 0.0 or c.use_adaptive_entropy     # TRL's _entropy_bonus_enabled
    coef = c.entropy_coef if entropy_coef is None else entropy_coef
    old = b.old_logprobs if b.old_logprobs is not None else logp.detach()
    if c.ratio_against_sampler and b.sampler_logprobs is not None:
        old = b.sampler_logprobs               # lesson 10c: the ratio pi_theta / mu, PPO on a stale behaviour policy
    mask = b.loss_mask
    if c.loss_type == "rloo":
        loss = rloo_loss(logp, old, b.advantages, mask, c.epsilon, c.epsilon_high)
        ratio = torch.exp(((logp - old) * mask).sum(1, keepdim=True))
    else:
        beta = 0.0 if c.kl_in_reward else c.beta
        per_token = per_token_loss(logp, old, b.advantages, mask, c.loss_type, c.epsilon, c.epsilon_high,
                                   c.importance_sampling_level, beta, b.ref_logprobs, c.sapo_temperature_pos,
                                   c.sapo_temperature_neg, c.use_bias_correction_kl)
        if b.is_weights is not None or c.off_policy_mask_threshold is not None:
            # Off-policy (lesson 10c), in TRL's order: the policy term times the sequence mask and the
            # sampler's importance weight; the KL term (beta > 0) is added after, unweighted.
            policy_term = per_token if beta == 0 else per_token_loss(
                logp, old, b.advantages, mask, c.loss_type, c.epsilon, c.epsilon_high, c.importance_sampling_level,
                0.0, None, c.sapo_temperature_pos, c.sapo_temperature_neg, c.use_bias_correction_kl)
            kl_term = per_token - policy_term
            if c.off_policy_mask_threshold is not None:
                mu = b.sampler_logprobs if b.sampler_logprobs is not None else old
                policy_term = policy_term * off_policy_sequence_mask(b.advantages, logp, mu, mask,
                                                                     c.off_policy_mask_threshold).to(logp.dtype)
            if b.is_weights is not None:
                policy_term = policy_term * b.is_weights
            per_token = policy_term + kl_term
        if c.top_entropy_quantile < 1.0 or bonus:
            per_token, entropy_term = _entropy_terms(c, logits, logp, old, b, per_token, beta)
        loss = aggregate_loss(per_token, mask, c.loss_type, max_len)
        if bonus:
            loss = loss - coef * entropy_term
        ratio = importance_weights(logp, old, mask, c.importance_sampling_level).detach()
    with torch.no_grad():
        logp_full = torch.log_softmax(logits.float() / c.temperature, dim=-1)
        stats = {"entropy": float(masked_mean(exact_entropy(logp_full), mask.bool())),
                 **clip_fractions(ratio, b.advantages, mask, c.epsilon, c.epsilon_high)}
        if b.ref_logprobs is not None:
            stats["kl"] = float(masked_mean(kl_k3(logp.detach(), b.ref_logprobs), mask.bool()))
        if bonus and c.loss_type != "rloo":
            stats["entropy_bonus/entropy"] = float(entropy_term.detach())
        if b.sampler_logprobs is not None:     # lesson 10c: how far the sampler is from the trainer, TRL's sampling/*
            stats.update(sampler_gap_stats(b.old_logprobs, b.sampler_logprobs, mask, b.is_weights,
                                           c.vllm_importance_sampling_clip_max or 3.0))
            if c.off_policy_mask_threshold is not None:
                kept = off_policy_sequence_mask(b.advantages, logp, b.sampler_logprobs, mask, c.off_policy_mask_threshold)
                stats["sampling/off_policy_masked"] = 1.0 - float(kept.float().mean())
    return loss, stats


def _entropy_terms(c: PolicyGradientConfig, logits, logp, old, b: _Batch, per_token, beta: float):
    """Lesson 10b, in TRL's order: keep the policy term only on the top ``top_entropy_quantile`` tokens by
    entropy (:func:`rlcourse.losses.rlvr.high_entropy_mask`; the KL term stays on every token), and the
    mean entropy over those tokens that ``entropy_coef`` multiplies (:func:`rlcourse.losses.entropy_bonus`)."""
    mask = b.loss_mask
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / c.temperature
    keep = mask.bool()
    if c.top_entropy_quantile < 1.0:
        keep = high_entropy_mask(exact_entropy(torch.log_softmax(scaled, dim=-1)), mask, c.top_entropy_quantile)
        kl_term = torch.zeros_like(per_token) if beta == 0 else (
            per_token_loss(logp, old, b.advantages, mask, c.loss_type, c.epsilon, c.epsilon_high,
                           c.importance_sampling_level, beta, b.ref_logprobs, c.sapo_temperature_pos,
                           c.sapo_temperature_neg, c.use_bias_correction_kl)
            - per_token_loss(logp, old, b.advantages, mask, c.loss_type, c.epsilon, c.epsilon_high,
                             c.importance_sampling_level, 0.0, None, c.sapo_temperature_pos,
                             c.sapo_temperature_neg, c.use_bias_correction_kl))
        per_token = (per_token - kl_term) * keep.to(per_token.dtype) + kl_term
    bonus = c.entropy_coef != 0.0 or c.use_adaptive_entropy
    return per_token, entropy_bonus(scaled, keep) if bonus else None


def overlong_shaped(c: PolicyGradientConfig, roll, rewards: torch.Tensor, max_len: int) -> torch.Tensor:
    """Lesson 10b: ``rewards + overlong_penalty_factor * overlong_penalty(|y|)`` when ``overlong_buffer_len > 0``
    (DAPO's soft overlong punishment, :func:`rlcourse.losses.rlvr.overlong_penalty`; ``|y|`` counts ``<eos>``)."""
    if c.overlong_buffer_len == 0:
        return rewards
    lengths = roll.completion_mask.sum(1).cpu()
    penalty = overlong_penalty(lengths, max_len, c.overlong_buffer_len)
    return rewards + c.overlong_penalty_factor * penalty.to(rewards.device, rewards.dtype)


def completion_budget(c: PolicyGradientConfig, task) -> int:
    """The completion budget L of a run, ``max_completion_length`` or the task's ``max_new_tokens``; refuses
    an overlong buffer longer than L (the penalty would charge every completion, however short)."""
    max_len = c.max_completion_length or task.max_new_tokens
    if c.overlong_buffer_len > max_len:
        raise ValueError(f"overlong_buffer_len ({c.overlong_buffer_len}) must be <= the completion budget "
                         f"max_completion_length ({max_len}{'' if c.max_completion_length else ', the task default'})")
    return max_len


def draw_metrics(drawn, num_generations: int) -> dict:
    """TRL's sampling metrics over every ``(rollout, rewards)`` drawn in a step (kept or not)."""
    rewards = torch.cat([r for _, r in drawn])
    lengths = torch.cat([roll.completion_mask.sum(1) for roll, _ in drawn]).float()
    truncated = torch.cat([~roll.finished for roll, _ in drawn]).float()
    zero_std = ~informative_groups(rewards, num_generations)
    return {"reward": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(truncated.mean()), "num_gen_batches": float(len(drawn))}


class PolicyGradientTrainer:
    """``trainer = PolicyGradientTrainer(model, tokenizer, task, config); trainer.train()``.

    ``task`` has ``prompts(n, rng) -> list[str]``, ``reward(prompts, completions) -> tensor`` and
    ``max_new_tokens`` (every task in :mod:`rlcourse.tasks.arithmetic` does). ``history`` holds one dict of
    metrics per step. ``ref_model`` defaults to a frozen copy of ``model`` when ``beta > 0``.

    ``sampler`` (lesson 10c) replaces :func:`rlcourse.lm.sample` with a function of the same
    signature whose ``Rollout.logprobs`` are the sampler's own (another copy of the model: bf16,
    quantised, stale): they become ``sampler_logprobs`` and the config's off-policy settings apply
    (:func:`attach_sampler_logprobs`).
    """

    def __init__(self, model, tokenizer, task, config: PolicyGradientConfig | None = None, ref_model=None,
                 optimizer: torch.optim.Optimizer | None = None, sampler=None):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.config = config or PolicyGradientConfig()
        c = self.config
        self.max_len = completion_budget(c, task)
        if c.beta > 0 and ref_model is None:
            ref_model = frozen_copy(model)
        self.ref_model = ref_model
        # foreach: one kernel per operation over all parameters, not one per tensor (same numbers).
        self.optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=c.learning_rate, foreach=True)
        self.device = next(model.parameters()).device
        self.rng = np.random.default_rng(c.seed)
        self.generator = torch.Generator(device=self.device).manual_seed(c.seed)
        self.baseline: float | None = None
        self.history: list[dict] = []
        self.sampler = sampler
        # the adaptive entropy controller's state (lesson 10b): TRL starts with no measured entropy
        self.entropy_coef, self.last_entropy = c.entropy_coef, float("inf")

    # ------------------------------------------------------------------ pieces of one step
    def _logits_and_logprobs(self, model, b: _Batch):
        return logits_and_logprobs(model, b, self.config.temperature)

    def _advantages(self, rewards: torch.Tensor, table: tuple | None = None) -> torch.Tensor:
        adv, self.baseline = advantages(self.config, rewards, self.baseline, table)
        return adv

    def _draw(self, n_prompts: int):
        """One generation batch: ``n_prompts`` fresh prompts, ``num_generations`` completions each, and their task
        rewards (before any shaping)."""
        c = self.config
        prompts = [p for p in self.task.prompts(n_prompts, self.rng) for _ in range(c.num_generations)]
        roll = (self.sampler or sample)(self.model, self.tokenizer, prompts, self.max_len, temperature=c.temperature,
                                        generator=self.generator)
        return roll, checked_rewards(self.task, prompts, roll.completions, self.device)

    def _sample_groups(self):
        """The step's completions and rewards (refilled by dynamic sampling), and every draw made; rewards with
        the overlong penalty. Dynamic sampling filters on the task's rewards, before the penalty (as verl's DAPO
        filters on accuracy): a group whose answers differ only in length has nothing to teach about the task."""
        c = self.config
        n_groups = c.per_device_train_batch_size // c.num_generations
        if not c.dynamic_sampling:
            roll, rewards = self._draw(n_groups)
            rewards = overlong_shaped(c, roll, rewards, self.max_len)
            return roll, rewards, [(roll, rewards)]
        roll, rewards, drawn = fill_batch(lambda: self._draw(n_groups), n_groups, c.num_generations,
                                          c.max_num_gen_batches, self.tokenizer.pad_token_id)
        drawn = [(r, overlong_shaped(c, r, task_rewards, self.max_len)) for r, task_rewards in drawn]
        return roll, None if roll is None else overlong_shaped(c, roll, rewards, self.max_len), drawn

    @torch.no_grad()
    def make_batch(self) -> _Batch:
        """Sample, score and compute advantages for one step's completions (``advantages`` None: skip)."""
        c = self.config
        roll, rewards, drawn = self._sample_groups()
        table = reward_table(self.task) if c.multi_objective_aggregation == "normalize_then_sum" else None
        metrics = draw_metrics(drawn, c.num_generations)
        if roll is None:                         # dynamic sampling found no group with a signal
            return _Batch(metrics=metrics)
        mask = roll.completion_mask
        if c.mask_truncated_completions:
            mask = mask * roll.finished.long()[:, None]
        b = _Batch(roll.prompt_ids, roll.prompt_mask, roll.completion_ids, mask, metrics=metrics)
        if float(mask.sum()) == 0:
            return b                             # nothing to learn from in this batch
        if self.ref_model is not None and c.beta > 0:
            b.ref_logprobs = self._logits_and_logprobs(self.ref_model, b)[1]
        shaped = rewards
        if c.kl_in_reward and b.ref_logprobs is not None:   # TRL's RLOO: r - beta * sum_t (log pi_old - log pi_ref)
            old_now = self._logits_and_logprobs(self.model, b)[1]
            shaped = rewards - c.beta * kl_k1(old_now, b.ref_logprobs, mask).sum(1)
        b.rewards, b.advantages = shaped, self._advantages(shaped, table)
        if c.num_iterations > 1:
            b.old_logprobs = self._logits_and_logprobs(self.model, b)[1]
        if self.sampler is not None:
            attach_sampler_logprobs(c, self.model, b, roll.logprobs)
        return b

    def _loss(self, b: _Batch):
        logits, logp = self._logits_and_logprobs(self.model, b)
        return loss_and_stats(self.config, logits, logp, b, self.max_len,
                              entropy_coef=entropy_coef_now(self.config, self.entropy_coef, self.last_entropy))

    def step(self) -> dict:
        """One training step (sampling, then ``num_iterations`` optimiser steps); returns its metrics."""
        b = self.make_batch()
        metrics = dict(b.metrics)
        if b.advantages is None:
            metrics.update(loss=0.0, skipped=1.0)
            self.history.append(metrics)
            return metrics
        self.model.train()
        for _ in range(self.config.num_iterations):
            loss, stats = self._loss(b)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.config.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
            self.entropy_coef, self.last_entropy = entropy_coef_after(self.config, self.entropy_coef,
                                                                      self.last_entropy, stats)
        self.model.eval()
        metrics.update(stats, loss=float(loss.detach()))
        if self.config.use_adaptive_entropy:
            metrics["entropy_coef"] = self.entropy_coef
        self.history.append(metrics)
        return metrics

    def train(self, max_steps: int | None = None, progress: bool = True, callback=None) -> list[dict]:
        """Run ``max_steps`` steps (default ``config.max_steps``) with a tqdm bar showing reward and KL.

        ``callback(step, trainer)`` runs after each step (e.g. a held-out evaluation every N steps).
        """
        from tqdm.auto import tqdm

        steps = self.config.max_steps if max_steps is None else max_steps
        bar = tqdm(range(steps), disable=not progress, desc=f"{self.config.advantage_estimator}/{self.config.loss_type}")
        for i in bar:
            m = self.step()
            bar.set_postfix(reward=f"{m['reward']:.3f}", kl=f"{m.get('kl', 0.0):.4f}")
            if callback is not None:
                callback(i, self)
        return self.history

    def config_dict(self) -> dict:
        return asdict(self.config)
