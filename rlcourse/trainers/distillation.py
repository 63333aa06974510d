"""Distillation of a frozen teacher into a student, on the student's own samples or on the teacher's (lesson 11c).

Pseudocode of one step, for every seed ``s`` at once (the seeds share the work, as in
:mod:`rlcourse.trainers.policy_gradient_seeds`; each seed is the run a one-seed trainer makes):

    prompts_s <- task.prompts(n, rng_s)                                   n = per_device_train_batch_size
    on-policy <- coin_s < lmbda                                           (GKD's lmbda; 1.0: always, as TRL's
                                                                           DistillationTrainer)
    y         <- sample(pi_s, prompts_s)  if on-policy  else  sample(pi_T, prompts_s)      # rlcourse.lm.sample
    z_s, z_T  <- student and teacher logits at every position of y        # rlcourse.lm.logprobs.completion_logits
    loss      <- masked_mean(JSD_beta(z_s, z_T), mask)                     loss_type="jsd"  (rlcourse.losses.distillation)
                 masked_mean(-log pi_s(y_t), mask)                         loss_type="nll"  (SFT on the batch's tokens)
    clip the seed's gradient to max_grad_norm; one Adam step              # rlcourse.lm.seed_stack.SeedAdam

Three methods of the lesson are three configs of this one loop:

* on-policy distillation: ``lmbda=1.0, beta=1.0, loss_type="jsd"`` (TRL's ``DistillationTrainer``);
* SFT on teacher samples (sequence-level KD, Kim and Rush 2016): ``lmbda=0.0, loss_type="nll"``;
* supervised KD on teacher samples (GKD's ``seq_kd=True`` with ``lmbda=0``): ``lmbda=0.0, loss_type="jsd"``.

Settings are named as TRL's ``DistillationConfig`` / ``GKDConfig``. Only plain GPT-2 students and
teachers (:func:`rlcourse.lm.fast_gpt2.supports`) are accepted: the seeds are stacked. The teacher
may have another width or depth than the student; the vocabulary must be the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlcourse.lm.fast_gpt2 import supports
from rlcourse.lm.logprobs import completion_logits, token_logprobs_from_logits
from rlcourse.lm.sampling import sample
from rlcourse.lm.seed_stack import SeedAdam, seed_model, seed_runs, stack_models
from rlcourse.losses.distillation import generalized_jsd_per_token, reverse_kl_per_token
from rlcourse.losses.policy_gradient import masked_mean
from rlcourse.trainers.steps import run_steps

__all__ = ["DistillationConfig", "DistillationTrainer", "train_distillation", "exact_match_by_seed",
           "DISTILLATION_LOSS_TYPES"]

DISTILLATION_LOSS_TYPES = ("jsd", "nll")


@dataclass
class DistillationConfig:
    """Settings, named as TRL's ``DistillationConfig`` (and ``GKDConfig`` for ``lmbda``).

    Defaults that differ from TRL's: ``learning_rate`` 1e-3 (TRL: 1e-6, sized for large models);
    ``per_device_train_batch_size`` 64 completions (TRL: 8); ``max_completion_length`` ``None`` =
    the task's ``max_new_tokens`` (TRL: 512). ``lmbda`` is GKD's (``GKDConfig``, default 0.5 there);
    TRL's ``DistillationTrainer`` has none and is always on-policy, our default 1.0. Off-policy
    batches are the teacher's samples (GKD's ``seq_kd=True``); a dataset's fixed answers are not used.
    ``loss_type`` is ours.
    """

    learning_rate: float = 1e-3
    """Adam's step size."""
    per_device_train_batch_size: int = 64
    """completions per seed and step (one per prompt)."""
    max_completion_length: int | None = None
    """tokens sampled at most per completion; None: the task's ``max_new_tokens``."""
    temperature: float = 1.0
    """sampling temperature, and the softmax temperature of both models in the loss (TRL's)."""
    beta: float = 1.0
    """generalised JSD: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher) (TRL's default)."""
    lmbda: float = 1.0
    """probability that a step trains on the student's own samples (else on the teacher's), drawn per seed."""
    loss_type: str = "jsd"
    """"jsd": the divergence above, exact over the vocabulary; "nll": SFT on the sampled tokens."""
    max_steps: int = 100
    """optimiser steps of :meth:`DistillationTrainer.train`."""
    seed: int = 0
    """the first seed; seed ``s`` of a seed-batched run uses ``seed + s`` unless seeds are given."""
    max_grad_norm: float | None = 1.0
    """each seed's gradient is clipped to this norm (None: no clipping)."""

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not isinstance(self.per_device_train_batch_size, int) or self.per_device_train_batch_size < 1:
            raise ValueError(f"per_device_train_batch_size must be a positive integer, got "
                             f"{self.per_device_train_batch_size!r}")
        if self.max_completion_length is not None and (not isinstance(self.max_completion_length, int)
                                                       or self.max_completion_length < 1):
            raise ValueError(f"max_completion_length must be None or a positive integer, got "
                             f"{self.max_completion_length!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {self.beta!r}")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda must be in [0, 1] (the share of on-policy steps), got {self.lmbda!r}")
        if self.loss_type not in DISTILLATION_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {DISTILLATION_LOSS_TYPES}, got {self.loss_type!r}")
        if not isinstance(self.max_steps, int) or self.max_steps < 0:
            raise ValueError(f"max_steps must be a non-negative integer, got {self.max_steps!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be None or > 0, got {self.max_grad_norm!r}")


