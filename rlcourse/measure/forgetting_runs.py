"""Lesson 12b's runs: one base model taught a new task by SFT, GRPO, RFT (and distillation), fully or through LoRA.

The base model is the ``addition`` checkpoint (2-digit sums, the **old task**, measured by greedy
exact match on held-out pairs). The **new task** is :class:`~rlcourse.tasks.arithmetic.DigitSumTask`
with two digits (``"S=07:"`` -> two digits summing to 7), measured by the validity of samples at T=1;
the base model gets it right now and then (pass@8 above zero), so a verifier's reward has something to
reinforce. Every run starts from the same base and takes ``steps`` optimiser steps; then
:func:`evaluate` measures both accuracies and the forward KL from the base on the new task's prompts
(:func:`rlcourse.measure.forgetting.forward_kl_on_prompts`).

* ``"SFT"``: :func:`rlcourse.trainers.sft.train_sft` on oracle answers (uniformly random valid ones);
* ``"GRPO"``: :class:`~rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer`
  (all seeds at once; :class:`~rlcourse.trainers.policy_gradient.PolicyGradientTrainer` under LoRA);
* ``"RFT"``: :class:`rlcourse.trainers.rft.RFTTrainer` (SFT on the policy's own verified samples);
* ``"distillation"``: on-policy distillation from a teacher (:mod:`rlcourse.trainers.distillation`).

``lora`` is ``None`` (full fine-tuning) or ``"all"`` / ``"attention"`` (rank-``lora_rank`` LoRA,
:func:`rlcourse.lm.lora.apply_lora`, merged back before measuring).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from rlcourse.lm.lora import apply_lora, merge_lora, trainable_parameters
from rlcourse.lm.sampling import sample
from rlcourse.measure.forgetting import base_completions, forward_kl_on_prompts
from rlcourse.tasks.arithmetic import AdditionTask, DigitSumTask
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.trainers.rft import RFTConfig, RFTTrainer
from rlcourse.trainers.sft import exact_match, train_sft

__all__ = ["ForgettingSetup", "evaluate", "new_task_accuracy", "make_teacher", "run_method", "METHODS"]

METHODS = ("SFT", "GRPO", "RFT", "distillation")
N_GENERATIONS = 8   # completions per prompt (GRPO, RFT)


@dataclass
class ForgettingSetup:
    """The tasks, the measurement sets and the base model's samples, fixed for every run."""

    base: torch.nn.Module
    tokenizer: object
    old_prompts: int = 200
    """held-out 2-digit additions the old-task accuracy is measured on (greedy)."""
    new_samples: int = 16
    """samples (T=1) of each of the 19 new-task prompts for the new-task accuracy."""
    kl_samples: int = 8
    """base-model completions of each new-task prompt the forward KL is read along."""
    batch_size: int = 64
    """rows per optimiser step, every method."""

    def __post_init__(self):
        self.old_task, self.new_task = AdditionTask(n_digits=2), DigitSumTask(n_digits=2)
        self.oracle_task = DigitSumTask(n_digits=2, demo_accuracy=1.0)
        self.old_set = self.old_task.test_prompts(self.old_prompts)
        self.new_set = self.new_task.test_prompts(None)
        self.kl_rollout = base_completions(self.base, self.tokenizer, self.new_set, self.kl_samples,
                                           self.new_task.max_new_tokens, seed=0)


@torch.no_grad()
def new_task_accuracy(model, setup: ForgettingSetup, seed: int = 0) -> float:
    """Fraction of valid samples (T=1), ``new_samples`` per new-task prompt, from a fixed generator."""
    rows = [p for p in setup.new_set for _ in range(setup.new_samples)]
    roll = sample(model.eval(), setup.tokenizer, rows, setup.new_task.max_new_tokens,
                  generator=torch.Generator(device=next(model.parameters()).device).manual_seed(seed))
    return float(setup.new_task.reward(rows, roll.completions).mean())


def evaluate(model, setup: ForgettingSetup) -> dict:
    """``{"new", "old", "kl"}``: new-task validity (T=1), old-task greedy exact match, forward KL (nats/completion)."""
    return {"new": new_task_accuracy(model, setup),
            "old": exact_match(model.eval(), setup.tokenizer, setup.old_task, setup.old_set),
            "kl": forward_kl_on_prompts(setup.base, model, setup.kl_rollout)}


