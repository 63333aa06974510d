"""Distillation losses: a student matches a frozen teacher's next-token distribution, token by token (lesson 11c).

On-policy distillation (GKD, Agarwal et al., arXiv 2306.13649; Thinking Machines' "On-Policy
Distillation", 2025) samples completions ``y ~ pi_s`` from the student and, at every position
``t`` of them, compares the student's next-token distribution with the teacher's, given the same
prefix ``h_t = (x, y_<t)``:

    reverse KL   D_t = KL(pi_s(.|h_t) || pi_T(.|h_t)) = sum_v pi_s(v|h_t) (log pi_s(v|h_t) - log pi_T(v|h_t))
    forward KL   D_t = KL(pi_T(.|h_t) || pi_s(.|h_t))

and GKD's generalised Jensen-Shannon divergence with ``beta`` in (0, 1), through the mixture
``M = beta pi_T + (1 - beta) pi_s``:

    JSD_beta(t) = beta KL(pi_T || M) + (1 - beta) KL(pi_s || M)

TRL's convention (``DistillationConfig.beta``, ``GKDTrainer.generalized_jsd_loss``): ``beta = 0`` is
the forward KL, ``beta = 1`` the reverse KL (both exactly, not as limits: ``JSD_beta`` itself tends to
``beta KL(pi_T || pi_s)`` and to 0 as ``beta -> 0``), ``beta = 0.5`` the symmetric JSD.

Every divergence here is the *exact* sum over the vocabulary at each position (``V`` is 81 for the
course's tiny GPT): no sampled estimator of the per-token KL. The teacher is under stop-gradient
(its logits are detached); the prefix ``h_t`` is treated as given, as TRL does, so the gradient is
that of the per-token divergences at fixed prefixes, not a score-function gradient through the
sampling of ``y``. Logits are divided by ``temperature`` before the softmax (TRL's ``temperature``).

Shapes: logits ``(B, T, V)``, masks ``(B, T)`` (1 = a completion token that counts: the student's
own tokens up to and including ``<eos>``). A mask means "not there": masked positions may hold
anything, NaN and inf included, and give exactly 0 in the value and the gradient.
"""
from __future__ import annotations

import math

import torch

from rlcourse.kl import as_mask, exact_kl, kl_k1
from rlcourse.losses.policy_gradient import masked_mean

__all__ = ["generalized_jsd_per_token", "reverse_kl_per_token", "forward_kl_per_token", "generalized_jsd",
           "sampled_reverse_kl_per_token"]


