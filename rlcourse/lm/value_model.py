"""The critic of PPO-RLHF: one value per completion token, ``V(s_t)`` with ``s_t = (x, y_<t)``.

It is a :class:`~rlcourse.lm.scalar_head.ScalarHeadModel` read at every position instead of the
last one. The value of the state *before* completion token ``t`` is the head's output at the
column that predicts that token: column ``P - 1 + t`` of ``[prompt | completion]``, the same
shift as for log-probs. So ``V(s_0)`` is read at the prompt's last token, and nothing is read at
the last completion token (its successor state is terminal, value 0).

Two ways to start it, both used in practice and compared in lesson 08:

* ``init="reward"``: a copy of the trained reward model (InstructGPT, Ouyang et al. 2022, and
  TRL's PPO examples). It already knows what a good completion looks like, so its first values
  are informative about the final score;
* ``init="policy"``: the policy's body with a zero head: its first values are all 0, so the first
  advantages are plain returns.
"""
from __future__ import annotations

import copy

import torch

from rlcourse.lm import fast_gpt2
from rlcourse.lm.scalar_head import ScalarHeadModel

__all__ = ["make_value_model", "token_values"]


def make_value_model(init: str, policy=None, reward_model=None) -> ScalarHeadModel:
    """A fresh critic: a deep copy of ``reward_model`` (``init="reward"``) or the ``policy``'s body with a zero head."""
    if init == "reward":
        if not isinstance(reward_model, ScalarHeadModel):
            raise ValueError("init='reward' needs reward_model, a ScalarHeadModel")
        critic = copy.deepcopy(reward_model)
        for p in critic.parameters():  # the reward model may have been frozen: its copy must learn
            p.requires_grad_(True)
        return critic.train()
    if init == "policy":
        if policy is None:
            raise ValueError("init='policy' needs the policy (a causal LM)")
        return ScalarHeadModel(policy, head_std=0.0).train()
    raise ValueError(f"init must be 'reward' or 'policy', got {init!r}")


def token_values(value_model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` values ``V(x, y_<t)`` of the states before each completion token, 0 on padding.

    A seed-stacked critic (:func:`rlcourse.lm.seed_stack.stack_models`) has no ``transformers``
    forward: it goes through the lean GPT-2 forward, which reads the same columns.
    """
    if fast_gpt2.num_seeds(value_model) is not None:
        if not fast_gpt2.supports_scalar_head(value_model):
            raise ValueError("a seed-stacked critic must be a plain GPT-2 ScalarHeadModel with dropout off")
        values = fast_gpt2.completion_window_values(
            value_model, prompt_ids.masked_fill(prompt_mask == 0, 0), prompt_mask,
            completion_ids.masked_fill(completion_mask == 0, 0), completion_mask)[:, :completion_ids.shape[1]]
        return values * completion_mask.to(values.dtype)
    values = value_model(torch.cat([prompt_ids, completion_ids], 1),
                         torch.cat([prompt_mask, completion_mask], 1).long())
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    return values[:, P - 1:P - 1 + T] * completion_mask.to(values.dtype)
