"""FillerAdditionTask: the verifier on hand-made cases, the lengths of its demonstrations, its split."""
import rlcourse  # noqa: F401  (before torch)
from collections import Counter

import pytest
import torch

from rlcourse.tasks.arithmetic import AdditionTask, FillerAdditionTask


def test_reward_counts_only_the_sum_after_at_most_budget_dots():
    task = FillerAdditionTask(max_filler=12, budget=3)
    prompts = ["12+34="] * 10
    completions = ["46", "...46", "....46", "...47", "..4.6", "...46.", "", "...", ".46 ", "99+46"]
    r = task.reward(prompts, completions)
    assert r.dtype == torch.float32 and r.shape == (10,)
    assert r.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert task.reward(["99+99="], ["..198"]).tolist() == [1.0]
    assert task.split("...46") == (3, "46") and task.split("46..") == (0, "46..") and task.split("") == (0, "")


def test_demonstrations_vary_in_length_and_many_are_over_budget():
    task = FillerAdditionTask(max_filler=6, budget=2)
    rows = task.sft_dataset(3500, rng=0)
    dots = Counter(task.split(r["completion"])[0] for r in rows)
    assert set(dots) == set(range(7))                        # every length 0..max_filler occurs
    assert all(400 < n < 600 for n in dots.values())         # uniformly (500 expected each)
    assert all(task.split(r["completion"])[1] == task.answer(r["prompt"]) for r in rows)
    over = task.reward([r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert abs(float(1 - over.mean()) - 4 / 7) < 0.03         # 3..6 dots are over the budget of 2
    # room for a completion 6 dots longer than the longest demonstration (6 dots, 3 digits, <eos>)
    assert task.max_new_tokens == 2 * 6 + 2 + 2


def test_prompts_are_addition_prompts_disjoint_from_the_held_out_ones():
    task = FillerAdditionTask()
    test = task.test_prompts(500)
    assert test == AdditionTask().test_prompts(500)          # the same split as AdditionTask
    assert not set(task.prompts(5000, rng=0)) & set(test)
    assert task.prompts(20, rng=3) == task.prompts(20, rng=3)


@pytest.mark.parametrize("kwargs", [dict(max_filler=-1), dict(max_filler=30), dict(max_filler=4, budget=5),
                                    dict(budget=-1), dict(budget=1.5)])
def test_bad_settings_are_named(kwargs):
    with pytest.raises(ValueError, match="max_filler|budget"):
        FillerAdditionTask(**kwargs)


def test_bad_reward_input_is_named():
    task = FillerAdditionTask()
    with pytest.raises(ValueError):
        task.reward(["12+34="], ["46", "46"])
    with pytest.raises(ValueError, match="kind"):
        task.reward(["12+34="], ["46"], kind="partial")
    with pytest.raises(ValueError, match="prompt"):
        task.reward(["hello"], ["46"])
