"""rlcourse.tasks.verifiers against an independent character-by-character oracle over every short string,
hand-made adversarial completions, and the reward combination's closed form and errors."""
import itertools
import math

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import FillerAdditionTask
from rlcourse.trainers.policy_gradient import checked_rewards
from rlcourse.tasks.verifiers import FillerVerifiers, RandomReward, RewardedTask, combine_rewards, extract_answer

TASK = FillerAdditionTask()            # budget 3
V = FillerVerifiers(TASK)


def oracle(completion: str, target: str, budget: int) -> dict:
    """Read the completion one character at a time: leading dots, then ASCII digits to the end."""
    dots = 0
    while dots < len(completion) and completion[dots] == ".":
        dots += 1
    rest = completion[dots:]
    parsed = len(rest) > 0 and all(ch in "0123456789" for ch in rest)
    return {"extract": rest if parsed else None,
            "format": parsed and dots <= budget,
            "answer": parsed and rest == target,
            "lenient": parsed and (target.startswith(rest) or rest.startswith(target)),
            "strict": parsed and dots <= budget and rest == target}


@pytest.mark.parametrize("prompt,alphabet", [("12+34=", ".46 1\n"), ("99+12=", ".1102\u0661")])
def test_every_short_string_is_judged_as_the_oracle_reads_it(prompt, alphabet):
    target = TASK.answer(prompt)
    strings = ["".join(s) for n in range(0, 6) for s in itertools.product(alphabet, repeat=n)]
    prompts = [prompt] * len(strings)
    got = {"format": V.format_reward(prompts, strings), "answer": V.answer_reward(prompts, strings),
           "lenient": V.lenient_answer_reward(prompts, strings), "strict": V.is_right(prompts, strings)}
    counts = dict.fromkeys(got, 0)
    for i, s in enumerate(strings):
        expected = oracle(s, target, TASK.budget)
        assert extract_answer(s) == expected["extract"], s
        for name in got:
            assert bool(got[name][i]) == expected[name], (name, s)
            counts[name] += expected[name]
    # every verifier both accepts and rejects strings here, and the lenient one accepts strictly more
    assert all(0 < c < len(strings) for c in counts.values()), counts
    assert counts["lenient"] > counts["answer"] >= counts["strict"]


def credit_oracle(completion: str, target: str) -> float:
    """Partial credit by place value: pad both numbers on the left to one width and count the places that
    agree (a pad never agrees); an unparsable completion scores 0."""
    parsed = oracle(completion, target, TASK.budget)["extract"]
    if parsed is None:
        return 0.0
    width = max(len(parsed), len(target))
    a, b = parsed.rjust(width, "a"), target.rjust(width, "b")
    return sum(x == y for x, y in zip(a, b)) / width


@pytest.mark.parametrize("prompt,alphabet", [("90+75=", ".1650"), ("12+34=", ".46 0")])
def test_digit_credit_is_the_share_of_places_right_for_every_short_string(prompt, alphabet):
    target = TASK.answer(prompt)
    strings = ["".join(s) for n in range(0, 6) for s in itertools.product(alphabet, repeat=n)]
    got = V.digit_credit_reward([prompt] * len(strings), strings)
    for s, credit in zip(strings, got):
        assert credit == pytest.approx(credit_oracle(s, target), abs=1e-12), s
        assert (credit == 1.0) == bool(V.answer_reward([prompt], [s])[0]), s      # only the exact sum scores 1
    values = set(got)
    assert 0.0 in values and 1.0 in values and len(values) > 4
    # the documented cases: a missing place, an extra place, a shifted answer, a leading zero, a bad format
    assert V.digit_credit_reward(["90+75="] * 6, ["165", "..155", "65", "1650", "0165", "..1.65"]) == \
        pytest.approx([1.0, 2 / 3, 2 / 3, 0.0, 0.75, 0.0])


def test_thinking_cost_is_minus_the_number_of_dots():
    assert V.thinking_cost(["1+1="] * 4, ["..46", "46", ".....", ".4.6"]) == [-2.0, 0.0, -5.0, -1.0]


ADVERSARIAL = ["46\n", " 46", "46 ", "+46", "046", "4_6", "\u0664\u0666", "\uff14\uff16", "46.0", "..46.", "4", "467",
               "....46", "..4.6", "", "...", "46+0", "４6"]


def test_adversarial_completions_are_rejected_by_the_strict_judge_and_the_answer_reward():
    prompts = ["12+34="] * len(ADVERSARIAL)
    assert not any(V.is_right(prompts, ADVERSARIAL))
    others = [a for a in ADVERSARIAL if a != "....46"]
    assert not any(V.answer_reward(["12+34="] * len(others), others))
    assert V.is_right(["12+34="] * 4, ["46", ".46", "..46", "...46"]) == [True] * 4
    # the lenient verifier's false positives are exactly the prefixes either way
    assert V.lenient_answer_reward(["12+34="] * 3, ["4", "467", "47"]) == [1.0, 1.0, 0.0]


def test_extract_answer_refuses_a_non_string():
    with pytest.raises(ValueError, match="completion must be a string"):
        extract_answer(46)
    with pytest.raises(ValueError, match="FillerAdditionTask"):
        FillerVerifiers(object())


