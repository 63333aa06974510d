"""From rlcourse to TRL: the same task, checkpoint and settings on Hugging Face TRL's trainers.

Lesson 13 graduates from our single-process trainers to an engine that scales. The pieces:

* :func:`task_dataset` - a ``datasets.Dataset`` of prompts (TRL's "prompt-only" format) from a task;
* :func:`task_reward_func` - the task's verifier as a TRL reward function
  ``f(prompts, completions, **columns) -> list[float]``;
* :func:`export_checkpoint` - a shipped checkpoint written to a folder TRL can load offline;
* :data:`GRPO_NAME_MAP` - our setting names next to TRL's, verl's and OpenRLHF's;
* :data:`PPO_NAME_MAP` - lesson 08's PPO-RLHF settings under OpenRLHF's and verl's names (TRL has
  no PPO trainer since 1.13);
* :func:`distributed_report` - who am I, how many of us are there, and do we hold the same weights?

The last one exists because a multi-process launch can fail silently: on a CPU machine
``accelerate launch --cpu --num_processes 2`` starts a single process, and an FSDP config without
GPUs can start two processes that never talk (two independent trainings). Counting processes
(the world size) catches the first; comparing a checksum of the weights across processes after
training catches the second: data-parallel replicas must end identical.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from rlcourse.lm.checkpoints import checkpoint_path

__all__ = ["GRPO_NAME_MAP", "PPO_NAME_MAP", "OURS_ONLY", "task_dataset", "task_reward_func", "export_checkpoint",
           "grpo_config_kwargs", "dpo_config_kwargs", "preference_dataset",
           "parameter_checksum", "distributed_report"]

# Our name (rlcourse trainers use TRL's names) -> TRL GRPOConfig, verl, OpenRLHF. Where a system
# has no single switch for the setting, the entry says what to do instead. verl names are the
# keys of its ppo_trainer.yaml (actor_rollout_ref.*, algorithm.*), OpenRLHF's its CLI flags of
# openrlhf/cli/train_ppo_ray.py; both read at the commits named in rlcourse.kl (verl b178a3c,
# OpenRLHF 3c3be62, whose flags are dotted: --actor.*, --rollout.*, --algo.*).
GRPO_NAME_MAP = {
    "num_generations": ("num_generations", "actor_rollout_ref.rollout.n", "--rollout.n_samples_per_prompt"),
    "learning_rate": ("learning_rate", "actor_rollout_ref.actor.optim.lr", "--actor.adam.lr"),
    "beta": ("beta", "actor_rollout_ref.actor.kl_loss_coef (use_kl_loss=True)",
             "--algo.kl.init_coef (with --algo.kl.use_loss)"),
    "epsilon": ("epsilon", "actor_rollout_ref.actor.clip_ratio_low", "--actor.eps_clip"),
    "epsilon_high": ("epsilon_high", "actor_rollout_ref.actor.clip_ratio_high",
                     "--actor.eps_clip_low_high LOW HIGH"),
    "loss_type": ("loss_type", "actor_rollout_ref.actor.loss_agg_mode", "(always the token mean)"),
    "scale_rewards": ("scale_rewards", "algorithm.norm_adv_by_std_in_grpo",
                      "--algo.advantage.estimator group_norm (dr_grpo: no std)"),
    "num_iterations": ("num_iterations", "actor_rollout_ref.actor.ppo_epochs", "--train.max_epochs"),
    "temperature": ("temperature", "actor_rollout_ref.rollout.temperature", "--rollout.temperature"),
    "max_completion_length": ("max_completion_length", "data.max_response_length", "--rollout.max_new_tokens"),
    "per_device_train_batch_size": ("per_device_train_batch_size",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                    "--train.micro_batch_size"),
    "kl_estimator": ("(k3 in the loss)", "actor_rollout_ref.actor.kl_loss_type (low_var_kl = k3)",
                     "--algo.kl.estimator"),
}

# Lesson 08's PPOConfig (TRL's last PPOConfig names) -> OpenRLHF CLI flag, verl key, read in the
# same sources. Both engines train PPO with a critic by default (OpenRLHF
# --algo.advantage.estimator gae, verl algorithm.adv_estimator: gae); both put the KL penalty in
# the reward by default, as lesson 08 does. The critic is a separate model with its own optimiser
# in both, so there is no vf_coef: its learning rate plays that part.
PPO_NAME_MAP = {
    "learning_rate": ("--actor.adam.lr", "actor_rollout_ref.actor.optim.lr"),
    "batch_size": ("--rollout.batch_size (prompts) x --rollout.n_samples_per_prompt",
                   "data.train_batch_size (prompts) x actor_rollout_ref.rollout.n"),
    "num_mini_batches": ("--train.batch_size (samples per optimiser step)",
                         "actor_rollout_ref.actor.ppo_mini_batch_size (prompts per optimiser step)"),
    "num_ppo_epochs": ("--train.max_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    "response_length": ("--rollout.max_new_tokens", "data.max_response_length"),
    "temperature": ("--rollout.temperature", "actor_rollout_ref.rollout.temperature"),
    "kl_coef": ("--algo.kl.init_coef (adaptive with --algo.kl.target)",
                "algorithm.kl_ctrl.kl_coef (with algorithm.use_kl_in_reward=True)"),
    "kl_estimator": ("--algo.kl.estimator (k1, k2, k3)", "algorithm.kl_penalty (kl = k1, low_var_kl = k3)"),
    "cliprange": ("--actor.eps_clip", "actor_rollout_ref.actor.clip_ratio"),
    "cliprange_value": ("--critic.value_clip", "critic.cliprange_value"),
    "vf_coef": ("(none: --critic.adam.lr)", "(none: critic.optim.lr)"),
    "gamma": ("--algo.advantage.gamma", "algorithm.gamma"),
    "lam": ("--algo.advantage.lambd", "algorithm.lam"),
    "whiten_advantages": ("(always for gae; --algo.advantage.no_std_norm only centres)",
                          "(always for gae: masked_whiten, with Bessel's correction)"),
    "whiten_rewards": ("(none)", "(none)"),
    "missing_eos_penalty": ("(none: --reward.stop_properly_penalty_coef in [0, 1] scales a cut reward)",
                            "(none: write it into the reward function)"),
    "non_eos_score": ("--reward.stop_properly_penalty_coef (a negative value replaces a cut reward)",
                      "(none: write it into the reward function)"),
}


# PolicyGradientConfig fields TRL's GRPOConfig has no switch for: GRPOTrainer always uses the group
# advantage (TRL's RLOOTrainer the leave-one-out one), a fixed 1e-4 added to the std, no dynamic
# sampling and no moving baseline; DAPO's overlong shaping is a reward function in TRL
# (trl.rewards.get_soft_overlong_punishment), not a setting; GRPOTrainer always recomputes pi_old
# (no ratio against the sampler's own log-probs). grpo_config_kwargs leaves them out only
# at their GRPO values; those marked None (read only by another setting: the moving average, dynamic
# sampling, the overlong buffer) always.
OURS_ONLY = {"std_floor": 1e-4, "advantage_estimator": "grpo", "baseline_decay": None,
             "kl_in_reward": False, "dynamic_sampling": False, "max_num_gen_batches": None,
             "overlong_buffer_len": 0, "overlong_penalty_factor": None, "ratio_against_sampler": False}


def grpo_config_kwargs(config, task=None) -> dict:
    """Our :class:`~rlcourse.trainers.policy_gradient.PolicyGradientConfig` as ``trl.GRPOConfig`` keyword arguments.

    Every field that TRL shares is passed under its own (identical) name; ``max_completion_length``
    ``None`` (ours: the task's ``max_new_tokens``) is resolved with ``task``. Our trainer keeps the
    learning rate constant, so ``lr_scheduler_type="constant"`` is added (TRL's default decays it
    linearly). Output, device and logging options (``output_dir``, ``use_cpu``...) are the caller's.
    A field TRL cannot express (see :data:`OURS_ONLY`) at a non-GRPO value raises ``ValueError``:
    GRPOTrainer would silently run a different algorithm.

    ``max_steps``: ours counts *sampling* steps, each followed by ``num_iterations`` optimiser steps
    on the whole batch; TRL's counts optimiser steps. In TRL 1.16's GRPOTrainer (``_prepare_inputs``)
    a counter of micro-batches ``s`` (one per ``training_step``) decides: it generates a batch of
    ``per_device_train_batch_size * steps_per_generation`` completions (per process) whenever
    ``s % (steps_per_generation * num_iterations) == 0``, trains on slice ``s % steps_per_generation``
    of it, and takes an optimiser step every ``gradient_accumulation_steps`` micro-batches. Over
    ``S`` optimiser steps it therefore generates

        ``S * gradient_accumulation_steps / (steps_per_generation * num_iterations)`` batches.

    With ``steps_per_generation = gradient_accumulation_steps`` (TRL's default when neither it nor
    ``generation_batch_size`` is set; both are 1 unless the caller adds them) that is ``S /
    num_iterations``, so TRL gets ``max_steps * num_iterations``: it samples ``max_steps`` batches,
    as ours does, and takes ``num_iterations`` optimiser steps on each, every one over the whole
    generation batch (accumulated over ``gradient_accumulation_steps`` slices; to keep our batch size
    then, divide ``per_device_train_batch_size`` by it). A ``steps_per_generation`` other than
    ``gradient_accumulation_steps`` is a different algorithm (several optimiser steps on slices of
    one batch, PPO's minibatches), which ours does not run.
    """
    from dataclasses import fields

    kwargs = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in OURS_ONLY:
            if OURS_ONLY[f.name] is not None and value != OURS_ONLY[f.name]:
                raise ValueError(f"config.{f.name}={value!r} has no GRPOConfig equivalent "
                                 f"(GRPOTrainer runs {f.name}={OURS_ONLY[f.name]!r})")
            continue
        kwargs[f.name] = value
    if kwargs["max_completion_length"] is None:
        if task is None:
            raise ValueError("config.max_completion_length is None: pass task= to use task.max_new_tokens")
        kwargs["max_completion_length"] = task.max_new_tokens
    kwargs["lr_scheduler_type"] = "constant"
    # Our max_steps counts sampling steps, each followed by num_iterations optimiser steps; TRL's
    # counts optimiser steps and samples once every num_iterations of them (see the docstring).
    kwargs["max_steps"] = config.max_steps * config.num_iterations
    return kwargs


def dpo_config_kwargs(config) -> dict:
    """Our :class:`~rlcourse.trainers.dpo.DPOConfig` as ``trl.DPOConfig`` keyword arguments (same names).

    Ours has no warm-up: ``warmup_steps=0`` is added so TRL's schedule is the same linear decay.
    The losses of lesson 11b are other trainers in TRL (``simpo``: ``CPOTrainer``, ``orpo``:
    ``ORPOTrainer``, ``kto``: ``KTOTrainer``) and R-DPO's ``rdpo_alpha`` has no TRL option: either
    raises ``ValueError``. Their other settings (``simpo_gamma``, ``desirable_weight``,
    ``undesirable_weight``) are read by those losses only, so they are left out.
    """
    from dataclasses import fields

    from rlcourse.losses.beyond_dpo import BEYOND_DPO_LOSS_TYPES

    elsewhere = [t for t in config.loss_types if t in BEYOND_DPO_LOSS_TYPES]
    if elsewhere:
        raise ValueError(f"loss_type {elsewhere} is not a DPOTrainer loss: TRL runs simpo in CPOTrainer, orpo in "
                         f"ORPOTrainer and kto in KTOTrainer")
    if config.rdpo_alpha:
        raise ValueError(f"rdpo_alpha={config.rdpo_alpha!r} (R-DPO's length penalty) has no trl.DPOConfig option")
    ours_only = ("simpo_gamma", "rdpo_alpha", "desirable_weight", "undesirable_weight")
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name not in ours_only}
    kwargs["warmup_steps"] = 0
    return kwargs


def preference_dataset(pairs: list[dict]):
    """Preference pairs ``{"prompt", "chosen", "rejected"}`` as a ``datasets.Dataset`` (TRL's
    "standard preference" format, what ``DPOTrainer`` reads)."""
    from datasets import Dataset

    if not pairs or any(not {"prompt", "chosen", "rejected"} <= set(p) for p in pairs):
        raise ValueError("pairs must be a non-empty list of dicts with keys 'prompt', 'chosen', 'rejected'")
    return Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs])


def task_dataset(task, n: int, seed: int = 0):
    """``n`` training prompts of ``task`` as a ``datasets.Dataset`` with one column, ``"prompt"``."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": task.prompts(n, rng=seed)})


