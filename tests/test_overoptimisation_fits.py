"""Best-of-n's exact KL against brute-force enumeration and the Stiennon et al. formula, and the
least-squares fit of Gao et al.'s functional forms against its normal equations and optimality."""
import itertools
import math

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import pytest

from rlcourse.measure.best_of_n import best_of_n_kl, best_of_n_kl_exact
from rlcourse.measure.overoptimisation import fit_gao_form, gao_form


def brute_force_kl(p, r, n):
    """Enumerate every n-tuple of draws; keep the first draw with the highest reward."""
    pi_n = np.zeros(len(p))
    for draws in itertools.product(range(len(p)), repeat=n):
        prob = np.prod([p[i] for i in draws])
        best = max(draws, key=lambda i: (r[i], -draws.index(i)))     # highest reward, earliest draw on a tie
        pi_n[draws[[r[i] for i in draws].index(r[best])]] += prob
    keep = pi_n > 0
    return float(np.sum(pi_n[keep] * np.log(pi_n[keep] / np.asarray(p)[keep])))


@pytest.mark.parametrize("p, r", [
    ([0.1, 0.2, 0.3, 0.4], [3.0, 1.0, 2.0, 0.0]),          # no ties
    ([0.25, 0.25, 0.3, 0.2], [1.0, 1.0, 0.0, 2.0]),        # two outcomes tie at one level
    ([0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 5.0]),          # all tie; an impossible outcome with the top reward
])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_exact_kl_equals_enumerating_every_draw(p, r, n):
    assert best_of_n_kl_exact(p, r, n) == pytest.approx(brute_force_kl(p, r, n), abs=1e-12)


def test_the_formula_is_an_upper_bound_and_the_limit_without_repeats():
    rng = np.random.default_rng(0)
    for n in (2, 4, 16, 64):
        for _ in range(20):
            p = rng.dirichlet(np.ones(rng.integers(2, 30)))
            r = rng.integers(0, 5, size=len(p)).astype(float)        # ties on purpose
            assert best_of_n_kl_exact(p, r, n) <= best_of_n_kl(n) + 1e-12
        # many outcomes of tiny probability: repeats become rare and the exact KL tends to the formula
        fine = best_of_n_kl_exact(np.full(200_000, 1 / 200_000), rng.permutation(200_000), n)
        assert best_of_n_kl(n) - 1e-3 < fine <= best_of_n_kl(n)
    # one outcome of probability 1/2 at the top: best-of-n keeps it with probability 1 - 2^-n
    n = 5
    exact = best_of_n_kl_exact([0.5, 0.5], [1.0, 0.0], n)
    top = 1 - 0.5 ** n
    assert exact == pytest.approx(top * math.log(top / 0.5) + (1 - top) * math.log((1 - top) / 0.5))
    assert exact < best_of_n_kl(n) - 0.25     # the formula overstates it by a third


@pytest.mark.parametrize("p, r, match", [([0.5, 0.6], [0, 1], "sum to 1"), ([0.5, 0.5], [0, 1, 2], "same length"),
                                         ([1.0, 0.0], [0, float("nan")], "finite")])
def test_exact_kl_refuses_bad_input(p, r, match):
    with pytest.raises(ValueError, match=match):
        best_of_n_kl_exact(p, r, 2)


@pytest.mark.parametrize("form", ["best_of_n", "rl"])
def test_noiseless_points_give_back_their_coefficients(form):
    kl = np.array([0.0, 0.2, 0.7, 1.5, 3.0, 6.0])
    gain = gao_form(kl, 0.4, 0.15, form)
    d = np.sqrt(kl)
    by_hand = d * (0.4 - 0.15 * (d if form == "best_of_n" else np.log(np.where(d > 0, d, 1.0))))
    assert gain == pytest.approx(by_hand, abs=1e-15)
    assert fit_gao_form(kl, gain, form) == pytest.approx((0.4, 0.15), abs=1e-10)


@pytest.mark.parametrize("form", ["best_of_n", "rl"])
def test_the_fit_solves_the_normal_equations_and_no_nearby_pair_does_better(form):
    rng = np.random.default_rng(1)
    kl = rng.uniform(0, 8, size=25)
    gain = 0.3 * np.sqrt(kl) - 0.05 * kl + rng.normal(0, 0.05, size=25)
    alpha, beta = fit_gao_form(kl, gain, form)
    d = np.sqrt(kl)
    x1, x2 = d, (-d * d if form == "best_of_n" else -d * np.log(d))   # the two columns, written out
    # 2 x 2 normal equations solved by Cramer's rule
    a11, a12, a22 = (x1 * x1).sum(), (x1 * x2).sum(), (x2 * x2).sum()
    b1, b2 = (x1 * gain).sum(), (x2 * gain).sum()
    det = a11 * a22 - a12 * a12
    assert (alpha, beta) == pytest.approx(((b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det), rel=1e-9)
    sse = lambda a, b: float(((gain - gao_form(kl, a, b, form)) ** 2).sum())  # noqa: E731
    best = sse(alpha, beta)
    for da, db in rng.normal(0, 0.01, size=(50, 2)):
        assert sse(alpha + da, beta + db) >= best


@pytest.mark.parametrize("kl, gain, form, match", [
    ([0.0, 1.0], [0.0, 0.1], "rl", "two points"), ([1.0, 1.0], [0.1, 0.2], "best_of_n", "two points"),
    ([1.0, 2.0], [0.1], "rl", "same length"), ([-1.0, 2.0], [0.1, 0.2], "rl", "kl must be"),
    ([1.0, 2.0], [0.1, 0.2], "ppo", "form")])
def test_the_fit_refuses_what_it_cannot_fit(kl, gain, form, match):
    with pytest.raises(ValueError, match=match):
        fit_gao_form(kl, gain, form)
