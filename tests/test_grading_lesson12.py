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
