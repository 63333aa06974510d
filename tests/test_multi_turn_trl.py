"""Lesson 10e against TRL 1.16: the observation mask means what TRL's ``tool_mask`` means.

Two parities, TRL's own code run on our episodes:

* the loss: ``GRPOTrainer.compute_loss`` given our episodes with ``tool_mask`` = our policy mask gives
  our masked loss and gradient (float64, 1e-6), for every clipped loss type;
* the convention: a ``GRPOTrainer`` with our rollout as its ``rollout_func`` turns the ``env_mask`` we
  return into the ``tool_mask`` it trains with, token for token, and its advantages are GRPO's of the
  environment's rewards.
"""
from __future__ import annotations

import warnings

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.interop.trl_parity import build_trl_trainer, flat_grad, set_trl_grpo_loss
from rlcourse.interop.trl_tools import (TRLCalculatorEnv, env_reward, grpo_tool_config_kwargs, trl_rollout_func)
from rlcourse.lm import load_checkpoint, save_checkpoint, sequence_logprobs
from rlcourse.lm.multi_turn import rollout
from rlcourse.losses import group_advantages
from rlcourse.losses.multi_turn import multi_turn_loss
from rlcourse.tasks.tool_env import ToolSumTask
from rlcourse.trainers.multi_turn import MultiTurnConfig

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402

TASK = ToolSumTask()
K = 4
MAX_LEN = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    save_checkpoint(model, tokenizer, path)
    # prompts of one length: TRL's forward takes no position ids, so left padding would shift GPT-2's positions
    rows = [p for p in [q for q in TASK.prompts(60, rng=0) if len(q) == 9][:4] for _ in range(K)]
    dataset = Dataset.from_dict({"prompt": rows, "env_reward": [0.0] * len(rows)})
    trainer = build_trl_trainer(trl.GRPOTrainer, trl.GRPOConfig, path, tokenizer, dataset, env_reward, path / "out",
                                num_generations=K, max_completion_length=MAX_LEN, beta=0.0)
    tools = tmp_path_factory.mktemp("tool-sum")
    save_checkpoint(*load_checkpoint("tool-sum-sft", device="cpu"), tools)      # a model that calls the tool
    return dict(path=path, tools=tools, tokenizer=tokenizer, rows=rows, trainer=trainer)


def _episodes_with_calls(model, tokenizer, rows):
    """Sampled episodes; the test then writes a calculator trace into every other row."""
    return rollout(model, tokenizer, rows, TASK.make_env, max_completion_length=MAX_LEN,
                   generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_loss_with_our_policy_mask_as_tool_mask_is_our_masked_loss(setup, loss_type):
    trainer, tok = setup["trainer"], setup["tokenizer"]
    model = trainer.model
    ep = _episodes_with_calls(model, tok, setup["rows"])
    # make sure the batch holds observations: write a calculator trace into every other row
    policy, completion = ep.policy_mask.clone(), ep.completion_mask.clone()
    ids = ep.completion_ids.clone()
    trace = tok("(1+2)=3;(3+4)=7;7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    mask = [1] * 5 + [0] * 3 + [1] * 5 + [0] * 3 + [1] * 2
    width = max(ids.shape[1], len(trace))
    pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], width - t.shape[1]), v, dtype=t.dtype)], 1)  # noqa: E731
    ids, policy, completion = pad(ids, tok.pad_token_id), pad(policy, 0), pad(completion, 0)
    for b in range(0, len(setup["rows"]), 2):
        ids[b] = tok.pad_token_id
        ids[b, :len(trace)], policy[b], completion[b] = torch.tensor(trace), 0, 0
        policy[b, :len(trace)], completion[b, :len(trace)] = torch.tensor(mask), 1
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = sequence_logprobs(model, ep.prompt_ids, ids, completion, ep.prompt_mask)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype)) * completion
    advantages = torch.randn(len(setup["rows"]), generator=gen, dtype=current.dtype)
    set_trl_grpo_loss(trainer, loss_type, beta=0.0, epsilon=0.2, epsilon_high=0.28)
    inputs = dict(prompt_ids=ep.prompt_ids, prompt_mask=ep.prompt_mask, completion_ids=ids, completion_mask=completion,
                  advantages=advantages, old_per_token_logps=old, tool_mask=policy,
                  num_items_in_batch=(completion * policy).sum())
    model.zero_grad(set_to_none=True)
    expected = trainer.compute_loss(model, inputs)
    expected.backward()
    expected_grad = flat_grad(model)
    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, ep.prompt_ids, ids, completion, ep.prompt_mask)
    loss = multi_turn_loss(logprobs, old, advantages, policy, completion, loss_type=loss_type, epsilon=0.2,
                           epsilon_high=0.28, max_completion_length=MAX_LEN)
    loss.backward()
    assert (completion - policy).sum() > 10          # observations are there
    assert torch.allclose(loss.detach(), expected.detach(), atol=1e-6, rtol=0)
    assert torch.allclose(flat_grad(model), expected_grad, atol=1e-6, rtol=1e-5)
    # and TRL without the tool mask trains on the observations too: our unmasked loss
    del inputs["tool_mask"]
    inputs["num_items_in_batch"] = completion.sum()
    unmasked = trainer.compute_loss(model, inputs)
    ours = multi_turn_loss(logprobs, old, advantages, policy, completion, mask_observations=False, loss_type=loss_type,
                           epsilon=0.2, epsilon_high=0.28, max_completion_length=MAX_LEN)
    assert torch.allclose(ours.detach(), unmasked.detach(), atol=1e-6, rtol=0)


