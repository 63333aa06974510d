"""Parity with TRL 1.16 for lesson 10b's knobs: ``top_entropy_quantile``, ``entropy_coef``,
``mask_truncated_completions`` (with the ``completions/clipped_ratio`` it logs), weighted
``reward_funcs`` and the soft overlong punishment, ``multi_objective_aggregation`` (GDPO) and
``use_adaptive_entropy``. TRL's own code is run on fixed inputs, not copied.

The loss cases hand one fixed batch (:func:`rlcourse.interop.trl_parity.fixed_completion_batch`: ragged
completions, some cut at the maximum length, ratios on both sides of the clip) to
``GRPOTrainer.compute_loss`` and to our trainer's :func:`~rlcourse.trainers.policy_gradient.loss_and_stats`,
the function both of our trainers call, and compare the loss and the gradient of every parameter.
The batch-building cases run TRL's ``_generate_and_score_completions`` with its generation replaced
by the fixed completions, and our ``PolicyGradientTrainer.make_batch`` with its sampler replaced by
the same completions.
"""
from __future__ import annotations

import itertools

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import Rollout
from rlcourse.trainers import policy_gradient
from rlcourse.trainers.policy_gradient import (PolicyGradientConfig, PolicyGradientTrainer, _Batch, logits_and_logprobs,
                                         loss_and_stats)
from rlcourse.interop.trl_parity import fixed_completion_batch, flat_grad, set_trl_grpo_loss
from rlcourse.tasks.verifiers import combine_rewards
from rlcourse.losses import group_advantages
from rlcourse.losses.rlvr import overlong_penalty

import trl  # noqa: E402  (a dependency of the project: these tests never skip)
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

# The fixed prompts, rewards and task of the GRPO parity tests: one batch for every parity file.
from test_trl_parity_grpo import K, MAX_LEN, REWARDS, _FixedTask, parity_setup  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    shared = parity_setup(tmp_path_factory)
    (trainer,) = shared.pop("trainers")
    return dict(trainer=trainer, **shared)


def _set_entropy_knobs(trainer, monkeypatch, top_entropy_quantile: float, entropy_coef: float) -> None:
    """The attributes TRL 1.16's ``_compute_loss`` reads for the two knobs (copied from its config at init)."""
    monkeypatch.setattr(trainer, "top_entropy_quantile", top_entropy_quantile)
    monkeypatch.setattr(trainer, "entropy_coef", entropy_coef)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", entropy_coef != 0.0)


def _trl_loss(trainer, b: dict, completion_mask=None):
    inputs = {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "advantages")}
    inputs["completion_mask"] = b["completion_mask"] if completion_mask is None else completion_mask
    inputs["old_per_token_logps"], inputs["ref_per_token_logps"] = b["old"], b["ref"]
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), flat_grad(trainer.model)


def _our_loss(model, b: dict, config: PolicyGradientConfig, completion_mask=None, entropy_coef=None):
    mask = b["completion_mask"] if completion_mask is None else completion_mask
    batch = _Batch(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], mask, advantages=b["advantages"],
                   old_logprobs=b["old"] * mask, ref_logprobs=b["ref"] * mask)
    model.zero_grad(set_to_none=True)
    logits, logp = logits_and_logprobs(model, batch, config.temperature)
    loss, stats = loss_and_stats(config, logits, logp, batch, MAX_LEN, entropy_coef=entropy_coef)
    loss.backward()
    return loss.detach(), flat_grad(model), stats


def _config(loss_type, beta, top_entropy_quantile=1.0, entropy_coef=0.0, **kwargs) -> PolicyGradientConfig:
    return PolicyGradientConfig(per_device_train_batch_size=len(REWARDS), num_generations=K, loss_type=loss_type,
                                beta=beta, epsilon=0.2, epsilon_high=0.28, max_completion_length=MAX_LEN,
                                top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef, **kwargs)


ENTROPY_CASES = [(t, beta, q, 0.0) for t, beta, q in itertools.product(("dapo", "grpo", "dr_grpo"), (0.0, 0.04),
                                                                       (0.2, 0.5, 0.0))]
ENTROPY_CASES += [(t, beta, 1.0, c) for t, beta, c in itertools.product(("dapo", "grpo"), (0.0, 0.04), (0.01, 0.5))]
ENTROPY_CASES += [("dapo", 0.04, 0.2, 0.1), ("grpo", 0.0, 0.5, -0.2)]


