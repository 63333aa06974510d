"""A reward model: a causal LM's body with a scalar head, scored at the last real token.

    reward_model = ScalarHeadModel(policy)              # a copy of the body, a new 1-unit head
    history = train_reward_model(reward_model, tokenizer, task.preference_pairs(2000, rng=0), steps=300)
    scores = score_completions(reward_model, rollout.prompt_ids, rollout.prompt_mask,
                               rollout.completion_ids, rollout.completion_mask)

The body reads ``[prompt | completion <eos>]`` and gives a hidden state per position; a linear
head turns each into one number ``v_t``. The reward of the whole text is ``v`` at the **last real
token of the completion**: the only position that has seen all of it. Reading it anywhere else is
a silent bug: at a pad it reads a position that saw nothing new (and, with right padding, a pad
embedding), at a prompt token it scores the prompt alone. With ``<eos>`` appended to every
training pair (as the sampler's finished completions end with it) the reward model is read on the
same kind of input it was trained on.

The same class gives a per-token critic (:mod:`rlcourse.lm.value_model`): one value per position
instead of one per sequence. It is the ``AutoModelForSequenceClassification`` of TRL's reward and
value models, written out so the reading position is visible.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from tqdm.auto import tqdm

from rlcourse.lm.logprobs import position_ids_from_mask
from rlcourse.lm.sampling import encode_prompts
from rlcourse.losses.reward_model import bradley_terry_loss, reward_model_metrics

__all__ = ["ScalarHeadModel", "last_real_index", "score_at_last_token", "encode_completions",
           "score_completions", "encode_preference_pairs", "score_pairs", "train_reward_model",
           "evaluate_reward_model", "reward_model_bias"]


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


def encode_preference_pairs(tokenizer, pairs: list[dict], device=None) -> dict:
    """Tensors of ``[{"prompt", "chosen", "rejected"}]`` pairs: chosen rows first, then rejected rows."""
    if not pairs or not all({"prompt", "chosen", "rejected"} <= set(p) for p in pairs):
        raise ValueError("pairs must be a non-empty list of {'prompt', 'chosen', 'rejected'} dicts")
    prompts = [p["prompt"] for p in pairs]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts + prompts, device)
    ids, mask = encode_completions(tokenizer, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], device)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": ids, "completion_mask": mask}


def score_pairs(reward_model, encoded: dict, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_chosen, r_rejected)`` for the pairs ``rows`` (default all) of :func:`encode_preference_pairs`."""
    n = encoded["prompt_ids"].shape[0] // 2
    rows = torch.arange(n, device=encoded["prompt_ids"].device) if rows is None else rows
    both = torch.cat([rows, rows + n])
    scores = score_completions(reward_model, *(encoded[k][both] for k in
                                               ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")))
    return scores[:len(rows)], scores[len(rows):]


def train_reward_model(reward_model, tokenizer, pairs: list[dict], steps: int, batch_size: int = 64,
                       lr: float = 1e-3, margin: float | None = None, eval_pairs: list[dict] | None = None,
                       seed: int = 0, progress: bool = True, loss_fn=bradley_terry_loss) -> dict:
    """Fit ``reward_model`` to preference pairs with the Bradley-Terry loss (AdamW, minibatches).

    ``loss_fn(rewards_chosen, rewards_rejected, margin) -> scalar`` is the loss minimised (the
    Bradley-Terry loss by default; exercise 8.1's check trains with the learner's own).

    Returns TRL ``RewardTrainer``'s metrics: ``history`` (per step ``loss``, ``accuracy``,
    ``margin``, ``min_reward``, ``mean_reward``, ``max_reward`` on the minibatch) and, with
    ``eval_pairs``, ``eval`` (the same metrics on the held-out pairs, ``eval_`` prefixed).
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    device = next(reward_model.parameters()).device
    data = encode_preference_pairs(tokenizer, pairs, device)
    n = len(pairs)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(reward_model.parameters(), lr=lr, weight_decay=0.0)
    history = []
    reward_model.train()
    for _ in tqdm(range(steps), desc="reward model", disable=not progress):
        rows = torch.randint(0, n, (min(batch_size, n),), generator=gen).to(device)
        chosen, rejected = score_pairs(reward_model, data, rows)
        loss = loss_fn(chosen, rejected, margin)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append({"loss": loss.item(), **reward_model_metrics(chosen.detach(), rejected.detach())})
    reward_model.eval()
    out = {"history": history}
    if eval_pairs is not None:
        out["eval"] = evaluate_reward_model(reward_model, tokenizer, eval_pairs)
    return out


@torch.no_grad()
def evaluate_reward_model(reward_model, tokenizer, pairs: list[dict]) -> dict:
    """TRL's reward metrics on ``pairs`` (prefixed ``eval_``, as TRL's evaluation logs them)."""
    data = encode_preference_pairs(tokenizer, pairs, next(reward_model.parameters()).device)
    chosen, rejected = score_pairs(reward_model, data)
    metrics = {"loss": float(bradley_terry_loss(chosen, rejected)), **reward_model_metrics(chosen, rejected)}
    return {f"eval_{k}": v for k, v in metrics.items()}



@torch.no_grad()
def reward_model_bias(reward_model, policy, tokenizer, prompts: list[str], max_new_tokens: int,
                      generator: torch.Generator | None = None, batch_size: int = 256) -> float:
    """The reward model's mean score on ``policy``'s own completions of ``prompts``: ``mean_i r(x_i, y_i)``, ``y_i ~ policy``.

    Subtract it from every score (``PPOConfig(reward_bias=...)``) and the policy it was measured on
    (the SFT model, as in InstructGPT, Ouyang et al. 2022, arXiv 2203.02155) scores 0 on average:
    a positive reward then means "better than the starting point". Only the level moves; every
    difference between two scores, all a Bradley-Terry model learned, is unchanged.
    """
    from rlcourse.lm.sampling import sample

    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt")
    total = 0.0
    for start in range(0, len(prompts), batch_size):
        ro = sample(policy, tokenizer, prompts[start:start + batch_size], max_new_tokens, generator=generator)
        scores = score_completions(reward_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        total += float(scores.sum())
    return total / len(prompts)
