"""Reward model: the Bradley-Terry loss (closed form and TRL's RewardTrainer), the last-real-token
read-out, the exact Bayes limit of PreferenceTask (brute force and Monte Carlo), and a trained
reward model's held-out accuracy against that limit."""
import itertools
import math

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import pytest
import torch

from rlcourse.tasks import PreferenceTask
from rlcourse.lm import load_checkpoint
from rlcourse.tasks.preference import LETTERS
from rlcourse.measure.bayes_limit import bayes_accuracy, gold_score_distribution, rater_utility_distribution
from rlcourse.lm.scalar_head import (ScalarHeadModel, encode_completions, last_real_index, score_at_last_token, score_completions)
from rlcourse.tasks.reward_model import train_reward_model
from rlcourse.lm.sampling import encode_prompts
from rlcourse.losses import bradley_terry_loss, reward_model_metrics


def test_bradley_terry_closed_form_margin_and_gradient():
    rc, rr = torch.tensor([2.0, -1.0, 0.5, 30.0]), torch.tensor([1.0, 1.0, 0.5, -30.0])
    expected = np.mean([math.log1p(math.exp(-(c - r))) for c, r in zip(rc.tolist(), rr.tolist())])
    assert bradley_terry_loss(rc, rr).item() == pytest.approx(expected, rel=1e-6)
    m = torch.tensor([0.5, 0.0, 1.0, 2.0])
    expected_m = np.mean([math.log1p(math.exp(-(c - r - k))) for c, r, k in zip(rc.tolist(), rr.tolist(), m.tolist())])
    assert bradley_terry_loss(rc, rr, m).item() == pytest.approx(expected_m, rel=1e-6)
    assert bradley_terry_loss(rc, rr, 0.5).item() == pytest.approx(
        bradley_terry_loss(rc, rr, torch.full((4,), 0.5)).item())
    # gradient wrt r_chosen: -sigmoid(-(d - m)) / N
    c = rc.clone().requires_grad_(True)
    bradley_terry_loss(c, rr, m).backward()
    d = (rc - rr - m).double()
    assert torch.allclose(c.grad.double(), -torch.sigmoid(-d) / 4, atol=1e-7)
    # no underflow for a badly ranked pair
    assert bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0])).item() == pytest.approx(400.0)
    # invariant to a shared offset
    assert bradley_terry_loss(rc + 7, rr + 7).item() == pytest.approx(bradley_terry_loss(rc, rr).item(), rel=1e-6)


def test_bradley_terry_rejects_bad_input():
    with pytest.raises(ValueError, match="rewards_chosen"):
        bradley_terry_loss(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one shape"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(TypeError, match="floating"):
        bradley_terry_loss(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="margin"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2))


def test_metrics_by_hand():
    m = reward_model_metrics(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))
    assert m == pytest.approx({"accuracy": 1 / 3, "margin": 0.0, "min_reward": 0.0,
                               "mean_reward": 1.0, "max_reward": 3.0})


def test_last_real_index_and_score():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 0], [1, 0, 0, 0, 0]])
    assert last_real_index(mask).tolist() == [2, 4, 2, 0]
    values = torch.full(mask.shape, 1e6)  # pads hold huge values: reading one would show
    values[mask.bool()] = torch.arange(int(mask.sum()), dtype=torch.float)
    expected = torch.tensor([values[0, 2], values[1, 4], values[2, 2], values[3, 0]])
    assert torch.equal(score_at_last_token(values, mask), expected)
    with pytest.raises(ValueError, match="no real token"):
        last_real_index(torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="one shape"):
        score_at_last_token(values[:, :3], mask)


@pytest.fixture(scope="module")
def sft():
    return load_checkpoint("preference-sft", device="cpu")


def test_score_is_read_at_the_last_completion_token_whatever_the_padding(sft):
    model, tok = sft
    torch.manual_seed(0)
    rm = ScalarHeadModel(model).eval()
    prompts, completions = ["ab:", "ce:", "hh:"], ["abcd", "c", "defgab"]
    pids, pmask = encode_prompts(tok, prompts)
    cids, cmask = encode_completions(tok, completions)
    with torch.no_grad():
        batched = score_completions(rm, pids, pmask, cids, cmask)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids = tok(p + c)["input_ids"] + [tok.eos_token_id]   # one unpadded row
            alone = rm(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0, -1]
            assert batched[i].item() == pytest.approx(alone.item(), abs=1e-5)
    with pytest.raises(ValueError, match="no real token"):
        score_completions(rm, pids, pmask, cids, torch.zeros_like(cmask))


