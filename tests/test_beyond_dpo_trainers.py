"""The trainers of lesson 11b: SimPO, ORPO, KTO and R-DPO through train_dpo and train_dpo_seeds, and online DPO.

Oracles: the loss of a step recomputed by hand from the same model and batch (KTO's mismatched pairs
included), the single-seed trainer for the seed-stacked one, exact Bradley-Terry probabilities for the
rater, and the parameters of a run that had nothing to learn from.
"""
import copy

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from rlcourse.tasks import PreferenceTask
from rlcourse.lm import load_checkpoint
from rlcourse.trainers.dpo import (DPOConfig, _reference_logps, kto_mismatched_pairs, pair_token_logprobs, select_pairs,
                             train_dpo)
from rlcourse.trainers.online_dpo import BradleyTerryRater, OnlineDPOConfig, OnlineDPOTrainer
from rlcourse.lm.scalar_head import ScalarHeadModel
from rlcourse.tasks.reward_model import encode_preference_pairs
from rlcourse.trainers.dpo_seeds import train_dpo_seeds
from rlcourse.losses import kto_loss, kto_reference_point, online_dpo_pairs, dpo_sigmoid_loss
from seed_helpers import perturbed_copies


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("preference-sft", device="cpu")


@pytest.fixture(scope="module")
def pairs():
    return PreferenceTask().preference_pairs(24, rng=3)


def test_kto_mismatched_pairs_shift_the_completions_by_one(pairs):
    shifted = kto_mismatched_pairs(pairs[:3])
    assert [r["prompt"] for r in shifted] == [r["prompt"] for r in pairs[:3]]
    assert [r["chosen"] for r in shifted] == [pairs[2]["chosen"], pairs[0]["chosen"], pairs[1]["chosen"]]
    assert [r["rejected"] for r in shifted] == [pairs[2]["rejected"], pairs[0]["rejected"], pairs[1]["rejected"]]


def test_train_dpo_kto_first_step_is_kto_on_the_batch_with_mismatched_reference_point(checkpoint, pairs):
    """The first step's loss, recomputed: the batch the seed draws, z0 from the mismatched pairs."""
    model, tok = checkpoint
    ref = perturbed_copies(model, [5], torch.float32, offset=0)[0]       # z0 > 0 needs a policy away from pi_ref
    args = DPOConfig(beta=0.5, loss_type="kto", per_device_train_batch_size=8, max_steps=1, seed=11,
                     desirable_weight=1.2, undesirable_weight=0.8)
    trained = copy.deepcopy(model)
    history = train_dpo(trained, tok, pairs, args, ref_model=ref, progress=False)

    idx = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(11))[:8]
    data = encode_preference_pairs(tok, pairs)
    mismatched = encode_preference_pairs(tok, kto_mismatched_pairs(pairs))
    with torch.no_grad():
        c, r = (t.sum(-1) for t in pair_token_logprobs(model, select_pairs(data, idx)))
        rc, rr = (t.sum(-1) for t in pair_token_logprobs(ref, select_pairs(data, idx)))
        kc, kr = (t.sum(-1) for t in pair_token_logprobs(model, select_pairs(mismatched, idx)))
        qc, qr = (t.sum(-1) for t in pair_token_logprobs(ref, select_pairs(mismatched, idx)))
    z0 = kto_reference_point(torch.cat([kc, kr]), torch.cat([qc, qr]))
    assert float(z0) > 0
    expected = kto_loss(c, r, rc, rr, z0, 0.5, 1.2, 0.8).mean()
    assert history["loss"][0] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("settings", [dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5), dict(loss_type="orpo", beta=0.5),
                                      dict(loss_type="kto", beta=0.5), dict(loss_type="sigmoid", beta=0.5, rdpo_alpha=0.3)],
                         ids=["simpo", "orpo", "kto", "rdpo"])
