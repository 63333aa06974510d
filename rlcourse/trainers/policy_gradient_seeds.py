"""S independent runs of the critic-free policy-gradient trainer (REINFORCE, RLOO, GRPO family), one step for all.

Each seed is the run that :class:`~rlcourse.trainers.policy_gradient.PolicyGradientTrainer` would make
with ``config.seed`` set to that seed: its own prompt stream (``numpy`` generator), its own sampling
stream (``torch.Generator``), its own copy of the task (a reward with state, a seeded coin or a
noisy rater, draws for seed s what it draws in seed s's solo run), weights, Adam moments and step
count, baseline and metrics. What they share is the work of a step (see :mod:`rlcourse.lm.seed_stack`
for why that is faster):

    prompts_s <- task_s.prompts(n, rng_s), each repeated num_generations times    for every seed s
    y         <- sample(stacked pi, [prompts_1 | ... | prompts_S], generators)    # one decoding loop
    r_s, A_s  <- task_s.reward(prompts_s, y_s), advantages(r_s)                   for every seed s
    repeat num_iterations times:
        logp  <- log pi(y) at `temperature`                                       # one forward pass
        L     <- sum_s loss_s(logp_s, A_s)                                        # one backward pass
        clip each seed's gradient to max_grad_norm; one Adam step per seed        # SeedAdam

Every formula is the single-seed trainer's (:func:`~rlcourse.trainers.policy_gradient.advantages`,
:func:`~rlcourse.trainers.policy_gradient.loss_and_stats`), applied to each seed's rows. Given the same
completions, a seed's loss and gradient equal the single-seed trainer's (``tests/test_policy_gradient_seeds.py``).
DAPO's dynamic sampling is not batched (each seed would draw a different number of generation
batches): ``dynamic_sampling=True`` is refused here.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse.kl import kl_k1
from rlcourse.lm.fast_gpt2 import supports
from rlcourse.trainers.policy_gradient import (PolicyGradientConfig, _Batch, advantages, attach_sampler_logprobs,
                                         checked_rewards, completion_budget, draw_metrics, entropy_coef_after,
                                         entropy_coef_now, logits_and_logprobs, loss_and_stats, overlong_shaped,
                                         reward_table)
from rlcourse.lm.sampling import sample
from rlcourse.lm.seed_stack import SeedAdam, seed_copies, seed_model, seed_runs, stack_models
from rlcourse.trainers.steps import run_steps

__all__ = ["SeedBatchedPolicyGradientTrainer"]


class SeedBatchedPolicyGradientTrainer:
    """``trainer = SeedBatchedPolicyGradientTrainer(model, tokenizer, task, config); trainer.train()``.

    ``num_seeds`` runs start from ``model`` (a plain GPT-2: :func:`rlcourse.lm.fast_gpt2.supports`),
    or one run from each model of a list; seed ``s`` uses ``seeds[s]``, by default ``config.seed + s``
    (the seeds are not a ``PolicyGradientConfig`` field: that config stays the one TRL's
    ``GRPOConfig`` mirrors, and one seed per run is TRL's way). ``history[s]`` holds seed ``s``'s metrics, one dict per step (TRL's names,
    as the single-seed trainer logs them); ``model_of(s)`` returns seed ``s``'s policy as an ordinary
    ``GPT2LMHeadModel``. With ``beta > 0`` the reference is each seed's starting model, frozen.

    ``task`` is one task, which each seed gets a deep copy of (``tasks[s]``), or a list of one task
    per seed (each seed its own seeded random reward, say); either way seed ``s``'s task sees exactly
    the calls of seed ``s``'s solo run, whatever other seeds run beside it.
    """

    def __init__(self, model, tokenizer, task, config: PolicyGradientConfig | None = None,
                 num_seeds: int | None = None, seeds: list[int] | None = None, sampler=None):
        self.config = c = config or PolicyGradientConfig()
        if c.dynamic_sampling:
            raise ValueError("dynamic_sampling is not seed-batched (each seed would draw a different number of "
                             "generation batches): run PolicyGradientTrainer once per seed")
        models, self.seeds = seed_runs(model, c.seed, num_seeds, seeds)
        for i, m in enumerate(models):
            if not supports(m):
                raise ValueError(f"model {i} is not a plain GPT-2 model (rlcourse.lm.fast_gpt2.supports): only those "
                                 f"can be seed-batched; use PolicyGradientTrainer for {type(m).__name__}")
        if isinstance(task, (list, tuple)):
            if len(task) != len(self.seeds):
                raise ValueError(f"task must be one task or a list of one task per seed ({len(self.seeds)}), "
                                 f"got {len(task)} tasks")
            self.tasks = list(task)
        else:
            self.tasks = seed_copies(task, len(self.seeds), "task")
        self.tokenizer, self.task = tokenizer, self.tasks[0]
        budgets = {completion_budget(c, t) for t in self.tasks}
        if len(budgets) > 1:
            raise ValueError(f"the seeds' tasks give different completion budgets {sorted(budgets)}: set "
                             f"config.max_completion_length")
        self.max_len = budgets.pop()
        self.model = stack_models(models)
        self.ref_model = stack_models(models).eval().requires_grad_(False) if c.beta > 0 else None
        self.optimizer = SeedAdam(self.model.parameters(), lr=c.learning_rate)
        self.device = next(self.model.parameters()).device
        self.rngs = [np.random.default_rng(s) for s in self.seeds]
        self.generators = [torch.Generator(device=self.device).manual_seed(s) for s in self.seeds]
        self.baselines: list[float | None] = [None] * len(self.seeds)
        self.history: list[list[dict]] = [[] for _ in self.seeds]
        self.sampler = sampler   # off-policy (lesson 10c): PolicyGradientTrainer's ``sampler``, on the stacked model
        # each seed's adaptive entropy controller (lesson 10b): coefficient and last measured entropy
        self.entropy_coefs = [c.entropy_coef] * len(self.seeds)
        self.last_entropies = [float("inf")] * len(self.seeds)
        self.last_batch: _Batch | None = None    # the latest step's batch, for measurements (lesson 10b)

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def model_of(self, s: int):
        """Seed ``s``'s current policy as an ordinary ``GPT2LMHeadModel`` (a copy)."""
        return seed_model(self.model, s)

    def _rows(self, s: int, batch: int) -> slice:
        return slice(s * batch, (s + 1) * batch)

    @torch.no_grad()
    def make_batch(self) -> tuple[_Batch, torch.Tensor]:
        """Sample, score and compute every seed's advantages; the batch (seed-major rows) and which seeds learn."""
        c = self.config
        n_groups = c.per_device_train_batch_size // c.num_generations
        prompts = [[p for p in task.prompts(n_groups, rng) for _ in range(c.num_generations)]
                   for task, rng in zip(self.tasks, self.rngs)]
        size = len(prompts[0])
        roll = (self.sampler or sample)(self.model, self.tokenizer, [p for block in prompts for p in block], self.max_len,
                      temperature=c.temperature, generator=self.generators)
        mask = roll.completion_mask
        if c.mask_truncated_completions:
            mask = mask * roll.finished.long()[:, None]
        b = _Batch(roll.prompt_ids, roll.prompt_mask, roll.completion_ids, mask)
        rewards, tables = [], []
        for s, (task, block) in enumerate(zip(self.tasks, prompts)):
            rewards.append(checked_rewards(task, block, roll.completions[self._rows(s, size)], self.device))
            tables.append(reward_table(task) if c.multi_objective_aggregation == "normalize_then_sum" else None)
        rewards = torch.cat(rewards)
        rewards = overlong_shaped(c, roll, rewards, self.max_len)   # lesson 10b: DAPO's soft overlong punishment
        metrics = [draw_metrics([(roll.select(self._rows(s, size)), rewards[self._rows(s, size)])], c.num_generations)
                   for s in range(self.num_seeds)]
        if self.ref_model is not None:
            b.ref_logprobs = logits_and_logprobs(self.ref_model, b, c.temperature)[1]
        shaped = rewards
        if c.kl_in_reward and b.ref_logprobs is not None:   # TRL's RLOO: r - beta * sum_t (log pi_old - log pi_ref)
            old_now = logits_and_logprobs(self.model, b, c.temperature)[1]
            shaped = rewards - c.beta * kl_k1(old_now, b.ref_logprobs, mask).sum(1)
        active = mask.view(self.num_seeds, size, -1).sum((1, 2)).cpu() > 0   # a seed with no real token skips
        per_seed = []
        for s in range(self.num_seeds):
            if not bool(active[s]):   # skipped, as the single-seed trainer skips it: the baseline does not move
                per_seed.append(torch.zeros_like(shaped[self._rows(s, size)]))
                continue
            adv, self.baselines[s] = advantages(c, shaped[self._rows(s, size)], self.baselines[s], tables[s])
            per_seed.append(adv)
        b.rewards, b.advantages, b.metrics = shaped, torch.cat(per_seed), metrics
        if c.num_iterations > 1:
            b.old_logprobs = logits_and_logprobs(self.model, b, c.temperature)[1]
        if self.sampler is not None:
            attach_sampler_logprobs(c, self.model, b, roll.logprobs)
        return b, active

    def losses(self, b: _Batch, active: torch.Tensor | None = None) -> tuple[list, list[dict]]:
        """Each seed's loss (None where the seed skips) and stats from one forward pass over all seeds."""
        size = b.completion_ids.shape[0] // self.num_seeds
        active = torch.ones(self.num_seeds, dtype=torch.bool) if active is None else active
        logits, logp = logits_and_logprobs(self.model, b, self.config.temperature)
        out, stats = [], []
        for s in range(self.num_seeds):
            if not bool(active[s]):
                out.append(None)
                stats.append({})
                continue
            rows = self._rows(s, size)
            coef = entropy_coef_now(self.config, self.entropy_coefs[s], self.last_entropies[s])
            loss, st = loss_and_stats(self.config, logits[rows], logp[rows], b.rows(rows), self.max_len, entropy_coef=coef)
            out.append(loss)
            stats.append(st)
        return out, stats

    def step(self) -> list[dict]:
        """One training step of every seed; returns each seed's metrics."""
        c = self.config
        b, active = self.make_batch()
        self.last_batch = b
        self.model.train()
        for _ in range(c.num_iterations):
            losses, stats = self.losses(b, active)
            self.optimizer.zero_grad()
            if bool(active.any()):
                self.optimizer.backward(sum(loss for loss in losses if loss is not None))
                if c.max_grad_norm is not None:
                    self.optimizer.clip_grad_norm_(c.max_grad_norm)
                self.optimizer.step(active)
            for s, st in enumerate(stats):
                self.entropy_coefs[s], self.last_entropies[s] = entropy_coef_after(c, self.entropy_coefs[s],
                                                                                   self.last_entropies[s], st)
        self.model.eval()
        metrics = []
        for s in range(self.num_seeds):
            m = dict(b.metrics[s])
            if losses[s] is None:
                m.update(loss=0.0, skipped=1.0)
            else:
                m.update(stats[s], loss=float(losses[s].detach()))
                if c.use_adaptive_entropy:
                    m["entropy_coef"] = self.entropy_coefs[s]
            self.history[s].append(m)
            metrics.append(m)
        return metrics

    def train(self, max_steps: int | None = None, progress: bool = True, callback=None) -> list[list[dict]]:
        """Run ``max_steps`` steps (default ``config.max_steps``) with a tqdm bar of the reward averaged over seeds.

        ``callback(step, trainer)`` runs after each step.
        """
        c = self.config
        return run_steps(self, c.max_steps if max_steps is None else max_steps, metric="reward",
                         desc=f"{c.advantage_estimator}/{c.loss_type} x{self.num_seeds} seeds",
                         progress=progress, callback=callback)
