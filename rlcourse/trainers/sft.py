"""Supervised fine-tuning (and pretraining) of a causal LM on prompt/completion pairs.

Each example becomes one sequence ``<bos> prompt completion <eos>``. The loss is the mean
negative log-likelihood of the completion tokens and of the ``<eos>`` (the model must learn to
stop), given everything before them; prompt tokens and pads carry no loss:

    L(theta) = - (1 / N) sum_b sum_t m_bt log pi_theta(y_bt | x_b, y_b,<t),   N = sum m_bt.

Sequences are left-padded like the sampler's prompts, with position ids from the attention mask,
so training and sampling see the same positions.
"""
from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from rlcourse.lm.logprobs import position_ids_from_mask, token_logprobs_from_logits
from rlcourse.lm.sampling import sample
from rlcourse.lm.tokenizer import check_encodable


def encode_examples(tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask, loss_mask)`` for ``{"prompt", "completion"}`` rows.

    ``loss_mask`` is 1 on the completion's tokens and its ``<eos>``, 0 on ``<bos>``, the prompt
    and the pads. A row may also hold ``"observation_spans"``, ``(start, end)`` character spans of
    the completion that an environment wrote (a tool's output, lesson 10e): the completion is then
    tokenised span by span, as a multi-turn rollout builds it, and those tokens get loss 0.
    """
    if not examples or not all(isinstance(e, dict) and "prompt" in e and "completion" in e for e in examples):
        raise ValueError("examples must be a non-empty list of {'prompt': str, 'completion': str} dicts")
    check_encodable(tokenizer, [e["prompt"] + e["completion"] for e in examples], "examples")
    rows = []
    for e in examples:
        p = tokenizer(e["prompt"])["input_ids"]  # starts with <bos>
        c, trained = [], []
        for text, keep in _segments(e["completion"], e.get("observation_spans") or ()):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            c, trained = c + ids, trained + [int(keep)] * len(ids)
        c, trained = c + [tokenizer.eos_token_id], trained + [1]
        rows.append((p + c, [0] * len(p) + trained))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lm) in enumerate(rows):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention[i, width - len(ids):] = 1
        loss_mask[i, width - len(ids):] = torch.tensor(lm)
    return input_ids, attention, loss_mask


def _segments(text: str, spans) -> list[tuple[str, bool]]:
    """``text`` cut at the ``spans`` boundaries: ``(piece, trained)`` in order, ``trained`` False inside a span."""
    out, at = [], 0
    for start, end in sorted(spans):
        if not (isinstance(start, int) and isinstance(end, int) and at <= start < end <= len(text)):
            raise ValueError(f"observation_spans must be ordered, non-overlapping (start, end) character spans "
                             f"inside the completion {text!r}, got {list(spans)}")
        out += [(text[at:start], True)] if start > at else []
        out.append((text[start:end], False))
        at = end
    return out + ([(text[at:], True)] if at < len(text) else [])


def sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the tokens where ``loss_mask`` is 1 (each predicted from its prefix)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    # logits[:, t] predicts token t + 1.
    logp = token_logprobs_from_logits(out.logits[:, :-1], input_ids[:, 1:])
    mask = loss_mask[:, 1:].to(logp.dtype)
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to 10% of ``lr`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_sft(model, tokenizer, examples: list[dict], steps: int, lr: float = 3e-3,
              batch_size: int = 64, weight_decay: float = 0.01, warmup: int | None = None,
              task=None, eval_prompts: list[str] | None = None, eval_every: int = 0,
              stop_at: float | None = None, seed: int = 0, progress: bool = True) -> dict:
    """Train ``model`` in place on ``examples`` for ``steps`` AdamW steps of ``batch_size`` rows.

    If ``task`` and ``eval_prompts`` are given, the held-out greedy exact match is measured every
    ``eval_every`` steps (and at the end); with ``stop_at``, training stops at the first
    evaluation whose exact match reaches it (how the deliberately *partial* checkpoint is made:
    its accuracy is set by the recipe, not by luck of a step count). Returns the history: ``{"step", "loss", "eval_step",
    "eval_exact_match", "seconds"}``.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if stop_at is not None and not (task is not None and eval_every):
        raise ValueError("stop_at needs task, eval_prompts and eval_every > 0")
    if (task is None) != (eval_prompts is None):
        raise ValueError("pass task and eval_prompts together (or neither)")
    dev = next(model.parameters()).device
    input_ids, attention, loss_mask = (t.to(dev) for t in encode_examples(tokenizer, examples))
    warmup = max(1, steps // 20) if warmup is None else warmup
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    rows = torch.Generator().manual_seed(seed)
    history = {"step": [], "loss": [], "eval_step": [], "eval_exact_match": [], "seconds": 0.0}
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc="SFT", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        idx = torch.randint(0, input_ids.shape[0], (batch_size,), generator=rows).to(dev)
        # Drop the columns that are padding in every row of this batch: shorter, faster forward.
        keep = attention[idx].any(dim=0)
        loss = sft_loss(model, input_ids[idx][:, keep], attention[idx][:, keep], loss_mask[idx][:, keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history["step"].append(step)
        history["loss"].append(loss.item())
        last = step == steps - 1
        if task is not None and (last or (eval_every and (step + 1) % eval_every == 0)):
            em = exact_match(model, tokenizer, task, eval_prompts)
            model.train()
            history["eval_step"].append(step + 1)
            history["eval_exact_match"].append(em)
            bar.set_postfix(loss=f"{loss.item():.3f}", exact_match=f"{em:.1%}")
            if stop_at is not None and em >= stop_at:
                break
        elif step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    history["seconds"] = time.perf_counter() - start
    return history


@torch.no_grad()
def exact_match(model, tokenizer, task, prompts: list[str], greedy: bool = True,
                temperature: float = 1.0, generator: torch.Generator | None = None,
                batch_size: int = 512) -> float:
    """Fraction of ``prompts`` whose completion earns the task's full reward (1.0).

    ``greedy=True`` decodes with argmax; otherwise samples at ``temperature`` (pass a seeded
    ``generator`` for a reproducible number).
    """
    if not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    hits = 0.0
    for i in range(0, len(prompts), batch_size):
        chunk = list(prompts[i:i + batch_size])
        roll = sample(model, tokenizer, chunk, task.max_new_tokens,
                      temperature=0.0 if greedy else temperature, generator=generator)
        hits += float((task.reward(chunk, roll.completions) >= 1.0).sum())
    return hits / len(prompts)
