"""pass@k against brute force over k-subsets and its exact expectation; distinct-among-valid by hand."""
import math
from fractions import Fraction
from itertools import combinations, product

import pytest

from rlcourse.measure.coverage import coverage, pass_at_k


def _brute_force(outcomes, k):
    """The fraction of all k-subsets of the samples that hold at least one right sample (exact)."""
    subsets = list(combinations(range(len(outcomes)), k))
    return Fraction(sum(any(outcomes[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_sample(n):
    """Every pattern of right and wrong samples (2^n of them) and every k, against exact enumeration."""
    for outcomes in product([False, True], repeat=n):
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(outcomes), k) == pytest.approx(float(_brute_force(outcomes, k)), abs=1e-12)


def test_pass_at_k_special_cases():
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)                   # k = 1 is the fraction right
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 1, 16) == 1.0    # k = n: any right sample
    assert pass_at_k(10, 7, 4) == 1.0                                     # n - c < k: every subset has one
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))


@pytest.mark.parametrize("n, k", [(4, 1), (8, 3), (16, 4), (16, 16)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.93])
def test_pass_at_k_is_unbiased_for_one_minus_one_minus_p_to_the_k(n, k, p):
    """Exact expectation over c ~ Binomial(n, p): sum_c P(c) pass@k(n, c, k) = 1 - (1 - p)^k."""
    expected = sum(math.comb(n, c) * p ** c * (1 - p) ** (n - c) * pass_at_k(n, c, k) for c in range(n + 1))
    assert expected == pytest.approx(1 - (1 - p) ** k, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4.0, 2, 1), (4, True, 1)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_takes_numpy_integers():
    """Counts often come from NumPy (``(samples == answer).sum()``, an ``np.int64``): they are integers too."""
    import numpy as np

    right = np.array([True, False, True, True]).sum()
    for kind in (np.int64, np.int32, np.uint8):
        assert pass_at_k(kind(16), kind(right), kind(4)) == pass_at_k(16, 3, 4)
    with pytest.raises(ValueError, match="c must be an integer"):
        pass_at_k(16, np.bool_(True), 4)
    with pytest.raises(ValueError, match="k must be an integer"):
        pass_at_k(16, 3, np.float64(4.0))


def test_coverage_by_hand():
    prompts = ["a"] * 4 + ["b"] * 4
    completions = ["x", "x", "y", "z", "u", "v", "w", "u"]
    valid = [True, True, True, False, False, False, False, True]
    out = coverage(prompts, completions, valid, ks=(1, 2, 4))
    # a: 3 right of 4 (2 different), b: 1 right of 4
    assert out["pass@1"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert out["pass@2"] == pytest.approx(((1 - 0) + (1 - math.comb(3, 2) / math.comb(4, 2))) / 2)
    assert out["pass@4"] == 1.0
    assert out["distinct_among_valid"] == pytest.approx(3 / 4) and out["valid_answers"] == 4
    assert math.isnan(coverage(["a", "a"], ["x", "y"], [False, False])["distinct_among_valid"])
    with pytest.raises(ValueError, match="same number"):
        coverage(["a", "a", "b"], ["x", "y", "z"], [True] * 3)
    with pytest.raises(ValueError, match="one entry each"):
        coverage(["a"], ["x", "y"], [True])


def test_pass_at_k_by_cell_by_hand_and_against_per_cell_pass_at_k():
    """Two prompts split into cells by first letter; every cell listed counts, also the ones never hit."""
    from rlcourse.measure.coverage import pass_at_k_by_cell

    prompts = ["a"] * 4 + ["b"] * 4
    completions = ["x1", "x2", "y1", "x3", "u1", "v1", "w1", "u2"]
    valid = [True, True, True, False, True, False, True, True]
    cells = {"a": ["x", "y", "z"], "b": ["u", "w"]}
    out = pass_at_k_by_cell(prompts, completions, valid, cells, lambda c: c[0], ks=(1, 2, 4))
    # (a, x): 2 of 4 right and in x; (a, y): 1; (a, z): 0; (b, u): 2; (b, w): 1. v1 is wrong: no cell.
    hits = [2, 1, 0, 2, 1]
    for k in (1, 2, 4):
        assert out[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in hits) / 5)
    assert out["cells"] == 5
    # one cell per prompt holding every right answer: the plain pass@k of coverage()
    whole = pass_at_k_by_cell(prompts, completions, valid, {"a": ["*"], "b": ["*"]}, lambda c: "*", ks=(1, 2))
    plain = coverage(prompts, completions, valid, ks=(1, 2))
    assert whole["pass@1"] == pytest.approx(plain["pass@1"]) and whole["pass@2"] == pytest.approx(plain["pass@2"])
    with pytest.raises(ValueError, match="missing"):
        pass_at_k_by_cell(prompts, completions, valid, {"a": ["x"]}, lambda c: c[0])
    with pytest.raises(ValueError, match="same number"):
        pass_at_k_by_cell(["a", "a", "b"], ["x", "y", "z"], [True] * 3, {"a": ["x"], "b": ["z"]}, lambda c: c)
    with pytest.raises(ValueError, match="at least one cell"):
        pass_at_k_by_cell(["a"], ["x"], [True], {"a": []}, lambda c: c)


def test_digit_sum_first_digits_by_enumeration():
    """The digits a right answer can begin with, against every 4-digit string."""
    from rlcourse.tasks import DigitSumTask

    task = DigitSumTask()
    for prompt in task.test_prompts():
        s = task.target(prompt)
        brute = sorted({a[0] for a in map("".join, product("0123456789", repeat=4)) if sum(map(int, a)) == s})
        assert task.first_digits(prompt) == brute
    assert task.first_digits("S=34:") == ["7", "8", "9"] and task.first_digits("S=00:") == ["0"]
    assert sum(len(task.first_digits(p)) for p in task.test_prompts()) == 280
