"""Direct preference optimisation and its relatives: losses on the log-probs of preference pairs.

A preference pair is a prompt ``x``, a chosen completion ``y_w`` and a rejected one ``y_l``. Every
loss here reads four sequence log-probabilities per pair (the trained policy and the frozen
reference, on each completion) through the *implicit reward*

    r_hat(x, y) = beta * (log pi_theta(y | x) - log pi_ref(y | x)),

which is the reward for which ``pi_theta`` would be the optimum of ``E[r] - beta KL(pi || pi_ref)``
(Rafailov et al. 2023, "Direct Preference Optimization", arXiv 2305.18290). With the log-ratio
margin ``h = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)]``:

    sigmoid (DPO)      -log sigmoid(beta h)                          Rafailov et al. 2023
    hinge (SLiC)       max(0, 1 - beta h)                            Zhao et al. 2023, arXiv 2305.10425
    ipo                (h / |y| - 1 / (2 beta))^2                    Azar et al. 2023, arXiv 2310.12036
    sigmoid_norm       -log sigmoid(beta h / |y|)                    length-normalised DPO, Tulu 3:
                                                                     Lambert et al. 2024, arXiv 2411.15124
    robust             [-(1-e) log s(beta h) + e log s(-beta h)] / (1 - 2e)
                                                                     Chowdhury et al. 2024, arXiv 2403.00409
    conservative       -(1-e) log s(beta h) - e log s(-beta h)       cDPO, Mitchell 2023 (a note,
                                                                     https://ericmitchell.ai/cdpo.pdf)
    sft (NLL)          -mean over chosen tokens of log pi(y_w,t | x, y_w,<t)
                                                                     added to any of them: RPO,
                                                                     Pang et al. 2024, arXiv 2404.19733

Every pairwise loss returns one value per pair (shape (B,)); :func:`preference_loss` averages
them and sums the weighted terms, with TRL's ``DPOConfig`` names (``beta``, ``loss_type``,
``loss_weights``, ``label_smoothing``). Names and conventions follow TRL 1.16's ``DPOTrainer`` (the
parity tests run TRL's code on the same log-probs): IPO's margin is averaged over each
completion's tokens when lengths are given, ``sigmoid_norm`` always averages them (``h / |y|``
stands for ``[log pi(y_w) - log pi_ref(y_w)] / |y_w| - [log pi(y_l) - log pi_ref(y_l)] / |y_l|``), and
the ``sft`` term is a mean over all chosen tokens of the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcourse.losses.policy_gradient import masked_mean

__all__ = ["DPO_LOSS_TYPES", "dpo_implicit_reward", "dpo_logratio_margin", "dpo_sigmoid_loss",
           "dpo_hinge_loss", "ipo_loss", "length_normalised_dpo_loss", "robust_dpo_loss", "conservative_dpo_loss",
           "chosen_nll_loss", "preference_loss"]

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sft", "sigmoid_norm")
LOSS_TYPES = DPO_LOSS_TYPES  # the short name inside this module


def _check_beta(beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a number > 0, got {beta!r}")


def _logps(**tensors) -> list[torch.Tensor]:
    """The named sequence log-probs as float tensors of one 1-D shape (B,)."""
    out, shapes = [], {}
    for name, t in tensors.items():
        t = torch.as_tensor(t)
        if not t.is_floating_point():
            raise TypeError(f"{name} must hold floating-point log-probabilities, got dtype {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, one sequence log-prob per pair (B,), got shape "
                             f"{tuple(t.shape)} (sum per-token log-probs over the completion first)")
        shapes[name] = tuple(t.shape)
        out.append(t)
    if len(set(shapes.values())) != 1:
        raise ValueError(f"the log-probs must all have one shape (B,), got {shapes}")
    return out


def dpo_implicit_reward(policy_logps, ref_logps, beta: float) -> torch.Tensor:
    """``r_hat(x, y) = beta * (log pi_theta(y|x) - log pi_ref(y|x))``, one per sequence.

    The reward that makes ``pi_theta`` optimal for ``E[r] - beta KL(pi || pi_ref)``, up to a
    per-prompt constant ``beta log Z(x)`` that every comparison of two answers cancels. TRL logs its
    mean as ``rewards/chosen`` and ``rewards/rejected``.
    """
    _check_beta(beta)
    policy_logps, ref_logps = _logps(policy_logps=policy_logps, ref_logps=ref_logps)
    return beta * (policy_logps - ref_logps)


def dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                        chosen_lengths=None, rejected_lengths=None) -> torch.Tensor:
    """``h = [log pi(y_w) - log pi_ref(y_w)] / |y_w| - [log pi(y_l) - log pi_ref(y_l)] / |y_l|``.

    Without lengths (the default) each log-ratio is the whole sequence's: ``beta * h`` is then the
    implicit reward margin. With lengths each log-ratio is averaged per token (IPO's form in TRL);
    lengths below 1 count as 1 so an empty completion cannot divide by zero.
    """
    cw, cl, rw, rl = _logps(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                            ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    chosen_ratio, rejected_ratio = cw - rw, cl - rl
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass chosen_lengths and rejected_lengths together (or neither)")
    if chosen_lengths is not None:
        for name, n in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
            if torch.as_tensor(n).shape != chosen_ratio.shape:
                raise ValueError(f"{name} must have shape {tuple(chosen_ratio.shape)}, got "
                                 f"{tuple(torch.as_tensor(n).shape)}")
        chosen_ratio = chosen_ratio / torch.as_tensor(chosen_lengths).to(cw).clamp(min=1.0)
        rejected_ratio = rejected_ratio / torch.as_tensor(rejected_lengths).to(cw).clamp(min=1.0)
    return chosen_ratio - rejected_ratio


def dpo_sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                     beta: float) -> torch.Tensor:
    """DPO: ``-log sigmoid(beta * h)`` per pair, the Bradley-Terry negative log-likelihood of the
    preference with the implicit reward in place of a reward model (``h``: the log-ratio margin).

    Its gradient, ``-beta * sigmoid(-beta h) * (grad log pi(y_w) - grad log pi(y_l))``, weights
    each pair by how wrongly the implicit reward currently orders it and tends to 0 only as
    ``h -> +inf``: on deterministic preferences the margin grows without bound.
    """
    _check_beta(beta)
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return -F.logsigmoid(beta * h)


def dpo_hinge_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                   beta: float) -> torch.Tensor:
    """SLiC's hinge: ``max(0, 1 - beta * h)`` per pair; pairs past the margin ``1 / beta`` stop
    contributing."""
    _check_beta(beta)
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return torch.relu(1 - beta * h)


def ipo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
             chosen_lengths=None, rejected_lengths=None) -> torch.Tensor:
    """IPO: ``(h - 1 / (2 beta))^2`` per pair (Azar et al. 2023, eq. 17, ``tau`` = ``beta``).

    A squared loss has a finite minimiser: the margin is pulled to its target ``1 / (2 beta)``
    however deterministic the preferences, where DPO's pushes it to infinity. With lengths, ``h``
    uses per-token log-ratios (TRL's normalisation, so ``beta`` does not depend on length).
    """
    _check_beta(beta)
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                            chosen_lengths, rejected_lengths)
    return (h - 1 / (2 * beta)) ** 2


def length_normalised_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float,
                               chosen_lengths, rejected_lengths) -> torch.Tensor:
    """Length-normalised DPO (Tulu 3: Lambert et al. 2024, arXiv 2411.15124), per pair:

        -log sigmoid(beta * ([log pi(y_w) - log pi_ref(y_w)] / |y_w| - [log pi(y_l) - log pi_ref(y_l)] / |y_l|)),

    DPO with each log-ratio divided by its completion's length in tokens (``chosen_lengths``,
    ``rejected_lengths``: shape (B,); lengths below 1 count as 1). TRL 1.16's ``loss_type="sigmoid_norm"``.
    A per-token log-ratio is about ``1 / |y|`` of the whole one, so ``beta`` must be about ``|y|`` times
    DPO's for the same pull (Tulu 3 used ``beta = 5``). Both lengths are required.
    """
    _check_beta(beta)
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError("length-normalised DPO (loss_type 'sigmoid_norm') needs chosen_lengths and rejected_lengths")
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                            chosen_lengths, rejected_lengths)
    return -F.logsigmoid(beta * h)


def robust_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                    beta: float, label_smoothing: float) -> torch.Tensor:
    """Robust DPO for labels flipped with probability ``e`` = ``label_smoothing`` (Chowdhury et al. 2024):

        [-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)] / (1 - 2e),

    an unbiased estimate of the clean DPO loss under that noise. ``e = 0`` is DPO.
    """
    _check_beta(beta)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for the robust loss, got {label_smoothing!r}")
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


def conservative_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                          beta: float, label_smoothing: float) -> torch.Tensor:
    """Conservative DPO (cDPO; E. Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO"):

        -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h),

    the cross-entropy of the implicit preference ``sigmoid(beta h)`` against the soft label ``1 - e``
    (``e`` = ``label_smoothing``). Unlike DPO and robust DPO it has a finite minimiser per pair,
    ``beta h = log((1 - e) / e)``, so a pair's margin stops growing there. This is what OpenRLHF's
    ``DPOLoss`` computes with ``label_smoothing > 0`` (``openrlhf/models/loss.py``). TRL 1.16's
    ``DPOTrainer`` reads ``label_smoothing`` only in its ``robust``, ``exo_pair``, ``aot`` and
    ``aot_unpaired`` losses (the last two weight a sorted-batch margin by ``1 - e`` and ``e`` as cDPO
    does); its ``sigmoid`` ignores it and it has no cDPO loss type, so this function is not one of
    :data:`LOSS_TYPES`. ``e = 0`` is DPO.
    """
    _check_beta(beta)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    eps = label_smoothing
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def chosen_nll_loss(chosen_token_logps: torch.Tensor, chosen_mask: torch.Tensor) -> torch.Tensor:
    """``-(1/N) sum_{b,t} m_bt log pi(y_w,bt | x_b, y_w,b<t)``: the SFT term on the chosen answers.

    A mean over every real chosen token of the batch (``N = sum m``), TRL's ``"sft"`` loss type.
    Added to a preference loss it keeps the chosen answers likely (RPO).
    """
    if chosen_token_logps.dim() != 2:
        raise ValueError(f"chosen_token_logps must be per-token, shape (B, T), got "
                         f"{tuple(chosen_token_logps.shape)}")
    return -masked_mean(chosen_token_logps, chosen_mask)


def _loss_types(loss_type, loss_weights) -> list[tuple[str, float]]:
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if not types:
        raise ValueError("loss_type must name at least one loss")
    for t in types:
        if t not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES} (or a list of them), got {t!r}")
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types):
        raise ValueError(f"loss_weights must have one weight per loss type ({len(types)}), got {len(weights)}")
    return list(zip(types, weights))


def preference_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
                    beta: float, loss_type="sigmoid", loss_weights=None, label_smoothing: float = 0.0,
                    chosen_lengths=None, rejected_lengths=None, chosen_token_logps=None,
                    chosen_mask=None) -> torch.Tensor:
    """``sum_k w_k * mean_pairs loss_k``: the scalar a DPO trainer minimises.

    ``loss_type`` is one name of :data:`LOSS_TYPES` or a list (``["sigmoid", "sft"]`` is RPO),
    ``loss_weights`` one weight per type (default 1 each). IPO reads the completion lengths when
    given, ``sigmoid_norm`` requires them; the ``"sft"`` term needs the chosen per-token log-probs and
    their mask.
    """
    _check_beta(beta)
    args = (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    total = 0.0
    for kind, weight in _loss_types(loss_type, loss_weights):
        if kind == "sigmoid":
            term = dpo_sigmoid_loss(*args, beta).mean()
        elif kind == "hinge":
            term = dpo_hinge_loss(*args, beta).mean()
        elif kind == "ipo":
            term = ipo_loss(*args, beta, chosen_lengths, rejected_lengths).mean()
        elif kind == "robust":
            term = robust_dpo_loss(*args, beta, label_smoothing).mean()
        elif kind == "sigmoid_norm":
            term = length_normalised_dpo_loss(*args, beta, chosen_lengths, rejected_lengths).mean()
        else:  # "sft"
            if chosen_token_logps is None or chosen_mask is None:
                raise ValueError("loss_type 'sft' needs chosen_token_logps (B, T) and chosen_mask")
            term = chosen_nll_loss(chosen_token_logps, chosen_mask)
        total = total + weight * term
    return total
