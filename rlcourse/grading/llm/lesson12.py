"""Checks for lesson 12 (the capstone: every algorithm on one task, compared with intervals).

* :func:`check_t_interval` - mean and half-width of the 95% Student-t interval over seeds
  (mistakes caught: ``ddof=0``, the normal's 1.96 instead of t, t with n instead of n - 1 degrees
  of freedom, dividing by sqrt(n - 1), the standard deviation without the sqrt(n));
* :func:`check_intervals_separate` - whether two ``(mean, half_width)`` intervals do not overlap
  (only one direction tested, means compared without the widths, touching called separate,
  the tuple read as ``(low, high)``);
* :func:`check_final_validity_intervals` - an experiment: the learner runs algorithms on several
  seeds through the ``run`` it is given and summarises the *final* validity of each with the
  interval; the check measures the same runs and compares.
"""
from __future__ import annotations

import math

import numpy as np

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references

__all__ = ["check_t_interval", "check_intervals_separate", "check_final_validity_intervals"]


def _pair(name, case, got):
    __tracebackhide__ = True
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        fail(name, case, "a pair (mean, half_width)", f"{type(got).__name__} {got!r:.80}",
             "return two numbers: return mean, half_width")
    return got


@references("rlcourse.stats:t_interval")
def check_t_interval(fn) -> None:
    """``fn(values) -> (mean, half_width)`` with ``half_width = t_{0.975, n-1} * s / sqrt(n)``, ``s`` with ``ddof=1``."""
    __tracebackhide__ = True
    from rlcourse.stats import T975, t_interval as reference

    name = "check_t_interval"
    rng = np.random.default_rng(120)
    cases = [("n = 2 seeds", np.array([0.5, 0.7])),
             ("n = 3 seeds (the capstone's)", np.array([0.73, 0.81, 0.74])),
             ("n = 3, constant values: the half-width is 0", np.array([0.4, 0.4, 0.4])),
             ("n = 4, a list of Python floats", [0.61, 0.52, 0.7, 0.58]),
             ("n = 5, integer values", np.array([3, 1, 4, 1, 5])),
             ("n = 6, seeded normal values", rng.normal(0.6, 0.1, 6)),
             ("n = 11 (10 degrees of freedom)", rng.normal(size=11)),
             ("n = 3, values near 1e6 with a small spread", 1e6 + np.array([0.1, -0.2, 0.3])),
             ("n = 3, negative values", np.array([-2.0, -1.5, -3.25]))]
    for case, values in cases:
        got = _pair(name, case, call_unmutated(name, case, fn, values))
        mean, half = reference(values)
        x = np.asarray(values, dtype=float)
        n, t = len(x), T975[len(x) - 1]
        mistakes = [(t * x.std(ddof=0) / math.sqrt(n), "use the sample standard deviation, ddof=1 (divide by n - 1)"),
                    (1.96 * x.std(ddof=1) / math.sqrt(n),
                     "with a handful of seeds the normal's 1.96 is far too small: use Student's t_{0.975, n-1}"),
                    (T975.get(n, t) * x.std(ddof=1) / math.sqrt(n), "t has n - 1 degrees of freedom, not n"),
                    (t * x.std(ddof=1) / math.sqrt(n - 1), "the standard error divides by sqrt(n), not sqrt(n - 1)"),
                    (t * x.std(ddof=1), "the interval is for the mean: divide s by sqrt(n)")]
        for wrong, hint in mistakes:
            fail_if_mistake(name, case, half, got[1], wrong, hint)
        atol = 1e-3 if abs(mean) > 1e3 else 1e-9
        assert_close(name, case + " (mean)", mean, got[0], "the mean of the values", atol=atol)
        # table t values have 3 decimals; scipy's exact quantile is within 1e-3 relative of them
        assert_close(name, case + " (half-width)", half, got[1],
                     "t_{0.975, n-1} * std(values, ddof=1) / sqrt(n)", atol=1e-9, rtol=1e-3)
    passed(name, len(cases))


