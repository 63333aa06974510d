"""Losses on multi-turn episodes: which tokens learn, and how a reward reaches each turn (lesson 10e).

Shapes: ``B`` episodes (the ``K = num_generations`` episodes of a prompt next to each other), ``T``
completion tokens. An episode's completion interleaves the policy's turns and the environment's
observations; ``policy_mask`` ``(B, T)`` is 1 on the tokens the policy sampled and
``completion_mask`` ``(B, T)`` on every real token. ``turn_index`` ``(B, T)`` gives each token's
turn (-1 on padding).

* :func:`policy_mask_from_segments` builds the policy mask from the lengths of an episode's pieces;
* :func:`process_advantages` gives each token an advantage from per-turn rewards (DeepSeekMath's
  process supervision, arXiv 2402.03300, section 4.1.3);
* :func:`multi_turn_loss` is GRPO's clipped loss (:func:`rlcourse.losses.grpo.per_token_loss`,
  :func:`rlcourse.losses.policy_gradient.ppo_clip_objective`, :func:`rlcourse.losses.grpo.aggregate_loss`)
  on the policy's tokens, on every token, or on the policy's tokens plus a cross-entropy term on the
  observations.

Why the mask: the observation tokens were written by the environment, not drawn from the policy,
so ``grad log pi`` of them is not part of the policy gradient; training on them teaches the model to
predict the tool's output, that is, to write it itself. Search-R1 (Jin et al., 2025, arXiv
2503.09516) reports that masking the retrieved tokens is what kept its RL stable; ToRL (Li et al.,
2025, arXiv 2503.23383) masks the interpreter's output the same way. TRL 1.16's ``GRPOTrainer``
multiplies its ``completion_mask`` by a ``tool_mask`` (0 on tool results) before every sum.
"""
from __future__ import annotations

import torch

from rlcourse.kl import as_mask
from rlcourse.losses.grpo import GRPO_LOSS_TYPES, aggregate_loss, importance_weights, per_token_loss
from rlcourse.losses.policy_gradient import check_logprobs_mask, masked_mean, ppo_clip_objective
from rlcourse.returns import check_integer, reward_to_go

__all__ = ["policy_mask_from_segments", "process_advantages", "token_advantages", "multi_turn_loss"]


def policy_mask_from_segments(segments, width: int) -> torch.Tensor:
    """The ``(B, width)`` policy mask of episodes given as the lengths of their pieces.

    ``segments[b]`` lists episode ``b``'s pieces in order, ``[policy_0, observation_0, policy_1,
    observation_1, ...]`` (token counts; the last piece may be a policy turn with no observation).
    The mask is 1 on the policy's pieces, 0 on the observations and on the padding after the
    episode: ``[[3, 2, 1]]`` with ``width=8`` gives ``[[1, 1, 1, 0, 0, 1, 0, 0]]``.
    """
    width = check_integer("width", width, 1)
    if isinstance(segments, (str, torch.Tensor)) or not isinstance(segments, (list, tuple)):
        raise ValueError(f"segments must be a list with one list of piece lengths per episode, got {type(segments).__name__}")
    mask = torch.zeros(len(segments), width, dtype=torch.long)
    for b, pieces in enumerate(segments):
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in pieces) or sum(pieces) > width:
            raise ValueError(f"segments[{b}] must hold token counts >= 0 that sum to at most width={width}, "
                             f"got {list(pieces)}")
        at = 0
        for k, n in enumerate(pieces):
            if k % 2 == 0:                  # even pieces are the policy's turns
                mask[b, at:at + n] = 1
            at += n
    return mask