def test_random_reward_is_a_seeded_coin_independent_of_the_completion():
    first, second = RandomReward(0.3, seed=4), RandomReward(0.3, seed=4)
    a = first(["1+1="] * 4000, ["2"] * 4000)
    b = second(["1+1="] * 4000, ["nonsense"] * 4000)
    assert a == b                                           # the completions play no part
    assert abs(np.mean(a) - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 4000)
    assert set(a) == {0.0, 1.0} and a != first(["1+1="] * 4000, ["2"] * 4000)   # a stream, not one draw
    with pytest.raises(ValueError, match="p must be in"):
        RandomReward(1.5)


def _length(prompts, completions):
    return [float(len(c)) for c in completions]


def _flag(prompts, completions):
    return [c.startswith(".") for c in completions]           # bools are numbers, as TRL reads them


def test_combine_rewards_is_the_weighted_sum_of_each_function():
    prompts, completions = ["1+2="] * 3, ["3", "..3", ".9"]
    total, parts = combine_rewards([_length, _flag], prompts, completions, [0.5, -2.0])
    assert torch.equal(parts["_length"], torch.tensor([1.0, 3.0, 2.0]))
    assert torch.equal(parts["_flag"], torch.tensor([0.0, 1.0, 1.0]))
    assert torch.allclose(total, torch.tensor([0.5, -0.5, -1.0]))
    unweighted, _ = combine_rewards([_length, _flag], prompts, completions)
    assert torch.allclose(unweighted, torch.tensor([1.0, 4.0, 3.0]))


def _returns(value):
    def reward_with_a_bug(prompts, completions):
        return [1.0] * (len(completions) - 1) + [value]
    return reward_with_a_bug


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), -float("inf"), "1", [1.0]])
def test_a_bad_reward_is_refused_naming_the_function_and_the_completion(value):
    with pytest.raises(ValueError, match=r"'reward_with_a_bug' returned .* for completion 2 '\.\.7'"):
        combine_rewards([_length, _returns(value)], ["3+4="] * 3, ["7", "07", "..7"])


@pytest.mark.parametrize("result,message", [([1.0], "returned 1 rewards for 3 completions"),
                                            ([1.0] * 4, "returned 4 rewards for 3 completions"),
                                            (torch.ones(2), "returned 2 rewards for 3 completions"),
                                            (None, "returned None, not a list of 3 rewards"),
                                            ("abc", "returned a str .'abc'., not a list of 3 rewards"),
                                            (1.0, "returned a float .1.0., not a list of 3 rewards")])
def test_a_reward_function_returning_the_wrong_number_of_rewards_is_refused(result, message):
    def miscounted(prompts, completions):
        return result
    with pytest.raises(ValueError, match=rf"'miscounted' {message}"):
        combine_rewards([miscounted], ["3+4="] * 3, ["7", "07", "..7"])


@pytest.mark.parametrize("weights,match", [([1.0], "one finite weight per reward function"),
                                           ([1.0, float("nan")], "one finite weight"), (None, None)])
def test_reward_weights_are_checked(weights, match):
    funcs = [_length, _flag]
    if match is None:
        with pytest.raises(ValueError, match="at least one function"):
            combine_rewards([], ["1+2="], ["3"])
        return
    with pytest.raises(ValueError, match=match):
        combine_rewards(funcs, ["1+2="], ["3"], weights)
    with pytest.raises(ValueError, match=match):
        RewardedTask(TASK, funcs, weights)


def test_rewarded_task_is_the_task_with_the_combined_reward():
    rewarded = RewardedTask(TASK, [V.format_reward, V.answer_reward], [1.0, 2.0])
    assert rewarded.max_new_tokens == TASK.max_new_tokens
    assert rewarded.prompts(5, rng=3) == TASK.prompts(5, rng=3) and rewarded.test_prompts(7) == TASK.test_prompts(7)
    prompts, completions = ["12+34="] * 4, ["46", "....46", "47", "x"]
    assert rewarded.reward(prompts, completions).tolist() == [3.0, 2.0, 1.0, 0.0]
    assert rewarded.last_rewards["answer_reward"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert "format_reward" in repr(rewarded)


def test_two_reward_functions_of_one_name_are_refused():
    """last_rewards keeps each function's rewards by name: a second function of the same name would overwrite the
    first's (two coins, two lambdas). Refused, naming the name; distinct names are kept apart."""
    coins = [RandomReward(1.0, seed=0), RandomReward(0.0, seed=1)]
    with pytest.raises(ValueError, match=r"reward_funcs must have distinct names .*\['random_reward'\]"):
        RewardedTask(TASK, coins)
    with pytest.raises(ValueError, match=r"\['<lambda>'\] more than once"):
        combine_rewards([lambda p, c: [1.0] * len(c), lambda p, c: [0.0] * len(c)], ["1+2="], ["3"])
    coins[1].__name__ = "never"
    rewarded = RewardedTask(TASK, coins)
    rewarded.reward(["1+2="] * 2, ["3", "4"])
    assert {k: v.tolist() for k, v in rewarded.last_rewards.items()} == {"random_reward": [1.0, 1.0], "never": [0.0, 0.0]}


def test_the_trainer_refuses_a_reward_function_that_returns_none():
    rewarded = RewardedTask(TASK, [V.format_reward, _returns(None)])
    with pytest.raises(ValueError, match=r"'reward_with_a_bug' returned None for completion 1 '\.\.46'"):
        checked_rewards(rewarded, ["12+34="] * 2, ["46", "..46"], "cpu")
