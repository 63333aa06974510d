"""Parity with TRL 1.16: our GRPO/RLOO advantages, per-token losses, losses and gradients equal what
TRL's own GRPOTrainer and RLOOTrainer compute on the same fixed inputs (their code is run, not copied).

RLOO with ``beta > 0`` (TRL puts the k1 KL in the reward) goes through our trainer's own
``make_batch`` and loss, with sampling replaced by the fixed completions.

One trainer per module (building one takes about a second); each case sets the trainer's
attributes that TRL's ``_compute_loss`` reads (``loss_type``, ``importance_sampling_level``,
``beta``, ``epsilon_low``/``epsilon_high``), then compares. The batch, the trainers' set-up and both
sides of the GRPO comparison are :mod:`rlcourse.interop.trl_parity`, which lesson 13 runs too.
"""
from __future__ import annotations

import itertools
import warnings

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import load_checkpoint, save_checkpoint, sequence_logprobs
from rlcourse.interop.trl_parity import (build_trl_trainer, fixed_completion_batch, flat_grad as _grads,
                                    rlcourse_grpo_loss, set_trl_grpo_loss, trl_grpo_loss)
from rlcourse.losses import GRPO_LOSS_TYPES as LOSS_TYPES, group_advantages, leave_one_out_advantages, rloo_loss

import trl  # noqa: E402  (a dependency of the project: these tests never skip)
from datasets import Dataset  # noqa: E402

PROMPTS = ["12+34=", "56+78=", "90+12=", "33+44="]       # one length: no left padding
K = 4
MAX_LEN = 5
REWARDS = torch.tensor([0.0, 1.0, 1.0, 0.0,   0.25, 0.25, 0.25, 0.25,   1.0, 0.5, 0.0, 0.75,   1.0, 1.0, 0.0, 1.0])


def _reward_column(completions, reward, **kwargs):
    return list(reward)


def parity_setup(tmp_path_factory, classes=((trl.GRPOTrainer, trl.GRPOConfig),)):
    """The set-up every parity file shares: the tiny checkpoint saved to a temporary folder, one TRL
    trainer per (trainer, config) class pair on the fixed prompts and rewards (beta 0.04), and one
    fixed batch of completions of varied lengths (1..MAX_LEN tokens, some ending in <eos>, some cut)."""
    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    save_checkpoint(model, tokenizer, path)
    rows = [p for p in PROMPTS for _ in range(K)]
    dataset = Dataset.from_dict({"prompt": rows, "reward": REWARDS.tolist()})
    trainers = [build_trl_trainer(trainer, config, path, tokenizer, dataset, _reward_column, path / "out",
                                  num_generations=K, max_completion_length=MAX_LEN, beta=0.04)
                for trainer, config in classes]
    batch = fixed_completion_batch(trainers[0].model, tokenizer, rows, MAX_LEN, seed=0)
    return dict(trainers=trainers, batch=batch, tokenizer=tokenizer, rows=rows)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # float64: our forward (rlcourse.lm.fast_gpt2) and transformers' round differently in float32
    # (~1e-6 relative); in float64 what is left (~1e-7) is TRL's float32 log-probs (its fused head).
    shared = parity_setup(tmp_path_factory, ((trl.GRPOTrainer, trl.GRPOConfig), (trl.RLOOTrainer, trl.RLOOConfig)))
    grpo, rloo = shared.pop("trainers")
    return dict(grpo=grpo, rloo=rloo, **shared)


CASES = [(t, lvl, 0.0, True) for t, lvl in itertools.product(LOSS_TYPES, ("token", "sequence"))]
CASES += [(t, lvl, 0.04, corr) for t, lvl, corr in itertools.product(("grpo", "dapo"), ("token", "sequence"),
                                                                   (True, False))]


@pytest.mark.parametrize("loss_type,level,beta,bias_correction", CASES)
def test_grpo_loss_and_gradient_match_trl(setup, loss_type, level, beta, bias_correction):
    trainer, b = setup["grpo"], setup["batch"]
    settings = dict(importance_sampling_level=level, beta=beta, epsilon=0.2,
                    epsilon_high=5.0 if loss_type == "cispo" else 0.28, use_bias_correction_kl=bias_correction)
    set_trl_grpo_loss(trainer, loss_type, **settings)
    expected_loss, expected_grad = trl_grpo_loss(trainer, b)
    loss, grad = rlcourse_grpo_loss(trainer.model, b, loss_type, **settings)
    assert torch.allclose(loss.detach(), expected_loss, atol=1e-6, rtol=0), (loss.item(), expected_loss.item())
    assert torch.allclose(grad, expected_grad, atol=1e-6, rtol=1e-5)
    assert expected_grad.abs().max() > 1e-4          # a real gradient, not two zeros


