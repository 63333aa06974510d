"""Intervals over seeds: the Student-t interval against its table and brute-force coverage, and the
rule that calls two intervals different."""
import math

import numpy as np
import pytest

from rlcourse.stats import interval_above, intervals_separate, t_interval


@pytest.mark.parametrize("n, t", [(2, 12.706), (3, 4.303), (4, 3.182), (5, 2.776), (6, 2.571), (11, 2.228)])
def test_t_interval_uses_the_t_table_with_n_minus_1_degrees_of_freedom(n, t):
    values = np.arange(n, dtype=float) ** 1.5
    mean, half = t_interval(values)
    s = math.sqrt(sum((v - values.mean()) ** 2 for v in values) / (n - 1))  # ddof=1 by hand
    assert mean == pytest.approx(values.mean())
    assert half == pytest.approx(t * s / math.sqrt(n), rel=1e-12)


def test_t_interval_two_values_and_constants():
    assert t_interval([0.0, 1.0]) == pytest.approx((0.5, 12.706 * math.sqrt(0.5) / math.sqrt(2)))
    assert t_interval([0.4, 0.4, 0.4]) == (pytest.approx(0.4), pytest.approx(0.0, abs=1e-12))


def test_t_interval_covers_the_true_mean_95_percent_of_the_time():
    """Brute force: draw 3 normal values 20000 times; the interval must cover the mean ~95% of the time."""
    rng = np.random.default_rng(0)
    draws = rng.normal(1.0, 2.0, size=(20_000, 3))
    covered = np.mean([abs(m - 1.0) <= h for m, h in map(t_interval, draws)])
    assert covered == pytest.approx(0.95, abs=0.007)
    # the normal's 1.96 would cover far less with 3 samples
    z_covered = np.mean(np.abs(draws.mean(1) - 1.0) <= 1.96 * draws.std(1, ddof=1) / math.sqrt(3))
    assert z_covered < 0.85


@pytest.mark.parametrize("values", [[1.0], [], [[1.0, 2.0]], [1.0, float("nan")]])
def test_t_interval_rejects_bad_values(values):
    with pytest.raises(ValueError, match="values"):
        t_interval(values)


def test_intervals_separate_is_strict_and_symmetric():
    assert interval_above((0.8, 0.05), (0.5, 0.1)) and not interval_above((0.5, 0.1), (0.8, 0.05))
    assert intervals_separate((0.5, 0.1), (0.8, 0.05)) and intervals_separate((0.8, 0.05), (0.5, 0.1))
    assert not intervals_separate((0.7, 0.1), (0.5, 0.1))  # touching at 0.6
    assert not intervals_separate((0.5, 0.3), (0.55, 0.05))  # nested
