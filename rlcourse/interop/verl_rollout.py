"""verl's rollout correction: the sampler-trainer weights of lesson 10c under verl's conventions.

TRL 1.16's weight for the sampler ``mu`` (:func:`rlcourse.losses.off_policy.sampler_importance_weights`)
and verl's differ in five conventions, each a line of code and each measured in lesson 10c:

* verl clamps the log-ratio ``log pi_old - log mu`` (a token's, or a sequence's sum) to
  ``[-20, 20]`` before the exponential; TRL exponentiates it as it is;
* verl truncates at ``threshold = 2`` by default; TRL's ``vllm_importance_sampling_clip_max`` is 3;
* verl's weights are 0 on padding; TRL's token weights are ``exp(0) = 1`` there (the loss masks
  padding anyway, so only statistics taken over the whole ``(B, T)`` tensor see the difference);
* verl's rejection (drop instead of reweight) bounds the same ratio ``pi_old / mu`` on both sides by
  default: its lower bound, when not given, is ``1 / upper``; TRL's ``*_mask`` modes drop only above
  ``vllm_importance_sampling_clip_max`` unless ``vllm_importance_sampling_clip_min`` is set;
* verl logs the mean weight *before* truncation; TRL's ``importance_sampling_ratio/mean`` is the
  mean of the weights it applies, after.

Shapes: ``old_logprobs`` (the trainer's ``pi_old``), ``sampler_logprobs`` (``mu``) and ``mask`` are
``(B, T)``; padding may hold anything (it is selected away before any arithmetic).
"""
from __future__ import annotations

import math

import torch

__all__ = ["VERL_LOG_RATIO_BOUND", "VERL_IS_THRESHOLD", "verl_rollout_weights", "verl_rejection_mask"]

VERL_LOG_RATIO_BOUND = 20.0   # |log pi_old - log mu| is clamped here before exp (a token's, or a sequence's sum)
VERL_IS_THRESHOLD = 2.0       # verl's default truncation of the weight (TRL's vllm_importance_sampling_clip_max: 3)


def _log_ratio(old_logprobs, sampler_logprobs, mask, level):
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if not (isinstance(old_logprobs, torch.Tensor) and isinstance(sampler_logprobs, torch.Tensor)
            and isinstance(mask, torch.Tensor)) or old_logprobs.dim() != 2 \
            or old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(f"old_logprobs, sampler_logprobs and mask must be tensors of one shape (B, T), got "
                         f"{tuple(getattr(old_logprobs, 'shape', ()))}, {tuple(getattr(sampler_logprobs, 'shape', ()))} "
                         f"and {tuple(getattr(mask, 'shape', ()))}")
    real = mask.bool()
    d = torch.where(real, old_logprobs.detach() - sampler_logprobs.detach(), torch.zeros_like(old_logprobs))
    if level == "sequence":
        d = d.sum(-1, keepdim=True)
    return real, d


def verl_rollout_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *,
                         level: str = "token", threshold: float | None = VERL_IS_THRESHOLD,
                         log_ratio_bound: float | None = VERL_LOG_RATIO_BOUND) -> tuple[torch.Tensor, dict]:
    """verl's truncated importance weight ``pi_old / mu`` and the mean it logs.

    ``w = min(exp(clamp(d, -b, b)), threshold) * m``, with ``d = log pi_old - log mu`` per token
    (``level="token"``) or summed over the completion's real tokens (``"sequence"``, one weight
    spread over its tokens), ``b = log_ratio_bound`` (``None``: no clamp, TRL's way) and ``m`` the
    mask: 0 on padding. ``threshold=None`` applies no truncation.

    Returns ``(weights, metrics)``: ``weights`` ``(B, T)``, detached; ``metrics`` holds
    ``"rollout_is_mean"``, the mean over real tokens of the weights *before* truncation (verl's
    logged mean), and ``"rollout_is_truncated"``, the share of real tokens whose weight the
    threshold cut.
    """
    if threshold is not None and not threshold > 0:
        raise ValueError(f"threshold must be None or > 0, got {threshold!r}")
    if log_ratio_bound is not None and not log_ratio_bound > 0:
        raise ValueError(f"log_ratio_bound must be None or > 0, got {log_ratio_bound!r}")
    real, d = _log_ratio(old_logprobs, sampler_logprobs, mask, level)
    if log_ratio_bound is not None:
        d = torch.clamp(d, -log_ratio_bound, log_ratio_bound)
    raw = torch.where(real, torch.exp(d).expand(real.shape), torch.zeros((), dtype=d.dtype, device=d.device))
    weights = raw if threshold is None else torch.clamp(raw, max=threshold)
    n = real.sum().clamp(min=1)
    metrics = {"rollout_is_mean": float(raw[real].double().sum() / n),
               "rollout_is_truncated": 0.0 if threshold is None else float((raw[real] > threshold).double().sum() / n)}
    return weights, metrics


def verl_rejection_mask(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *,
                        level: str = "token", upper: float = VERL_IS_THRESHOLD, lower: float | None = None) -> torch.Tensor:
    """verl's rejection: keep a token (``level="token"``, ``(B, T)``) or a completion (``"sequence"``,
    ``(B, 1)``) only if ``lower <= pi_old / mu <= upper``, with ``lower = 1 / upper`` when not given.

    The ratio is the weight's, ``pi_old / mu``, as TRL's ``token_mask`` and ``sequence_mask`` bound it;
    the difference is the default lower bound. With ``upper = 3`` verl also drops what the sampler
    found more than 3 times *likelier* than the trainer (``pi_old / mu < 1/3``), where TRL, with its
    ``clip_min`` unset, drops only what it found 3 times *less* likely. Returns 1 (keep) or 0 in the
    log-probs' dtype; padding tokens are 0 at token level.
    """
    if not upper > 0:
        raise ValueError(f"upper must be > 0, got {upper!r}")
    lower = 1.0 / upper if lower is None else lower
    if not lower > 0:
        raise ValueError(f"lower must be None or > 0, got {lower!r}")
    if lower > upper:
        raise ValueError(f"lower ({lower!r}) must not exceed upper ({upper!r})")
    real, d = _log_ratio(old_logprobs, sampler_logprobs, mask, level)   # d = log(pi_old / mu)
    keep = (d >= math.log(lower)) & (d <= math.log(upper))
    if level == "token":
        keep &= real
    return keep.to(old_logprobs.dtype)