def _log_softmaxes(student_logits, teacher_logits, mask, temperature):
    """Checked ``(log pi_s, log pi_T detached, bool mask)``; masked positions hold the uniform distribution."""
    for name, x in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 1:
            raise TypeError(f"{name} must be a floating-point tensor (..., V) of logits, got {type(x).__name__}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits and teacher_logits must have one shape (B, T, V) (one vocabulary), got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                             and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    m = as_mask(mask, student_logits[..., 0], "mask", "the logits without their vocabulary dimension")
    teacher_logits = teacher_logits.detach()     # the teacher is frozen: stop-gradient
    if m is not None:   # replace what masked positions hold before any arithmetic (NaN never reaches a gradient)
        keep = m[..., None]
        student_logits = torch.where(keep, student_logits, torch.zeros_like(student_logits))
        teacher_logits = torch.where(keep, teacher_logits, torch.zeros_like(teacher_logits))
    wide = torch.promote_types(student_logits.dtype, torch.float32)   # float64 stays float64; half becomes float32
    log_s = torch.log_softmax(student_logits.to(wide) / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.to(wide) / temperature, dim=-1)
    return log_s, log_t, m


def _zero_masked(value: torch.Tensor, m) -> torch.Tensor:
    return value if m is None else torch.where(m, value, torch.zeros_like(value))


def generalized_jsd_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask=None, *,
                              beta: float = 1.0, temperature: float = 1.0) -> torch.Tensor:
    """GKD's generalised JSD at each position, exactly over the vocabulary: ``(B, T)``, 0 where ``mask`` is 0.

        beta = 0:        KL(pi_T || pi_s)                                   (forward KL, mode covering)
        beta = 1:        KL(pi_s || pi_T)                                   (reverse KL, mode seeking)
        0 < beta < 1:    beta KL(pi_T || M) + (1 - beta) KL(pi_s || M),     M = beta pi_T + (1 - beta) pi_s

    Args:
        student_logits: ``(B, T, V)`` the student's logits at the completion positions (with grad).
        teacher_logits: ``(B, T, V)`` the teacher's logits at the same positions (detached here).
        mask: ``(B, T)`` 0/1 or bool, or None (every position counts).
        beta: in [0, 1], TRL's ``DistillationConfig.beta`` (default 1.0 = reverse KL, as TRL's).
        temperature: both logits are divided by it before the softmax.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    log_s, log_t, m = _log_softmaxes(student_logits, teacher_logits, mask, temperature)
    if beta == 1:
        return exact_kl(log_s, log_t, mask=m)
    if beta == 0:
        return exact_kl(log_t, log_s, mask=m)
    # log M = log(beta e^{log pi_T} + (1 - beta) e^{log pi_s}), computed without leaving log space
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
    value = beta * exact_kl(log_t, log_m, mask=m) + (1 - beta) * exact_kl(log_s, log_m, mask=m)
    return _zero_masked(value, m)


def reverse_kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask=None, *,
                         temperature: float = 1.0) -> torch.Tensor:
    """``KL(pi_s(.|h_t) || pi_T(.|h_t))`` at each position, exactly over the vocabulary: ``(B, T)``.

    On-policy distillation's per-token loss (TRL's ``DistillationTrainer`` default, ``beta=1``): the
    student's expected log-ratio to the teacher, ``sum_v pi_s(v) (log pi_s(v) - log pi_T(v))``. The
    teacher's logits are detached; positions where ``mask`` is 0 are exactly 0.
    """
    return generalized_jsd_per_token(student_logits, teacher_logits, mask, beta=1.0, temperature=temperature)


def forward_kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask=None, *,
                         temperature: float = 1.0) -> torch.Tensor:
    """``KL(pi_T(.|h_t) || pi_s(.|h_t))`` at each position, exactly over the vocabulary: ``(B, T)`` (``beta=0``).

    Its gradient in the student's logits is ``pi_s - pi_T``: the cross-entropy to the teacher's whole
    distribution, which SFT on teacher samples estimates with one sampled token per position.
    """
    return generalized_jsd_per_token(student_logits, teacher_logits, mask, beta=0.0, temperature=temperature)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask=None, *,
                    beta: float = 1.0, temperature: float = 1.0) -> torch.Tensor:
    """The distillation loss: :func:`generalized_jsd_per_token` averaged over the counted tokens (a scalar).

        L = sum_{b,t} m_bt JSD_beta(t) / sum_{b,t} m_bt          (:func:`rlcourse.losses.masked_mean`)

    What TRL 1.16's ``DistillationTrainer`` minimises (its chunked ``_chunked_divergence_loss`` with
    ``num_items_in_batch=None``) and ``GKDTrainer.generalized_jsd_loss`` with ``reduction="batchmean"``
    on the same positions (``tests/test_distillation.py`` runs both, values and gradients).
    """
    per_token = generalized_jsd_per_token(student_logits, teacher_logits, mask, beta=beta, temperature=temperature)
    return masked_mean(per_token, mask)   # every counted token weighs the same, whichever completion holds it


def sampled_reverse_kl_per_token(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                                 mask=None) -> torch.Tensor:
    """The one-sample estimate of the reverse KL at each position: ``log pi_s(y_t) - log pi_T(y_t)`` (k1).

    ``y_t`` is the token the student sampled. Lesson 07b's k1 (:func:`rlcourse.kl.kl_k1`): unbiased
    for :func:`reverse_kl_per_token` (``E_{y_t ~ pi_s}[k1] = KL(pi_s || pi_T)``), but noisy and often
    negative. It needs only the teacher's log-prob of the sampled token, what a teacher behind a server
    returns cheaply (Thinking Machines' on-policy distillation feeds its negative to a policy gradient
    as a per-token reward; TRL's ``ServerDistillationTrainer`` instead takes the KL over the sampled
    token and a tail bucket of the remaining mass).
    """
    return kl_k1(student_logprobs, teacher_logprobs, mask)
