"""A causal LM's body with a scalar head: one number per position, read where it is meant.

    reward_model = ScalarHeadModel(policy)              # a copy of the body, a new 1-unit head
    scores = score_completions(reward_model, rollout.prompt_ids, rollout.prompt_mask,
                               rollout.completion_ids, rollout.completion_mask)

The body reads ``[prompt | completion <eos>]`` and gives a hidden state per position; a linear
head turns each into one number ``v_t``. A reward model's score of the whole text is ``v`` at the
**last real token of the completion**: the only position that has seen all of it. Reading it
anywhere else is a silent bug: at a pad it reads a position that saw nothing new (and, with right
padding, a pad embedding), at a prompt token it scores the prompt alone.

The same class gives a per-token critic (:mod:`rlcourse.lm.value_model`): one value per position
instead of one per sequence. It is the ``AutoModelForSequenceClassification`` of TRL's reward and
value models, written out so the reading position is visible. Training one on preference pairs is
:mod:`rlcourse.tasks.reward_model`'s job.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from rlcourse.lm.logprobs import position_ids_from_mask

__all__ = ["ScalarHeadModel", "last_real_index", "score_at_last_token", "encode_completions", "score_completions"]


class ScalarHeadModel(nn.Module):
    """The body of a causal LM (a deep copy) and a linear head to one number per position.

    ``causal_lm`` is any ``transformers`` causal LM (its ``base_model`` is the body without the
    LM head). ``forward(input_ids, attention_mask)`` returns ``(B, L)`` values; position ids come
    from the mask, so left-padded prompts work with GPT-2's absolute positions. The head has no
    bias, like ``GPT2ForSequenceClassification.score``; ``head_std=0`` starts it at zero.
    """

    def __init__(self, causal_lm, head_std: float = 0.02):
        super().__init__()
        self.body = copy.deepcopy(causal_lm.base_model)
        self.config = self.body.config
        self.head = nn.Linear(self.config.hidden_size, 1, bias=False, dtype=torch.float32)
        nn.init.normal_(self.head.weight, std=head_std) if head_std > 0 else nn.init.zeros_(self.head.weight)
        self.head.to(next(self.body.parameters()).device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` values in the head's dtype (float32, or float64). The body may run in bf16; the head must not."""
        if self.head.weight.dtype not in (torch.float32, torch.float64):
            # bf16 keeps 8 bits of mantissa: two scores closer than ~1% of their size come out
            # equal, and the Bradley-Terry loss and every PPO advantage are built on such differences.
            raise ValueError(f"the reward/value head must be float32 or float64, got {self.head.weight.dtype}: "
                             f"cast the body alone (model.body.to(torch.bfloat16)) and keep model.head.float()")
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)


def last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` index of the last position where ``mask`` (``(B, T)``) is 1; ValueError for an empty row."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        raise ValueError(f"mask must be a (B, T) tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
    real = mask.bool()
    if not bool(real.any(dim=1).all()):
        empty = (~real.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"mask has rows with no real token (rows {empty}): there is no position to read a "
                         f"score at (an empty completion must not be scored at a prompt token or a pad)")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(real)
    return torch.where(real, positions, torch.full_like(positions, -1)).max(dim=1).values


def score_at_last_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``score_b = values[b, t_b]`` with ``t_b`` the last position where ``mask[b]`` is 1: ``(B,)``.

    ``values`` and ``mask`` are the completion's columns only, so the score can never be read at a
    prompt token; padding anywhere (also holes inside a row) is skipped.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have one shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    return values.gather(1, last_real_index(mask)[:, None]).squeeze(1)


def encode_completions(tokenizer, completions: list[str], device=None, append_eos: bool = True):
    """Right-padded ``(completion_ids, completion_mask)`` of texts, each followed by ``<eos>``."""
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if append_eos else [])
            for c in completions]
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(device), mask.to(device)


def score_completions(reward_model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Reward-model score ``(B,)`` of each ``[prompt | completion]``, read at the completion's last real token."""
    values = reward_model(torch.cat([prompt_ids, completion_ids], 1),
                          torch.cat([prompt_mask, completion_mask], 1).long())
    return score_at_last_token(values[:, prompt_ids.shape[1]:], completion_mask)
