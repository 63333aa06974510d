"""Every route to an answer that a learner could import is a reference of its check, and the grader flags it.

A check's ``references`` (``@references(...)``, grouped in :mod:`rlcourse.grading._routes`) are the library
functions that compute its answer under any name and its own module's reference helpers; under
``python -m rlcourse grade`` each is a tripwire in the process that runs the answer. Three layers:

* statically, every check names its references, its module's reference helpers among them, and each
  name resolves;
* for each check, an answer that calls every one of its references, in the worker the grader starts,
  finds each of them a tripwire (a name that silently failed to become one would open a route);
* the cheats tried on the GRPO, RLOO and DPO step exercises (the grading module's own reference step,
  the course trainer's loss or step, the library's loss pieces, DPO under other names: lesson 08's
  Bradley-Terry loss on beta-scaled margins, SimPO with a zero margin, cDPO and R-DPO at 0...), each
  written to compute the right answer, are graded as ``reference``.
"""
import importlib
import inspect
import re
import sys

import cloudpickle
import pytest

import rlcourse  # noqa: F401  (before torch)
import rlcourse.grading as grading
from rlcourse.grading import _routes
from rlcourse.tools import grade_runner

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the answers below travel by value

CHECKS = sorted(name for name in grading.__all__ if name.startswith("check_"))


def _module_of(check: str):
    return sys.modules[getattr(grading, check).__module__]


# --------------------------------------------------------------------------------- statically
@pytest.mark.parametrize("check", CHECKS)
def test_every_check_names_its_references_and_its_modules_reference_helpers(check):
    references = getattr(getattr(grading, check), "references", None)
    assert references is not None, f"{check} has no @references(...)"
    module = _module_of(check)
    helpers = _routes.helpers_of(module.__name__)
    assert set(helpers) <= set(references)
    for ref in references:
        assert callable(grade_runner.resolve(ref)), ref


@pytest.mark.parametrize("module", sorted({_module_of(c).__name__ for c in CHECKS} | {"rlcourse.grading._steps"}))
def test_a_reference_helper_of_a_grading_module_is_listed(module):
    """A helper named for what it is (``_reference_update``, ``_batch_td_reference``) is a reference helper:
    it must be in ``_routes.REFERENCE_HELPERS``, which adds it to every check of its module."""
    functions = {name for name, obj in vars(importlib.import_module(module)).items()
                 if inspect.isfunction(inspect.unwrap(obj)) and getattr(obj, "__module__", None) == module
                 and not name.startswith("check_")}
    named = {name for name in functions if re.search(r"(?<![a-z])reference", name)}
    listed = set(_routes.REFERENCE_HELPERS.get(module.rpartition(".")[2], ()))
    assert named <= listed, sorted(named - listed)
    assert listed <= functions, sorted(listed - functions)


# --------------------------------------------------------------------------------- every reference fires
def calls_every_reference(references):
    """An answer that calls each of ``references`` and returns those that did not stop it as a tripwire."""
    def answer(*args, **kwargs):
        import importlib

        missed = []
        for target in references:
            module, _, qualname = target.partition(":")
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            try:
                obj()
            except BaseException as e:  # noqa: BLE001
                if type(e).__name__ != "ReferenceUsed":
                    missed.append(f"{target} ({type(e).__name__})")
            else:
                missed.append(f"{target} (ran)")
        return missed
    return answer


@pytest.mark.parametrize("check", CHECKS)
def test_each_reference_of_a_check_is_a_tripwire_under_the_grader(check, tmp_path):
    references = getattr(grading, check).references
    path = tmp_path / "answer.pkl"
    with open(path, "wb") as f:
        cloudpickle.dump(((calls_every_reference(references),), {}), f)
    session = grade_runner.Session(str(path), {r: r for r in references}, timeout=120)
    try:
        missed = session.answer()
        tripped = set(session.tripped())
    finally:
        session.close()
    assert missed == []
    # references that are one function under two names (rlcourse.losses re-exports) report one of them
    by_object = {}
    for r in references:
        by_object.setdefault(id(inspect.unwrap(grade_runner.resolve(r))), set()).add(r)
    assert all(names & tripped for names in by_object.values()), sorted(set(references) - tripped)