@pytest.mark.parametrize("loss_type,beta,top_entropy_quantile,entropy_coef", ENTROPY_CASES)
def test_entropy_knobs_match_trl(setup, monkeypatch, loss_type, beta, top_entropy_quantile, entropy_coef):
    trainer, b = setup["trainer"], setup["batch"]
    set_trl_grpo_loss(trainer, loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28)
    _set_entropy_knobs(trainer, monkeypatch, top_entropy_quantile, entropy_coef)
    expected_loss, expected_grad = _trl_loss(trainer, b)
    config = _config(loss_type, beta, top_entropy_quantile, entropy_coef)
    loss, grad, _ = _our_loss(trainer.model, b, config)
    assert torch.allclose(loss, expected_loss, atol=1e-6, rtol=0), (loss.item(), expected_loss.item())
    assert torch.allclose(grad, expected_grad, atol=1e-6, rtol=1e-5), (grad - expected_grad).abs().max()
    # the knob acts: the same batch without it gives another gradient
    set_trl_grpo_loss(trainer, loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28)
    _set_entropy_knobs(trainer, monkeypatch, 1.0, 0.0)
    _, plain_grad = _trl_loss(trainer, b)
    assert (plain_grad - expected_grad).abs().max() > 1e-4


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_knobs_with_truncated_rows_masked_match_trl(setup, monkeypatch, loss_type):
    """mask_truncated_completions zeroes whole rows of the loss mask; the entropy quantile is then over
    the rows that remain, in both."""
    trainer, b = setup["trainer"], setup["batch"]
    ended = (b["completion_ids"] == setup["tokenizer"].eos_token_id).any(1)
    mask = b["completion_mask"] * ended.long()[:, None]
    assert 0 < int(ended.sum()) < len(ended)
    set_trl_grpo_loss(trainer, loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28)
    _set_entropy_knobs(trainer, monkeypatch, 0.3, 0.05)
    expected_loss, expected_grad = _trl_loss(trainer, b, mask)
    loss, grad, _ = _our_loss(trainer.model, b, _config(loss_type, 0.04, 0.3, 0.05), mask)
    assert torch.allclose(loss, expected_loss, atol=1e-6, rtol=0)
    assert torch.allclose(grad, expected_grad, atol=1e-6, rtol=1e-5)


def _fixed_rollout(b: dict, rows, tokenizer) -> Rollout:
    return Rollout(prompt_ids=b["prompt_ids"], prompt_mask=b["prompt_mask"], completion_ids=b["completion_ids"],
                   completion_mask=b["completion_mask"], logprobs=torch.zeros(b["completion_ids"].shape),
                   prompts=list(rows), completions=[""] * len(rows), eos_token_id=tokenizer.eos_token_id)


