"""Reward over-optimisation on :class:`~rlcourse.tasks.preference.PreferenceTask`, computed exactly.

Gao et al. (2022, "Scaling Laws for Reward Model Overoptimization", arXiv 2210.10760) measured
the gold score of policies optimised against a proxy reward, against their KL to the start: it
rises, peaks and falls, while the proxy keeps rising. Here the proxy is the utility of raters with
a length bias (``PreferenceTask(length_bias=b)``: ``gold + b * len``), on the Bradley-Terry logit
scale a reward model of their labels learns, ``r = beta_rater * utility``. For each ``kl_coef``
the best policy against that proxy is known in closed form
(:func:`rlcourse.regularised_optimum.kl_regularised_optimum`),

    pi*(y | x) = pi_ref(y | x) exp(r(x, y) / kl_coef) / Z(x),

where ``pi_ref`` is the base policy (uniform length, uniform letters: the SFT checkpoint's target).
Every word of a class ``(L, S)`` (:meth:`PreferenceTask.word_classes`) has the same gold score and
proxy, so ``pi*`` is exact over all 8 + 8^2 + ... + 8^7 words through a few hundred classes. The
curve is what a perfect optimiser of this proxy reaches at each KL: no sampling, no training.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse.kl import exact_kl
from rlcourse.regularised_optimum import kl_regularised_optimum

__all__ = ["audit_labels", "optimum_curve", "gao_form", "fit_gao_form"]

GAO_FORMS = ("best_of_n", "rl")


def optimum_curve(task, kl_coefs, length_bias: float | None = None, prompts=None) -> list[dict]:
    """For each ``kl_coef``: the exact KL-regularised optimum against the raters' proxy, averaged over prompts.

    ``length_bias`` is the proxy's bias per letter (default ``task.length_bias``); ``prompts``
    default to the 64 test prompts. Each row: ``kl_coef``, ``kl`` (nats, ``KL(pi* || pi_ref)``),
    ``gold``, ``proxy`` (on the reward model's logit scale) and ``length``, expectations under ``pi*``.
    """
    bias = task.length_bias if length_bias is None else float(length_bias)
    prompts = task.test_prompts(64) if prompts is None else prompts
    classes = [task.word_classes(p) for p in prompts]
    rows = []
    for coef in kl_coefs:
        stats = []
        for lengths, gold, probs in classes:
            keep = probs > 0
            lengths, gold = torch.as_tensor(lengths[keep], dtype=torch.float64), torch.as_tensor(gold[keep])
            ref = torch.as_tensor(probs[keep]).log()
            proxy = task.beta * (gold + bias * lengths)
            logp = kl_regularised_optimum(ref, proxy, float(coef))
            p = logp.exp()
            stats.append([float(exact_kl(logp, ref)), float(p @ gold), float(p @ proxy), float(p @ lengths)])
        kl, gold, proxy, length = np.mean(stats, axis=0)
        rows.append({"kl_coef": float(coef), "kl": kl, "gold": gold, "proxy": proxy, "length": length})
    return rows


def audit_labels(pairs: list[dict], gold_score) -> tuple[float, float]:
    """``(gold_agreement, longer_chosen)`` of rated pairs ``{"prompt", "chosen", "rejected"}``.

    ``gold_agreement`` is the share of pairs whose chosen completion has the higher
    ``gold_score(prompt, completion)``, ``longer_chosen`` the share whose chosen completion is the
    longer one; a tie counts one half in each, so both are 0.5 for labels that ignore the feature.
    """
    if not pairs:
        raise ValueError("pairs must hold at least one rated pair")

    def share(differences):
        return float(np.mean([1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in differences]))

    gold = [gold_score(p["prompt"], p["chosen"]) - gold_score(p["prompt"], p["rejected"]) for p in pairs]
    return share(gold), share([len(p["chosen"]) - len(p["rejected"]) for p in pairs])


def _gao_columns(kl, form: str) -> np.ndarray:
    """The two columns ``[d, -d^2]`` (best-of-n) or ``[d, -d log d]`` (RL) at ``d = sqrt(kl)``, shape (N, 2)."""
    if form not in GAO_FORMS:
        raise ValueError(f"form must be one of {GAO_FORMS}, got {form!r}")
    kl = np.asarray(kl, dtype=np.float64)
    if kl.ndim != 1 or not np.isfinite(kl).all() or (kl < 0).any():
        raise ValueError("kl must be a 1-D array of finite values >= 0 (nats)")
    d = np.sqrt(kl)
    if form == "best_of_n":
        return np.stack([d, -d * d], axis=1)
    d_log_d = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)   # d log d -> 0 as d -> 0
    return np.stack([d, -d_log_d], axis=1)


def gao_form(kl, alpha: float, beta: float, form: str) -> np.ndarray:
    """Gao et al.'s (2022, arXiv 2210.10760) gold-score gain at ``KL`` nats, with ``d = sqrt(KL)``:

        best-of-n:  R(d) = d (alpha - beta d)
        RL:         R(d) = d (alpha - beta log d)

    ``kl`` is (N,); returns (N,). ``R`` is the gain over the starting policy (0 at ``KL = 0``).
    """
    return _gao_columns(kl, form) @ np.array([alpha, beta], dtype=np.float64)


def fit_gao_form(kl, gain, form: str) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of :func:`gao_form` through the points ``(kl_i, gain_i)``, both (N,).

    Both forms are linear in ``(alpha, beta)``, so the fit minimises ``sum_i (gain_i - R(d_i))^2``
    exactly: the normal equations of the columns ``[d, -d^2]`` or ``[d, -d log d]``. Points at
    ``KL = 0`` add nothing (both columns vanish there). At least two points with ``KL > 0`` and
    columns that are not proportional are needed.
    """
    columns = _gao_columns(kl, form)
    gain = np.asarray(gain, dtype=np.float64)
    if gain.shape != (columns.shape[0],) or not np.isfinite(gain).all():
        raise ValueError(f"gain must be a finite 1-D array of the same length as kl ({columns.shape[0]})")
    if np.linalg.matrix_rank(columns) < 2:
        raise ValueError("the fit needs at least two points at different KL > 0 (and, for RL, not all at d = 1)")
    (alpha, beta), *_ = np.linalg.lstsq(columns, gain, rcond=None)
    return float(alpha), float(beta)
