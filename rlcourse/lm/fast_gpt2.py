"""A lean GPT-2 forward pass with a preallocated (static) KV cache, for sampling only.

Why a second forward pass when ``transformers`` has one? For a 0.1M-parameter model the arithmetic
of a decoding step is tiny and the time goes into Python: module hooks, output wrappers, a fresh
4-D attention mask built every step, and a cache that grows with ``torch.cat``. This module runs
the *same weights* through the same equations with none of that:

    h_0 = wte[x] + wpe[pos]
    for each block:   a = attn(LN_1(h));  h = h + a;   h = h + W_2 gelu(W_1 LN_2(h))
    logits = LN_f(h) @ wte^T

with keys and values written in place into buffers of shape (B, heads, P + T, head_dim) that
are allocated once. The attention mask is built once for the whole rollout and sliced per step.

It is used by :func:`rlcourse.lm.sampling.sample` for plain GPT-2 models (any other causal LM
goes through the model's own forward). Its results are tested against the ``transformers``
forward pass to 1e-5; training and log-prob recomputation always use the real model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(model) -> bool:
    """True when ``model`` is a plain GPT-2 LM that this module computes exactly."""
    cfg = getattr(model, "config", None)
    return (type(model).__name__ == "GPT2LMHeadModel" and cfg is not None
            and not cfg.add_cross_attention and not cfg.scale_attn_by_inverse_layer_idx
            and not cfg.reorder_and_upcast_attn and cfg.scale_attn_weights
            and cfg.activation_function in ("gelu_new", "gelu_pytorch_tanh", "gelu")
            and not model.training)


class GPT2Decoder:
    """Incremental decoding of a ``GPT2LMHeadModel`` for one batch of left-padded prompts.

    ``prefill(ids, mask)`` consumes the prompts and returns the next-token logits (B, V);
    ``step(tokens)`` appends one token per row and returns the next logits. Pads (mask 0) are
    never attended to by real tokens.
    """

    def __init__(self, model, prompt_mask: torch.Tensor, max_new_tokens: int):
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.n_head, self.width = cfg.n_head, cfg.n_embd
        self.head_dim = cfg.n_embd // cfg.n_head
        self.eps = cfg.layer_norm_epsilon
        self.approximate = "none" if cfg.activation_function == "gelu" else "tanh"
        batch, prompt_len = prompt_mask.shape
        self.total = prompt_len + max_new_tokens
        p = next(model.parameters())
        shape = (batch, self.n_head, self.total, self.head_dim)
        # Every column is written before it is read (reads stop at the current length): no zeroing.
        self.keys = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        self.values = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        # Which key columns are real tokens: the prompt's mask, then every generated column.
        valid = torch.ones(batch, self.total, dtype=torch.bool, device=p.device)
        valid[:, :prompt_len] = prompt_mask.bool()
        self.valid = valid
        self.length = 0
        self.next_position = None

    def _attention_mask(self, start: int, n: int) -> torch.Tensor:
        """(B, 1, n, start + n) bool: query i sees real keys at columns <= start + i."""
        cols = torch.arange(start + n, device=self.valid.device)
        rows = torch.arange(start, start + n, device=self.valid.device)
        causal = cols[None, :] <= rows[:, None]                       # (n, start + n)
        mask = causal[None] & self.valid[:, None, :start + n]           # (B, n, start + n)
        # A pad query would see no key at all, and a fully masked softmax gives NaN, which would
        # then sit in the cache; let each query always see itself (pads only ever see pads).
        mask[:, torch.arange(n), rows] = True
        return mask[:, None]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tr = self.model.transformer
        start, n = self.length, ids.shape[1]
        batch = ids.shape[0]
        mask = self._attention_mask(start, n)
        h = F.embedding(ids, tr.wte.weight) + F.embedding(positions, tr.wpe.weight)
        for i, block in enumerate(tr.h):
            a = F.layer_norm(h, (self.width,), block.ln_1.weight, block.ln_1.bias, self.eps)
            # GPT-2's Conv1D stores weights as (in, out): y = x @ W + b.
            qkv = torch.addmm(block.attn.c_attn.bias, a.reshape(-1, self.width), block.attn.c_attn.weight)
            q, k, v = qkv.view(batch, n, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
            self.keys[i][:, :, start:start + n] = k
            self.values[i][:, :, start:start + n] = v
            att = F.scaled_dot_product_attention(q, self.keys[i][:, :, :start + n],
                                                 self.values[i][:, :, :start + n], attn_mask=mask)
            att = att.transpose(1, 2).reshape(-1, self.width)
            h = h + torch.addmm(block.attn.c_proj.bias, att, block.attn.c_proj.weight).view(batch, n, -1)
            m = F.layer_norm(h, (self.width,), block.ln_2.weight, block.ln_2.bias, self.eps)
            m = torch.addmm(block.mlp.c_fc.bias, m.reshape(-1, self.width), block.mlp.c_fc.weight)
            m = F.gelu(m, approximate=self.approximate)
            h = h + torch.addmm(block.mlp.c_proj.bias, m, block.mlp.c_proj.weight).view(batch, n, -1)
        self.length += n
        last = F.layer_norm(h[:, -1], (self.width,), tr.ln_f.weight, tr.ln_f.bias, self.eps)
        return last @ self.model.lm_head.weight.T                    # (B, V), next-token logits

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.next_position = positions[:, -1:] + 1
        return self._forward(prompt_ids, positions)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.length >= self.total:
            raise RuntimeError(f"the cache holds {self.total} tokens and is full")
        logits = self._forward(tokens.view(-1, 1), self.next_position)
        self.next_position = self.next_position + 1
        return logits
