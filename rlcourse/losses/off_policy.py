"""Off-policy corrections for LM policy gradients: the sampler is not the policy the trainer scores.

In production the completions come from one engine (vLLM, SGLang: bf16, its own kernels, often a
policy several updates old) and the trainer recomputes their log-probs with another. Write

    mu(y_t)      the sampler's probability of the token it drew (``sampler_logprobs``);
    pi_old(y_t)  the trainer's probability of that token when the batch is scored (``old_logprobs``);
    pi(y_t)      the policy being optimised (``logprobs``, with grad).

PPO/GRPO's ratio ``pi / pi_old`` assumes the tokens were drawn from ``pi_old``. They were drawn from
``mu``; the weight that repairs it is ``pi_old / mu``, which TRL 1.16 multiplies onto every
per-token loss (``vllm_importance_sampling_correction=True``), in one of four modes
(:data:`SAMPLER_IS_MODES`), and DeepSeek-V3.2's off-policy sequence mask drops far-off-policy
sequences of negative advantage (:func:`off_policy_sequence_mask`). These functions compute
exactly what TRL's ``GRPOTrainer`` does with those settings (``tests/test_off_policy_trl_parity.py``
runs TRL's trainer on fixed inputs and compares).

References: truncated importance weights as in IMPALA's V-trace (Espeholt et al., 2018, arXiv
1802.01561); the off-policy sequence mask of DeepSeek-V3.2 (2025, arXiv 2512.02556, eq. 9).
"""
from __future__ import annotations

import math

import torch

__all__ = ["SAMPLER_IS_MODES", "sampler_importance_weights", "off_policy_sequence_mask", "sampler_gap_stats",
           "effective_sample_size", "check_sampler_logprobs"]

SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_sampler_logprobs(sampler_logprobs, completion_ids: torch.Tensor, mask: torch.Tensor,
                           name: str = "sampler_logprobs") -> torch.Tensor:
    """``sampler_logprobs`` as a float tensor, refused with an error naming ``name`` unless it has the
    completions' shape ``(B, T)`` and holds finite values <= 0 on every real token (``mask == 1``).

    (TRL zeroes the correction of a token vLLM could not score, a NaN; here a NaN from our own
    sampler is a bug, so it is refused.)
    """
    if not isinstance(sampler_logprobs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {tuple(completion_ids.shape)}, "
                        f"got {type(sampler_logprobs).__name__}")
    if sampler_logprobs.shape != completion_ids.shape:
        raise ValueError(f"{name} must have the completions' shape {tuple(completion_ids.shape)} (one log-prob per "
                         f"completion token), got {tuple(sampler_logprobs.shape)}")
    if not sampler_logprobs.is_floating_point():
        raise ValueError(f"{name} must hold floating-point log-probs, got dtype {sampler_logprobs.dtype}")
    real = mask.bool()
    values = sampler_logprobs[real]
    if not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise ValueError(f"{name} holds {bad} NaN or infinite value(s) on real completion tokens: the sampler must "
                         f"return the finite log-prob of every token it drew")
    if bool((values > 1e-4).any()):
        raise ValueError(f"{name} holds log-probs above 0 (largest {float(values.max()):.3g}) on real tokens: "
                         f"pass log-probabilities, not logits or probabilities")
    return sampler_logprobs


