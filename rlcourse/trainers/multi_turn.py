"""GRPO on multi-turn episodes with a tool (lesson 10e): several runs, one seed-stacked model.

Pseudocode of one step (the formulas live in :mod:`rlcourse.losses.multi_turn` and :mod:`rlcourse.losses.grpo`):

    prompts_s <- task.prompts(n, rng_s), each repeated num_generations times        for every run s
    episodes  <- rollout(stacked pi, [prompts_1 | ... | prompts_S], task.make_env)   # rlcourse.lm.multi_turn
    A_s       <- group_advantages(final rewards)                  (reward_mode="final": one per episode)
                 token_advantages(process_advantages(turn rewards))   (reward_mode="per_turn": one per turn)
    logp      <- log pi(every completion token), one forward pass over the whole episodes
    L         <- sum_s multi_turn_loss(logp_s, logp_s detached, A_s, policy mask, completion mask,
                                       mask_observations, observation_loss_weight)
    clip each run's gradient to max_grad_norm; one Adam step per run           # rlcourse.lm.seed_stack.SeedAdam

A *run* is one :class:`MultiTurnConfig` (with its ``seed``): the runs of a trainer may differ in
what the loss does with the episodes (``mask_observations``, ``observation_loss_weight``,
``reward_mode``, ``learning_rate``) but not in how episodes are drawn or gradients clipped (:data:`ROLLOUT_FIELDS`), so
a masked and an unmasked run on one seed see the same first batch: the comparison is paired. Each
run is the run it would be alone: its own prompt stream, sampling stream, weights and Adam state.
One update per batch (``num_iterations = 1``): the ratio is 1 and ``pi_old`` is the current
log-probs, detached, on every token, the environment's included.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from rlcourse.lm.fast_gpt2 import supports
from rlcourse.lm.logprobs import completion_logits, token_logprobs_from_logits
from rlcourse.lm.multi_turn import END_REASONS, rollout
from rlcourse.lm.seed_stack import SeedAdam, seed_model, stack_models
from rlcourse.losses.grpo import group_advantages
from rlcourse.losses.multi_turn import multi_turn_loss, process_advantages, token_advantages
from rlcourse.trainers.steps import run_steps

__all__ = ["MultiTurnConfig", "ROLLOUT_FIELDS", "MultiTurnTrainer", "episode_metrics", "evaluate_tool_use"]

REWARD_MODES = ("final", "per_turn")


@dataclass
class MultiTurnConfig:
    """One run's settings, TRL's ``GRPOConfig`` names where TRL has the setting."""

    learning_rate: float = 3e-4
    """Adam's step size (TRL: 1e-6, sized for billion-parameter models)"""
    per_device_train_batch_size: int = 64
    """episodes per step (TRL: 8 completions)"""
    num_generations: int = 8
    """episodes per prompt, the group of GRPO's advantage"""
    temperature: float = 1.0
    """sampling temperature; log-probs are taken at it"""
    epsilon: float = 0.2
    """the clip width of the ratio"""
    epsilon_high: float | None = None
    """DAPO's upper clip width (None: epsilon)"""
    loss_type: str = "dapo"
    """how per-token losses are averaged (rlcourse.losses.grpo.aggregate_loss): grpo, bnpo, dr_grpo, dapo"""
    max_completion_length: int = 32
    """tokens after the prompt, policy and tool together (TRL's meaning in multi-turn runs)"""
    max_tool_calling_iterations: int = 3
    """tool calls per episode at most: max_turns = this + 1 (TRL: None, unlimited)"""
    max_turn_tokens: int = 8
    """tokens one turn may sample (ours: TRL lets a turn run to the completion budget)"""
    mask_observations: bool = True
    """leave the tool's tokens out of the policy loss (TRL always does, with its tool_mask)"""
    observation_loss_weight: float = 0.0
    """weight of a cross-entropy term on the tool's tokens (ours; TRL 1.16 has none)"""
    reward_mode: str = "final"
    """'final': the answer's reward on every token; 'per_turn': process advantages from each turn's reward"""
    scale_rewards: str = "group"
    """GRPO's advantage scaling (final reward only): group, batch or none"""
    std_floor: float = 1e-4
    """added to the std in the advantage (TRL adds 1e-4)"""
    max_grad_norm: float | None = 1.0
    """each run's gradient clipped to this norm"""
    max_steps: int = 40
    """training steps"""
    seed: int = 0
    """the run's prompt and sampling streams"""

    def __post_init__(self):
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(f"loss_type must be one of grpo, bnpo, dr_grpo, dapo, got {self.loss_type!r}")
        if self.num_generations < 2 or self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size ({self.per_device_train_batch_size}) must be a multiple of "
                             f"num_generations ({self.num_generations}), which must be >= 2")
        if not self.learning_rate > 0 or not self.temperature > 0:
            raise ValueError(f"learning_rate and temperature must be > 0, got {self.learning_rate!r}, {self.temperature!r}")
        if self.max_tool_calling_iterations < 0 or self.max_turn_tokens < 1 or self.max_completion_length < 1:
            raise ValueError("max_tool_calling_iterations must be >= 0, max_turn_tokens and max_completion_length >= 1")
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {self.reward_mode!r}")
        if not self.observation_loss_weight >= 0:
            raise ValueError(f"observation_loss_weight must be >= 0, got {self.observation_loss_weight!r}")
        if self.observation_loss_weight and not self.mask_observations:
            raise ValueError("observation_loss_weight adds a cross-entropy term on the tool's tokens to a loss that "
                             "masks them; with mask_observations=False the policy loss already trains on them")

    @property
    def max_turns(self) -> int:
        return self.max_tool_calling_iterations + 1


