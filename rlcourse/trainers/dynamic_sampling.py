"""DAPO's dynamic sampling: keep drawing groups until the batch is full of groups that teach something.

A group whose ``K = num_generations`` rewards are all equal (all right, all wrong) has zero
advantage under every group baseline (GRPO, RLOO): its completions were sampled and scored, and
then contribute nothing to the gradient. Dropping such groups alone shrinks the batch, and the
gradient's noise grows as the policy masters its prompts. DAPO (Yu et al., 2025, "DAPO: an
open-source LLM reinforcement learning system at scale", arXiv 2503.14476, section 3.2) instead
keeps sampling fresh prompts until the batch holds enough informative groups:

    kept <- []
    for draw in 1 .. max_num_gen_batches:                 # verl: algorithm.filter_groups
        prompts <- num_groups fresh prompts, each repeated K times
        y, r    <- sample and score them                  # one generation batch
        kept    <- kept + [groups of (y, r) whose rewards are not all equal]
        if len(kept) >= num_groups: break
    train on kept[:num_groups]                            # fewer if the cap was hit first

The cap is never infinite here (verl's ``max_num_gen_batches=0`` means "no cap"): a policy that
solves every prompt, or none, would otherwise sample forever.

The filter reads the task's rewards, before any KL or length shaping (verl's DAPO filters on
accuracy): a KL penalty or DAPO's overlong penalty makes the shaped rewards of a group differ almost
surely, but the task gives no signal to learn from, and its advantages would be length alone.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlcourse.lm.sampling import Rollout

__all__ = ["informative_groups", "concat_rollout_rows", "fill_batch"]


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(B / K,)`` bool: the group's rewards are not all exactly equal (the group has a learning signal)."""
    if rewards.ndim != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D with a multiple of num_generations={num_generations} entries, "
                         f"got shape {tuple(rewards.shape)}")
    grouped = rewards.view(-1, num_generations)
    return ~(grouped == grouped[:, :1]).all(dim=1)


def _pad_to(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    return F.pad(t, (extra, 0) if left else (0, extra), value=value)


def concat_rollout_rows(parts: list[tuple[Rollout, torch.Tensor]], pad_token_id: int) -> Rollout:
    """One :class:`Rollout` of the chosen rows of several rollouts, in order.

    ``parts`` is a list of ``(rollout, row_index)``. Rollouts drawn at different times have
    different widths: prompts are re-padded on the **left** (masked, so position ids, which come
    from the mask, do not move) and completions on the **right** with ``<pad>`` (mask 0), as the
    sampler lays them out.
    """
    if not parts:
        raise ValueError("parts must name at least one (rollout, rows) pair")
    p_width = max(r.prompt_ids.shape[1] for r, _ in parts)
    c_width = max(r.completion_ids.shape[1] for r, _ in parts)

    def cat(attr, width, value, left):
        return torch.cat([_pad_to(getattr(r, attr)[rows], width, value, left) for r, rows in parts])

    return Rollout(prompt_ids=cat("prompt_ids", p_width, pad_token_id, True),
                   prompt_mask=cat("prompt_mask", p_width, 0, True),
                   completion_ids=cat("completion_ids", c_width, pad_token_id, False),
                   completion_mask=cat("completion_mask", c_width, 0, False),
                   logprobs=cat("logprobs", c_width, 0.0, False),
                   completions=[r.completions[i] for r, rows in parts for i in rows.tolist()],
                   prompts=[r.prompts[i] for r, rows in parts for i in rows.tolist()],
                   eos_token_id=parts[0][0].eos_token_id)


def fill_batch(draw: Callable[[], tuple[Rollout, torch.Tensor]], num_groups: int, num_generations: int,
               max_num_gen_batches: int, pad_token_id: int):
    """Call ``draw()`` (one generation batch: a rollout and its ``(B,)`` rewards) until ``num_groups``
    informative groups are collected or ``max_num_gen_batches`` draws were made.

    Returns ``(rollout, rewards, drawn)``: the first ``num_groups`` informative groups in the order
    they were drawn (fewer when the cap was hit first; ``(None, None, drawn)`` when there were
    none), and ``drawn``, every ``(rollout, rewards)`` drawn, for metrics over all that was sampled.
    """
    if not isinstance(max_num_gen_batches, int) or isinstance(max_num_gen_batches, bool) or max_num_gen_batches < 1:
        raise ValueError(f"max_num_gen_batches must be an integer >= 1, got {max_num_gen_batches!r}")
    drawn, parts, found = [], [], 0
    for _ in range(max_num_gen_batches):
        rollout, rewards = draw()
        drawn.append((rollout, rewards))
        groups = informative_groups(rewards, num_generations).nonzero().flatten()[: num_groups - found]
        if len(groups):
            rows = (groups[:, None] * num_generations + torch.arange(num_generations, device=groups.device)).flatten()
            parts.append((rollout, rows, rewards[rows]))
            found += len(groups)
        if found >= num_groups:
            break
    if not parts:
        return None, None, drawn
    rollout = concat_rollout_rows([(r, rows) for r, rows, _ in parts], pad_token_id)
    return rollout, torch.cat([kept for _, _, kept in parts]), drawn