def sampler_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: str = "sequence_mask", clip_min: float | None = None,
                               clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's ``importance_sampling_ratio``: the weight ``pi_old / mu`` that corrects the sampler's tokens.

    With ``d_t = (log pi_old(y_t) - log mu(y_t)) m_t`` (0 on padding, and 0 where ``mu`` is NaN, as TRL):

    * token level (``token_*``): ``rho_t = exp(d_t)``, shape ``(B, T)``;
    * sequence level (``sequence_*``): ``rho = exp(sum_t d_t) = pi_old(y) / mu(y)``, shape ``(B, 1)``;
    * ``*_truncate``: ``w = clamp(rho, clip_min, clip_max)`` (truncated IS);
    * ``*_mask``: ``w = rho`` if ``clip_min <= rho <= clip_max`` else ``0`` (masked IS).

    ``clip_min``/``clip_max`` are TRL's ``vllm_importance_sampling_clip_min`` (default None: no
    lower bound) and ``vllm_importance_sampling_clip_max`` (default 3.0); TRL's default mode is
    ``sequence_mask``. The weight is detached: it multiplies the per-token loss as a constant.
    The cap applies to the ratio, after exponentiating: ``min(exp(d), C)``, not ``exp(min(d, C))``.
    """
    if mode not in SAMPLER_IS_MODES:
        raise ValueError(f"mode must be one of {SAMPLER_IS_MODES} (TRL's vllm_importance_sampling_mode), got {mode!r}")
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must have one shape (B, T)")
    m = mask.to(old_logprobs.dtype)
    diff = torch.nan_to_num((old_logprobs.detach() - sampler_logprobs.detach()) * m, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            return ratio
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def off_policy_sequence_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9), TRL's ``off_policy_mask_threshold``.

    ``M_i = 0`` if ``A_i < 0`` and ``(1/|y_i|) sum_t (log mu(y_t) - log pi(y_t)) > delta``, else ``1``:
    a sequence is dropped only when it is pushed *down* and the policy has drifted from the sampler
    by more than ``delta`` nats per token (a sample estimate of ``KL(mu || pi)``). Shape ``(B, 1)``,
    in ``mask``'s dtype; ``logprobs`` is detached; NaN sampler log-probs count 0, as in TRL.
    Advantages are ``(B,)`` or ``(B, 1)``.
    """
    if threshold is None or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (TRL's off_policy_mask_threshold, e.g. 0.5), got {threshold!r}")
    adv = advantages.reshape(-1, 1)
    m = mask.to(logprobs.dtype)
    kl = torch.nan_to_num(sampler_logprobs - logprobs.detach(), nan=0.0)
    per_seq = (kl * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (per_seq <= threshold)).to(mask.dtype)


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size as a share of the sample, ``(sum w)^2 / (n sum w^2)``, in (0, 1].

    1 when every weight is equal; near 1/n when one weight dominates; 0 for all-zero weights.
    """
    w = weights.detach().double().reshape(-1)
    denom = w.numel() * float((w ** 2).sum())
    return float(w.sum() ** 2 / denom) if denom > 0 else 0.0


def sampler_gap_stats(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                      cap: float = 3.0) -> dict:
    """How far the sampler is from the trainer on one batch (TRL's ``sampling/*`` metrics and more).

    * ``sampling_logp_difference/mean`` and ``/max``: mean and max of ``|log pi_old - log mu|`` over real tokens;
    * ``token_ratio_std``: the spread of the token ratios ``pi_old / mu``;
    * ``token_beyond_cap`` / ``sequence_beyond_cap``: the share of tokens / sequences whose ratio
      is above ``cap`` or below ``1 / cap``;
    * ``sequence_ess``: :func:`effective_sample_size` of the sequence ratios.
    """
    real = mask.bool()
    d = (old_logprobs - sampler_logprobs).detach().double()
    token_ratio = torch.exp(d[real])
    seq_ratio = torch.exp((d * real).sum(1))
    beyond = lambda r: float(((r > cap) | (r < 1.0 / cap)).double().mean())
    return {"sampling_logp_difference/mean": float(d[real].abs().mean()),
            "sampling_logp_difference/max": float(d[real].abs().max()),
            "token_ratio_std": float(token_ratio.std()) if token_ratio.numel() > 1 else 0.0,
            "token_beyond_cap": beyond(token_ratio), "sequence_beyond_cap": beyond(seq_ratio),
            "sequence_ess": effective_sample_size(seq_ratio)}