def _trl_scored(trainer, rows, b, tokenizer):
    """TRL's ``_generate_and_score_completions`` on the fixed completions: only its decoding loop is
    replaced, so its own ``_generate`` decodes, measures and logs them (``completions/clipped_ratio``)."""
    completions = [ids[m.bool()].tolist() for ids, m in zip(b["completion_ids"], b["completion_mask"])]
    trainer._generate_single_turn = lambda prompt_ids, images, fields, num_generations: (completions, None)
    return trainer._generate_and_score_completions([{"prompt": p, "reward": float(r)} for p, r in zip(rows, REWARDS)])


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_completions_and_clipped_ratio_match_trl(setup, monkeypatch, mask_truncated):
    """The loss mask, advantages (truncated rows keep their place in their group's mean and std),
    ``completions/clipped_ratio``, loss and gradient of our trainer's own step equal TRL's."""
    trainer, b, tokenizer, rows = setup["trainer"], setup["batch"], setup["tokenizer"], setup["rows"]
    set_trl_grpo_loss(trainer, "dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)
    _set_entropy_knobs(trainer, monkeypatch, 1.0, 0.0)
    monkeypatch.setattr(trainer, "mask_truncated_completions", mask_truncated)
    monkeypatch.setattr(trainer, "scale_rewards", "group")
    out = _trl_scored(trainer, rows, b, tokenizer)
    trl_clipped = trainer._metrics["train"]["completions/clipped_ratio"][-1]
    model = trainer.model
    model.zero_grad(set_to_none=True)
    expected_loss = trainer.compute_loss(model, out)
    expected_loss.backward()
    expected_grad = flat_grad(model)

    monkeypatch.setattr(policy_gradient, "sample", lambda *args, **kwargs: _fixed_rollout(b, rows, tokenizer))
    ours = PolicyGradientTrainer(model, tokenizer, _FixedTask(), _config("dapo", 0.0,
                                                                        mask_truncated_completions=mask_truncated))
    batch = ours.make_batch()
    truncated = ~(b["completion_ids"] == tokenizer.eos_token_id).any(1)
    assert 0 < int(truncated.sum()) < len(truncated)
    assert torch.equal(batch.loss_mask, out["completion_mask"])
    assert bool((batch.loss_mask[truncated] == 0).all()) == mask_truncated
    assert batch.metrics["completions/clipped_ratio"] == pytest.approx(trl_clipped, abs=1e-7)
    assert trl_clipped == pytest.approx(float(truncated.float().mean()))
    assert torch.allclose(batch.advantages.double(), out["advantages"].double(), atol=1e-6, rtol=0)
    model.zero_grad(set_to_none=True)
    loss, _ = ours._loss(batch)
    loss.backward()
    assert torch.allclose(loss.detach().double(), expected_loss.detach().double(), atol=1e-6, rtol=0)
    assert torch.allclose(flat_grad(model), expected_grad, atol=1e-6, rtol=1e-5)


def test_weighted_reward_funcs_match_trl(setup, monkeypatch):
    """TRL sums ``reward_weights[i] * reward_funcs[i]``; with ``scale_rewards="none"`` its advantages are
    that sum minus its group mean, which ours must equal (rlcourse.tasks.verifiers.combine_rewards)."""
    trainer, b, tokenizer, rows = setup["trainer"], setup["batch"], setup["tokenizer"], setup["rows"]

    def first(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    def second(prompts, completions, **kwargs):
        return [1.0 if c.endswith("1") else -0.5 for c in completions]

    weights = [0.3, 2.0]
    monkeypatch.setattr(trainer, "reward_funcs", [first, second])
    monkeypatch.setattr(trainer, "reward_func_names", ["first", "second"])
    monkeypatch.setattr(trainer, "reward_processing_classes", [None, None])
    monkeypatch.setattr(trainer, "reward_weights", torch.tensor(weights))
    monkeypatch.setattr(trainer, "scale_rewards", "none")
    set_trl_grpo_loss(trainer, "dapo", beta=0.0)
    out = _trl_scored(trainer, rows, b, tokenizer)
    texts = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(b["completion_ids"], b["completion_mask"])],
                                   skip_special_tokens=True)
    total, parts = combine_rewards([first, second], rows, texts, weights)
    assert set(parts) == {"first", "second"}
    expected = group_advantages(total, K, scale_rewards="none")
    assert torch.allclose(expected.double(), out["advantages"].double(), atol=1e-6, rtol=0)
    assert expected.abs().max() > 0.1


@pytest.mark.parametrize("max_len,buffer", [(5, 2), (10, 4), (8, 8), (6, 0)])
def test_overlong_penalty_matches_trls_soft_overlong_punishment(max_len, buffer):
    lengths = list(range(0, max_len + 3))
    trl_reward = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=buffer)
    expected = torch.tensor(trl_reward([[7] * n for n in lengths]), dtype=torch.float32)
    assert torch.allclose(overlong_penalty(torch.tensor(lengths), max_len, buffer), expected, atol=1e-7, rtol=0)


# ---------------------------------------------------------------- GDPO: multi_objective_aggregation
def _two_rewards(trainer, monkeypatch, weights):
    """Two reward functions on different scales (a length, and a 1 / -0.5 mark), installed in TRL's trainer."""
    def length(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    def ends_in_one(prompts, completions, **kwargs):
        return [1.0 if c.endswith("1") else -0.5 for c in completions]

    monkeypatch.setattr(trainer, "reward_funcs", [length, ends_in_one])
    monkeypatch.setattr(trainer, "reward_func_names", ["length", "ends_in_one"])
    monkeypatch.setattr(trainer, "reward_processing_classes", [None, None])
    monkeypatch.setattr(trainer, "reward_weights", torch.tensor(weights))
    return [length, ends_in_one]


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_multi_objective_aggregation_matches_trl(setup, monkeypatch, aggregation, scale_rewards):
    """TRL's advantages from two weighted reward functions, summed then normalised or normalised then summed
    (GDPO), equal :func:`rlcourse.losses.multi_objective_advantages` on the same rewards and our trainer's own
    ``make_batch`` with a RewardedTask of the same functions."""
    from rlcourse.losses import multi_objective_advantages
    from rlcourse.tasks.verifiers import RewardedTask
    trainer, b, tokenizer, rows = setup["trainer"], setup["batch"], setup["tokenizer"], setup["rows"]
    weights = [0.3, 2.0]
    funcs = _two_rewards(trainer, monkeypatch, weights)
    monkeypatch.setattr(trainer, "multi_objective_aggregation", aggregation)
    monkeypatch.setattr(trainer, "scale_rewards", scale_rewards)
    set_trl_grpo_loss(trainer, "dapo", beta=0.0)
    expected = _trl_scored(trainer, rows, b, tokenizer)["advantages"].double()
    texts = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(b["completion_ids"], b["completion_mask"])],
                                   skip_special_tokens=True)
    _, parts = combine_rewards(funcs, rows, texts, weights)
    table = torch.stack(list(parts.values()), dim=1)
    ours = multi_objective_advantages(table, K, weights, multi_objective_aggregation=aggregation, scale_rewards=scale_rewards)
    assert torch.allclose(ours.double(), expected, atol=1e-6, rtol=0)
    assert expected.abs().max() > 0.1

    roll = _fixed_rollout(b, rows, tokenizer)
    roll.completions = texts
    monkeypatch.setattr(policy_gradient, "sample", lambda *args, **kwargs: roll)
    config = _config("dapo", 0.0, scale_rewards=scale_rewards, multi_objective_aggregation=aggregation)
    batch = PolicyGradientTrainer(trainer.model, tokenizer, RewardedTask(_FixedTask(), funcs, weights), config).make_batch()
    assert torch.allclose(batch.advantages.double(), expected, atol=1e-6, rtol=0)