@references("rlcourse.stats:intervals_separate", "rlcourse.stats:interval_above")
def check_intervals_separate(fn) -> None:
    """``fn(a, b) -> bool``: True when the intervals ``mean +/- half_width`` of ``a`` and ``b`` do not overlap."""
    __tracebackhide__ = True
    from rlcourse.stats import intervals_separate as reference

    name = "check_intervals_separate"
    cases = [("a clearly above b", (0.8, 0.05), (0.5, 0.1)),
             ("a clearly below b", (0.3, 0.05), (0.7, 0.1)),
             ("means far apart but wide intervals that overlap", (0.8, 0.2), (0.5, 0.15)),
             ("b below a, wide b only", (0.7, 0.01), (0.5, 0.25)),
             ("intervals that touch (0.6 = 0.6): not separate", (0.7, 0.1), (0.5, 0.1)),
             ("one interval inside the other", (0.5, 0.3), (0.55, 0.05)),
             ("equal means, zero widths", (0.5, 0.0), (0.5, 0.0)),
             ("different means, zero widths", (0.5, 0.0), (0.4, 0.0)),
             ("numpy floats, a below b", (np.float64(0.2), np.float64(0.01)), (np.float64(0.3), np.float64(0.02)))]
    for case, a, b in cases:
        got = fn(a, b)
        expected = reference(a, b)
        if not isinstance(got, (bool, np.bool_)):
            fail(name, case, expected, f"{type(got).__name__} {got!r:.80}", "return True or False")
        if bool(got) != expected:
            hint = ("separate means: the lower end of one is above the upper end of the other "
                    "(mean - half_width > other mean + other half_width), in either order; touching is not separate")
            if not expected and a[0] != b[0]:
                hint = "compare the ends of the intervals, not the means: mean - half_width vs other mean + half_width"
            fail(name, case, expected, bool(got), hint)
    passed(name, len(cases))


@references()
def check_final_validity_intervals(fn, algorithms=("REINFORCE", "RFT"), seeds=(4, 1, 6), budget: int = 256) -> None:
    """``fn(run, algorithms, seeds, cfg) -> {algorithm: (mean, half_width)}`` of the *final* validity.

    The check hands ``fn`` a ``run`` that trains for real (:func:`rlcourse.measure.capstone.run`) and
    remembers every call, so the reference summary is computed from the very same runs. The seeds
    are neither 0, 1, 2 nor in order: an answer must use the ones it is given.
    """
    __tracebackhide__ = True
    from rlcourse.measure.capstone import CapstoneConfig, run
    from rlcourse.stats import t_interval

    name = "check_final_validity_intervals"
    cfg = CapstoneConfig(budget=budget, eval_points=1)
    calls, cache = [], {}

    case = f"{list(algorithms)} on seeds {list(seeds)}, budget {budget}"

    def recorded_run(algorithm, seed, config=None, device=None):
        __tracebackhide__ = True
        if config is not cfg:  # fail before a default-size run (minutes) starts
            fail(name, case, "run(algorithm, seed, cfg) with the cfg given", f"cfg = {config!r}",
                 "pass cfg on: it holds the sample budget that makes the comparison fair")
        calls.append((algorithm, seed, config))
        key = (algorithm, seed, repr(config))
        if key not in cache:
            cache[key] = run(algorithm, seed, config, device=device)
        return cache[key]

    got = fn(recorded_run, list(algorithms), list(seeds), cfg)
    wanted = {(a, s) for a in algorithms for s in seeds}
    made = {(a, s) for a, s, _ in calls}
    if made != wanted:
        hint = "loop over every algorithm and every seed, calling run(algorithm, seed, cfg)"
        if {s for _, s in made} == set(range(len(seeds))):
            hint = "use the seeds you are given (the argument seeds), not range(len(seeds)) or 0, 1, 2"
        fail(name, case, f"one run per (algorithm, seed): {sorted(wanted)}", f"runs made: {sorted(made)}", hint)
    if not isinstance(got, dict) or set(got) != set(algorithms):
        fail(name, case, f"a dict with keys {list(algorithms)}", got if not isinstance(got, dict) else sorted(got),
             "return {algorithm: (mean, half_width)}")
    for algorithm in algorithms:
        curves = [cache[(algorithm, s, repr(cfg))]["curve"] for s in seeds]
        expected = t_interval([c[-1]["validity"] for c in curves])
        pair = _pair(name, f"{case}: {algorithm}", got[algorithm])
        start = t_interval([c[0]["validity"] for c in curves])
        if np.allclose(pair, start) and not np.allclose(start, expected):
            fail(name, f"{case}: {algorithm}", expected, pair,
                 "curve[0] is the evaluation *before* training: use the last point, curve[-1]")
        assert_close(name, f"{case}: {algorithm}", expected, pair,
                     "t_interval of [run's curve[-1]['validity'] for each seed]", atol=1e-9, rtol=1e-3)
    passed(name, len(algorithms))
