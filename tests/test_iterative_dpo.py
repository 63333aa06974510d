"""Iterative DPO (lesson 11b): rounds of rejection-sampled pairs and offline DPO.

Oracles: the best and worst answer of each group found by brute force; one round recomputed by hand
(the same sampler stream, scorer and pairing, then :func:`train_dpo` on those pairs); each seed of a
stack against its run alone; the reference each round's DPO receives; a run that had nothing to learn.
"""
import copy
import dataclasses

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

import rlcourse.trainers.iterative_dpo as iterative
from rlcourse.lm import load_checkpoint, sample
from rlcourse.lm.scalar_head import ScalarHeadModel
from rlcourse.tasks import PreferenceTask
from rlcourse.trainers.dpo import train_dpo
from rlcourse.trainers.iterative_dpo import IterativeDPOConfig, rejection_sampled_pairs, train_iterative_dpo
from seed_helpers import update_cosine


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("preference-sft", device="cpu")


def _args(**kw):
    settings = dict(beta=0.5, learning_rate=1e-3, per_device_train_batch_size=4, max_steps=3, rounds=2,
                    prompts_per_round=6, num_generations=3)
    return IterativeDPOConfig(**{**settings, **kw})


def test_pairs_are_each_prompts_best_against_its_worst_and_ties_give_none():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (60,), generator=g).float()       # small integers: many ties, some whole groups
    scores[9:12] = 2.0                                              # group 3: all equal
    prompts = [f"p{i // 3}" for i in range(60)]
    completions = [f"c{i}" for i in range(60)]
    pairs = rejection_sampled_pairs(scores, prompts, completions, 3)
    expected = []
    for group in range(20):
        s = scores[3 * group:3 * group + 3].tolist()
        if max(s) == min(s):
            continue
        best, worst = 3 * group + s.index(max(s)), 3 * group + s.index(min(s))   # the first among equals
        expected.append({"prompt": f"p{group}", "chosen": f"c{best}", "rejected": f"c{worst}"})
    assert pairs == expected and all(p["prompt"] != "p3" for p in pairs) and 0 < len(pairs) < 20


def test_pairs_refuse_misshapen_input():
    with pytest.raises(ValueError, match="multiple of num_generations"):
        rejection_sampled_pairs(torch.zeros(5), ["x"] * 5, ["y"] * 5, 2)
    with pytest.raises(ValueError, match="one length"):
        rejection_sampled_pairs(torch.zeros(4), ["x"] * 4, ["y"] * 3, 2)


def test_one_round_is_dpo_on_the_pairs_it_sampled(checkpoint):
    """Round 1 recomputed: the seed's prompts and sampling stream, the scorer, the pairs, then plain DPO on them."""
    model, tok = checkpoint
    task = PreferenceTask()
    args = _args(rounds=1, max_steps=4, seed=7)
    trained = copy.deepcopy(model)
    history = train_iterative_dpo([trained], tok, task.reward, task.prompts, args, progress=False)

    prompts = [p for p in task.prompts(6, 7 * 100_003) for _ in range(3)]
    roll = sample(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(7))
    pairs = rejection_sampled_pairs(task.reward(roll.prompts, roll.completions), prompts, roll.completions, 3)
    alone = copy.deepcopy(model)
    dpo = train_dpo(alone, tok, pairs, dataclasses.replace(args, seed=7 * 100_003), progress=False)
    assert history[0][0]["pairs"] == len(pairs) > 0
    assert history[0][0]["loss"] == pytest.approx(sum(dpo["loss"]) / len(dpo["loss"]), rel=1e-6)
    for p, q in zip(trained.parameters(), alone.parameters()):
        assert torch.equal(p, q)


def test_each_seed_of_a_stack_trains_as_it_trains_alone(checkpoint):
    model, tok = checkpoint
    task = PreferenceTask()
    args = _args()
    together = [copy.deepcopy(model) for _ in range(2)]
    histories = train_iterative_dpo(together, tok, task.reward, task.prompts, args, seeds=[3, 5], progress=False)
    for s, seed in enumerate([3, 5]):
        alone = copy.deepcopy(model)
        single = train_iterative_dpo([alone], tok, task.reward, task.prompts, args, seeds=[seed], progress=False)[0]
        assert [r["pairs"] for r in histories[s]] == [r["pairs"] for r in single]
        assert [r["loss"] for r in histories[s]] == pytest.approx([r["loss"] for r in single], rel=1e-4)
        assert update_cosine(model, alone, together[s]) > 0.999


@pytest.mark.parametrize("sync", [False, True])
def test_each_rounds_reference_is_the_start_or_the_rounds_starting_policy(checkpoint, monkeypatch, sync):
    model, tok = checkpoint
    task = PreferenceTask()
    seen = []

    def recording(policy, tokenizer, pairs, args, ref_model=None, progress=True):
        flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])   # noqa: E731
        seen.append((flat(policy).clone(), flat(ref_model).clone()))
        return train_dpo(policy, tokenizer, pairs, args, ref_model=ref_model, progress=progress)

    monkeypatch.setattr(iterative, "train_dpo", recording)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    train_iterative_dpo([copy.deepcopy(model)], tok, task.reward, task.prompts, _args(sync_ref_model=sync), progress=False)
    (first_policy, first_ref), (second_policy, second_ref) = seen
    assert torch.equal(first_policy, start) and torch.equal(first_ref, start)
    assert not torch.equal(second_policy, start)                    # round 1 moved the policy
    assert torch.equal(second_ref, second_policy if sync else start)


def test_a_run_whose_answers_all_tie_does_not_move(checkpoint):
    model, tok = checkpoint
    flat = lambda prompts, completions: torch.zeros(len(prompts))          # noqa: E731
    models = [copy.deepcopy(model) for _ in range(2)]
    histories = train_iterative_dpo(models, tok, flat, PreferenceTask().prompts, _args(), progress=False)
    assert all(r["pairs"] == 0 and "loss" not in r for h in histories for r in h)
    for m in models:
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m.parameters()))


def test_a_reward_model_labels_the_pairs(checkpoint):
    model, tok = checkpoint
    rm = ScalarHeadModel(copy.deepcopy(model))
    history = train_iterative_dpo([copy.deepcopy(model)], tok, rm, PreferenceTask().prompts, _args(rounds=1),
                                  progress=False)[0]
    assert history[0]["pairs"] == 6 and history[0]["objective/scores_margin"] > 0 and history[0]["loss"] > 0


@pytest.mark.parametrize("bad, match", [(dict(rounds=0), "rounds"), (dict(prompts_per_round=0), "prompts_per_round"),
                                        (dict(num_generations=1), "num_generations"), (dict(loss_type="kto"), "kto")])
def test_config_refuses_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        _args(**bad)
