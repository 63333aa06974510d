"""Tiny GPT-2 models by size name, built from ``transformers`` (no downloads: random init).

| size    | layers | width | heads | parameters (char vocab) | for                        |
|---------|--------|-------|-------|-------------------------|----------------------------|
| ``tiny``  | 2      | 64    | 4     | ~0.1 M                  | every lesson on a 2-core CPU |
| ``small`` | 4      | 128   | 4     | ~0.8 M                  | longer CPU runs             |
| ``demo``  | 8      | 320   | 8     | ~10 M                   | an instructor's GPU         |

Dropout is off by default. RL compares log-probabilities of the same tokens under the policy
that sampled them and under the policy being updated (the importance ratio), and under a
reference policy (the KL penalty). With dropout on, two forward passes of the *same* weights
give different log-probs, so the ratio is not 1 at the start of an update and the KL to an
identical copy is not 0. ``model.eval()`` would also switch dropout off, but trainers call
``model.train()``; a zero probability is safe in both modes.
"""
from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel

SIZES: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_positions=64),
    "small": dict(n_layer=4, n_embd=128, n_head=4, n_positions=64),
    "demo": dict(n_layer=8, n_embd=320, n_head=8, n_positions=128),
}


def make_config(size: str, tokenizer, dropout: float = 0.0, **overrides) -> GPT2Config:
    """The ``GPT2Config`` of a named size, with the tokenizer's vocabulary and special tokens."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is None:
            raise ValueError(f"tokenizer has no {name[:-3]}: build it with build_char_tokenizer()")
    kwargs = dict(SIZES[size])
    kwargs.update(overrides)
    return GPT2Config(
        vocab_size=len(tokenizer),
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs)


def make_model(size: str, tokenizer, dropout: float = 0.0, seed: int | None = None,
               **overrides) -> GPT2LMHeadModel:
    """A freshly initialised ``GPT2LMHeadModel`` of the named size for ``tokenizer``.

    ``overrides`` replace any ``GPT2Config`` field (e.g. ``n_layer=3``); ``seed`` fixes the
    initial weights.
    """
    import torch

    config = make_config(size, tokenizer, dropout=dropout, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    # generate() reads its defaults from here; keep them consistent with the tokenizer.
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def frozen_copy(model):
    """A frozen reference model: an independent copy of ``model``, in eval mode, without gradients.

    ``copy.deepcopy`` alone is not enough for a model that accelerate (and so TRL) has prepared:
    preparing sets an instance attribute ``forward`` that wraps the *original* model's bound
    forward, the copy inherits that attribute, and the "reference" then computes the policy's own
    outputs: a KL of exactly 0, silently. Dropping the attribute gives the copy its class's forward
    over its own weights.
    """
    import copy

    reference = copy.deepcopy(model)
    vars(reference).pop("forward", None)
    return reference.eval().requires_grad_(False)


def count_parameters(model) -> int:
    """Number of distinct parameters (the tied input/output embedding counted once)."""
    return sum(p.numel() for p in model.parameters())
