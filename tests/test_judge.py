"""The judge of lesson 10d: its reward is its verdict's probability, and the rubric, ensemble, false-positive
and mining statistics against independent computations (NumPy, plain loops)."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import load_checkpoint
from rlcourse.tasks import AdditionTask
from rlcourse.tasks.judge import (ADVERSARIAL_KINDS, RUBRIC_ITEMS, GenerativeJudge, JudgeRewardTask, JudgeTask,
                                  RubricTask, adversarial_answer, ensemble_reward, false_positive_rate, judge_text,
                                  mine_negatives, rubric_items, rubric_reward, well_formed)


@pytest.fixture(scope="module")
def judge():
    model, tokenizer = load_checkpoint("judge", device="cpu")
    return GenerativeJudge(model, tokenizer)


def test_reward_is_the_verdict_probability_of_a_fresh_forward_pass(judge):
    """One line at a time, no padding, through the model's own forward: p("y") after the line."""
    task = AdditionTask()
    problems = task.test_prompts(12)
    answers = [task.answer(p) if i % 3 == 0 else adversarial_answer(ADVERSARIAL_KINDS[i % 5], p)
               for i, p in enumerate(problems)]
    rewards = JudgeRewardTask(task, judge).reward(problems, answers)
    yes = judge.tokenizer.convert_tokens_to_ids("y")
    for p, a, r in zip(problems, answers, rewards.tolist()):
        ids = judge.tokenizer(judge_text(p, a, task.answer(p)), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = judge.model(input_ids=ids).logits[0, -1].double()
        fresh = float(torch.exp(logits[yes] - torch.logsumexp(logits, 0)))
        assert abs(fresh - r) < 1e-5, (p, a, fresh, r)


def test_the_shipped_judge_is_accurate_on_well_formed_held_out_answers(judge):
    maker = JudgeTask()
    lines = maker.test_prompts(400)
    truth = torch.tensor([maker.verdict(line) == "y" for line in lines])
    assert float(((judge.prob_yes_lines(lines) > 0.5) == truth).float().mean()) > 0.9


def test_judge_data_is_well_formed_and_balanced():
    maker = JudgeTask()
    rows = maker.examples(AdditionTask().prompts(2000, rng=0), rng=1)
    assert 0.45 < np.mean([r["right"] for r in rows]) < 0.55
    for r in rows:
        problem, rest = r["prompt"].split("=")
        answer, reference = rest[:-1].split("|")
        assert well_formed(answer, reference) and (answer == reference) == r["right"]
        assert r["completion"] == ("y" if r["right"] else "n") == maker.verdict(r["prompt"])
    mined = JudgeTask(extra_negatives=[("1+2=", "|")], negative_fraction=0.5).examples(["3+4="] * 400, rng=0)
    assert 0.4 < np.mean([r["prompt"] == "1+2=||3>" for r in mined]) < 0.6
    assert all(r["completion"] == "n" for r in mined if r["prompt"] == "1+2=||3>")


def test_adversarial_answers_are_wrong_and_never_well_formed():
    task = AdditionTask()
    for p in task.test_prompts(50):
        for kind in ADVERSARIAL_KINDS:
            a = adversarial_answer(kind, p)
            assert a != task.answer(p) and not well_formed(a, task.answer(p))
    assert adversarial_answer("echo", "12+34=") == "|46" and adversarial_answer("truncated", "12+34=") == "4"
    with pytest.raises(ValueError, match="kind"):
        adversarial_answer("nonsense", "1+2=")


def test_rubric_weighted_sum_against_numpy_and_its_errors():
    rng = np.random.default_rng(0)
    items, w = rng.random((7, 4)), rng.random(4) * 3
    assert np.allclose(rubric_reward(torch.tensor(items), torch.tensor(w)).numpy(),
                       np.einsum("bi,i->b", items, w) / w.sum(), atol=1e-6)
    for bad in ([1.0, -1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match="weights"):
            rubric_reward(torch.tensor(items), bad)
    with pytest.raises(ValueError, match="shape"):
        rubric_reward(torch.tensor(items), [1.0, 1.0])
    assert rubric_items("46", "46") == {"format": 1.0, "digit count": 1.0, "last digit": 1.0, "full answer": 1.0}
    assert list(rubric_items("", "46").values()) == [0.0, 0.0, 0.0, 0.0]
    assert list(rubric_items("16", "46").values()) == [1.0, 1.0, 1.0, 0.0]
    assert list(rubric_items("a6", "146").values()) == [0.0, 0.0, 1.0, 0.0]
    task = RubricTask(AdditionTask(), {"format": 1.0, "last digit": 3.0})
    assert task.reward(["12+34="] * 3, ["46", "16", "x"]).tolist() == pytest.approx([1.0, 1.0, 0.0])
    assert task.reward(["12+34="], ["47"]).tolist() == pytest.approx([0.25])
    with pytest.raises(ValueError, match="items"):
        RubricTask(AdditionTask(), {"style": 1.0})
    assert list(RUBRIC_ITEMS) == list(rubric_items("1", "1"))


def test_ensemble_statistics_against_numpy():
    probs = np.random.default_rng(1).random((5, 9))
    assert np.allclose(ensemble_reward(torch.tensor(probs), "mean").numpy(), probs.mean(0), atol=1e-6)
    assert np.allclose(ensemble_reward(torch.tensor(probs), "min").numpy(), probs.min(0), atol=1e-6)
    with pytest.raises(ValueError, match="how"):
        ensemble_reward(torch.tensor(probs), "median")
    with pytest.raises(ValueError, match="shape"):
        ensemble_reward(torch.tensor(probs[0]))


def test_false_positive_rate_and_mining_against_loops():
    rng = np.random.default_rng(2)
    probs, right = rng.random(300), rng.random(300) < 0.4
    wrong = [p for p, ok in zip(probs, right) if not ok]
    assert false_positive_rate(probs, right, 0.3) == pytest.approx(sum(p > 0.3 for p in wrong) / len(wrong))
    assert np.isnan(false_positive_rate([0.9], [True]))
    prompts = ["1+1=", "1+1=", "2+2=", "1+1=", "2+2="]
    completions = ["3", "3", "3", "2", "5"]
    mined = mine_negatives(prompts, completions, [0.9, 0.8, 0.6, 0.9, 0.4], [False, False, False, True, False])
    assert mined == [("1+1=", "3"), ("2+2=", "3")]