def _trl_advantages(trainer, rows, completion_ids, completion_mask, tokenizer):
    """Run TRL's _generate_and_score_completions with generation replaced by our fixed completions."""
    prompt_ids = [tokenizer(r)["input_ids"] for r in rows]
    completions = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    if isinstance(trainer, trl.GRPOTrainer):
        trainer._generate = lambda prompts: (prompt_ids, completions, None, texts, None, {}, None, None)
    else:
        trainer._generate = lambda prompts: (prompt_ids, completions, texts)
    inputs = [{"prompt": p, "reward": float(r)} for p, r in zip(rows, REWARDS)]
    out = trainer._generate_and_score_completions(inputs)
    return out


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_trl(setup, scale_rewards):
    trainer, b = setup["grpo"], setup["batch"]
    trainer.scale_rewards, trainer.beta = scale_rewards, 0.0
    out = _trl_advantages(trainer, setup["rows"], b["completion_ids"], b["completion_mask"], setup["tokenizer"])
    ours = group_advantages(REWARDS, K, scale_rewards=scale_rewards)
    assert torch.allclose(ours, out["advantages"], atol=1e-6, rtol=0)
    assert ours.abs().max() > 0.5


def test_rloo_advantages_loss_and_gradient_match_trl(setup):
    trainer, b = setup["rloo"], setup["batch"]
    trainer.beta = 0.0
    out = _trl_advantages(trainer, setup["rows"], b["completion_ids"], b["completion_mask"], setup["tokenizer"])
    assert torch.allclose(leave_one_out_advantages(REWARDS, K), out["advantages"], atol=1e-6, rtol=0)

    trainer.epsilon_low, trainer.epsilon_high = 0.2, 0.28
    old_logps = (b["old"] * b["completion_mask"]).sum(1)
    inputs = {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs["old_logps"] = old_logps
    model = trainer.model
    model.zero_grad(set_to_none=True)
    expected = trainer.compute_loss(model, inputs)
    expected.backward()
    expected_grad = _grads(model)

    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, b["prompt_ids"], b["completion_ids"], b["completion_mask"], b["prompt_mask"])
    loss = rloo_loss(logprobs, b["old"], b["advantages"], b["completion_mask"], epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    assert torch.allclose(loss.detach(), expected.detach(), atol=1e-6, rtol=0)
    assert torch.allclose(_grads(model), expected_grad, atol=1e-6, rtol=1e-5)
    assert expected_grad.abs().max() > 1e-4


class _FixedTask:
    """The parity batch as a task: the fixture's prompts and rewards, whatever was sampled."""

    max_new_tokens = MAX_LEN

    def prompts(self, n, rng=None):
        return PROMPTS[:n]

    def reward(self, prompts, completions):
        return REWARDS.clone()


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_rloo_kl_in_reward_matches_trl(setup, monkeypatch, request, mask_truncated):
    """beta > 0: TRL's RLOOTrainer subtracts beta * sum_t (log pi_old - log pi_ref) from each reward
    before the leave-one-out baseline. Our trainer's own path (make_batch, then its loss) on the same
    completions must give the same shaped rewards, advantages, loss and gradients."""
    import trl.trainer.rloo_trainer as rloo_module

    from rlcourse.lm import Rollout
    from rlcourse.trainers import policy_gradient
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer

    trainer, b, tokenizer = setup["rloo"], setup["batch"], setup["tokenizer"]
    beta = 0.1
    # TRL's own reference model plus fixed noise, put back afterwards: a reference that differs from
    # the policy. (Not a copy: TRL patches its models' forward, and a deepcopy keeps calling the original.)
    ref = trainer.ref_model
    saved = {k: v.clone() for k, v in ref.state_dict().items()}
    request.addfinalizer(lambda: ref.load_state_dict(saved))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    monkeypatch.setattr(trainer, "beta", beta)
    monkeypatch.setattr(trainer, "mask_truncated_completions", mask_truncated)
    monkeypatch.setattr(trainer, "epsilon_low", 0.2)
    monkeypatch.setattr(trainer, "epsilon_high", 0.28)
    # TRL hands the per-sequence KL to accelerate's gather before subtracting it: record it there.
    gathered, real_gather = [], rloo_module.gather
    monkeypatch.setattr(rloo_module, "gather", lambda t: gathered.append(t.clone()) or real_gather(t))
    out = _trl_advantages(trainer, setup["rows"], b["completion_ids"], b["completion_mask"], tokenizer)
    trl_kl = next(t for t in gathered if t.ndim == 1)
    model = trainer.model
    model.zero_grad(set_to_none=True)
    expected_loss = trainer.compute_loss(model, out)
    expected_loss.backward()
    expected_grad = _grads(model)

    rollout = Rollout(prompt_ids=b["prompt_ids"], prompt_mask=b["prompt_mask"], completion_ids=b["completion_ids"],
                      completion_mask=b["completion_mask"], logprobs=torch.zeros(b["completion_ids"].shape),
                      prompts=setup["rows"], completions=[""] * len(setup["rows"]),
                      eos_token_id=tokenizer.eos_token_id)
    monkeypatch.setattr(policy_gradient, "sample", lambda *args, **kwargs: rollout)
    ours = PolicyGradientTrainer(model, tokenizer, _FixedTask(), PolicyGradientConfig(
        per_device_train_batch_size=len(setup["rows"]), num_generations=K, max_completion_length=MAX_LEN,
        advantage_estimator="rloo", loss_type="rloo", kl_in_reward=True, beta=beta, epsilon=0.2, epsilon_high=0.28,
        mask_truncated_completions=mask_truncated), ref_model=ref)
    batch = ours.make_batch()
    assert torch.equal(batch.loss_mask, out["completion_mask"])
    assert torch.allclose(batch.rewards.double(), REWARDS.double() - beta * trl_kl.double(), atol=1e-6, rtol=0)
    assert torch.allclose(batch.advantages.double(), out["advantages"].double(), atol=1e-6, rtol=0)
    model.zero_grad(set_to_none=True)
    loss, _ = ours._loss(batch)
    loss.backward()
    assert torch.allclose(loss.detach().double(), expected_loss.detach().double(), atol=1e-6, rtol=0)
    assert torch.allclose(_grads(model), expected_grad, atol=1e-6, rtol=1e-5)
    # the penalty is real: it moved the advantages away from beta = 0's, and the gradient is not zero
    assert (out["advantages"] - leave_one_out_advantages(REWARDS, K)).abs().max() > 1e-2
    assert trl_kl.abs().max() > 0.1 and expected_grad.abs().max() > 1e-4


def test_frozen_copy_of_a_trl_prepared_model_runs_its_own_weights(setup):
    """accelerate patches an instance ``forward`` bound to the original model; a plain deepcopy keeps
    calling it, so a "reference" made that way returns the policy's outputs (a KL of 0, silently).
    ``frozen_copy`` (every trainer's default reference) must compute with its own weights."""
    import copy

    from rlcourse.lm import frozen_copy

    model, ids = setup["grpo"].model, setup["batch"]["prompt_ids"]
    naive, reference = copy.deepcopy(model), frozen_copy(model)
    with torch.no_grad():
        for m in (naive, reference):
            for p in m.parameters():
                p.add_(0.1)
        base = model(input_ids=ids).logits
        assert torch.equal(naive(input_ids=ids).logits, base)            # the trap, as TRL 1.16 prepares models
        ours = reference(input_ids=ids).logits
        assert not torch.allclose(ours, base)
        assert torch.equal(ours, type(reference).forward(reference, input_ids=ids).logits)
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())