def test_the_two_aggregations_differ_on_these_rewards(setup, monkeypatch):
    from rlcourse.losses import multi_objective_advantages
    table = torch.tensor([[float(n), 1.0 if n % 3 == 0 else -0.5] for n in range(16)])
    a = multi_objective_advantages(table, K, [0.3, 2.0])
    b = multi_objective_advantages(table, K, [0.3, 2.0], multi_objective_aggregation="normalize_then_sum")
    assert (a - b).abs().max() > 0.1


# ---------------------------------------------------------------- adaptive entropy control
def test_adaptive_entropy_control_matches_trl_step_by_step(setup, monkeypatch):
    """TRL's ``compute_loss`` with ``use_adaptive_entropy``, called once per optimiser step on the fixed batch
    while the target moves above and below the batch's entropy, against our loss with the controller's
    coefficient (:func:`~rlcourse.trainers.policy_gradient.entropy_coef_now` / ``entropy_coef_after``): the same
    loss and gradient at every step, and the same coefficient after it."""
    from rlcourse.trainers.policy_gradient import entropy_coef_after, entropy_coef_now
    trainer, b = setup["trainer"], setup["batch"]
    set_trl_grpo_loss(trainer, "dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)
    _set_entropy_knobs(trainer, monkeypatch, 0.5, 0.07)
    monkeypatch.setattr(trainer, "use_adaptive_entropy", True)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", True)
    monkeypatch.setattr(trainer, "_last_world_entropy", float("inf"))
    monkeypatch.setattr(trainer, "_entropy_window_stats", None)
    for name, value in (("entropy_coef_delta", 0.03), ("entropy_coef_min", 0.01), ("entropy_coef_max", 0.12)):
        monkeypatch.setattr(trainer.args, name, value)
    coef, last = 0.07, float("inf")
    seen = []
    for target in (10.0, 10.0, 10.0, 0.0, 0.0, 10.0, 0.0, 0.0, 0.0):
        monkeypatch.setattr(trainer.args, "entropy_target", target)
        expected_loss, expected_grad = _trl_loss(trainer, b)
        config = _config("dapo", 0.0, 0.5, 0.07, use_adaptive_entropy=True, entropy_target=target, entropy_coef_delta=0.03,
                         entropy_coef_min=0.01, entropy_coef_max=0.12)
        applied = entropy_coef_now(config, coef, last)
        loss, grad, stats = _our_loss(trainer.model, b, config, entropy_coef=applied)
        assert torch.allclose(loss, expected_loss, atol=1e-6, rtol=0), (target, loss.item(), expected_loss.item())
        assert torch.allclose(grad, expected_grad, atol=1e-6, rtol=1e-5)
        coef, last = entropy_coef_after(config, coef, last, stats)
        assert coef == pytest.approx(trainer.entropy_coef, abs=1e-12) and last == pytest.approx(trainer._last_world_entropy)
        seen.append((applied, coef))
    # the run visits both branches, both bounds, and the gate (a step with the bonus off)
    assert {c for _, c in seen} >= {0.12, 0.01} and 0.0 in {a for a, _ in seen} and any(a > 0 for a, _ in seen)
