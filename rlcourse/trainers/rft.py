"""Rejection-sampling fine-tuning (RFT, a.k.a. expert iteration): SFT on the policy's own verified answers (lesson 12b).

Pseudocode of one step:

    prompts <- n prompts, each repeated num_generations times
    y       <- sample(pi_theta, prompts) at temperature 1                    # rlcourse.lm.sample
    keep    <- the (prompt, y) whose task reward is 1                        # the verifier filters
    loss    <- mean NLL of the kept completions' tokens and <eos>            # rlcourse.trainers.sft.sft_loss
    one Adam step (the optimiser persists across steps); no kept answer: no step

It is the policy gradient with a 0/1 reward and no baseline, each kept answer weighted by one over the
number of kept tokens: RL in the sense that the data comes from the policy and a verifier, SFT in the
sense of the loss. Any causal LM works (a LoRA-adapted one too); lesson 12's capstone runs the same idea.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlcourse.lm.sampling import sample
from rlcourse.trainers.sft import encode_examples, sft_loss

__all__ = ["RFTConfig", "RFTTrainer"]


@dataclass
class RFTConfig:
    """Settings of :class:`RFTTrainer` (names as :class:`~rlcourse.trainers.policy_gradient.PolicyGradientConfig`)."""

    learning_rate: float = 1e-3
    """Adam's step size."""
    per_device_train_batch_size: int = 64
    """completions sampled per step (prompts x num_generations)."""
    num_generations: int = 8
    """completions per prompt."""
    max_grad_norm: float | None = 1.0
    """the gradient's norm is clipped to this (None: no clipping)."""
    seed: int = 0
    """seeds the prompt stream and the sampler."""

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if self.num_generations < 1 or self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size ({self.per_device_train_batch_size}) must be a positive "
                             f"multiple of num_generations ({self.num_generations})")


class RFTTrainer:
    """``RFTTrainer(model, tokenizer, task, config).train(steps)``: ``history`` holds ``{"reward", "kept", "loss"}`` per step."""

    def __init__(self, model, tokenizer, task, config: RFTConfig | None = None):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.config = c = config or RFTConfig()
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=c.learning_rate)
        self.rng = np.random.default_rng(c.seed)
        self.generator = torch.Generator(device=self.device).manual_seed(c.seed)
        self.history: list[dict] = []

    def step(self) -> dict:
        c = self.config
        prompts = [p for p in self.task.prompts(c.per_device_train_batch_size // c.num_generations, self.rng)
                   for _ in range(c.num_generations)]
        with torch.no_grad():
            roll = sample(self.model.eval(), self.tokenizer, prompts, self.task.max_new_tokens, generator=self.generator)
        rewards = self.task.reward(prompts, roll.completions)
        kept = [{"prompt": p, "completion": y} for p, y, r in zip(prompts, roll.completions, rewards.tolist()) if r >= 1.0]
        metrics = {"reward": float(rewards.mean()), "kept": len(kept), "loss": 0.0}
        if kept:
            ids, attention, loss_mask = (t.to(self.device) for t in encode_examples(self.tokenizer, kept))
            self.model.train()
            loss = sft_loss(self.model, ids, attention, loss_mask)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if c.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
            self.optimizer.step()
            self.model.eval()
            metrics["loss"] = float(loss.detach())
        self.history.append(metrics)
        return metrics

    def train(self, steps: int, progress: bool = False) -> list[dict]:
        from tqdm.auto import tqdm

        for _ in tqdm(range(steps), desc="RFT", disable=not progress):
            self.step()
        return self.history