@pytest.mark.parametrize("accumulation", [1, 2])
def test_bridge_max_steps_samples_as_many_batches_in_trl_as_ours(tmp_path, accumulation):
    """TRL counts optimiser steps: with num_iterations=2 our max_steps=2 (2 batches, 4 optimiser
    steps) must make TRL draw 2 generation batches too, of our batch size, also when the batch is
    accumulated over 2 slices (steps_per_generation = gradient_accumulation_steps, TRL's default).
    Counted by TRL's own calls of the reward."""
    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.interop.trl_bridge import grpo_config_kwargs

    path = tmp_path / "tiny"
    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    save_checkpoint(model, tokenizer, path)
    calls = []

    def reward(completions, **kwargs):
        calls.append(len(completions))
        return [0.0] * len(completions)

    ours = PolicyGradientConfig(per_device_train_batch_size=8, num_generations=4, num_iterations=2, max_steps=2,
                                max_completion_length=2)
    kwargs = grpo_config_kwargs(ours, AdditionTask())
    assert kwargs["max_steps"] == 4
    kwargs.update(per_device_train_batch_size=ours.per_device_train_batch_size // accumulation,
                  gradient_accumulation_steps=accumulation)
    data = Dataset.from_dict({"prompt": [p for p in PROMPTS for _ in range(4)]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(model=str(path), reward_funcs=reward, train_dataset=data, processing_class=tokenizer,
                                  args=trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False,
                                                      report_to=[], disable_tqdm=True, save_strategy="no", **kwargs))
        trainer.train()
    assert trainer.state.global_step == ours.max_steps * ours.num_iterations
    assert calls == [ours.per_device_train_batch_size] * ours.max_steps