def test_each_seed_trains_as_train_dpo_trains_it_alone(checkpoint, pairs, settings):
    model, tok = checkpoint
    args = DPOConfig(learning_rate=5e-4, per_device_train_batch_size=8, num_train_epochs=1,
                     precompute_ref_log_probs=True, **settings)
    seeds = [1, 2]
    together = [copy.deepcopy(model) for _ in seeds]
    steps_seen = []
    histories = train_dpo_seeds(together, tok, pairs, args, seeds=seeds, progress=False,
                                callback=lambda step, stack: steps_seen.append(step))
    assert steps_seen == [1, 2, 3]
    for s, seed in enumerate(seeds):
        alone = copy.deepcopy(model)
        single = train_dpo(alone, tok, pairs, _with_seed(args, seed), progress=False)
        assert histories[s]["loss"] == pytest.approx(single["loss"], rel=1e-4)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        moved_alone = torch.cat([p.detach().flatten() for p in alone.parameters()]) - start
        moved_together = torch.cat([p.detach().flatten() for p in together[s].parameters()]) - start
        assert float(F.cosine_similarity(moved_alone, moved_together, dim=0)) > 0.999


def _with_seed(args, seed):
    out = copy.copy(args)
    out.seed = seed
    return out


def test_reference_free_runs_hold_no_reference(checkpoint, pairs, monkeypatch):
    """SimPO and ORPO never build or run a reference: frozen_copy is not called."""
    import rlcourse.trainers.dpo as dpo_module

    model, tok = checkpoint
    monkeypatch.setattr(dpo_module, "frozen_copy", lambda m: pytest.fail("a reference copy was made"))
    for kind in ("simpo", "orpo"):
        train_dpo(copy.deepcopy(model), tok, pairs, DPOConfig(loss_type=kind, max_steps=2), progress=False)


# --- online DPO -------------------------------------------------------------------------------------

def test_bradley_terry_rater_prefers_with_the_bradley_terry_probability():
    rater = BradleyTerryRater(lambda p, c: {"a": 0.3, "b": 0.0}[c], beta=4.0, seed=0)
    n = 40_000
    scores = rater(["x:"] * (2 * n), ["a", "b"] * n).view(n, 2)
    won = float((scores[:, 0] > scores[:, 1]).double().mean())
    p = 1 / (1 + np.exp(-4.0 * 0.3))
    assert abs(won - p) < 4 * np.sqrt(p * (1 - p) / n)


def _online(model, tok, reward, seeds=None, **kw):
    task = PreferenceTask()
    args = OnlineDPOConfig(beta=0.5, learning_rate=1e-3, per_device_train_batch_size=6, max_steps=3, **kw)
    return OnlineDPOTrainer(model, tok, reward, task.prompts, args, seeds=seeds, gold_fn=task.reward)