def test_trl_trains_with_the_env_mask_our_rollout_returns(setup):
    tok, rows = setup["tokenizer"], setup["rows"]
    args = trl.GRPOConfig(output_dir=str(setup["path"] / "rf"), use_cpu=True, bf16=False, report_to=[],
                          disable_tqdm=True, per_device_train_batch_size=len(rows), num_generations=K,
                          max_completion_length=MAX_LEN, beta=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(model=str(setup["tools"]), reward_funcs=env_reward, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": rows}), processing_class=tok,
                                  rollout_func=trl_rollout_func(TASK, seed=0, max_completion_length=MAX_LEN))
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"prompt": p} for p in rows])
    # the same episodes, rolled out by us with the same seed
    ep = rollout(trainer.model, tok, rows, TASK.make_env, max_completion_length=MAX_LEN,
                 generator=torch.Generator().manual_seed(0))
    T = ep.completion_ids.shape[1]
    assert torch.equal(out["completion_mask"][:, :T].cpu(), ep.completion_mask)
    assert torch.equal((out["tool_mask"] * out["completion_mask"])[:, :T].cpu(), ep.policy_mask)
    assert torch.equal(out["completion_ids"][:, :T][ep.completion_mask.bool()], ep.completion_ids[ep.completion_mask.bool()])
    assert torch.allclose(out["advantages"].cpu().float(), group_advantages(ep.rewards, K), atol=1e-4)
    assert ep.tool_calls.sum() > 0 and (ep.completion_mask - ep.policy_mask).sum() > 0


def test_environment_factory_needs_a_tool_aware_chat_template(setup):
    env = TRLCalculatorEnv()
    assert env.reset(prompt="12+34+56=") is None and env.calc(12, 34) == "46" and env.calls == 1
    from transformers.utils import get_json_schema
    schema = get_json_schema(TRLCalculatorEnv.calc)
    assert schema["function"]["name"] == "calc" and set(schema["function"]["parameters"]["properties"]) == {"a", "b"}
    args = trl.GRPOConfig(output_dir=str(setup["path"] / "ef"), use_cpu=True, bf16=False, report_to=[],
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=MAX_LEN)
    with warnings.catch_warnings(), pytest.raises((ValueError, ImportError)) as refused:
        warnings.simplefilter("ignore")
        trl.GRPOTrainer(model=str(setup["path"]), reward_funcs=env_reward, args=args, processing_class=setup["tokenizer"],
                        train_dataset=Dataset.from_dict({"prompt": ["1+2+3="] * 4}), environment_factory=TRLCalculatorEnv)
    assert "chat template" in str(refused.value) or "transformers" in str(refused.value)


def test_config_maps_to_grpo_config():
    kwargs = grpo_tool_config_kwargs(MultiTurnConfig(max_tool_calling_iterations=2))
    config = trl.GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to=[], **kwargs)
    assert config.max_tool_calling_iterations == 2 and config.beta == 0.0 and config.num_iterations == 1
    for bad in (dict(mask_observations=False), dict(observation_loss_weight=0.1), dict(reward_mode="per_turn")):
        with pytest.raises(ValueError, match="TRL"):
            grpo_tool_config_kwargs(MultiTurnConfig(**bad))