def process_advantages(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, num_generations: int, *,
                       std_floor: float = 1e-4) -> torch.Tensor:
    """Per-turn advantages from per-turn rewards, DeepSeekMath's process supervision (arXiv 2402.03300, 4.1.3).

    With ``r_ik`` the reward of turn ``k`` of episode ``i`` and ``G(i)`` the real turns of the
    ``K = num_generations`` episodes of ``i``'s prompt:

    ``rn_ik = (r_ik - mean_G(r)) / (std_G(r) + std_floor)``     (mean and std, Bessel's correction,
    over every real turn of the group at once)

    ``A_ik = sum_{k' >= k} rn_ik'``                             (the normalised rewards from turn k on)

    so a turn is credited with what it and the later turns earned (:func:`rlcourse.returns.reward_to_go`
    with ``gamma = 1``). A group whose real rewards are all equal gets exactly 0 (as
    :func:`~rlcourse.losses.grpo.group_advantages`), and so does a group with a single real turn.
    With one turn per episode (the final reward only) this is GRPO's group advantage.

    Args: ``turn_rewards`` ``(B, K_max)``, any value where ``turn_mask`` is 0; ``turn_mask``
    ``(B, K_max)``, 1 on the turns the episode took (a prefix of each row). Returns ``(B, K_max)``,
    0 on missing turns, detached.
    """
    K = check_integer("num_generations", num_generations, 1)
    if std_floor < 0:
        raise ValueError(f"std_floor must be >= 0, got {std_floor!r}")
    rewards = torch.as_tensor(turn_rewards)
    if rewards.ndim != 2 or rewards.shape[0] % K:
        raise ValueError(f"turn_rewards must be (B, K_max) with B a multiple of num_generations={K}, "
                         f"got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.get_default_dtype())).detach()
    m = as_mask(turn_mask, rewards, "turn_mask")
    if not bool(torch.isfinite(rewards[m]).all()):
        raise ValueError("turn_rewards must be finite on the real turns, got NaN or inf")
    clean = torch.where(m, rewards, torch.zeros_like(rewards))
    groups = clean.view(-1, K * rewards.shape[1])
    gm = m.view_as(groups)
    count = gm.sum(1, keepdim=True).to(rewards.dtype)
    mean = groups.sum(1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(gm, groups - mean, torch.zeros_like(groups))
    std = ((centred ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    lo = torch.where(gm, groups, torch.full_like(groups, float("inf"))).min(1, keepdim=True).values
    hi = torch.where(gm, groups, torch.full_like(groups, float("-inf"))).max(1, keepdim=True).values
    flat = (lo == hi) | (count < 2)       # nothing to compare: exactly 0
    normalised = torch.where(flat, torch.zeros_like(centred), centred / (std + std_floor)).view_as(rewards)
    return reward_to_go(normalised, 1.0, mask=m)


def token_advantages(turn_advantages: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """Each token's advantage, that of its turn: ``A_it = A_{i, turn_index[i, t]}``, 0 where ``turn_index`` is -1.

    Args: ``turn_advantages`` ``(B, K_max)``; ``turn_index`` ``(B, T)`` long. Returns ``(B, T)``.
    """
    if turn_advantages.ndim != 2 or turn_index.ndim != 2 or turn_index.shape[0] != turn_advantages.shape[0]:
        raise ValueError(f"turn_advantages must be (B, K_max) and turn_index (B, T), got "
                         f"{tuple(turn_advantages.shape)} and {tuple(turn_index.shape)}")
    if int(turn_index.max()) >= turn_advantages.shape[1] or int(turn_index.min()) < -1:
        raise ValueError(f"turn_index must hold turns in [0, {turn_advantages.shape[1]}) or -1 on padding, got "
                         f"{int(turn_index.min())} to {int(turn_index.max())}")
    picked = turn_advantages.gather(1, turn_index.clamp(min=0))
    return torch.where(turn_index >= 0, picked, torch.zeros_like(picked))


def multi_turn_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    policy_mask: torch.Tensor, completion_mask: torch.Tensor, *, mask_observations: bool = True,
                    observation_loss_weight: float = 0.0, loss_type: str = "dapo", epsilon: float = 0.2,
                    epsilon_high: float | None = None, max_completion_length: int | None = None) -> torch.Tensor:
    """GRPO's loss on multi-turn episodes, with the observation tokens masked or not.

    With ``m`` the loss mask (``policy_mask`` when ``mask_observations``, else ``completion_mask``:
    every token, the environment's too), ``w`` the per-token ratio ``pi / pi_old`` and ``A`` the
    advantage (one per episode, ``(B,)``, broadcast over its tokens; or one per token, ``(B, T)``,
    from :func:`token_advantages`):

    ``L = aggregate_m(-min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A))
          + observation_loss_weight * (-sum_t o_t log pi(y_t) / sum_t o_t)``

    where ``aggregate_m`` is :func:`~rlcourse.losses.grpo.aggregate_loss` of ``loss_type`` over the
    tokens of ``m`` and ``o = completion_mask - policy_mask`` marks the observations: the second term
    is a small supervised (cross-entropy) loss on what the environment wrote, so the model learns to
    read it without the reward pushing on it. On an episode without observations the three
    settings give the same loss, the single-turn GRPO loss.

    The tokens the environment wrote have no sampler log-prob; ``old_logprobs`` there is whatever
    the trainer puts (the recomputed ``pi_old``, or the current log-probs detached: ratio 1).

    Args: ``logprobs`` (with grad), ``old_logprobs``, ``policy_mask``, ``completion_mask`` ``(B, T)``;
    ``advantages`` ``(B,)`` or ``(B, T)``. Returns a scalar.
    """
    if loss_type not in GRPO_LOSS_TYPES or loss_type in ("cispo", "sapo"):
        raise ValueError(f"loss_type must be one of grpo, bnpo, dr_grpo, dapo (PPO's clipped surrogate), "
                         f"got {loss_type!r}")
    if not observation_loss_weight >= 0:
        raise ValueError(f"observation_loss_weight must be >= 0, got {observation_loss_weight!r}")
    completion = as_mask(completion_mask, logprobs, "completion_mask")
    policy = as_mask(policy_mask, logprobs, "policy_mask")
    check_logprobs_mask(logprobs, completion)
    if bool((policy & ~completion).any()):
        raise ValueError("policy_mask must be 0 wherever completion_mask is 0: a policy token is a real token")
    mask = policy if mask_observations else completion
    advantages = torch.as_tensor(advantages, dtype=logprobs.dtype, device=logprobs.device).detach()
    if advantages.shape == (logprobs.shape[0],):
        per_token = per_token_loss(logprobs, old_logprobs, advantages, mask, loss_type=loss_type, epsilon=epsilon,
                                   epsilon_high=epsilon_high)
    elif advantages.shape == logprobs.shape:
        high = epsilon if epsilon_high is None else epsilon_high
        ratio = importance_weights(logprobs, old_logprobs, mask, "token")
        per_token = -ppo_clip_objective(ratio, torch.where(mask, advantages, torch.zeros_like(advantages)),
                                        epsilon, high)
    else:
        raise ValueError(f"advantages must be (B,) = ({logprobs.shape[0]},) or (B, T) = {tuple(logprobs.shape)}, "
                         f"got {tuple(advantages.shape)}")
    loss = aggregate_loss(per_token, mask, loss_type=loss_type, max_completion_length=max_completion_length)
    if observation_loss_weight:
        observed = completion & ~policy
        if bool(observed.any()):        # no observation, no term
            loss = loss - observation_loss_weight * masked_mean(logprobs, observed)
    return loss