# --------------------------------------------------------------------------------- the cheats
# Each computes the exercise's answer through a route a learner could import; none writes the update.

def _group(prompts, num_generations):
    return [p for p in prompts for _ in range(num_generations)]


def grpo_step_calling_the_graders_reference(model, optimizer, tokenizer, task, prompts, generator, num_generations=8,
                                            loss_type="dapo", epsilon=0.2, epsilon_high=None):
    from rlcourse.grading.llm.lesson10 import _reference_update
    return _reference_update(model, optimizer, tokenizer, task, prompts, generator, num_generations, loss_type,
                             epsilon, epsilon_high)[0]


def _sampled(model, tokenizer, task, prompts, generator, num_generations, temperature=1.0):
    from rlcourse.lm import sample

    group = _group(prompts, num_generations)
    roll = sample(model, tokenizer, group, task.max_new_tokens, temperature=temperature, generator=generator)
    return group, roll, task.reward(group, roll.completions).float()


def _own_group_advantages(rewards, num_generations):
    import torch

    grouped = rewards.double().view(-1, num_generations)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    same = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    return torch.where(same, torch.zeros_like(adv), adv).reshape(-1).float()


def grpo_step_with_the_trainers_loss(model, optimizer, tokenizer, task, prompts, generator, num_generations=8,
                                     loss_type="dapo", epsilon=0.2, epsilon_high=None):
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer, _Batch

    group, roll, rewards = _sampled(model, tokenizer, task, prompts, generator, num_generations)
    config = PolicyGradientConfig(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high,
                                  num_generations=num_generations, per_device_train_batch_size=len(group))
    trainer = PolicyGradientTrainer(model, tokenizer, task, config, optimizer=optimizer)
    batch = _Batch(roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask,
                   advantages=_own_group_advantages(rewards, num_generations), old_logprobs=roll.logprobs)
    loss, _ = trainer._loss(batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


def grpo_step_with_the_trainers_step(model, optimizer, tokenizer, task, prompts, generator, num_generations=8,
                                     loss_type="dapo", epsilon=0.2, epsilon_high=None):
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer

    config = PolicyGradientConfig(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, max_grad_norm=None,
                                  num_generations=num_generations, per_device_train_batch_size=len(prompts) * num_generations)
    trainer = PolicyGradientTrainer(model, tokenizer, task, config, optimizer=optimizer)
    trainer.generator = generator
    trainer.task = type("Fixed", (), {"prompts": lambda self, n, rng=None: list(prompts), "reward": task.reward,
                                      "max_new_tokens": task.max_new_tokens})()
    return trainer.step()["reward"]


def grpo_step_from_the_librarys_pieces(model, optimizer, tokenizer, task, prompts, generator, num_generations=8,
                                       loss_type="dapo", epsilon=0.2, epsilon_high=None):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.losses import aggregate_loss, group_advantages, per_token_loss

    group, roll, rewards = _sampled(model, tokenizer, task, prompts, generator, num_generations)
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    mask = roll.completion_mask
    per_token = per_token_loss(logp, roll.logprobs, group_advantages(rewards, num_generations), mask, loss_type,
                               epsilon, epsilon_high)
    loss = aggregate_loss(per_token, mask, loss_type, task.max_new_tokens)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


def grpo_step_with_ppos_clipped_objective(model, optimizer, tokenizer, task, prompts, generator, num_generations=8,
                                          loss_type="dapo", epsilon=0.2, epsilon_high=None):
    import torch

    from rlcourse.lm import sequence_logprobs
    from rlcourse.losses import ppo_clip_objective

    group, roll, rewards = _sampled(model, tokenizer, task, prompts, generator, num_generations)
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    m = roll.completion_mask.float()
    ratio = torch.exp(logp - roll.logprobs)
    adv = _own_group_advantages(rewards, num_generations)[:, None].expand_as(logp)
    per_token = -ppo_clip_objective(ratio, adv, epsilon, epsilon_high) * m
    loss = ((per_token.sum(1) / m.sum(1)).mean() if loss_type == "grpo" else
            per_token.sum() / m.sum() if loss_type == "dapo" else per_token.sum() / (len(group) * task.max_new_tokens))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


def grpo_update_calling_the_graders_reference(model, optimizer, tokenizer, task, prompts, generator, num_generations=8,
                                              temperature=0.7, num_iterations=2, epsilon=0.2):
    from rlcourse.grading.llm.lesson10 import _reference_update
    return _reference_update(model, optimizer, tokenizer, task, prompts, generator, num_generations, "dapo", epsilon,
                             None, temperature, num_iterations)[1]


def rloo_step_calling_the_graders_reference(model, optimizer, tokenizer, task, prompts, generator, num_generations=8):
    from rlcourse.grading.llm.lesson09 import _reference_rloo_step
    return _reference_rloo_step(model, optimizer, tokenizer, task, prompts, generator, num_generations)[0]


def _loo(rewards, K):
    grouped = rewards.double().view(-1, K)
    return (grouped - (grouped.sum(1, keepdim=True) - grouped) / (K - 1)).reshape(-1).float()


def rloo_step_with_the_librarys_rloo_loss(model, optimizer, tokenizer, task, prompts, generator, num_generations=8):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.losses import rloo_loss

    group, roll, rewards = _sampled(model, tokenizer, task, prompts, generator, num_generations)
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    loss = rloo_loss(logp, logp.detach(), _loo(rewards, num_generations), roll.completion_mask)   # ratio 1: REINFORCE
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


def rloo_step_with_the_trainers_loss(model, optimizer, tokenizer, task, prompts, generator, num_generations=8):
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, _Batch, logits_and_logprobs, loss_and_stats

    group, roll, rewards = _sampled(model, tokenizer, task, prompts, generator, num_generations)
    config = PolicyGradientConfig(loss_type="rloo", advantage_estimator="rloo", num_generations=num_generations,
                                  per_device_train_batch_size=len(group))
    batch = _Batch(roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask,
                   advantages=_loo(rewards, num_generations))
    logits, logp = logits_and_logprobs(model, batch, 1.0)
    loss, _ = loss_and_stats(config, logits, logp, batch, task.max_new_tokens)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


def rloo_kl_step_calling_the_graders_reference(model, optimizer, tokenizer, task, prompts, generator, num_generations,
                                               ref_model, beta):
    from rlcourse.grading.llm.lesson09 import _reference_rloo_kl_step
    return _reference_rloo_kl_step(model, optimizer, tokenizer, task, prompts, generator, num_generations, ref_model,
                                   beta)[0]


def rloo_kl_step_with_ppo_rlhfs_shaped_rewards(model, optimizer, tokenizer, task, prompts, generator, num_generations,
                                               ref_model, beta):
    import torch

    from rlcourse.lm import sequence_logprobs
    from rlcourse.trainers.ppo_rlhf import kl_shaped_rewards

    group, roll, task_rewards = _sampled(model, tokenizer, task, prompts, generator, num_generations)
    mask = roll.completion_mask
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask)
    with torch.no_grad():
        ref = sequence_logprobs(ref_model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask)
    shaped, _ = kl_shaped_rewards(task_rewards, logp.detach(), ref, mask, beta)       # r - beta k1, per token
    loss = -(_loo(shaped.sum(1), num_generations) * logp.sum(1)).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(task_rewards.mean())


