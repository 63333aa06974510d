"""The lesson-12 checks accept the reference and reject plausible wrong answers."""
import math

import numpy as np
import pytest

from grading_asserts import assert_fails, assert_passes
from rlcourse.grading import (check_final_validity_intervals, check_intervals_separate,
                              check_t_interval)

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


# ----------------------------------------------------------------------------- reference answers
def t_interval(values):
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(T975[len(x) - 1] * x.std(ddof=1) / math.sqrt(len(x)))


def intervals_separate(a, b):
    return bool(a[0] - a[1] > b[0] + b[1] or b[0] - b[1] > a[0] + a[1])


def final_validity_intervals(run, algorithms, seeds, cfg):
    return {a: t_interval([run(a, s, cfg)["curve"][-1]["validity"] for s in seeds]) for a in algorithms}


# ----------------------------------------------------------------------------- plausible mistakes
def t_ddof0(values):
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(T975[len(x) - 1] * x.std() / math.sqrt(len(x)))


def z_instead_of_t(values):
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(1.96 * x.std(ddof=1) / math.sqrt(len(x)))


def t_with_n_degrees_of_freedom(values):
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(T975[min(len(x), 10)] * x.std(ddof=1) / math.sqrt(len(x)))


def divides_by_sqrt_n_minus_1(values):
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(T975[len(x) - 1] * x.std(ddof=1) / math.sqrt(len(x) - 1))


def standard_deviation_not_error(values):
    x = np.asarray(values, dtype=float)
    return float(x.mean()), float(T975[len(x) - 1] * x.std(ddof=1))


def sorts_in_place(values):
    if isinstance(values, np.ndarray):
        values.sort()
    return t_interval(values)


def returns_low_high(values):
    m, h = t_interval(values)
    return m - h, m + h


def one_direction_only(a, b):
    return bool(a[0] - a[1] > b[0] + b[1])


def compares_means(a, b):
    return bool(a[0] != b[0])


def touching_counts(a, b):
    return bool(a[0] - a[1] >= b[0] + b[1] or b[0] - b[1] >= a[0] + a[1])


def reads_low_high(a, b):
    return bool(a[0] > b[1] or b[0] > a[1])


def start_not_final(run, algorithms, seeds, cfg):
    return {a: t_interval([run(a, s, cfg)["curve"][0]["validity"] for s in seeds]) for a in algorithms}


def forgets_cfg(run, algorithms, seeds, cfg):
    return {a: t_interval([run(a, s)["curve"][-1]["validity"] for s in seeds]) for a in algorithms}


def first_two_seeds(run, algorithms, seeds, cfg):
    return {a: t_interval([run(a, s, cfg)["curve"][-1]["validity"] for s in seeds[:2]]) for a in algorithms}


def best_point_not_final(run, algorithms, seeds, cfg):
    return {a: t_interval([max(p["validity"] for p in run(a, s, cfg)["curve"]) for s in seeds]) for a in algorithms}


def seeds_zero_one_two(run, algorithms, seeds, cfg):        # passed when the check's seeds were 0, 1, 2
    return {a: t_interval([run(a, s, cfg)["curve"][-1]["validity"] for s in range(len(seeds))]) for a in algorithms}


def test_an_experiment_on_its_own_seeds_is_told_to_use_the_given_ones():
    assert_fails(check_final_validity_intervals, seeds_zero_one_two, hint="use the seeds you are given", **SMALL)


def experiment_with_ddof0(run, algorithms, seeds, cfg):
    return {a: t_ddof0([run(a, s, cfg)["curve"][-1]["validity"] for s in seeds]) for a in algorithms}


SMALL = dict(budget=128)


@pytest.mark.parametrize("check, fn, kwargs", [(check_t_interval, t_interval, {}),
                                               (check_intervals_separate, intervals_separate, {}),
                                               (check_final_validity_intervals, final_validity_intervals, SMALL)])
def test_reference_passes_with_one_line(check, fn, kwargs, capsys):
    assert_passes(check, fn, capsys, **kwargs)


def test_the_library_reference_passes_too():
    from rlcourse.stats import intervals_separate as ref_separate, t_interval as ref_t

    check_t_interval(ref_t)
    check_intervals_separate(ref_separate)


