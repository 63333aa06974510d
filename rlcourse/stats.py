"""Intervals over seeds: how the course says whether one result differs from another.

Every empirical claim in the lessons (a method beats another, a knob helps) is judged over several
seeds, never one run. A result is a mean over seeds with a 95% Student-t interval,
``mean +/- t_{0.975, n-1} s / sqrt(n)``; two results are called different only where their
intervals do not overlap, or, for two results that share their seeds, where the interval of the
seed-by-seed differences excludes 0 (:func:`rlcourse.capstone.paired_difference`).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["T975", "t_interval", "interval_above", "intervals_separate"]

# Student's t quantile t_{0.975, df}, from standard tables (df > 30: the normal's 1.96 is within 4%).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def t_interval(values) -> tuple[float, float]:
    """Mean and half-width of the 95% Student-t interval: ``mean +/- t_{0.975, n-1} s / sqrt(n)``.

    ``s`` is the sample standard deviation (``ddof=1``). With 3 seeds ``t = 4.303``: the interval
    is wide, and two algorithms are called different only where their intervals do not overlap.
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) < 2 or not np.isfinite(x).all():
        raise ValueError(f"values must be at least 2 finite numbers, got {values!r}")
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