def make_teacher(setup: ForgettingSetup, steps: int = 200, learning_rate: float = 1e-3, seed: int = 0):
    """The distillation teacher: the base after ``steps`` of SFT on oracle answers (good at the new task, not the old)."""
    teacher = copy.deepcopy(setup.base)
    data = setup.oracle_task.sft_dataset(setup.batch_size * steps, rng=10_000 + seed)
    train_sft(teacher, setup.tokenizer, data, steps=steps, lr=learning_rate, batch_size=setup.batch_size,
              seed=10_000 + seed, progress=False)
    return teacher.eval().requires_grad_(False)


def _start(setup: ForgettingSetup, lora: str | None, rank: int, alpha: float, seed: int):
    model = copy.deepcopy(setup.base)
    if lora is not None:
        apply_lora(model, r=rank, alpha=alpha, targets=lora, seed=seed)
    return model


def _finish(model, lora):
    return merge_lora(model) if lora is not None else model


def run_method(method: str, setup: ForgettingSetup, learning_rate: float, seeds, steps: int,
               lora: str | None = None, lora_rank: int = 1, lora_alpha: float = 4.0, teacher=None) -> list[dict]:
    """Train one run per seed from the base; one row per seed: ``{method, lr, seed, lora, trainable, new, old, kl}``.

    ``lora_alpha`` defaults to 4, not "LoRA Without Regret"'s 32: the update ``(alpha / r) B A`` scales with
    ``A``'s init bound ``1 / sqrt(in)``, and ``4 / sqrt(64)`` at width 64 equals their ``32 / sqrt(4096)`` at 4096.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    seeds = list(seeds)
    rows = []

    def row(model, seed, trainable):
        return {"method": method, "lr": learning_rate, "seed": seed, "lora": lora or "full",
                "trainable": trainable, **evaluate(model, setup)}

    if method == "GRPO" and lora is None:
        from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer

        config = PolicyGradientConfig(learning_rate=learning_rate, per_device_train_batch_size=setup.batch_size,
                                      num_generations=N_GENERATIONS, seed=seeds[0])
        trainer = SeedBatchedPolicyGradientTrainer(setup.base, setup.tokenizer, setup.new_task, config, seeds=seeds)
        for _ in range(steps):
            trainer.step()
        return [row(trainer.model_of(s), seed, trainable_parameters(setup.base)) for s, seed in enumerate(seeds)]
    if method == "distillation":
        from rlcourse.trainers.distillation import DistillationConfig, DistillationTrainer

        if teacher is None or lora is not None:
            raise ValueError("distillation needs a teacher and runs full fine-tuning only")
        config = DistillationConfig(learning_rate=learning_rate, per_device_train_batch_size=setup.batch_size,
                                    seed=seeds[0])
        trainer = DistillationTrainer(setup.base, teacher, setup.tokenizer, setup.new_task, config, seeds=seeds)
        for _ in range(steps):
            trainer.step()
        return [row(trainer.model_of(s), seed, trainable_parameters(setup.base)) for s, seed in enumerate(seeds)]
    with warnings.catch_warnings():   # a LoRA model samples through transformers' generate path, which warns
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        for seed in seeds:
            rows.append(_one_seed(method, setup, learning_rate, seed, steps, lora, lora_rank, lora_alpha, row))
    return rows


def _one_seed(method, setup, learning_rate, seed, steps, lora, lora_rank, lora_alpha, row) -> dict:
    """One single-seed run (SFT, RFT, or GRPO through LoRA) and its measurement row."""
    torch.manual_seed(seed)
    model = _start(setup, lora, lora_rank, lora_alpha, seed)
    trainable = trainable_parameters(model)
    if method == "SFT":
        data = setup.oracle_task.sft_dataset(max(2000, setup.batch_size * steps), rng=seed)
        train_sft(model, setup.tokenizer, data, steps=steps, lr=learning_rate, batch_size=setup.batch_size,
                  seed=seed, progress=False)
    elif method == "RFT":
        RFTTrainer(model, setup.tokenizer, setup.new_task,
                   RFTConfig(learning_rate=learning_rate, per_device_train_batch_size=setup.batch_size,
                             num_generations=N_GENERATIONS, seed=seed)).train(steps)
    else:   # GRPO through LoRA: one seed at a time (a LoRA model cannot be seed-stacked)
        config = PolicyGradientConfig(learning_rate=learning_rate, per_device_train_batch_size=setup.batch_size,
                                      num_generations=N_GENERATIONS, seed=seed)
        PolicyGradientTrainer(model, setup.tokenizer, setup.new_task, config).train(steps, progress=False)
    return row(_finish(model, lora), seed, trainable)