def task_reward_func(task):
    """The task's verifier as a TRL reward function (its ``__name__`` is what TRL logs it under)."""
    def reward(prompts, completions, **_columns):
        return [float(x) for x in task.reward(list(prompts), list(completions))]

    reward.__name__ = f"{type(task).__name__}_reward"
    return reward


def export_checkpoint(name: str, folder) -> Path:
    """Copy a shipped checkpoint's model and tokenizer to ``folder`` (TRL loads models from a path).

    TRL pads prompts on the left and stops at ``eos_token``; our tokenizer already does both.
    """
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    from rlcourse.lm.checkpoints import save_checkpoint

    source = checkpoint_path(name)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    model = GPT2LMHeadModel.from_pretrained(source)
    return save_checkpoint(model, tokenizer, folder)


def parameter_checksum(model) -> str:
    """A short hash of every parameter's bytes: equal across processes iff the weights are equal."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def distributed_report(model) -> dict:
    """``world_size``, ``rank`` and every process's weight checksum (gathered when distributed).

    ``replicas_identical`` is True when all processes hold the same weights: what data-parallel
    training (DDP, or FSDP/ZeRO after gathering) guarantees, and what two independent runs that
    only *think* they are distributed do not.
    """
    import torch.distributed as dist

    mine = parameter_checksum(model)
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        world, rank, everyone = 1, 0, [mine]
    return {"world_size": world, "rank": rank, "checksums": everyone,
            "replicas_identical": len(set(everyone)) == 1}
