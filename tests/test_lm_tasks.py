"""Task verifiers on hand-made cases, and the data formats they produce."""
import rlcourse  # noqa: F401  (before torch)
import math

import numpy as np

import pytest
import torch

from rlcourse.tasks import AdditionTask, DigitSumTask, PreferenceTask


def test_addition_answer_and_exact_reward():
    task = AdditionTask()
    assert task.answer("12+34=") == "46" and task.answer("99+99=") == "198"
    r = task.reward(["12+34=", "12+34=", "12+34=", "5+5=", "5+5="], ["46", "47", "046", "10", ""])
    assert r.dtype == torch.float32
    assert r.tolist() == [1, 0, 0, 1, 0]


@pytest.mark.parametrize("target, completion, expected", [
    ("46", "46", 1.0), ("46", "47", 0.5), ("46", "56", 0.5), ("46", "146", 2 / 3),
    ("100", "10", 1 / 3), ("46", "", 0.0), ("46", "x6", 0.5), ("7", "8", 0.0),
])
def test_addition_partial_credit(target, completion, expected):
    assert AdditionTask.partial_credit(target, completion) == pytest.approx(expected)


def test_addition_split_is_disjoint_and_stable():
    task = AdditionTask()
    train = set(task.prompts(5000, rng=0))
    test = task.test_prompts(500)
    assert test == AdditionTask().test_prompts(500)           # fixed across instances
    assert len(set(test)) == 500                              # distinct
    assert not train & set(test)                              # never seen in training
    n_test = sum(task._is_test(a, b) for a in range(100) for b in range(100))
    assert 700 < n_test < 1300                                # ~10% of the 10,000 pairs


def test_addition_dataset_format_and_bad_input():
    rows = AdditionTask().sft_dataset(3, rng=1)
    assert all(set(r) == {"prompt", "completion"} and AdditionTask().answer(r["prompt"]) == r["completion"]
               for r in rows)
    with pytest.raises(ValueError, match="prompt must look like"):
        AdditionTask().answer("12 + 34")
    with pytest.raises(ValueError, match="same length"):
        AdditionTask().reward(["1+1="], ["2", "3"])
    with pytest.raises(ValueError, match="n_digits"):
        AdditionTask(n_digits=0)


def test_digitsum_validity():
    task = DigitSumTask(n_digits=4)
    cases = {"1303": True, "0007": True, "7000": True, "1304": False, "133": False,
             "13030": False, "13a3": False, "": False}
    got = task.reward(["S=07:"] * len(cases), list(cases))
    assert got.tolist() == [float(v) for v in cases.values()]


def test_digitsum_counts_match_brute_force():
    task = DigitSumTask(n_digits=3)
    for s in (0, 1, 13, 27):
        brute = sum(1 for x in range(1000) if sum(map(int, f"{x:03d}")) == s)
        assert task.n_valid(task.make_prompt(s)) == brute


def test_digitsum_demonstrations_have_the_stated_accuracy():
    task = DigitSumTask(n_digits=4, demo_accuracy=0.5)
    rows = task.sft_dataset(4000, rng=0)
    valid = task.reward([r["prompt"] for r in rows], [r["completion"] for r in rows]).mean().item()
    assert abs(valid - 0.5) < 0.03                           # binomial sd is 0.008
    assert all(len(r["completion"]) == 4 and r["completion"].isdigit() for r in rows)
    perfect = DigitSumTask(n_digits=4, demo_accuracy=1.0).sft_dataset(200, rng=0)
    assert all(task.is_valid(r["prompt"], r["completion"]) for r in perfect)


def test_digitsum_distinct_valid():
    task = DigitSumTask(n_digits=2)
    prompts = ["S=05:"] * 4 + ["S=18:"] * 2
    completions = ["05", "14", "14", "99", "99", "99"]
    # S=05 has 2 distinct valid answers, S=18 has 1: mean 1.5.
    assert task.distinct_valid(prompts, completions) == 1.5
    assert task.test_prompts() == [f"S={s:02d}:" for s in range(19)]


def test_preference_gold_score_by_hand():
    task = PreferenceTask()
    # "ce:" anchors c=2 and e=4; "ddcc": every letter within distance 1 or 0, length 4.
    expected = ((1 - 1 / 7) * 2 + 1 * 2) / 4
    assert task.gold_score("ce:", "ddcc") == pytest.approx(expected)
    # 7 letters, far from "ab": h is 6 away from b.
    assert task.gold_score("ab:", "hhhhhhh") == pytest.approx(1 - 6 / 7 - 0.25 * 3)
    assert task.gold_score("ab:", "") == -1.0 and task.gold_score("ab:", "abz") == -1.0
    with pytest.raises(ValueError, match="prompt must be two letters"):
        task.gold_score("zz:", "ab")


def test_preference_pairs_follow_bradley_terry():
    task = PreferenceTask(beta=4.0)
    pairs = task.preference_pairs(3000, rng=0)
    assert all(set(p) == {"prompt", "chosen", "rejected"} and p["chosen"] != p["rejected"] for p in pairs)
    # Under Bradley-Terry the expected fraction of pairs where the gold-better one is chosen is
    # the mean of sigmoid(beta * |gap|); compare the simulated raters with that expectation.
    agree, expected = 0, 0.0
    for p in pairs:
        gc, gr = task.gold_score(p["prompt"], p["chosen"]), task.gold_score(p["prompt"], p["rejected"])
        agree += gc > gr
        expected += 1 / (1 + math.exp(-task.beta * abs(gc - gr))) if gc != gr else 0.5
    assert abs(agree / len(pairs) - expected / len(pairs)) < 0.03
    assert 0.6 < agree / len(pairs) < 0.95                   # informative, yet noisy


def test_length_biased_raters_rate_by_gold_plus_a_bonus_per_letter():
    task = PreferenceTask(length_bias=0.35)
    assert task.rater_utility("ab:", "abab") == pytest.approx(task.gold_score("ab:", "abab") + 4 * 0.35)
    # a closer 4-letter word against a 7-letter word of the same letters: gold prefers 4, the raters 7
    assert task.gold_score("ab:", "abab") > task.gold_score("ab:", "abababa")
    assert task.preference_probability("ab:", "abababa", "abab") > 0.5
    assert PreferenceTask().preference_probability("ab:", "abababa", "abab") < 0.5
    # their labels lean long: the chosen word is longer than the rejected one more often than not
    pairs = task.preference_pairs(2000, rng=0)
    longer = np.mean([len(p["chosen"]) > len(p["rejected"]) for p in pairs])
    unbiased = np.mean([len(p["chosen"]) > len(p["rejected"]) for p in PreferenceTask().preference_pairs(2000, rng=0)])
    assert longer > unbiased + 0.1, (longer, unbiased)
    with pytest.raises(ValueError, match="length_bias"):
        PreferenceTask(length_bias=float("nan"))