def _dpo_logps(model, ref_model, batch):
    import torch

    from rlcourse.lm import sequence_logprobs

    args = (batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"], batch["prompt_mask"])
    chosen, rejected = sequence_logprobs(model, *args).sum(-1).chunk(2)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logprobs(ref_model, *args).sum(-1).chunk(2)
    return chosen - ref_chosen, rejected - ref_rejected, chosen, rejected, ref_chosen, ref_rejected


def _stepped(optimizer, loss):
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def dpo_step_calling_the_graders_reference(model, ref_model, optimizer, batch, beta):
    from rlcourse.grading.llm.lesson11 import _reference_dpo_step
    return _reference_dpo_step(model, ref_model, optimizer, batch, beta)


def dpo_step_with_bradley_terry_on_scaled_margins(model, ref_model, optimizer, batch, beta):
    from rlcourse.losses import bradley_terry_loss
    w, l, *_ = _dpo_logps(model, ref_model, batch)
    return _stepped(optimizer, bradley_terry_loss(beta * w, beta * l))


def dpo_step_with_simpo_at_a_zero_margin(model, ref_model, optimizer, batch, beta):
    from rlcourse.losses import simpo_loss
    w, l, *_ = _dpo_logps(model, ref_model, batch)
    return _stepped(optimizer, simpo_loss(w, l, beta, 0.0).mean())


def dpo_step_with_conservative_dpo_at_zero(model, ref_model, optimizer, batch, beta):
    from rlcourse.losses.dpo import conservative_dpo_loss
    _, _, *logps = _dpo_logps(model, ref_model, batch)
    return _stepped(optimizer, conservative_dpo_loss(*logps, beta, 0.0).mean())


def dpo_step_with_rdpo_at_zero(model, ref_model, optimizer, batch, beta):
    import torch

    from rlcourse.losses import rdpo_loss
    _, _, *logps = _dpo_logps(model, ref_model, batch)
    zeros = torch.zeros_like(logps[0])
    return _stepped(optimizer, rdpo_loss(*logps, zeros, zeros, beta, 0.0).mean())


def dpo_step_with_the_trainers_batch_loss(model, ref_model, optimizer, batch, beta):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.trainers.dpo import DPOConfig, batch_loss

    _, _, _, _, ref_chosen, ref_rejected = _dpo_logps(model, ref_model, batch)
    tokens = sequence_logprobs(model, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"],
                               batch["prompt_mask"])
    loss, _, _ = batch_loss(DPOConfig(beta=beta), *tokens.chunk(2), batch["completion_mask"], ref_chosen, ref_rejected)
    return _stepped(optimizer, loss)


def dpo_loss_with_bradley_terry_pair_by_pair(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    import torch

    from rlcourse.losses import bradley_terry_loss
    w, l = beta * (chosen_logps - ref_chosen_logps), beta * (rejected_logps - ref_rejected_logps)
    return torch.stack([bradley_terry_loss(w[i:i + 1], l[i:i + 1]) for i in range(len(w))])


def dpo_loss_with_simpo_at_a_zero_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    from rlcourse.losses import simpo_loss
    return simpo_loss(chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps, beta, 0.0)


def online_dpo_step_calling_the_graders_round(model, ref_model, optimizer, tokenizer, prompts, reward_fn, generator,
                                              num_generations=2, beta=0.1, temperature=1.0, max_new_tokens=8):
    from rlcourse.grading.llm.lesson11b import _online_round
    return _online_round(model, ref_model, optimizer, tokenizer, prompts, reward_fn, generator, num_generations, beta,
                         temperature, max_new_tokens)[:2]


def train_online_dpo_calling_the_graders_run(model, optimizer, tokenizer, prompt_batches, reward_fn, generator,
                                             num_generations=2, beta=0.1, max_new_tokens=8, ref_model=None):
    from rlcourse.grading.llm.lesson11b import _reference_online_dpo
    return _reference_online_dpo(model, optimizer, tokenizer, prompt_batches, reward_fn, generator, num_generations,
                                 beta, max_new_tokens)


def train_online_dpo_with_the_trainer(model, optimizer, tokenizer, prompt_batches, reward_fn, generator,
                                      num_generations=2, beta=0.1, max_new_tokens=8, ref_model=None):
    from rlcourse.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    batches = iter(prompt_batches)
    args = OnlineDPOConfig(beta=beta, num_generations=num_generations, max_new_tokens=max_new_tokens,
                           per_device_train_batch_size=len(prompt_batches[0]), max_steps=len(prompt_batches))
    trainer = OnlineDPOTrainer(model, tokenizer, reward_fn, lambda n, seed=None: list(next(batches)), args,
                               ref_model=ref_model)
    trainer.optimizer, trainer.generators = optimizer, [generator]
    return [{"loss": h["loss"], "objective/kl": h["objective/kl"], "objective/scores": h["objective/scores"]}
            for h in trainer.train(progress=False)[0]]


CHEATS = [
    ("check_grpo_step", grpo_step_calling_the_graders_reference, "rlcourse.grading.llm.lesson10:_reference_update"),
    ("check_grpo_step", grpo_step_with_the_trainers_loss, "PolicyGradientTrainer._loss"),
    ("check_grpo_step", grpo_step_with_the_trainers_step, "PolicyGradientTrainer.step"),
    ("check_grpo_step", grpo_step_from_the_librarys_pieces, "rlcourse.losses.grpo:group_advantages"),
    ("check_grpo_step", grpo_step_with_ppos_clipped_objective, "rlcourse.losses.policy_gradient:ppo_clip_objective"),
    ("check_grpo_update", grpo_update_calling_the_graders_reference, "rlcourse.grading.llm.lesson10:_reference_update"),
    ("check_rloo_step", rloo_step_calling_the_graders_reference, "rlcourse.grading.llm.lesson09:_reference_rloo_step"),
    ("check_rloo_step", rloo_step_with_the_librarys_rloo_loss, "rlcourse.losses.grpo:rloo_loss"),
    ("check_rloo_step", rloo_step_with_the_trainers_loss, "rlcourse.trainers.policy_gradient:loss_and_stats"),
    ("check_rloo_kl_step", rloo_kl_step_calling_the_graders_reference, "lesson09:_reference_rloo_kl_step"),
    ("check_rloo_kl_step", rloo_kl_step_with_ppo_rlhfs_shaped_rewards, "rlcourse.trainers.ppo_rlhf:kl_shaped_rewards"),
    ("check_dpo_step", dpo_step_calling_the_graders_reference, "rlcourse.grading.llm.lesson11:_reference_dpo_step"),
    ("check_dpo_step", dpo_step_with_bradley_terry_on_scaled_margins, "rlcourse.losses.reward_model:bradley_terry_loss"),
    ("check_dpo_step", dpo_step_with_simpo_at_a_zero_margin, "rlcourse.losses.beyond_dpo:simpo_loss"),
    ("check_dpo_step", dpo_step_with_conservative_dpo_at_zero, "rlcourse.losses.dpo:conservative_dpo_loss"),
    ("check_dpo_step", dpo_step_with_rdpo_at_zero, "rlcourse.losses.beyond_dpo:rdpo_loss"),
    ("check_dpo_step", dpo_step_with_the_trainers_batch_loss, "rlcourse.trainers.dpo:batch_loss"),
    ("check_dpo_loss", dpo_loss_with_bradley_terry_pair_by_pair, "rlcourse.losses.reward_model:bradley_terry_loss"),
    ("check_dpo_loss", dpo_loss_with_simpo_at_a_zero_margin, "rlcourse.losses.beyond_dpo:simpo_loss"),
    ("check_online_dpo_step", online_dpo_step_calling_the_graders_round, "rlcourse.grading.llm.lesson11b:_online_round"),
    ("check_train_online_dpo", train_online_dpo_calling_the_graders_run, "lesson11b:_reference_online_dpo"),
    ("check_train_online_dpo", train_online_dpo_with_the_trainer, "OnlineDPOTrainer.train"),
]


def run(check: str, answer, tmp_path) -> dict:
    path = tmp_path / f"{answer.__name__}.pkl"
    with open(path, "wb") as f:
        cloudpickle.dump(((answer,), {}), f)
    return grade_runner.run_one({"check": check, "file": str(path)}, timeout=300)


@pytest.mark.parametrize("check, answer, says", CHEATS, ids=[a.__name__ for _, a, _ in CHEATS])
def test_a_route_to_the_answer_is_graded_as_a_reference(check, answer, says, tmp_path):
    result = run(check, answer, tmp_path)
    assert result["outcome"] == "reference" and says in result["message"], result
