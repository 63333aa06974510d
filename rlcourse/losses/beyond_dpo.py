"""Preference losses past offline DPO: SimPO, ORPO, KTO, R-DPO's length penalty, and online-DPO pairs.

Each loss reads sequence log-probabilities, as :mod:`rlcourse.losses.dpo` does; some read them
*averaged over the completion's tokens*, ``log pi(y|x) / |y|`` (:func:`average_logps`). Per pair or
per example, shape (B,):

    simpo   -log sigmoid(beta (log pi(y_w)/|y_w| - log pi(y_l)/|y_l|) - gamma)      Meng et al. 2024, arXiv 2405.14734
    orpo    -lambda log sigmoid(log odds(y_w) - log odds(y_l)),  odds(y) = p / (1 - p), p = exp(log pi(y)/|y|)
            (added to the NLL of the chosen answers)                              Hong et al. 2024, arXiv 2403.07691
    kto     lambda_D (1 - sigmoid(beta (r_w - z0))) for a desirable answer,
            lambda_U (1 - sigmoid(beta (z0 - r_l))) for an undesirable one,
            r = log pi(y)/pi_ref(y), z0 = max(0, mean log pi/pi_ref over mismatched pairs), no gradient
                                                                                  Ethayarajh et al. 2024, arXiv 2402.01306
    rdpo    -log sigmoid(beta h + alpha (|y_w| - |y_l|))                          Park et al. 2024, arXiv 2403.19159

Names follow TRL 1.16: SimPO is ``CPOTrainer`` with ``loss_type="simpo"`` (``beta``, ``simpo_gamma``,
``cpo_alpha=0``), ORPO is ``ORPOTrainer`` (its ``beta`` is the paper's lambda), KTO is ``KTOTrainer``
(``beta``, ``desirable_weight``, ``undesirable_weight``); the parity tests run their code on fixed
log-probs. TRL 1.16 has no R-DPO option: ``rdpo_alpha`` is this course's name.

:func:`online_dpo_pairs` turns groups of sampled, scored completions into preference pairs (online
DPO: Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcourse.losses.dpo import (DPO_LOSS_TYPES, _check_beta, _logps, chosen_nll_loss, dpo_logratio_margin,
                                preference_loss)

__all__ = ["BEYOND_DPO_LOSS_TYPES", "ALL_PREFERENCE_LOSS_TYPES", "REFERENCE_FREE_LOSS_TYPES", "average_logps", "simpo_loss", "orpo_log_odds_ratio",
           "orpo_loss", "kto_reference_point", "kto_loss", "rdpo_loss", "online_dpo_pairs",
           "preference_objective"]

BEYOND_DPO_LOSS_TYPES = ("simpo", "orpo", "kto")
ALL_PREFERENCE_LOSS_TYPES = DPO_LOSS_TYPES + BEYOND_DPO_LOSS_TYPES
REFERENCE_FREE_LOSS_TYPES = ("simpo", "orpo", "sft")   # losses that never read pi_ref


def average_logps(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t m_t log pi(y_t | x, y_<t) / sum_t m_t``: each row's log-prob per real token, shape (B,).

    A row without real tokens counts as one token (no division by zero). Padding may hold anything (NaN, inf):
    it is selected away with ``torch.where``, not multiplied by 0."""
    if token_logps.dim() != 2 or token_logps.shape != mask.shape:
        raise ValueError(f"token_logps and mask must be (B, T) of one shape, got {tuple(token_logps.shape)} "
                         f"and {tuple(mask.shape)}")
    m = mask.to(token_logps.dtype)
    return torch.where(mask.bool(), token_logps, 0.0).sum(-1) / m.sum(-1).clamp(min=1.0)


