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


def _t_density(x, df):
    return math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2)) * (1 + x * x / df) ** (-(df + 1) / 2)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 10, 15])
@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.0, 3.5])
def test_t_cdf_matches_numerical_integration_of_the_density(df, t):
    from rlcourse.stats import t_cdf_two_sided

    xs = np.linspace(0.0, t, 20_001)
    ys = np.array([_t_density(x, df) for x in xs])
    integral = 2 * float(np.sum((ys[1:] + ys[:-1]) / 2 * np.diff(xs)))  # trapezoid, both tails folded
    assert t_cdf_two_sided(t, df) == pytest.approx(integral, abs=1e-7)
    assert t_cdf_two_sided(-t, df) == t_cdf_two_sided(t, df)


@pytest.mark.parametrize("df", sorted(__import__("rlcourse.stats", fromlist=["T975"]).T975))
def test_t_cdf_at_the_table_quantile_is_95_percent(df):
    from rlcourse.stats import T975, t_cdf_two_sided

    assert t_cdf_two_sided(T975[df], df) == pytest.approx(0.95, abs=2e-4)  # the table has 3 decimals


def test_t_test_p_value_agrees_with_the_interval_and_a_simulation():
    from rlcourse.stats import t_test_p_value

    rng = np.random.default_rng(1)
    for n in (3, 4, 8):
        for _ in range(200):
            x = rng.normal(0.3, 1.0, n)
            mean, half = t_interval(x)
            assert (t_test_p_value(x) < 0.05) == (abs(mean) > half)
    # under the null the p-value is uniform: 5% of tests reject at 0.05
    null = rng.normal(0.0, 1.0, size=(20_000, 4))
    assert np.mean([t_test_p_value(x) < 0.05 for x in null]) == pytest.approx(0.05, abs=0.005)
    assert t_test_p_value([0.2, 0.2]) == 0.0 and t_test_p_value([0.0, 0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="values"):
        t_test_p_value([1.0])


def test_holm_by_hand_and_against_brute_force_step_down():
    from rlcourse.stats import holm

    # m = 4, sorted 0.01, 0.02, 0.03, 0.20: 4*0.01 = 0.04, 3*0.02 = 0.06, max(0.06, 2*0.03) = 0.06, 0.20
    adjusted, rejected = holm([0.03, 0.01, 0.20, 0.02])
    assert adjusted == pytest.approx([0.06, 0.04, 0.20, 0.06])
    assert rejected == [False, True, False, False]
    rng = np.random.default_rng(2)
    for _ in range(300):
        p = rng.uniform(0, 0.2, size=int(rng.integers(1, 12)))
        # the textbook step-down: reject in sorted order while p_(i) <= alpha / (m - i + 1), stop at the first failure
        order, stepped = np.argsort(p), np.zeros(len(p), bool)
        for rank, i in enumerate(order):
            if p[i] > 0.05 / (len(p) - rank):
                break
            stepped[i] = True
        assert holm(p)[1] == stepped.tolist()
        assert all(a >= b for a, b in zip(holm(p)[0], p))
    with pytest.raises(ValueError, match="p_values"):
        holm([0.5, 1.5])
    with pytest.raises(ValueError, match="alpha"):
        holm([0.5], alpha=0)


def test_holm_keeps_the_family_wise_error_at_5_percent():
    """45 true nulls, independent: Holm rejects any of them in about 5% of families or less; uncorrected,
    in almost nine of ten."""
    from rlcourse.stats import holm

    rng = np.random.default_rng(3)
    p = rng.uniform(size=(4000, 45))
    assert np.mean([any(holm(row)[1]) for row in p]) <= 0.06
    assert np.mean((p < 0.05).any(1)) > 0.85
