"""Dr. GRPO's length bias, measured exactly: which wrong answers a loss aggregation lets grow.

Liu et al. (2025, "Understanding R1-Zero-like training", arXiv 2503.20783) saw the wrong answers of
reasoning models grow long under GRPO. The cause is the normaliser: under ``loss_type="grpo"`` token
``t`` of completion ``i`` weighs ``A_i / |y_i|``, so a long wrong answer (``A_i < 0``) is pushed
down less per token than a short one. :func:`wrong_answer_lengths` trains an
:class:`~rlcourse.measure.exact_gradient.EnumerablePolicy` whose only right answer is ``a <eos>`` with
sampled groups and one aggregation, and tracks the *exact* expected length of its wrong answers,

    E[|y| | y wrong] = sum_{y wrong} pi(y) |y| / sum_{y wrong} pi(y),

computed over every completion the policy can write, so no sampling noise enters the measurement.
"""
from __future__ import annotations

import torch

from rlcourse.measure.exact_gradient import EnumerablePolicy
from rlcourse.losses.grpo import aggregate_loss, group_advantages, per_token_loss

__all__ = ["wrong_answer_lengths"]


def wrong_answer_lengths(loss_type: str, seed: int, steps: int = 60, groups: int = 16, num_generations: int = 8,
                         lr: float = 0.1) -> list[float]:
    """The exact expected length of a wrong answer after each of ``steps`` GRPO steps under ``loss_type``.

    The policy: 2 tokens plus ``<eos>``, completions of up to 6 tokens (127 of them), one softmax
    per prefix (``EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)``). A step
    samples ``groups`` groups of ``num_generations`` completions, rewards ``a <eos>`` with 1 and the
    rest with 0, takes group advantages and one Adam step (``lr``) on the aggregated per-token loss.
    """
    policy = EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)
    ids, mask = policy.completions, policy.mask
    right = ((ids[:, 0] == 1) & (ids[:, 1] == 0)).float()             # "a <eos>"
    wrong, length = right == 0, policy.lengths.float()
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = policy.sample(groups * num_generations, gen)[0]
        logp = policy.token_logprobs()[0, idx]
        per_token = per_token_loss(logp, logp.detach(), group_advantages(right[idx], num_generations), mask[idx],
                                   loss_type)
        loss = aggregate_loss(per_token, mask[idx], loss_type, max_completion_length=policy.max_len)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            p = policy.probs()[0]
        out.append(float((p * length * wrong).sum() / (p * wrong).sum()))
    return out
