"""A reward model trained on preference pairs: the Bradley-Terry fit of a :class:`~rlcourse.lm.scalar_head.ScalarHeadModel`.

    reward_model = ScalarHeadModel(policy)              # a copy of the body, a new 1-unit head
    history = train_reward_model(reward_model, tokenizer, task.preference_pairs(2000, rng=0), steps=300)

Every training pair is read as ``[prompt | completion <eos>]`` with ``<eos>`` appended (as the
sampler's finished completions end with it), so the reward model is read on the same kind of input
it was trained on, at the completion's last real token (:func:`~rlcourse.lm.scalar_head.score_completions`).
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from rlcourse.lm.sampling import encode_prompts
from rlcourse.lm.scalar_head import encode_completions, score_completions
from rlcourse.losses.reward_model import bradley_terry_loss, reward_model_metrics

__all__ = ["encode_preference_pairs", "score_pairs", "train_reward_model", "evaluate_reward_model", "reward_model_bias"]


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