def test_bradley_terry_matches_trls_reward_trainer(sft, tmp_path):
    """TRL's own RewardTrainer.compute_loss on a fixed batch: same scores, loss and logged metrics."""
    from datasets import Dataset
    from transformers import GPT2ForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    model, tok = sft
    path = tmp_path / "sft"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    torch.manual_seed(0)
    seqcls = GPT2ForSequenceClassification.from_pretrained(path, num_labels=1)
    seqcls.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        seqcls.score.weight.normal_(std=0.5)
    data = Dataset.from_list([{"chosen": "ab:abcd", "rejected": "ab:hhhhhhh"}] * 4)
    args = RewardConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[],
                        per_device_train_batch_size=4)
    trainer = RewardTrainer(model=seqcls, args=args, train_dataset=data, processing_class=tok)
    rows = [("ab:abcd", "ab:hg", 0.5), ("ce:c", "ce:cdefgab", 0.0), ("hh:hhh", "hh:a", 1.0)]
    examples = [{"chosen_ids": tok(c)["input_ids"] + [tok.eos_token_id],
                 "rejected_ids": tok(r)["input_ids"] + [tok.eos_token_id], "margin": m} for c, r, m in rows]
    inputs = trainer.data_collator(examples)
    seqcls.train()
    trl_loss = trainer.compute_loss(seqcls, dict(inputs)).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}

    ours = ScalarHeadModel(seqcls)
    ours.head.weight.data.copy_(seqcls.score.weight.data)
    ours.train()
    scores = score_at_last_token(ours(inputs["input_ids"], inputs["attention_mask"]), inputs["attention_mask"])
    chosen, rejected = scores[:3], scores[3:]
    with torch.no_grad():
        trl_scores = seqcls(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, 0]
    assert torch.allclose(scores, trl_scores, atol=1e-5)
    assert bradley_terry_loss(chosen, rejected, inputs["margin"]).item() == pytest.approx(trl_loss, abs=1e-6)
    assert reward_model_metrics(chosen, rejected) == pytest.approx(trl_metrics, abs=1e-5)


@pytest.mark.parametrize("length_bias", [0.0, 0.3])
def test_gold_distribution_and_bayes_limit_by_brute_force(length_bias):
    """A small task where every word is enumerable: the exact formula equals the pair-by-pair sum."""
    task = PreferenceTask(target_length=2, max_length=3, beta=3.0, length_bias=length_bias)
    words = ["".join(w) for n in range(1, 4) for w in itertools.product(LETTERS, repeat=n)]
    prob = np.array([1 / 3 * 8.0 ** -len(w) for w in words])
    per_prompt = []
    for prompt in task.test_prompts(64):
        gold = np.array([task.gold_score(prompt, w) for w in words])
        utility = np.array([task.rater_utility(prompt, w) for w in words])
        g, q = gold_score_distribution(task, prompt)
        assert q.sum() == pytest.approx(1.0)
        assert (q * g).sum() == pytest.approx((prob * gold).sum(), abs=1e-12)
        u, qu = rater_utility_distribution(task, prompt)
        assert (qu * u).sum() == pytest.approx((prob * utility).sum(), abs=1e-12)
        assert (qu * u ** 2).sum() == pytest.approx((prob * utility ** 2).sum(), abs=1e-12)
        best = 1 / (1 + np.exp(-task.beta * np.abs(utility[:, None] - utility[None, :])))
        pair = np.outer(prob, prob)
        np.fill_diagonal(pair, 0.0)   # the task redraws b when it equals a
        per_prompt.append((pair * best).sum() / pair.sum())
    assert bayes_accuracy(task) == pytest.approx(np.mean(per_prompt), abs=1e-12)


@pytest.mark.parametrize("length_bias", [0.0, 0.35])
def test_bayes_limit_matches_the_raters_own_ranker_on_sampled_pairs(length_bias):
    task = PreferenceTask(length_bias=length_bias)
    pairs = task.preference_pairs(12000, rng=3)
    d = np.array([task.rater_utility(p["prompt"], p["chosen"]) - task.rater_utility(p["prompt"], p["rejected"])
                  for p in pairs])
    acc = np.where(d > 1e-12, 1.0, np.where(d < -1e-12, 0.0, 0.5))
    assert abs(acc.mean() - bayes_accuracy(task)) < 4 * acc.std() / math.sqrt(len(acc))


def test_trained_reward_model_approaches_but_does_not_beat_the_bayes_limit(sft):
    model, tok = sft
    task = PreferenceTask()
    torch.manual_seed(0)
    rm = ScalarHeadModel(model)
    heldout = task.preference_pairs(1500, rng=2)
    out = train_reward_model(rm, tok, task.preference_pairs(1500, rng=1), steps=60, batch_size=64, lr=3e-3,
                             eval_pairs=heldout, progress=False)
    bayes = bayes_accuracy(task)
    se = math.sqrt(bayes * (1 - bayes) / len(heldout))
    acc = out["eval"]["eval_accuracy"]
    assert bayes - 0.1 < acc < bayes + 3 * se, (acc, bayes)
    assert out["history"][-1].keys() >= {"loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"}
    assert np.mean([h["loss"] for h in out["history"][-10:]]) < np.mean([h["loss"] for h in out["history"][:10]])
