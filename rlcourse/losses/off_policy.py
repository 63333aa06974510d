"""Off-policy corrections for LM policy gradients: the sampler is not the policy the trainer scores.

In production the completions come from one engine (vLLM, SGLang: bf16, its own kernels, often a
policy several updates old) and the trainer recomputes their log-probs with another. Write

    mu(y_t)      the sampler's probability of the token it drew (``sampler_logprobs``);
    pi_old(y_t)  the trainer's probability of that token when the batch is scored (``old_logprobs``);
    pi(y_t)      the policy being optimised (``logprobs``, with grad).

PPO/GRPO's ratio ``pi / pi_old`` assumes the tokens were drawn from ``pi_old``. They were drawn from
``mu``; the weight that repairs it is ``pi_old / mu``, which TRL 1.16 multiplies onto every
per-token policy loss (``vllm_importance_sampling_correction=True``) in one of four modes
(:data:`SAMPLER_IS_MODES`), and DeepSeek-V3.2's off-policy sequence mask drops far-off-policy
sequences of negative advantage (:func:`off_policy_sequence_mask`). These functions compute what
TRL's ``GRPOTrainer`` computes with those settings (``tests/test_trl_parity_off_policy.py`` runs
TRL's trainer on fixed inputs and compares).

References: truncated importance weights as in IMPALA's V-trace (Espeholt et al., 2018, arXiv
1802.01561) and, for the sampler-trainer gap, Yao et al., "Your efficient RL framework secretly
brings you off-policy RL training" (2025); the off-policy sequence mask of DeepSeek-V3.2 (2025,
arXiv 2512.02556, eq. 9); Kish's effective sample size (Kish, 1965, "Survey Sampling").
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["SAMPLER_IS_MODES", "sampler_importance_weights", "off_policy_sequence_mask", "sampler_gap_stats",
           "effective_sample_size", "check_sampler_logprobs", "check_is_bounds"]

SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_sampler_logprobs(sampler_logprobs, completion_ids: torch.Tensor, mask: torch.Tensor,
                           name: str = "sampler_logprobs") -> torch.Tensor:
    """``sampler_logprobs`` as given, refused with an error naming ``name`` unless it is a floating-point
    tensor of the completions' shape ``(B, T)`` holding finite values <= 0 on every real token (``mask == 1``).

    (TRL sets the correction of a token vLLM could not score, a NaN, to 1; here a NaN from a sampler
    is a bug to report, so it is refused.)
    """
    if not isinstance(sampler_logprobs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {tuple(completion_ids.shape)}, "
                        f"got {type(sampler_logprobs).__name__}")
    if sampler_logprobs.shape != completion_ids.shape:
        raise ValueError(f"{name} must have the completions' shape {tuple(completion_ids.shape)} (one log-prob per "
                         f"completion token), got {tuple(sampler_logprobs.shape)}")
    if not sampler_logprobs.is_floating_point():
        raise ValueError(f"{name} must hold floating-point log-probs, got dtype {sampler_logprobs.dtype}")
    values = sampler_logprobs[mask.bool()]
    if not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise ValueError(f"{name} holds {bad} NaN or infinite value(s) on real completion tokens: the sampler must "
                         f"return the finite log-prob of every token it drew")
    if bool((values > 1e-4).any()):
        raise ValueError(f"{name} holds log-probs above 0 (largest {float(values.max()):.3g}) on real tokens: "
                         f"pass log-probabilities, not logits or probabilities")
    return sampler_logprobs


def check_is_bounds(clip_min, clip_max, min_name: str = "clip_min", max_name: str = "clip_max") -> None:
    """Refuse importance-weight bounds that are not ``None`` or numbers with ``0 <= clip_min <= clip_max``."""
    for value, label in ((clip_min, min_name), (clip_max, max_name)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or math.isnan(value) or value < 0):
            raise ValueError(f"{label} must be None or a number >= 0, got {value!r}")
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"{min_name} ({clip_min!r}) must not exceed {max_name} ({clip_max!r})")


def sampler_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: str = "sequence_mask", clip_min: float | None = None,
                               clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's ``importance_sampling_ratio``: the weight ``pi_old / mu`` that corrects for the sampler.

    With ``d_t = (log pi_old(y_t) - log mu(y_t)) m_t`` (0 on padding, and 0 where either is NaN, as TRL):

    * token level (``token_*``): ``rho_t = exp(d_t)``, shape ``(B, T)``;
    * sequence level (``sequence_*``): ``rho = exp(sum_t d_t) = pi_old(y) / mu(y)``, shape ``(B, 1)``;
    * ``*_truncate``: ``w = clamp(rho, clip_min, clip_max)`` (truncated IS);
    * ``*_mask``: ``w = rho`` if ``clip_min <= rho <= clip_max`` else ``0`` (masked IS).

    ``clip_min``/``clip_max`` are TRL's ``vllm_importance_sampling_clip_min`` (default None: no
    lower bound) and ``vllm_importance_sampling_clip_max`` (default 3.0); a bound of ``None`` is no
    bound (both None: the plain ratio; TRL's ``torch.clamp`` refuses that for ``*_truncate``). TRL's
    default mode is ``sequence_mask``. The weight is detached: it multiplies the per-token loss as a
    constant. The cap applies to the ratio, after exponentiating: ``min(exp(d), C)``.
    """
    if mode not in SAMPLER_IS_MODES:
        raise ValueError(f"mode must be one of {SAMPLER_IS_MODES} (TRL's vllm_importance_sampling_mode), got {mode!r}")
    check_is_bounds(clip_min, clip_max)
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape or old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must have one shape (B, T)")
    m = mask.to(old_logprobs.dtype)
    diff = torch.nan_to_num((old_logprobs.detach() - sampler_logprobs.detach()) * m, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def off_policy_sequence_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9), TRL's ``off_policy_mask_threshold``.

    ``M_i = 0`` if ``A_i < 0`` and ``(1/|y_i|) sum_t (log mu(y_t) - log pi(y_t)) > delta``, else ``1``:
    a sequence is dropped only when it is pushed *down* and the policy has drifted from the sampler
    by more than ``delta`` nats per token (a sample estimate of ``KL(mu || pi)`` per token, since the
    tokens were drawn from ``mu``). Shape ``(B, 1)``, in ``mask``'s dtype; ``logprobs`` (the current
    policy's) is detached; NaN differences count 0, as in TRL. Advantages are ``(B,)`` or ``(B, 1)``.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (TRL's off_policy_mask_threshold, e.g. 0.5), got {threshold!r}")
    if logprobs.shape != sampler_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} and "
                         f"mask {tuple(mask.shape)} must have one shape (B, T)")
    if advantages.numel() != logprobs.shape[0]:
        raise ValueError(f"advantages must hold one value per sequence ({logprobs.shape[0]}), got shape "
                         f"{tuple(advantages.shape)}")
    adv = advantages.reshape(-1, 1)
    m = mask.to(logprobs.dtype)
    gap = torch.nan_to_num(sampler_logprobs.detach() - logprobs.detach(), nan=0.0)
    per_token = (gap * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (per_token <= threshold)).to(mask.dtype)


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size as a share of the sample, ``(sum w)^2 / (n sum w^2)``, in (0, 1].

    1 when every weight is equal; near 1/n when one weight dominates; 0 for all-zero weights.
    """
    w = weights.detach().double().reshape(-1)
    denom = w.numel() * float((w ** 2).sum())
    return float(w.sum() ** 2 / denom) if denom > 0 else 0.0


def sampler_gap_stats(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                      weights: torch.Tensor | None = None, cap: float = 3.0) -> dict:
    """How far the sampler is from the trainer on one batch, as logged by the trainers.

    TRL's names (its ``GRPOTrainer`` logs them under vLLM):

    * ``sampling/sampling_logp_difference/mean`` and ``/max``: of ``|log pi_old - log mu|`` over real tokens;
    * ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max``: of the applied ``weights``
      (:func:`sampler_importance_weights`; over real tokens, or over sequences for a ``(B, 1)``
      weight), only when ``weights`` is given.

    Ours, of the uncapped ratios ``pi_old / mu``:

    * ``sampling/kl``: the mean over real tokens of ``log mu - log pi_old``, the per-token estimate
      of ``KL(mu || pi_old)`` from tokens drawn from ``mu``;
    * ``sampling/token_ratio_std``: the spread of the token ratios;
    * ``sampling/token_above_cap`` and ``sampling/sequence_above_cap``: the share of tokens and of
      sequences whose ratio exceeds ``cap`` (what ``*_mask`` with ``clip_max=cap`` drops);
    * ``sampling/token_outside_cap`` and ``sampling/sequence_outside_cap``: the share whose ratio lies
      outside ``[1 / cap, cap]``, off by more than a factor ``cap`` either way;
    * ``sampling/sequence_ess``: :func:`effective_sample_size` of the sequence ratios.
    """
    real = mask.bool()
    d = (old_logprobs.detach() - sampler_logprobs.detach()).double()
    gaps = d[real]
    token_ratio = torch.exp(gaps)
    seq_ratio = torch.exp(torch.where(real, d, torch.zeros_like(d)).sum(1))
    stats = {"sampling/sampling_logp_difference/mean": float(gaps.abs().mean()) if gaps.numel() else 0.0,
             "sampling/sampling_logp_difference/max": float(gaps.abs().max()) if gaps.numel() else 0.0,
             "sampling/kl": float(-gaps.mean()) if gaps.numel() else 0.0,
             "sampling/token_ratio_std": float(token_ratio.std()) if token_ratio.numel() > 1 else 0.0,
             "sampling/token_above_cap": float((token_ratio > cap).double().mean()) if gaps.numel() else 0.0,
             "sampling/sequence_above_cap": float((seq_ratio > cap).double().mean()),
             "sampling/token_outside_cap": float(((gaps.abs() > math.log(cap))).double().mean()) if gaps.numel() else 0.0,
             "sampling/sequence_outside_cap": float((seq_ratio.log().abs() > math.log(cap)).double().mean()),
             "sampling/sequence_ess": effective_sample_size(seq_ratio)}
    if weights is not None:
        flat = weights.detach().reshape(-1) if weights.shape[-1] == 1 else weights.detach()[real]
        if flat.numel():
            stats.update({"sampling/importance_sampling_ratio/min": float(flat.min()),
                          "sampling/importance_sampling_ratio/mean": float(flat.mean()),
                          "sampling/importance_sampling_ratio/max": float(flat.max())})
    return stats