class DistillationTrainer:
    """``trainer = DistillationTrainer(student, teacher, tokenizer, task, config, num_seeds=4); trainer.train()``.

    ``num_seeds`` runs start from ``student`` (or one run from each model of a list); seed ``s`` uses
    ``seeds[s]``, by default ``config.seed + s``: its own prompt stream, coin for ``lmbda``, sampling
    stream, weights and Adam. ``history[s]`` holds seed ``s``'s metrics, one dict per step:
    ``loss``, ``on_policy`` (1.0 or 0.0), ``reverse_kl`` (the exact per-token KL(student || teacher)
    on the batch, mean over its tokens, before the step), ``completions/mean_length`` and
    ``generated_tokens`` (the tokens of the batch trained on, sampled by the student or the teacher;
    with ``0 < lmbda < 1`` both models sample every step and the other batch is left unused). ``model_of(s)``
    returns seed ``s``'s student as an ordinary ``GPT2LMHeadModel``. ``task`` needs ``prompts(n, rng)``
    and ``max_new_tokens``; no reward is read.
    """

    def __init__(self, student, teacher, tokenizer, task, config: DistillationConfig | None = None,
                 num_seeds: int | None = None, seeds: list[int] | None = None):
        self.config = c = config or DistillationConfig()
        if num_seeds is None and seeds is None and not isinstance(student, (list, tuple)):
            num_seeds = 1
        models, self.seeds = seed_runs(student, c.seed, num_seeds, seeds)
        for name, m in [*((f"student {i}", m) for i, m in enumerate(models)), ("teacher", teacher)]:
            if not supports(m):
                raise ValueError(f"{name} is not a plain GPT-2 model (rlcourse.lm.fast_gpt2.supports): the trainer "
                                 f"stacks seeds, which needs one; got {type(m).__name__}")
        v_s, v_t = models[0].get_input_embeddings().num_embeddings, teacher.get_input_embeddings().num_embeddings
        if v_s != v_t:
            raise ValueError(f"student and teacher must share one vocabulary, got sizes {v_s} and {v_t}")
        self.tokenizer, self.task = tokenizer, task
        self.max_len = c.max_completion_length or task.max_new_tokens
        self.model = stack_models(models)
        # S copies of the one teacher, so its forward and sampling run seed-major like the student's.
        self.teacher = stack_models([teacher] * len(self.seeds)).eval().requires_grad_(False)
        self.optimizer = SeedAdam(self.model.parameters(), lr=c.learning_rate)
        self.device = next(self.model.parameters()).device
        self.rngs = [np.random.default_rng(s) for s in self.seeds]
        self.coins = [np.random.default_rng([s, 1]) for s in self.seeds]
        self.generators = [torch.Generator(device=self.device).manual_seed(s) for s in self.seeds]
        self.teacher_generators = [torch.Generator(device=self.device).manual_seed(s + 7919) for s in self.seeds]
        self.history: list[list[dict]] = [[] for _ in self.seeds]

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def model_of(self, s: int):
        """Seed ``s``'s current student as an ordinary ``GPT2LMHeadModel`` (a copy)."""
        return seed_model(self.model, s)

    @torch.no_grad()
    def make_batch(self) -> tuple[dict, list[bool]]:
        """Every seed's prompts, completions (the student's or the teacher's) and masks, seed-major."""
        c, n = self.config, self.config.per_device_train_batch_size
        prompts = [p for task_rng in self.rngs for p in self.task.prompts(n, task_rng)]
        on_policy = [bool(coin.random() < c.lmbda) for coin in self.coins]
        # With 0 < lmbda < 1 both models sample every step, each from its own streams: what a seed draws
        # then never depends on what the seeds beside it chose (a seed is the run a one-seed trainer makes).
        rolls = {}
        if c.lmbda > 0:
            rolls[True] = sample(self.model, self.tokenizer, prompts, self.max_len, temperature=c.temperature,
                                 generator=self.generators)
        if c.lmbda < 1:
            rolls[False] = sample(self.teacher, self.tokenizer, prompts, self.max_len, temperature=c.temperature,
                                  generator=self.teacher_generators)
        width = max(r.completion_ids.shape[1] for r in rolls.values())
        pad = self.tokenizer.pad_token_id
        ids, masks = [], []
        for s, own in enumerate(on_policy):
            r, rows = rolls[own], slice(s * n, (s + 1) * n)
            extra = width - r.completion_ids.shape[1]
            ids.append(torch.nn.functional.pad(r.completion_ids[rows], (0, extra), value=pad))
            masks.append(torch.nn.functional.pad(r.completion_mask[rows], (0, extra), value=0))
        any_roll = next(iter(rolls.values()))
        batch = {"prompt_ids": any_roll.prompt_ids, "prompt_mask": any_roll.prompt_mask,
                 "completion_ids": torch.cat(ids), "completion_mask": torch.cat(masks)}
        return batch, on_policy

    def losses(self, batch: dict) -> tuple[list[torch.Tensor], list[dict]]:
        """Each seed's loss and stats, from one student forward (with grad) and one teacher forward."""
        c, n = self.config, self.config.per_device_train_batch_size
        args = (batch["prompt_ids"], batch["completion_ids"], batch["prompt_mask"], batch["completion_mask"])
        student = completion_logits(self.model, *args)
        with torch.no_grad():
            teacher = completion_logits(self.teacher, *args)
        mask = batch["completion_mask"].bool()
        if c.loss_type == "jsd":
            per_token = generalized_jsd_per_token(student, teacher, mask, beta=c.beta, temperature=c.temperature)
        else:
            logp = token_logprobs_from_logits(student, batch["completion_ids"], c.temperature)
            per_token = -torch.where(mask, logp, torch.zeros_like(logp))
        with torch.no_grad():
            rkl = reverse_kl_per_token(student.detach(), teacher, mask, temperature=c.temperature)
        out, stats = [], []
        for s in range(self.num_seeds):
            rows = slice(s * n, (s + 1) * n)
            out.append(masked_mean(per_token[rows], mask[rows]))
            stats.append({"reverse_kl": float(masked_mean(rkl[rows], mask[rows])),
                          "completions/mean_length": float(mask[rows].sum(1).float().mean()),
                          "generated_tokens": float(mask[rows].sum())})
        return out, stats

    def step(self) -> list[dict]:
        """One optimiser step of every seed; returns each seed's metrics."""
        batch, on_policy = self.make_batch()
        self.model.train()
        losses, stats = self.losses(batch)
        self.optimizer.zero_grad()
        self.optimizer.backward(sum(losses))
        if self.config.max_grad_norm is not None:
            self.optimizer.clip_grad_norm_(self.config.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        metrics = []
        for s in range(self.num_seeds):
            m = dict(stats[s], loss=float(losses[s].detach()), on_policy=float(on_policy[s]))
            self.history[s].append(m)
            metrics.append(m)
        return metrics

    def train(self, max_steps: int | None = None, progress: bool = True, callback=None) -> list[list[dict]]:
        """Run ``max_steps`` steps (default ``config.max_steps``); ``callback(step, trainer)`` runs after each."""
        c = self.config
        return run_steps(self, c.max_steps if max_steps is None else max_steps, metric="reverse_kl",
                         desc=f"distill {c.loss_type} beta={c.beta} lmbda={c.lmbda} x{self.num_seeds} seeds",
                         progress=progress, callback=callback)


def train_distillation(student, teacher, tokenizer, task, config: DistillationConfig | None = None, *,
                       num_seeds: int | None = None, seeds: list[int] | None = None, progress: bool = True,
                       callback=None) -> DistillationTrainer:
    """Build a :class:`DistillationTrainer`, run ``config.max_steps`` steps and return it (``.history``, ``.model_of``)."""
    trainer = DistillationTrainer(student, teacher, tokenizer, task, config, num_seeds=num_seeds, seeds=seeds)
    trainer.train(progress=progress, callback=callback)
    return trainer


@torch.no_grad()
def exact_match_by_seed(stack, tokenizer, task, prompts: list[str], max_new_tokens: int | None = None) -> np.ndarray:
    """Greedy exact match of each seed of a seed-stacked model on ``prompts``: an array ``(S,)``.

    One decoding loop for every seed (seed ``s`` answers the ``prompts`` with its own weights); a
    completion counts when the task's reward is 1.0. A plain model is one seed.
    """
    from rlcourse.lm.fast_gpt2 import num_seeds as stacked_seeds

    if not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    s = stacked_seeds(stack) or 1
    roll = sample(stack, tokenizer, list(prompts) * s, max_new_tokens or task.max_new_tokens, temperature=0.0)
    n = len(prompts)
    hits = [(task.reward(list(prompts), roll.completions[i * n:(i + 1) * n]) >= 1.0).float().mean().item()
            for i in range(s)]
    return np.array(hits)