def simpo_loss(chosen_avg_logps, rejected_avg_logps, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO (Meng, Xia and Chen 2024, eq. 6), per pair:

        -log sigmoid(beta / |y_w| log pi(y_w|x) - beta / |y_l| log pi(y_l|x) - gamma).

    Two changes to DPO: no reference model (the implicit reward is the policy's *average* log-prob,
    ``beta log pi(y|x) / |y|``), and a target margin ``gamma`` the reward difference must exceed.
    The inputs are the per-token averages (:func:`average_logps`). ``label_smoothing`` ``e`` mixes
    in the flipped label as TRL's ``CPOTrainer`` does (``-(1-e) log s(z) - e log s(-z)``); 0 is SimPO.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    w, l = _logps(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    z = beta * (w - l) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


_LOG2 = 0.6931471805599453
_ALMOST_SURE = 1e-4   # ORPO: a per-token average log-prob above -1e-4 takes the form finite at 0 (orpo_loss)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-log 2``.

    The ``log1p`` branch sees ``x`` clamped to its side: where ``exp(x)`` rounds to 1 (``x`` about
    -1e-8 in float32) it would be ``log1p(-1) = -inf``, and its zero weight in ``where`` times an
    infinite derivative is a NaN gradient, although the value taken from the other branch is finite."""
    return torch.where(x < -_LOG2, torch.log1p(-torch.exp(x.clamp(max=-_LOG2))), torch.log(-torch.expm1(x)))


def orpo_log_odds_ratio(chosen_avg_logps, rejected_avg_logps) -> torch.Tensor:
    """``log odds(y_w) - log odds(y_l)``, ``odds(y) = p(y) / (1 - p(y))`` with ``p(y) = exp(log pi(y|x) / |y|)``
    (ORPO's per-token probability; Hong et al. 2024, eq. 4). Inputs: per-token averages, all < 0."""
    w, l = _logps(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    return (w - l) - (_log1mexp(w) - _log1mexp(l))


def orpo_loss(chosen_avg_logps, rejected_avg_logps, beta: float) -> torch.Tensor:
    """ORPO's odds-ratio term (Hong, Lee and Thorne 2024, eq. 7), per pair:

        L_OR = -log sigmoid(log odds(y_w) - log odds(y_l)),   returned times beta (the paper's lambda).

    ORPO minimises ``NLL(y_w) + lambda * mean L_OR``: supervised fine-tuning on the chosen answers
    with a penalty that pushes the rejected answer's odds below the chosen one's. No reference
    model, and no separate SFT stage before it. (TRL's ``ORPOTrainer`` returns ``beta * log
    sigmoid(...)`` and subtracts its mean from the NLL: the same number.) The NLL that
    :func:`preference_objective` adds is the chosen *completion's* (the paper's eq. 2); TRL 1.16's
    ``ORPOTrainer`` takes it over the prompt's tokens too, following the authors' code.

    A chosen answer the policy is certain of (``log pi(y_w|x) / |y_w| = 0``) gives loss 0 and the finite
    gradient ``-beta odds(y_l)`` here; TRL 1.16's ``odds_ratio_loss`` gives a NaN gradient there.
    """
    _check_beta(beta)
    w, l = _logps(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    # A chosen answer the policy is certain of (w = 0: float32's log-softmax returns 0.0 for a token ~20 nats
    # ahead) has infinite log-odds, whose infinite derivative times logsigmoid's zero slope is a NaN gradient.
    # Near w = 0 the same loss is log(1 + odds(y_l) / odds(y_w)) with 1 / odds(y_w) = expm1(-w): finite and
    # smooth through w = 0 (loss 0, gradient -odds(y_l)). Each branch sees w clamped to its side.
    near = w > -_ALMOST_SURE
    far_w, near_w = w.clamp(max=-_ALMOST_SURE), w.clamp(min=-_ALMOST_SURE)
    far = -F.logsigmoid(orpo_log_odds_ratio(far_w, l))
    close = torch.log1p(torch.expm1(-near_w) * torch.exp(l - _log1mexp(l)))
    return beta * torch.where(near, close, far)


def kto_reference_point(kl_logps, ref_kl_logps) -> torch.Tensor:
    """KTO's reference point ``z0 = max(0, mean(log pi(y'|x) - log pi_ref(y'|x)))``, detached.

    An estimate of ``KL(pi || pi_ref)`` from pairs ``(x, y')`` whose completion belongs to another
    example of the batch (TRL's ``KTOTrainer`` pairs each prompt with the previous example's
    completion). The paper treats ``z0`` as a constant: no gradient flows through it.
    """
    kl, ref = _logps(kl_logps=kl_logps, ref_kl_logps=ref_kl_logps)
    return (kl - ref).mean().detach().clamp(min=0)


def kto_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, z0, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 7; TRL's ``loss_type="kto"``): one loss per *single* example,

        desirable y:    lambda_D (1 - sigmoid(beta (r(x, y) - z0)))
        undesirable y:  lambda_U (1 - sigmoid(beta (z0 - r(x, y)))),     r = log pi(y|x) - log pi_ref(y|x),

    desirable examples first, then undesirable (shape ``(n_desirable + n_undesirable,)``; the two may
    differ in number: the labels are unpaired). ``z0`` is the reference point
    (:func:`kto_reference_point`), a constant. The value saturates: an example already far on the
    right side of ``z0`` stops contributing, as prospect theory's value function flattens.
    """
    _check_beta(beta)
    if not (desirable_weight >= 0 and undesirable_weight >= 0):
        raise ValueError(f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight!r} and "
                         f"{undesirable_weight!r}")
    w, rw = _logps(chosen_logps=chosen_logps, ref_chosen_logps=ref_chosen_logps)
    l, rl = _logps(rejected_logps=rejected_logps, ref_rejected_logps=ref_rejected_logps)
    z0 = torch.as_tensor(z0, dtype=w.dtype)
    desirable = desirable_weight * (1 - torch.sigmoid(beta * ((w - rw) - z0)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - (l - rl))))
    return torch.cat([desirable, undesirable])


def rdpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths,
              rejected_lengths, beta: float, alpha: float) -> torch.Tensor:
    """R-DPO (Park, Rafailov, Ermon and Finn 2024, eq. 9), per pair:

        -log sigmoid(beta h + alpha (|y_w| - |y_l|)).

    DPO for the objective ``E[r(x, y) - alpha |y|] - beta KL(pi || pi_ref)``: its optimum
    ``pi ~ pi_ref exp((r - alpha |y|) / beta)`` makes ``r = beta log pi / pi_ref + alpha |y| + beta log Z``,
    and Bradley-Terry on that ``r`` is the loss above. The length term explains the part of a
    preference that length alone predicts, so the policy's margin ``h`` is not pushed to carry it:
    with raters whose utility is ``gold + b |y|``, ``alpha = b`` leaves the optimum of the gold score.
    ``alpha = 0`` is DPO.
    """
    _check_beta(beta)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha == alpha:
        raise ValueError(f"alpha must be a number (R-DPO's weight per unit of length), got {alpha!r}")
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    lw, ll = (torch.as_tensor(n).to(h) for n in (chosen_lengths, rejected_lengths))
    if lw.shape != h.shape or ll.shape != h.shape:
        raise ValueError(f"chosen_lengths and rejected_lengths must have shape {tuple(h.shape)}, got "
                         f"{tuple(lw.shape)} and {tuple(ll.shape)}")
    return -F.logsigmoid(beta * h + alpha * (lw - ll))


def online_dpo_pairs(scores, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Preference pairs from sampled groups: ``(chosen_idx, rejected_idx)``, two 1-D long tensors.

    ``scores[i]`` is completion ``i``'s score (a rater's or a reward model's) and ``groups[i]`` the
    prompt it answers. Each group with two distinct scores gives one pair: the best completion
    (the first index among the highest scores) against the worst (the first index among the lowest).
    A group of one completion, or whose scores are all equal, gives no pair: nothing says which
    answer is better. Pairs come in increasing group id. With two completions per prompt and no
    ties this is TRL's ``OnlineDPOTrainer`` rule (which, on a tie, calls the first one chosen).
    """
    scores, groups = torch.as_tensor(scores), torch.as_tensor(groups)
    if scores.dim() != 1 or groups.shape != scores.shape:
        raise ValueError(f"scores and groups must be 1-D of one shape, got {tuple(scores.shape)} and {tuple(groups.shape)}")
    if not bool(torch.isfinite(scores.double()).all()):
        raise ValueError("scores must be finite: a NaN or infinite score cannot rank a group's answers")
    chosen, rejected = [], []
    for g in torch.unique(groups).tolist():
        idx = torch.nonzero(groups == g).flatten()
        s = scores[idx]
        if s.numel() < 2 or bool((s == s[0]).all()):
            continue
        chosen.append(int(idx[torch.nonzero(s == s.max())[0, 0]]))
        rejected.append(int(idx[torch.nonzero(s == s.min())[0, 0]]))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


def preference_objective(chosen_token_logps, rejected_token_logps, chosen_mask, rejected_mask,
                         ref_chosen_logps, ref_rejected_logps, *, beta: float, loss_type="sigmoid", loss_weights=None,
                         label_smoothing: float = 0.0, simpo_gamma: float = 0.5, rdpo_alpha: float = 0.0,
                         desirable_weight: float = 1.0, undesirable_weight: float = 1.0, kl_logps=None,
                         ref_kl_logps=None, ipo_per_token: bool = True) -> torch.Tensor:
    """The scalar a preference trainer minimises on one batch of pairs, from per-token log-probs.

    ``loss_type``: a name of :data:`ALL_PREFERENCE_LOSS_TYPES` or a list (``loss_weights`` one weight
    each). DPO's types go to :func:`rlcourse.losses.dpo.preference_loss`, with R-DPO's length term
    when ``rdpo_alpha != 0`` on ``"sigmoid"``. ``"simpo"`` (reference-free) and ``"orpo"`` (the NLL of
    the chosen answers plus ``beta`` times the odds-ratio term) read per-token averages. ``"kto"``
    splits each pair into a desirable and an undesirable single; its reference point ``z0`` comes
    from ``kl_logps`` and ``ref_kl_logps`` (policy and reference log-probs of mismatched
    prompt-completion pairs, as TRL's ``KTOTrainer`` builds them) or, when they are not given, from
    the batch's own completions: ``max(0, mean r)`` over all of them, detached. Token log-probs off the
    masks are not read (they may hold anything, NaN included). ``ipo_per_token``: IPO's log-ratios averaged
    per token (TRL's ``DPOTrainer``, the default) or whole (TRL's ``OnlineDPOTrainer``).
    """
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if not types or len(weights) != len(types):
        raise ValueError(f"loss_type must name at least one loss and loss_weights hold one weight each, got "
                         f"{loss_type!r} and {loss_weights!r}")
    if (kl_logps is None) != (ref_kl_logps is None):
        raise ValueError("pass kl_logps and ref_kl_logps together (or neither)")
    # where, not a product: padding may hold junk (NaN, inf), and 0 * NaN is NaN
    chosen_token_logps = torch.where(chosen_mask.bool(), chosen_token_logps, 0.0)
    rejected_token_logps = torch.where(rejected_mask.bool(), rejected_token_logps, 0.0)
    chosen_logps, rejected_logps = chosen_token_logps.sum(-1), rejected_token_logps.sum(-1)
    chosen_len, rejected_len = chosen_mask.sum(-1), rejected_mask.sum(-1)
    total = 0.0
    for kind, weight in zip(types, weights):
        if kind == "simpo":
            term = simpo_loss(average_logps(chosen_token_logps, chosen_mask),
                              average_logps(rejected_token_logps, rejected_mask), beta, simpo_gamma,
                              label_smoothing).mean()
        elif kind == "orpo":
            term = chosen_nll_loss(chosen_token_logps, chosen_mask) + orpo_loss(
                average_logps(chosen_token_logps, chosen_mask), average_logps(rejected_token_logps, rejected_mask),
                beta).mean()
        elif kind == "kto":
            if kl_logps is None:
                z0 = kto_reference_point(torch.cat([chosen_logps, rejected_logps]),
                                         torch.cat([ref_chosen_logps, ref_rejected_logps]))
            else:
                z0 = kto_reference_point(kl_logps, ref_kl_logps)
            term = kto_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, z0, beta,
                            desirable_weight, undesirable_weight).mean()
        elif kind == "sigmoid" and rdpo_alpha:
            term = rdpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_len,
                             rejected_len, beta, rdpo_alpha).mean()
        elif kind in DPO_LOSS_TYPES:
            per_token = ipo_per_token or kind == "sigmoid_norm"      # lengths: IPO's (offline) and sigmoid_norm's
            term = preference_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta,
                                   loss_type=kind, label_smoothing=label_smoothing,
                                   chosen_lengths=chosen_len if per_token else None,
                                   rejected_lengths=rejected_len if per_token else None,
                                   chosen_token_logps=chosen_token_logps,
                                   chosen_mask=chosen_mask)
        else:
            raise ValueError(f"loss_type must be one of {ALL_PREFERENCE_LOSS_TYPES} (or a list), got {kind!r}")
        total = total + weight * term
    return total