ROLLOUT_FIELDS = ("per_device_train_batch_size", "num_generations", "temperature", "max_completion_length",
                  "max_tool_calling_iterations", "max_turn_tokens", "max_grad_norm")


def episode_metrics(episodes) -> dict:
    """What one batch of :class:`~rlcourse.lm.multi_turn.Episodes` did, as floats.

    ``reward`` (mean final reward), ``tools/call_frequency`` (TRL's name: calls per episode),
    ``tool_call_rate`` (share of episodes with a call), ``turns``, ``completions/mean_length`` (the
    policy's tokens, ``policy_mask.sum``, as TRL counts), ``completions/mean_span`` (every token
    after the prompt) and ``end/<reason>`` (share of episodes that ended so).
    """
    reasons = Counter(episodes.end_reasons)
    n = len(episodes.end_reasons)
    out = {"reward": float(episodes.rewards.float().mean()),
           "tools/call_frequency": float(episodes.tool_calls.float().mean()),
           "tool_call_rate": float((episodes.tool_calls > 0).float().mean()),
           "turns": float(episodes.turns.float().mean()),
           "completions/mean_length": float(episodes.policy_mask.sum(1).float().mean()),
           "completions/mean_span": float(episodes.completion_mask.sum(1).float().mean())}
    out.update({f"end/{r}": reasons[r] / n for r in END_REASONS})
    return out


@torch.no_grad()
def evaluate_tool_use(model, tokenizer, task, prompts: list[str], *, tool_enabled: bool = True, temperature: float = 0.0,
                      generator=None, max_turns: int = 4, max_turn_tokens: int = 8,
                      max_completion_length: int = 32) -> list[dict]:
    """Each run's metrics on ``prompts`` (:func:`episode_metrics`), one dict per seed of ``model``.

    A seed-stacked model is rolled out once, every seed on all ``prompts``. With
    ``tool_enabled=False`` the calculator is off and ``hallucination_rate`` is the share of episodes
    with a call whose next turn writes the tool's output itself (:class:`~rlcourse.tasks.tool_env.CalculatorEnv`).
    ``generator``: None, or one per seed when ``temperature > 0``.
    """
    from rlcourse.lm.fast_gpt2 import num_seeds

    seeds = num_seeds(model) or 1
    ep = rollout(model, tokenizer, list(prompts) * seeds, lambda: task.make_env(tool_enabled=tool_enabled),
                 max_turns=max_turns, max_turn_tokens=max_turn_tokens, max_completion_length=max_completion_length,
                 temperature=temperature, generator=generator)
    out = []
    for s in range(seeds):
        rows = slice(s * len(prompts), (s + 1) * len(prompts))
        part = ep.select(rows)
        m = episode_metrics(part)
        called = [e for e, c in zip(part.envs, part.tool_calls.tolist()) if c > 0]
        m["hallucination_rate"] = float(np.mean([e.hallucinated for e in called])) if called else 0.0
        out.append(m)
    return out


