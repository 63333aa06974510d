"""Checks for lesson 12 (the capstone: every algorithm on one task, compared with intervals).

* :func:`check_t_interval` - mean and half-width of the 95% Student-t interval over seeds
  (mistakes caught: ``ddof=0``, the normal's 1.96 instead of t, t with n instead of n - 1 degrees
  of freedom, dividing by sqrt(n - 1), the standard deviation without the sqrt(n));
* :func:`check_intervals_separate` - whether two ``(mean, half_width)`` intervals do not overlap
  (only one direction tested, means compared without the widths, touching called separate,
  the tuple read as ``(low, high)``);
* :func:`check_final_validity_intervals` - an experiment: the learner runs algorithms on several
  seeds through the ``run`` it is given and summarises the *final* validity of each with the
  interval; the check measures the same runs and compares;
* :func:`check_paired_interval` - the t-interval of seed-by-seed differences of two methods, on
  data where it resolves a difference that two separate intervals cannot (mistakes caught: separate
  intervals combined, seeds paired by position instead of by seed, b - a, absolute differences,
  seeds only one method ran, ``ddof=0``, the normal's 1.96, no error below two shared seeds).
"""
from __future__ import annotations

import math

import numpy as np

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references

__all__ = ["check_t_interval", "check_intervals_separate", "check_final_validity_intervals", "check_paired_interval"]


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


def _paired_cases():
    """(case, a, b): ``{seed: final value}`` of two methods. The first is the capstone's situation: each seed's
    evaluation draws move both methods together (a shared seed effect much larger than their gap)."""
    rng = np.random.default_rng(1212)
    seeds = [0, 1, 2, 3, 4, 5, 6, 7]
    shared = rng.normal(0.0, 0.08, len(seeds))                     # what a seed's two runs share
    a = {s: 0.70 + e + rng.normal(0, 0.01) for s, e in zip(seeds, shared)}
    b = {s: 0.66 + e + rng.normal(0, 0.01) for s, e in zip(seeds, shared)}
    mixed = [5, 0, 3, 6, 1]                                         # the same seeds, stored in other orders
    a2 = {s: float(0.4 + 0.1 * rng.random()) for s in mixed}
    b2 = {s: a2[s] + float(rng.normal(0.05, 0.02)) for s in sorted(mixed, reverse=True)}
    a3 = {4: 0.52, 7: 0.61, 9: 0.58, 11: 0.49}                      # seed 13 ran only for b, seed 9 only for a
    b3 = {4: 0.55, 7: 0.55, 11: 0.47, 13: 0.05}                     # differences of both signs
    return [("8 seeds sharing a large seed effect: separate intervals overlap, pairing resolves", a, b),
            ("a seed only a ran (9) and one only b ran (13): use the shared seeds 4, 7, 11", a3, b3),
            ("5 seeds, a below b, each dict in its own seed order", a2, b2),
            ("2 seeds, numpy floats", {10: np.float64(0.3), 20: np.float64(0.5)}, {10: np.float64(0.1), 20: np.float64(0.4)}),
            ("4 seeds, identical differences: the half-width is 0", {1: 0.3, 2: 0.5, 3: 0.2, 4: 0.9},
             {1: 0.1, 2: 0.3, 3: 0.0, 4: 0.7})]


@references("rlcourse.measure.capstone:paired_difference", "rlcourse.measure.capstone:_paired_values",
            "rlcourse.measure.capstone:all_pairs")
def check_paired_interval(fn) -> None:
    """``fn(a, b) -> (mean, half_width)``: the 95% t-interval of ``a[s] - b[s]`` over the seeds ``s`` both dicts hold.

    ``a`` and ``b`` map seed -> final value of two methods. Fewer than two shared seeds: ``ValueError``.
    """
    __tracebackhide__ = True
    from rlcourse.stats import T975, interval_above, intervals_separate, t_interval as reference

    name = "check_paired_interval"
    cases = _paired_cases()
    for index, (case, a, b) in enumerate(cases):
        shared = sorted(set(a) & set(b))
        d = np.array([a[s] - b[s] for s in shared], dtype=float)
        expected = reference(d)
        try:
            got = _pair(name, case, call_unmutated(name, case, fn, a, b))
        except KeyError as error:
            fail(name, case, expected, f"KeyError: {error}",
                 "a seed that only one method ran has nothing to pair with: use the seeds both dicts hold")
        n, t = len(d), T975[len(d) - 1]
        if index == 0:  # what this exercise is for, measured on the data it grades with
            assert intervals_separate(reference(d), (0.0, 0.0)) and not intervals_separate(
                reference(list(a.values())), reference(list(b.values()))), "check data no longer shows pairing"
        va, vb = np.array([a[s] for s in shared], float), np.array([b[s] for s in shared], float)
        ha, hb = reference(va)[1], reference(vb)[1]
        by_position = [float(x) - float(y) for x, y in zip(a.values(), b.values())]
        mistakes = [
            ((expected[0], math.hypot(ha, hb)),
             "that combines two separate intervals; pair them: one difference a[s] - b[s] per seed, then the "
             "t-interval of those differences (what a seed's two runs share cancels in the difference)"),
            ((expected[0], ha + hb), "that adds the two separate half-widths; take the t-interval of the differences"),
            ((-expected[0], expected[1]), "the difference is a minus b, seed by seed"),
            (reference(np.abs(d)) if n > 1 else expected, "keep the sign of each difference: no abs()"),
            ((expected[0], t * d.std(ddof=0) / math.sqrt(n)), "use the sample standard deviation, ddof=1"),
            ((expected[0], 1.96 * d.std(ddof=1) / math.sqrt(n)), "use Student's t_{0.975, n-1}, not the normal's 1.96"),
        ]
        if len(by_position) > 1:
            mistakes.append((reference(by_position),
                             "pair the values by seed (a[s] - b[s] for each seed s), not by their position in the "
                             "dicts: zip(a.values(), b.values()) pairs different seeds when the orders differ"))
        if set(a) != set(b):
            everyone = sorted(set(a) | set(b))
            mistakes += [(reference([a.get(s, 0.0) - b.get(s, 0.0) for s in everyone]),
                          "a seed that only one method ran has nothing to pair with: use the seeds both dicts hold"),
                         ((float(np.mean(list(a.values())) - np.mean(list(b.values()))), expected[1]),
                          "the mean must be over the shared seeds too: a seed only one method ran is left out")]
        for wrong, hint in mistakes:
            fail_if_mistake(name, case, expected, got, wrong, hint)
        assert_close(name, case, expected, got, "t_interval([a[s] - b[s] for s in seeds both dicts hold])",
                     atol=1e-9, rtol=1e-3)
        if index == 0 and not interval_above(got, (0.0, 0.0)):
            fail(name, case, f"an interval above 0: {expected}", got, "pairing should resolve this difference")
    case = "only one shared seed (seed 3): an interval needs at least 2"
    try:
        got = fn({3: 0.5, 4: 0.6}, {3: 0.4, 8: 0.1})
    except ValueError:
        pass
    except Exception as error:  # noqa: BLE001 - name what was raised instead
        fail(name, case, "ValueError", f"{type(error).__name__}: {error}",
             "check the number of shared seeds first and raise ValueError with a message that says so")
    else:
        fail(name, case, "ValueError", got, "with fewer than 2 shared seeds there is no interval: raise ValueError")
    passed(name, len(cases) + 1)