def test_online_single_run_equals_a_stack_of_one(checkpoint):
    model, tok = checkpoint
    gold = PreferenceTask().reward
    single = _online(copy.deepcopy(model), tok, gold)
    stacked = _online(model, tok, gold, seeds=[42])
    single.train(progress=False)
    stacked.train(progress=False)
    for a, b in zip(single.history[0], stacked.history[0]):
        assert a["pairs"] == b["pairs"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for p, q in zip(single.model.parameters(), stacked.model_of(0).parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_online_step_is_dpo_on_the_best_and_worst_answer_of_each_prompt(checkpoint):
    """Recompute the first step's loss from the rollout the trainer draws with the same generator."""
    from rlcourse.lm import sample, sequence_logprobs

    model, tok = checkpoint
    task = PreferenceTask()
    trainer = _online(copy.deepcopy(model), tok, task.reward, num_generations=3)
    metrics = trainer.step()[0]
    prompts = [p for p in task.prompts(6, 42 * 100_003) for _ in range(3)]
    roll = sample(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(42))
    scores = task.reward(roll.prompts, roll.completions)
    chosen, rejected = online_dpo_pairs(scores, torch.arange(6).repeat_interleave(3))
    with torch.no_grad():
        logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask).sum(-1)
    expected = dpo_sigmoid_loss(logp[chosen], logp[rejected], logp[chosen], logp[rejected], 0.5).mean()
    assert metrics["pairs"] == len(chosen) and metrics["loss"] == pytest.approx(float(expected), rel=1e-6)
    assert metrics["objective/scores"] == pytest.approx(float(scores.mean()), rel=1e-6)
    assert metrics["objective/scores_margin"] == pytest.approx(float((scores[chosen] - scores[rejected]).mean()), rel=1e-6)


def test_a_run_without_pairs_does_not_move(checkpoint):
    model, tok = checkpoint
    flat = lambda prompts, completions: torch.zeros(len(prompts))          # noqa: E731  every answer ties
    trainer = _online(model, tok, flat, seeds=[0, 1])
    trainer.train(progress=False)
    assert all(row["pairs"] == 0 and "loss" not in row for h in trainer.history for row in h)
    for p, q in zip(model.parameters(), trainer.model_of(1).parameters()):
        assert torch.equal(p, q)


def test_missing_eos_penalty_and_a_reward_model(checkpoint):
    model, tok = checkpoint
    task = PreferenceTask()
    penalised = _online(copy.deepcopy(model), tok, task.reward, missing_eos_penalty=5.0, max_new_tokens=2)
    plain = _online(copy.deepcopy(model), tok, task.reward, max_new_tokens=2)
    a, b = penalised.step()[0], plain.step()[0]
    share = 1 - a["val/contain_eos_token"]
    assert share > 0 and a["objective/scores"] == pytest.approx(b["objective/scores"] - 5.0 * share, rel=1e-5)
    rm = ScalarHeadModel(copy.deepcopy(model))
    metrics = _online(copy.deepcopy(model), tok, rm).step()[0]
    assert metrics["pairs"] == 6 and np.isfinite(metrics["loss"])


@pytest.mark.parametrize("bad, match", [(dict(num_generations=1), "num_generations"), (dict(loss_type="kto"), "kto"),
                                        (dict(max_steps=0), "max_steps"), (dict(temperature=0.0), "temperature")])
def test_online_config_refuses_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        OnlineDPOConfig(**bad)


def test_online_learning_rate_stops_at_zero_past_max_steps(checkpoint):
    """TRL's linear schedule stops at 0: a second train() (steps past max_steps) must not run at a negative rate,
    which would be gradient ascent on the loss."""
    model, tok = checkpoint
    task = PreferenceTask()
    args = OnlineDPOConfig(beta=0.5, learning_rate=1e-3, per_device_train_batch_size=6, max_steps=2)
    trainer = OnlineDPOTrainer(copy.deepcopy(model), tok, task.reward, task.prompts, args)
    trainer.train(progress=False)
    after = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train(progress=False)                    # steps 3 and 4 of a 2-step schedule
    assert [row["learning_rate"] for row in trainer.history[0]] == pytest.approx([1e-3, 5e-4, 0.0, 0.0])
    assert all(torch.equal(a, p) for a, p in zip(after, trainer.model.parameters()))


def test_online_reference_free_losses_log_no_kl(checkpoint):
    """SimPO and ORPO keep no reference: there is no KL to log (the policy's mean log-prob is not one)."""
    model, tok = checkpoint
    for kind in ("simpo", "orpo"):
        trainer = _online(copy.deepcopy(model), tok, PreferenceTask().reward, loss_type=kind)
        rows = trainer.train(progress=True)[0]
        assert all("objective/kl" not in row for row in rows) and all("loss" in row for row in rows)
    row = _online(copy.deepcopy(model), tok, PreferenceTask().reward).step()[0]
    assert row["objective/kl"] == pytest.approx(0.0, abs=1e-6)     # the first step: the policy is its reference


def test_online_ipo_is_trls_on_whole_sequence_log_ratios(checkpoint):
    """TRL's OnlineDPOTrainer's IPO: (h - 1 / (2 beta))^2 on whole-sequence log-ratios, not per token as offline."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.losses import ipo_loss

    model, tok = checkpoint
    task = PreferenceTask()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    args = OnlineDPOConfig(beta=0.5, learning_rate=1e-3, per_device_train_batch_size=6, max_steps=3, loss_type="ipo")
    metrics = OnlineDPOTrainer(copy.deepcopy(model), tok, task.reward, task.prompts, args, ref_model=ref).step()[0]
    prompts = [p for p in task.prompts(6, 42 * 100_003) for _ in range(2)]
    roll = sample(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(42))
    chosen, rejected = online_dpo_pairs(task.reward(roll.prompts, roll.completions), torch.arange(6).repeat_interleave(2))
    with torch.no_grad():
        logp, ref_logp = (sequence_logprobs(m, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                            roll.prompt_mask).sum(-1) for m in (model, ref))
    expected = ipo_loss(logp[chosen], logp[rejected], ref_logp[chosen], ref_logp[rejected], 0.5).mean()
    assert metrics["pairs"] == len(chosen) > 0 and metrics["loss"] == pytest.approx(float(expected), rel=1e-6)