class MultiTurnTrainer:
    """``trainer = MultiTurnTrainer(model, tokenizer, task, configs); trainer.train()``.

    ``configs`` is one :class:`MultiTurnConfig` or a list, one per run (see the module docstring);
    all start from ``model`` (a plain GPT-2, :func:`rlcourse.lm.fast_gpt2.supports`). ``task`` has
    ``prompts(n, rng)`` and ``make_env()`` (:class:`rlcourse.tasks.tool_env.ToolSumTask`).
    ``history[s]`` holds run ``s``'s metrics per step (:func:`episode_metrics` and ``loss``);
    ``model_of(s)`` is run ``s``'s policy as an ordinary ``GPT2LMHeadModel``; ``model`` is the stack.
    """

    def __init__(self, model, tokenizer, task, configs):
        self.configs = list(configs) if isinstance(configs, (list, tuple)) else [configs or MultiTurnConfig()]
        if not self.configs or not all(isinstance(c, MultiTurnConfig) for c in self.configs):
            raise ValueError("configs must be a MultiTurnConfig or a non-empty list of them")
        first = self.configs[0]
        for i, c in enumerate(self.configs):
            differ = [f for f in ROLLOUT_FIELDS if getattr(c, f) != getattr(first, f)]
            if differ:
                raise ValueError(f"configs[{i}] draws episodes differently from configs[0] ({', '.join(differ)}): "
                                 f"runs of one trainer share the rollout; train them in separate trainers")
        if not supports(model):
            raise ValueError(f"model must be a plain GPT-2 model (rlcourse.lm.fast_gpt2.supports), got {type(model).__name__}")
        self.tokenizer, self.task = tokenizer, task
        self.model = stack_models([model] * len(self.configs))
        self.optimizer = SeedAdam(self.model.parameters(), lr=first.learning_rate)
        self.device = next(self.model.parameters()).device
        self.rngs = [np.random.default_rng(c.seed) for c in self.configs]
        self.generators = [torch.Generator(device=self.device).manual_seed(c.seed) for c in self.configs]
        self.history: list[list[dict]] = [[] for _ in self.configs]

    @property
    def num_runs(self) -> int:
        return len(self.configs)

    def model_of(self, s: int):
        """Run ``s``'s current policy as an ordinary ``GPT2LMHeadModel`` (a copy)."""
        return seed_model(self.model, s)

    def rollout(self):
        """Every run's episodes of one step, seed-major rows."""
        c = self.configs[0]
        n = c.per_device_train_batch_size // c.num_generations
        prompts = [p for task_rng in self.rngs for p in self.task.prompts(n, task_rng) for _ in range(c.num_generations)]
        return rollout(self.model, self.tokenizer, prompts, self.task.make_env, max_turns=c.max_turns,
                       max_turn_tokens=c.max_turn_tokens, max_completion_length=c.max_completion_length,
                       temperature=c.temperature, generator=self.generators)

    def advantages(self, s: int, episodes) -> torch.Tensor:
        """Run ``s``'s advantages on its episodes: ``(B,)`` (final reward) or ``(B, T)`` (per turn)."""
        c = self.configs[s]
        if c.reward_mode == "final":
            return group_advantages(episodes.rewards, c.num_generations, c.scale_rewards, c.std_floor)
        table = torch.zeros(len(episodes.turn_rewards), c.max_turns, device=self.device)
        turn_mask = torch.zeros_like(table, dtype=torch.bool)
        for b, rewards in enumerate(episodes.turn_rewards):
            table[b, :len(rewards)] = torch.tensor(rewards, device=self.device)
            turn_mask[b, :len(rewards)] = True
        return token_advantages(process_advantages(table, turn_mask, c.num_generations, std_floor=c.std_floor),
                                episodes.turn_index)

    def step(self) -> list[dict]:
        """One training step of every run; returns each run's metrics."""
        c0 = self.configs[0]
        ep = self.rollout()
        size = c0.per_device_train_batch_size
        self.model.train()
        logits = completion_logits(self.model, ep.prompt_ids, ep.completion_ids, ep.prompt_mask, ep.completion_mask)
        logp = token_logprobs_from_logits(logits, ep.completion_ids, c0.temperature)
        logp = torch.where(ep.completion_mask.bool(), logp, torch.zeros_like(logp))
        losses, metrics = [], []
        for s, c in enumerate(self.configs):
            rows = slice(s * size, (s + 1) * size)
            part = ep.select(rows)
            loss = multi_turn_loss(logp[rows], logp[rows].detach(), self.advantages(s, part), part.policy_mask,
                                   part.completion_mask, mask_observations=c.mask_observations,
                                   observation_loss_weight=c.observation_loss_weight, loss_type=c.loss_type,
                                   epsilon=c.epsilon, epsilon_high=c.epsilon_high,
                                   max_completion_length=c.max_completion_length)
            losses.append(loss)
            metrics.append({**episode_metrics(part), "loss": float(loss.detach())})
        self.optimizer.zero_grad()
        self.optimizer.backward(sum(losses))
        if c0.max_grad_norm is not None:
            self.optimizer.clip_grad_norm_(c0.max_grad_norm)
        self.optimizer.step(lr=[c.learning_rate for c in self.configs])
        self.model.eval()
        for s, m in enumerate(metrics):
            self.history[s].append(m)
        return metrics

    def train(self, max_steps: int | None = None, progress: bool = True, callback=None) -> list[list[dict]]:
        """``max_steps`` steps (default ``configs[0].max_steps``) with a tqdm bar of the mean reward over runs.

        ``callback(step, trainer)`` runs after each step.
        """
        return run_steps(self, self.configs[0].max_steps if max_steps is None else max_steps, metric="reward",
                         desc=f"multi-turn GRPO x{self.num_runs} runs", progress=progress, callback=callback)
