"""Losses on multi-turn episodes (lesson 10e): the masked loss reduces to the single-turn loss, the
process advantages against a loop written from the formula, the policy mask from segment lengths,
and the trainer's runs against solo runs.

Oracles: :func:`rlcourse.losses.grpo.per_token_loss` + :func:`~rlcourse.losses.grpo.aggregate_loss`
(the single-turn GRPO loss); DeepSeekMath's process-supervision formula written as a Python loop;
the hand-built mask of the hand-written episode; a single-run trainer.
"""
import itertools

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import build_char_tokenizer, make_model
from rlcourse.lm.multi_turn import rollout
from rlcourse.losses import aggregate_loss, group_advantages, per_token_loss
from rlcourse.losses.multi_turn import (multi_turn_loss, policy_mask_from_segments, process_advantages,
                                        token_advantages)
from rlcourse.tasks.tool_env import ToolSumTask
from rlcourse.trainers.multi_turn import MultiTurnConfig, MultiTurnTrainer, evaluate_tool_use

TASK = ToolSumTask()


def _batch(seed, B=8, T=7, observations=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    completion = (torch.arange(T)[None] < lengths[:, None]).long()
    policy = completion.clone()
    if observations:
        policy = policy * (torch.rand(B, T, generator=g) > 0.35).long()
        policy[:, 0] = 1
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    logp = torch.where(completion.bool(), logp, torch.full_like(logp, float("nan")))   # junk padding
    adv = torch.randn(B, generator=g, dtype=dtype)
    return logp, old, adv, policy, completion


@pytest.mark.parametrize("loss_type,variant", list(itertools.product(("grpo", "bnpo", "dr_grpo", "dapo"),
                                                                     ("masked", "all", "ce"))))
def test_without_a_tool_call_every_variant_is_the_single_turn_loss(loss_type, variant):
    logp, old, adv, policy, completion = _batch(0, observations=False)
    knobs = dict(masked={}, all=dict(mask_observations=False), ce=dict(observation_loss_weight=0.3))[variant]
    mine = logp.clone().requires_grad_()
    loss = multi_turn_loss(mine, old, adv, policy, completion, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
                           max_completion_length=7, **knobs)
    theirs = logp.clone().requires_grad_()
    single = aggregate_loss(per_token_loss(theirs, old, adv, completion, loss_type=loss_type, epsilon=0.2,
                                           epsilon_high=0.28), completion, loss_type=loss_type, max_completion_length=7)
    loss.backward()
    single.backward()
    assert torch.allclose(loss, single, atol=1e-12)
    assert torch.equal(torch.nan_to_num(mine.grad), torch.nan_to_num(theirs.grad))
    assert mine.grad[completion.bool()].abs().max() > 1e-3


def test_the_masked_loss_ignores_observations_and_the_unmasked_one_trains_them():
    logp, old, adv, policy, completion = _batch(1)
    observed = (completion - policy).bool()
    changed = torch.where(observed, logp - 5.0, logp)                 # different observation log-probs
    a = multi_turn_loss(logp, old, adv, policy, completion)
    b = multi_turn_loss(changed, torch.where(observed, old - 5.0, old), adv, policy, completion)
    assert torch.allclose(a, b, atol=1e-12)
    # per-token advantages equal to the broadcast ones give the same loss (the clipped piece is shared)
    broadcast = adv[:, None].expand_as(logp).clone()
    assert torch.allclose(multi_turn_loss(logp, old, broadcast, policy, completion), a, atol=1e-12)
    x = logp.clone().requires_grad_()
    multi_turn_loss(x, x.detach(), adv, policy, completion, mask_observations=False).backward()
    assert x.grad[observed].abs().min() > 0 and x.grad[~completion.bool()].abs().max() == 0
    # the cross-entropy term: its value, and its gradient only on the observations
    y = logp.clone().requires_grad_()
    with_ce = multi_turn_loss(y, y.detach(), adv, policy, completion, observation_loss_weight=0.5)
    plain = multi_turn_loss(logp, logp, adv, policy, completion)
    nll = -logp[observed].mean()
    assert torch.allclose(with_ce, plain + 0.5 * nll, atol=1e-12)


def test_process_advantages_against_the_formula_written_as_a_loop():
    g = torch.Generator().manual_seed(3)
    K, B, M = 4, 8, 3
    rewards = torch.randint(0, 2, (B, M), generator=g).double()
    turns = torch.randint(1, M + 1, (B,), generator=g)
    mask = torch.arange(M)[None] < turns[:, None]
    rewards[0:4] = torch.where(mask[0:4], torch.ones(4, M, dtype=torch.float64), rewards[0:4])   # an all-equal group
    got = process_advantages(torch.where(mask, rewards, torch.full_like(rewards, 7.0)), mask, K)
    expected = torch.zeros(B, M, dtype=torch.float64)
    for start in range(0, B, K):
        values = [float(rewards[i, k]) for i in range(start, start + K) for k in range(int(turns[i]))]
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        for i in range(start, start + K):
            for k in range(int(turns[i])):
                expected[i, k] = sum(0.0 if max(values) == min(values) else (float(rewards[i, j]) - mean) / (std + 1e-4)
                                     for j in range(k, int(turns[i])))
    assert torch.allclose(got, expected, atol=1e-12)
    assert bool((got[0:4] == 0).all()) and got.abs().max() > 0.5
    # one turn per episode: GRPO's group advantage
    one = process_advantages(rewards[:, :1], torch.ones(B, 1, dtype=torch.bool), K)
    assert torch.allclose(one[:, 0], group_advantages(rewards[:, 0], K), atol=1e-12)
    idx = torch.tensor([[0, 0, 1, 1, 2, -1]] * B).clamp(max=M - 1)
    assert torch.equal(token_advantages(got, idx)[:, :5], got.gather(1, idx[:, :5]))
    assert bool((token_advantages(got, idx)[:, 5] == 0).all())


def test_policy_mask_from_segments():
    assert policy_mask_from_segments([[3, 2, 1], [7, 4, 7, 5, 4]], 27).tolist() == [
        [1, 1, 1, 0, 0, 1] + [0] * 21, [1] * 7 + [0] * 4 + [1] * 7 + [0] * 5 + [1] * 4]
    for bad, width in (([[3, -1]], 5), ([[3, 4]], 5), ("3,4", 5), ([[1.5]], 5)):
        with pytest.raises(ValueError):
            policy_mask_from_segments(bad, width)


def test_bad_inputs_are_refused():
    logp, old, adv, policy, completion = _batch(2)
    with pytest.raises(ValueError, match="policy_mask"):
        multi_turn_loss(logp, old, adv, torch.ones_like(policy), completion)
    with pytest.raises(ValueError, match="advantages"):
        multi_turn_loss(logp, old, adv[:3], policy, completion)
    with pytest.raises(ValueError, match="loss_type"):
        multi_turn_loss(logp, old, adv, policy, completion, loss_type="cispo")
    with pytest.raises(ValueError, match="num_generations"):
        process_advantages(torch.zeros(6, 2), torch.ones(6, 2), 4)
    for kwargs in (dict(reward_mode="dense"), dict(num_generations=3), dict(mask_observations=False,
                                                                            observation_loss_weight=0.1)):
        with pytest.raises(ValueError):
            MultiTurnConfig(**kwargs)


@pytest.fixture(scope="module")
def small():
    tok = build_char_tokenizer()
    return make_model("tiny", tok, seed=4), tok


def test_runs_of_one_trainer_equal_each_run_alone(small):
    model, tok = small
    base = dict(per_device_train_batch_size=16, num_generations=4, max_steps=2, learning_rate=1e-3)
    configs = [MultiTurnConfig(seed=0, **base), MultiTurnConfig(seed=1, mask_observations=False, **base),
               MultiTurnConfig(seed=0, reward_mode="per_turn", observation_loss_weight=0.1, **base)]
    together = MultiTurnTrainer(model, tok, TASK, configs)
    together.train(progress=False)
    for s, c in enumerate(configs):
        alone = MultiTurnTrainer(model, tok, TASK, c)
        alone.train(progress=False)
        for a, b in zip(alone.history[0], together.history[s]):
            assert a["reward"] == b["reward"] and abs(a["loss"] - b["loss"]) < 1e-5
        for p, q in zip(alone.model_of(0).parameters(), together.model_of(s).parameters()):
            assert torch.allclose(p, q, atol=1e-5)
    with pytest.raises(ValueError, match="draws episodes differently"):
        MultiTurnTrainer(model, tok, TASK, [MultiTurnConfig(), MultiTurnConfig(max_turn_tokens=9)])


def test_evaluation_of_a_stack_equals_each_run(small):
    model, tok = small
    trainer = MultiTurnTrainer(model, tok, TASK, [MultiTurnConfig(seed=0), MultiTurnConfig(seed=1)])
    prompts = TASK.test_prompts(16)
    both = evaluate_tool_use(trainer.model, tok, TASK, prompts)
    alone = evaluate_tool_use(trainer.model_of(1), tok, TASK, prompts)
    assert both[1] == alone[0]
    episodes = rollout(model, tok, prompts, TASK.make_env, temperature=0.0)
    assert alone[0]["reward"] == float(episodes.rewards.mean())
