"""Checks for lesson 13 (graduating to TRL: the same run on an engine that scales).

* :func:`check_grpo_kwargs` - our ``PolicyGradientConfig`` as ``trl.GRPOConfig`` keyword arguments,
  name by name (mistakes caught: our own fields passed to TRL, which it rejects; a ``None``
  completion length left unresolved; TRL's decaying learning rate left in place; ``max_steps``
  passed unchanged although TRL counts optimiser steps; a setting TRL cannot express mapped
  silently instead of refused);
* :func:`check_reward_func` - a task's verifier as a TRL reward function (a list of numbers, one per
  completion: Python or NumPy floats, as TRL accepts both; extra dataset columns accepted, named
  after the task for TRL's logs);
* :func:`check_really_distributed` - an experiment: reports whose weight checksums come from real
  models (replicas of one checkpoint, and a copy that took a training step) must be told apart:
  the right number of processes, all holding the same weights.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import numbers

from rlcourse.grading._core import call_unmutated, fail, passed, references

__all__ = ["check_grpo_kwargs", "check_reward_func", "check_really_distributed"]


@references("rlcourse.interop.trl_bridge:grpo_config_kwargs")
def check_grpo_kwargs(fn) -> None:
    """``fn(config, task) -> dict`` of ``trl.GRPOConfig`` keyword arguments for our ``PolicyGradientConfig``."""
    __tracebackhide__ = True
    import trl

    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.interop.trl_bridge import OURS_ONLY, grpo_config_kwargs as reference

    name = "check_grpo_kwargs"
    trl_names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    task = AdditionTask()
    cases = [("the default config", PolicyGradientConfig()),
             ("GRPO with a KL penalty and clip-higher", PolicyGradientConfig(beta=0.04, epsilon_high=0.28, loss_type="grpo")),
             ("Dr. GRPO, 4 iterations, lr 3e-5", PolicyGradientConfig(loss_type="dr_grpo", num_iterations=4,
                                                                     learning_rate=3e-5, scale_rewards="none")),
             ("an explicit max_completion_length=6", PolicyGradientConfig(max_completion_length=6, temperature=0.7)),
             ("GSPO (sequence-level ratio), 16 generations", PolicyGradientConfig(
                 importance_sampling_level="sequence", num_generations=16, per_device_train_batch_size=128))]
    for case, config in cases:
        before = dataclasses.asdict(config)
        got = fn(config, task)
        if dataclasses.asdict(config) != before:
            fail(name, case, "config left unchanged", "a field of config was modified",
                 "read the config, build a new dict: the caller still needs its config")
        expected = reference(config, task)
        if not isinstance(got, dict):
            fail(name, case, "a dict of keyword arguments", f"{type(got).__name__}", "return a dict")
        unknown = sorted(set(got) - trl_names)
        if unknown:
            fail(name, case, "only names GRPOConfig accepts", f"unknown to GRPOConfig: {unknown}",
                 f"fields of ours that TRL lacks ({', '.join(OURS_ONLY)}) must be left out: GRPOConfig(**kwargs) "
                 "would raise TypeError")
        if got.get("max_completion_length") is None and "max_completion_length" in got:
            fail(name, case, expected["max_completion_length"], None,
                 "max_completion_length=None means task.max_new_tokens in rlcourse; TRL would read None differently")
        if got.get("lr_scheduler_type") != "constant":
            fail(name, case, "lr_scheduler_type='constant'", got.get("lr_scheduler_type"),
                 "our trainer keeps the learning rate fixed; TRL's default schedule decays it linearly to 0")
        missing = sorted(set(expected) - set(got))
        if missing:
            fail(name, case, sorted(expected), sorted(got), f"these settings are missing: {missing}")
        wrong = {k: (expected[k], got[k]) for k in expected if got[k] != expected[k]}
        if wrong:
            key = next(iter(wrong))
            hint = "pass each shared setting's value unchanged under its own name"
            if key == "max_steps":
                hint = ("TRL's max_steps counts optimiser steps, ours sampling steps (each followed by "
                        "num_iterations optimiser steps): pass max_steps * num_iterations")
            fail(name, f"{case}, setting {key!r}", wrong[key][0], wrong[key][1], hint)
    refused = [("advantage_estimator='rloo'", PolicyGradientConfig(advantage_estimator="rloo")),
               ("dynamic_sampling=True", PolicyGradientConfig(dynamic_sampling=True)),
               ("kl_in_reward=True", PolicyGradientConfig(kl_in_reward=True)),
               ("std_floor=0.0", PolicyGradientConfig(std_floor=0.0))]
    for case, config in refused:
        try:
            got = fn(config, task)
        except ValueError:
            continue
        fail(name, f"a config with {case}", "ValueError (GRPOTrainer cannot run this setting)",
             f"returned {type(got).__name__}",
             "GRPOTrainer has no switch for this: mapping it silently would run a different algorithm; raise ValueError")
    passed(name, len(cases) + len(refused))


@references("rlcourse.interop.trl_bridge:task_reward_func")
def check_reward_func(fn) -> None:
    """``fn(task) -> reward(prompts, completions, **columns) -> list[float]``, named ``<Task>_reward``."""
    __tracebackhide__ = True
    from rlcourse.tasks import AdditionTask, PreferenceTask

    name = "check_reward_func"
    cases = [("AdditionTask: right, wrong, empty and padded answers", AdditionTask(),
              ["1+2=", "10+5=", "33+44=", "7+8="], ["3", "14", "", "15 "]),
             ("AdditionTask: training prompts, sampled-looking completions", AdditionTask(),
              AdditionTask().prompts(6, rng=3), ["12", "99", "0", "130", "5", "1"]),
             ("PreferenceTask: a graded score in [-1, 1] (not 0/1)", PreferenceTask(),
              PreferenceTask().prompts(4, rng=1), ["abcd", "zz", "qwert", ""])]
    for case, task, prompts, completions in cases:
        reward = fn(task)
        if not callable(reward):
            fail(name, case, "a function", type(reward).__name__, "return the inner function, not its result")
        expected = [float(x) for x in task.reward(prompts, completions)]
        prompts_arg, completions_arg = list(prompts), list(completions)
        try:
            got = call_unmutated(name, case, reward, prompts_arg, completions_arg,
                                 completion_ids=[[0]] * len(prompts), trainer_state=None, answer=["?"] * len(prompts))
        except TypeError as e:
            fail(name, case, "reward(prompts, completions, **columns)", f"TypeError: {e}",
                 "TRL passes every other dataset column and more as keyword arguments: accept **kwargs")
        # TRL turns the list into a tensor: a Python float, an int or a NumPy number all work.
        if not isinstance(got, list) or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in got):
            fail(name, case, "a list of numbers", f"{type(got).__name__} {got!r:.80}",
                 "TRL expects a list with one number per completion: [float(x) for x in ...]")
        got = [float(x) for x in got]
        if got != expected:
            fail(name, case, expected, got, "score completion i of prompt i with task.reward(prompts, completions)")
        want = f"{type(task).__name__}_reward"
        if getattr(reward, "__name__", None) != want:
            fail(name, case, f"__name__ == {want!r}", repr(getattr(reward, "__name__", None)),
                 "TRL logs each reward function as rewards/<__name__>/mean: set reward.__name__ after the task")
    passed(name, len(cases))


@functools.lru_cache(maxsize=1)
def _measured_checksums() -> tuple[str, str]:
    """The checksum of a shipped checkpoint and of a copy that took one training step (real models)."""
    import torch

    from rlcourse.tasks import AdditionTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
    from rlcourse.interop.trl_bridge import parameter_checksum

    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    replica = parameter_checksum(copy.deepcopy(model))
    torch.manual_seed(0)
    config = PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4, learning_rate=1e-3, seed=1)
    PolicyGradientTrainer(model, tokenizer, AdditionTask(), config).train(max_steps=1, progress=False)
    return replica, parameter_checksum(model)


@references("rlcourse.interop.trl_bridge:distributed_report")
def check_really_distributed(fn) -> None:
    """``fn(report, requested_processes) -> bool``: did the launch run that many identical replicas?

    ``report`` is what :mod:`rlcourse.interop.trl_grpo` writes: ``world_size``, ``checksums`` (one per
    process) and more. Here the checksums come from real models: replicas of one checkpoint, and a
    copy that took one training step on its own (what two processes that never talk end up with).
    """
    __tracebackhide__ = True
    name = "check_really_distributed"
    same, other = _measured_checksums()
    cases = [("2 processes requested, 2 identical replicas", dict(world_size=2, checksums=[same, same]), 2, True),
             ("2 requested, 1 process started (accelerate launch --cpu)", dict(world_size=1, checksums=[same]), 2, False),
             ("2 requested, 2 processes whose weights differ (never synchronised)",
              dict(world_size=2, checksums=[same, other]), 2, False),
             ("4 requested, 4 identical replicas", dict(world_size=4, checksums=[other] * 4), 4, True),
             ("4 requested, 4 processes, the last one drifted", dict(world_size=4, checksums=[same] * 3 + [other]), 4, False),
             ("1 process requested and started", dict(world_size=1, checksums=[other]), 1, True),
             ("8 requested, only 2 started though they agree", dict(world_size=2, checksums=[same, same]), 8, False),
             ("world_size says 2 but only one checksum was gathered", dict(world_size=2, checksums=[same]), 2, False),
             # A summary flag is a claim, the checksums are the evidence: judge by what was measured.
             ("replicas_identical says True, but the two checksums differ",
              dict(world_size=2, checksums=[same, other], replicas_identical=True), 2, False),
             ("replicas_identical says False, but the two checksums agree",
              dict(world_size=2, checksums=[other, other], replicas_identical=False), 2, True)]
    for case, fields, requested, expected in cases:
        report = {"rank": 0, "replicas_identical": len(set(fields["checksums"])) == 1,
                  "exact_match_before": 0.35, "exact_match_after": 0.4, **fields}
        got = call_unmutated(name, case, fn, report, requested)
        if not isinstance(got, bool):
            fail(name, case, "True or False", f"{type(got).__name__} {got!r:.60}", "return a bool")
        if got != expected:
            hint = ("count the processes: world_size must equal requested_processes, with one checksum each"
                    if fields["world_size"] != requested or len(fields["checksums"]) != requested else
                    "data-parallel replicas end with identical weights: every checksum must be equal")
            if "replicas_identical" in fields:
                hint = ("compare the checksums themselves: replicas_identical is the report's own summary, and a "
                        "check of a distributed run must rest on what each process measured")
            fail(name, case, expected, got, hint)
    passed(name, len(cases))