@pytest.mark.parametrize("check, wrong, kwargs", [
    (check_t_interval, t_ddof0, {}),
    (check_t_interval, z_instead_of_t, {}),
    (check_t_interval, t_with_n_degrees_of_freedom, {}),
    (check_t_interval, divides_by_sqrt_n_minus_1, {}),
    (check_t_interval, standard_deviation_not_error, {}),
    (check_t_interval, sorts_in_place, {}),
    (check_t_interval, returns_low_high, {}),
    (check_intervals_separate, one_direction_only, {}),
    (check_intervals_separate, compares_means, {}),
    (check_intervals_separate, touching_counts, {}),
    (check_intervals_separate, reads_low_high, {}),
    (check_final_validity_intervals, start_not_final, SMALL),
    (check_final_validity_intervals, forgets_cfg, SMALL),
    (check_final_validity_intervals, first_two_seeds, SMALL),
    (check_final_validity_intervals, best_point_not_final, SMALL),
    (check_final_validity_intervals, experiment_with_ddof0, SMALL),
])
def test_wrong_answers_fail(check, wrong, kwargs):
    assert_fails(check, wrong, **kwargs)


def test_not_implemented_goes_through():
    def todo(*args):
        raise NotImplementedError

    for check in (check_t_interval, check_intervals_separate):
        with pytest.raises(NotImplementedError):
            check(todo)


# ----------------------------------------------------------------------------- the paired interval
def _shared(a, b):
    shared = [s for s in a if s in b]
    if len(shared) < 2:
        raise ValueError(f"need at least 2 shared seeds, got {shared}")
    return shared


def paired_interval(a, b):
    return t_interval([a[s] - b[s] for s in _shared(a, b)])


def combines_separate_intervals(a, b):
    shared = _shared(a, b)
    (ma, ha), (mb, hb) = t_interval([a[s] for s in shared]), t_interval([b[s] for s in shared])
    return ma - mb, math.hypot(ha, hb)


def adds_half_widths(a, b):
    shared = _shared(a, b)
    (ma, ha), (mb, hb) = t_interval([a[s] for s in shared]), t_interval([b[s] for s in shared])
    return ma - mb, ha + hb


def pairs_by_position(a, b):
    _shared(a, b)
    return t_interval([x - y for x, y in zip(a.values(), b.values())])


def b_minus_a(a, b):
    return t_interval([b[s] - a[s] for s in _shared(a, b)])


def absolute_differences(a, b):
    return t_interval([abs(a[s] - b[s]) for s in _shared(a, b)])


def missing_seeds_as_zero(a, b):
    _shared(a, b)
    return t_interval([a.get(s, 0.0) - b.get(s, 0.0) for s in sorted(set(a) | set(b))])


def paired_ddof0(a, b):
    return t_ddof0([a[s] - b[s] for s in _shared(a, b)])


def paired_with_z(a, b):
    return z_instead_of_t([a[s] - b[s] for s in _shared(a, b)])


def means_over_all_seeds(a, b):
    _, half = paired_interval(a, b)
    return float(np.mean(list(a.values())) - np.mean(list(b.values()))), half


def never_raises(a, b):
    shared = [s for s in a if s in b]
    return t_interval([a[s] - b[s] for s in shared]) if len(shared) > 1 else (float("nan"), float("nan"))


def raises_key_error(a, b):
    return t_interval([a[s] - b[s] for s in a])


@pytest.mark.parametrize("wrong, hint", [
    (combines_separate_intervals, "combines two separate intervals"),
    (adds_half_widths, "adds the two separate half-widths"),
    (pairs_by_position, "pair the values by seed"),
    (b_minus_a, "a minus b"),
    (absolute_differences, "no abs()"),
    (missing_seeds_as_zero, "use the seeds both dicts hold"),
    (paired_ddof0, "ddof=1"),
    (paired_with_z, "1.96"),
    (means_over_all_seeds, "the mean must be over the shared seeds"),
    (never_raises, "raise ValueError"),
    (raises_key_error, "use the seeds both dicts hold"),
])
def test_paired_interval_rejects_each_mistake_with_its_lesson(wrong, hint):
    from rlcourse.grading import check_paired_interval

    assert_fails(check_paired_interval, wrong, hint=hint)


def test_paired_interval_reference_passes_and_its_first_case_needs_pairing(capsys):
    from rlcourse.grading import check_paired_interval
    from rlcourse.grading.llm.lesson12 import _paired_cases
    from rlcourse.stats import intervals_separate as separate, t_interval as ref_t

    assert_passes(check_paired_interval, paired_interval, capsys)
    _, a, b = _paired_cases()[0]
    d = [a[s] - b[s] for s in a]
    assert separate(ref_t(d), (0.0, 0.0)) and not separate(ref_t(list(a.values())), ref_t(list(b.values())))
