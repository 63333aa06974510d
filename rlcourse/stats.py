"""Intervals over seeds: how the course says whether one result differs from another.

Every empirical claim in the lessons (a method beats another, a knob helps) is judged over several
seeds, never one run. A result is a mean over seeds with a 95% Student-t interval,
``mean +/- t_{0.975, n-1} s / sqrt(n)``; two results are called different only where their
intervals do not overlap, or, for two results that share their seeds, where the interval of the
seed-by-seed differences excludes 0 (:func:`rlcourse.measure.capstone.paired_difference`).

Many such comparisons at once (the capstone's 45 pairs of methods) need a correction: at 95% each,
two or three of 45 true ties are expected to look resolved. :func:`holm` adjusts a family of
p-values (:func:`t_test_p_value`) so that the chance of any false separation stays at 5%.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["T975", "t_interval", "interval_above", "intervals_separate", "t_cdf_two_sided", "t_test_p_value",
           "holm"]

# Student's t quantile t_{0.975, df}, from standard tables (df > 30: the normal's 1.96 is within 4%).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def _seed_values(values) -> np.ndarray:
    """``values`` as a 1-D float array of at least 2 finite numbers (one per seed), else ``ValueError``."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) < 2 or not np.isfinite(x).all():
        raise ValueError(f"values must be at least 2 finite numbers, got {values!r}")
    return x


def t_interval(values) -> tuple[float, float]:
    """Mean and half-width of the 95% Student-t interval: ``mean +/- t_{0.975, n-1} s / sqrt(n)``.

    ``s`` is the sample standard deviation (``ddof=1``). With 3 seeds ``t = 4.303``: the interval
    is wide, and two algorithms are called different only where their intervals do not overlap.
    """
    x = _seed_values(values)
    df = len(x) - 1
    t = T975[max(k for k in T975 if k <= df)] if df <= 30 else 1.96
    return float(x.mean()), float(t * x.std(ddof=1) / math.sqrt(len(x)))


def interval_above(a, b) -> bool:
    """Whether interval ``a = (mean, half_width)`` lies entirely above ``b``: ``a_mean - a_half > b_mean + b_half``.

    Strict: intervals that touch are not separated.
    """
    return float(a[0]) - float(a[1]) > float(b[0]) + float(b[1])


def intervals_separate(a, b) -> bool:
    """Whether two ``(mean, half_width)`` intervals do not overlap (either one above the other)."""
    return interval_above(a, b) or interval_above(b, a)


def t_cdf_two_sided(t: float, df: int) -> float:
    """``P(|T| <= |t|)`` for Student's t with ``df`` (a positive integer) degrees of freedom, in closed form.

    With ``theta = atan(|t| / sqrt(df))`` (Abramowitz & Stegun 26.7.3-4), the finite sums

    * odd ``df``:  ``2/pi * (theta + sin(theta) * (cos(theta) + 2/3 cos^3(theta) + ...
      + (2*4*...*(df-3)) / (1*3*...*(df-2)) cos^(df-2)(theta)))`` (``2 theta / pi`` for ``df = 1``);
    * even ``df``: ``sin(theta) * (1 + 1/2 cos^2(theta) + (1*3)/(2*4) cos^4(theta) + ...
      + (1*3*...*(df-3)) / (2*4*...*(df-2)) cos^(df-2)(theta))``.
    """
    if isinstance(df, bool) or not isinstance(df, (int, np.integer)) or df < 1:
        raise ValueError(f"df must be a positive integer, got {df!r}")
    if not math.isfinite(t):
        if math.isnan(t):
            raise ValueError("t must be a number, got nan")
        return 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2:  # odd: terms c, 2/3 c^3, (2*4)/(3*5) c^5, ...
        total, term = 0.0, c
        for k in range(1, df - 1, 2):          # powers 1, 3, ..., df-2
            total += term
            term *= (k + 1) / (k + 2) * c * c
        return min(1.0, 2 / math.pi * (theta + s * total))
    total, term = 0.0, 1.0                     # even: terms 1, 1/2 c^2, (1*3)/(2*4) c^4, ...
    for k in range(0, df - 1, 2):              # powers 0, 2, ..., df-2
        total += term
        term *= (k + 1) / (k + 2) * c * c
    return min(1.0, s * total)


def t_test_p_value(values) -> float:
    """Two-sided p-value of the one-sample t-test that the mean of ``values`` is 0.

    ``t = mean / (s / sqrt(n))`` with ``n - 1`` degrees of freedom; ``p = 1 - P(|T| <= |t|)``. On seed-by-seed
    differences this is the paired t-test, and ``p < 0.05`` exactly when the 95% :func:`t_interval` of the
    differences excludes 0 (for ``n - 1`` in the t table). All values equal: ``p = 1`` at 0, else 0.
    """
    x = _seed_values(values)
    mean, s = float(x.mean()), float(x.std(ddof=1))
    if s == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    return max(0.0, 1.0 - t_cdf_two_sided(mean / (s / math.sqrt(len(x))), len(x) - 1))


def holm(p_values, alpha: float = 0.05) -> tuple[list[float], list[bool]]:
    """Holm's step-down correction (Holm 1979) of a family of ``m`` p-values: ``(adjusted, rejected)``.

    Sort the p-values, ``p_(1) <= ... <= p_(m)``; the adjusted value of the i-th smallest is
    ``max_{j <= i} min(1, (m - j + 1) p_(j))``, and a hypothesis is rejected when its adjusted value is at
    most ``alpha``. The chance of rejecting any true null stays at most ``alpha``, whatever the dependence
    between the tests; it rejects everything Bonferroni (``m p <= alpha``) rejects, and often more. Both
    lists are in the order of ``p_values``.
    """
    p = np.asarray(p_values, dtype=float)
    if p.ndim != 1 or len(p) == 0 or not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"p_values must be a non-empty list of numbers in [0, 1], got {p_values!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    m, order = len(p), np.argsort(p, kind="stable")
    adjusted, running = np.empty(m), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist(), (adjusted <= alpha).tolist()
