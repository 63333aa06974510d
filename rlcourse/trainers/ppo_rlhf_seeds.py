"""S independent PPO-RLHF runs, one iteration for all: :class:`SeedBatchedPPORLHFTrainer`.

Seed ``s`` is the run :class:`~rlcourse.trainers.ppo_rlhf.PPORLHFTrainer` would make with ``seed=seeds[s]``:
its own prompts, sampling stream, minibatch order, policy, critic and Adam state, and its own
frozen reference. A reward model is shared (it keeps no state); a reward function and ``gold_fn``
are deep-copied per seed, so one with state (a seeded coin, a noisy rater) draws for seed ``s``
what it draws in seed ``s``'s solo run. What the seeds share is the work (:mod:`rlcourse.lm.seed_stack`
explains why that is faster):

    x_s      <- prompt_fn(batch_size, seed_s * 100_003 + iteration)          for every seed s
    y        <- sample(stacked pi, [x_1 | ... | x_S], generators)             # one decoding loop
    r_s      <- reward_s(x_s, y_s)                                            for every seed s
    V, ref   <- stacked critic(x, y), stacked reference(x, y)                 # one pass each
    r~, A_s, R_s <- KL-shaped rewards; GAE and whitening within each seed's rows
    for each epoch and minibatch k:
        rows  <- minibatch k of every seed's own permutation, seed-major
        L     <- sum_s ppo_rlhf_loss(seed s's rows)                            # one forward, one backward
        one Adam step per seed (SeedAdam over the policy's and the critic's stacks)

Every formula is the single-seed trainer's (:func:`~rlcourse.trainers.ppo_rlhf.kl_shaped_rewards`,
:func:`~rlcourse.trainers.ppo_rlhf.advantages_and_returns`, :func:`~rlcourse.trainers.ppo_rlhf.minibatch_loss`).
Given the same rollout, a seed's loss and gradients equal its single-seed trainer's
(``tests/test_ppo_rlhf_seeds.py``). The critic runs the lean GPT-2 forward
(:func:`rlcourse.lm.fast_gpt2.completion_window_values`), the single-seed trainer the
``transformers`` one: the same values to float rounding.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from rlcourse.lm.fast_gpt2 import supports, supports_scalar_head
from rlcourse.lm.logprobs import sequence_logprobs
from rlcourse.trainers.ppo_rlhf import (PPOConfig, PPORLHFTrainer, advantages_and_returns,
                                        disable_dropout, iteration_metrics, kl_shaped_rewards, minibatch_loss)
from rlcourse.lm.seed_stack import SeedAdam, seed_model, seed_runs, stack_models
from rlcourse.lm.seed_stack import score_by_seed, seed_copies
from rlcourse.lm.value_model import token_values

__all__ = ["SeedBatchedPPORLHFTrainer"]


class SeedBatchedPPORLHFTrainer(PPORLHFTrainer):
    """``SeedBatchedPPORLHFTrainer(config, policy, tokenizer, reward_model, value_model, prompt_fn, seeds=[0, 1, 2])``.

    The arguments are :class:`~rlcourse.trainers.ppo_rlhf.PPORLHFTrainer`'s; ``policy`` and ``value_model``
    are one model each (every seed starts from a copy) or lists of one per seed. ``num_seeds`` or
    ``seeds`` (default ``config.seed + s``) say how many runs. ``history[s]`` is seed ``s``'s log
    (TRL's names, as the single-seed trainer logs them); ``model_of(s)`` and ``critic_of(s)`` copy
    seed ``s``'s policy and critic out. Only plain GPT-2 models with dropout off can be stacked, so
    ``disable_dropout=False`` is refused. The given models are not trained (the stacks are copies).
    A reward function and ``gold_fn`` are never called themselves: seed ``s`` calls its own deep copies,
    ``seed_rewards[s]`` and ``seed_golds[s]``, as its solo run would call them.
    """

    def __init__(self, config: PPOConfig, policy, tokenizer, reward_model, value_model, prompt_fn, gold_fn=None,
                 num_seeds: int | None = None, seeds=None):
        if config.ptx_coef > 0:
            raise ValueError("ptx_coef > 0 (PPO-ptx) is not seed-batched: run PPORLHFTrainer once per seed with ptx_fn")
        if not config.disable_dropout:
            raise ValueError("disable_dropout=False is not seed-batched (dropout makes the stacked forward inexact): "
                             "run PPORLHFTrainer once per seed")
        policies, self.seeds = seed_runs(policy, config.seed, num_seeds, seeds)
        critics, _ = seed_runs(value_model, config.seed, len(self.seeds))
        for model in (*policies, *critics):
            disable_dropout(model)             # as the single-seed trainer does, in place
        for i, (p, v) in enumerate(zip(policies, critics)):
            if not supports(p) or not supports_scalar_head(v):
                raise ValueError(f"seed {i}: the policy must be a plain GPT2LMHeadModel and the critic a ScalarHeadModel "
                                 f"on a plain GPT-2 body (rlcourse.lm.fast_gpt2.supports, supports_scalar_head)")
        self.config, self.tokenizer = config, tokenizer
        is_model, S = isinstance(reward_model, torch.nn.Module), len(self.seeds)
        self.seed_rewards = seed_copies(reward_model.eval() if is_model else reward_model, S, "reward_model")
        self.seed_golds = seed_copies(gold_fn, S, "gold_fn")
        # read by rollout(): a reward model scores every row at once, a function each seed's rows with its own copy
        self.reward_model = self.seed_rewards[0] if is_model else score_by_seed(self.seed_rewards)
        self.prompt_fn, self.gold_fn = prompt_fn, gold_fn
        self.policy = stack_models(policies)
        self.ref_policy = stack_models(policies).eval().requires_grad_(False)
        self.value_model = stack_models(critics)
        self.device = next(self.policy.parameters()).device
        self.optimizer = SeedAdam([*self.policy.parameters(), *self.value_model.parameters()], lr=config.learning_rate)
        self.generator = [torch.Generator(self.device).manual_seed(s) for s in self.seeds]   # read by rollout()
        self.iteration = 0
        self.history: list[list[dict]] = [[] for _ in self.seeds]
        self.kl_coef = [config.kl_coef] * len(self.seeds)   # each seed's coefficient (its own controller if on)

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def model_of(self, s: int):
        """Seed ``s``'s current policy as an ordinary ``GPT2LMHeadModel`` (a copy)."""
        return seed_model(self.policy, s)

    def critic_of(self, s: int):
        """Seed ``s``'s current critic as an ordinary ``ScalarHeadModel`` (a copy)."""
        return seed_model(self.value_model, s)

    def _rows(self, s: int, size: int) -> slice:
        return slice(s * size, (s + 1) * size)

    def token_rewards(self, batch: dict):
        """KL-shaped rewards of every row, each seed's rows with its own ``kl_coef``."""
        c, B = self.config, self.config.batch_size
        parts = [kl_shaped_rewards(batch["scores"][self._rows(s, B)], batch["logprobs"][self._rows(s, B)],
                                   batch["ref_logprobs"][self._rows(s, B)], batch["completion_mask"][self._rows(s, B)],
                                   self.kl_coef[s], c.kl_estimator) for s in range(self.num_seeds)]
        return torch.cat([r for r, _ in parts]), torch.cat([k for _, k in parts])

    def advantages(self, batch: dict):
        """GAE and returns for every row; the advantages whitened within each seed's rows, as each run alone would."""
        c, B = self.config, self.config.batch_size
        parts = [advantages_and_returns(batch["rewards"][self._rows(s, B)], batch["values"][self._rows(s, B)],
                                        batch["completion_mask"][self._rows(s, B)], c.gamma, c.lam, c.whiten_rewards,
                                        c.whiten_advantages) for s in range(self.num_seeds)]
        return torch.cat([a for a, _ in parts]), torch.cat([r for _, r in parts])

    def losses(self, mb: dict) -> tuple[list[torch.Tensor], list[dict]]:
        """Each seed's loss and stats on a seed-major minibatch, from one forward pass of each stack."""
        logprobs = sequence_logprobs(self.policy, mb["prompt_ids"], mb["completion_ids"], mb["completion_mask"],
                                     mb["prompt_mask"], self.config.temperature)
        values = token_values(self.value_model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                              mb["completion_mask"])
        size = logprobs.shape[0] // self.num_seeds
        out = [minibatch_loss(self.config, logprobs[self._rows(s, size)], values[self._rows(s, size)],
                              {k: v[self._rows(s, size)] for k, v in mb.items()}) for s in range(self.num_seeds)]
        return [loss for loss, _ in out], [stats for _, stats in out]

    def loss(self, mb: dict):
        raise NotImplementedError("a seed-batched trainer has one loss per seed: use losses(mb)")

    def step(self) -> list[dict]:
        """One PPO-RLHF iteration of every seed; returns each seed's metrics."""
        c, B = self.config, self.config.batch_size
        prompts = [p for seed in self.seeds for p in self.prompt_fn(B, seed * 100_003 + self.iteration)]
        batch = self.rollout(prompts)
        batch["rewards"], batch["kl"] = self.token_rewards(batch)
        batch["advantages"], batch["returns"] = self.advantages(batch)
        self.policy.train()
        self.value_model.train()
        size = B // c.num_mini_batches
        gens = [torch.Generator().manual_seed(seed * 7919 + self.iteration) for seed in self.seeds]
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        stats: list[list[dict]] = [[] for _ in self.seeds]
        for _ in range(c.num_ppo_epochs):
            orders = [torch.randperm(B, generator=g) + s * B for s, g in enumerate(gens)]
            for start in range(0, B, size):
                rows = torch.cat([order[start:start + size] for order in orders]).to(self.device)
                losses, seed_stats = self.losses({k: v[rows] for k, v in tensors.items()})
                self.optimizer.zero_grad()
                self.optimizer.backward(sum(losses))
                self.optimizer.step()
                for s, st in enumerate(seed_stats):
                    stats[s].append(st)
        self.policy.eval()
        self.value_model.eval()
        return self._log(batch, stats)

    def _log(self, batch: dict, stats: list[list[dict]]) -> list[dict]:
        c, rows = self.config, []
        B = c.batch_size
        for s in range(self.num_seeds):
            part = {k: v[self._rows(s, B)] for k, v in batch.items()}    # tensors and lists alike
            row = iteration_metrics(c, part, stats[s], self.iteration, self.kl_coef[s])
            if self.gold_fn is not None:
                gold = self.seed_golds[s](part["prompts"], part["completions"])
                row["gold/scores"] = float(torch.as_tensor(gold).mean())
            if c.adap_kl_ctrl:   # each seed's controller reads its own KL, as its solo run's would
                self.kl_coef[s] = self.next_kl_coef(self.kl_coef[s], row["objective/kl"])
            self.history[s].append(row)
            rows.append(row)
        self.iteration += 1
        return rows

    def train(self, iterations: int, progress: bool = True) -> list[list[dict]]:
        """Run ``iterations`` iterations of every seed, with a bar of the score and KL averaged over seeds."""
        bar = tqdm(range(iterations), desc=f"PPO-RLHF x{self.num_seeds} seeds", disable=not progress)
        for _ in bar:
            rows = self.step()
            shown = {key: np.mean([r[key] for r in rows]) for key in ("objective/scores", "objective/kl", "gold/scores")
                     if key in rows[0]}
            bar.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in shown.items()})
        return self.history
