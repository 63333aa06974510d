"""A lean GPT-2 forward pass: a static-cache decoder for sampling, and a prompt-sharing forward for training.

Why a second forward pass when ``transformers`` has one? For a 0.1M-parameter model the arithmetic
is tiny and the time goes into Python: module hooks, output wrappers, a fresh 4-D attention mask
built every call, and a cache that grows with ``torch.cat``. This module runs the *same weights*
(the model's own parameters, so autograd reaches them) through the same equations with none of that:

    h_0 = wte[x] + wpe[pos]
    for each block:   a = attn(LN_1(h));  h = h + a;   h = h + W_2 gelu(W_1 LN_2(h))
    logits = LN_f(h) @ wte^T

**Prompts are computed once per group.** GRPO and RLOO sample K completions of the same prompt,
and a DPO pair shares its prompt. A prompt token's hidden states never depend on what follows it
(causal attention), so the K copies of a prompt compute identical keys and values. We run each
distinct prompt once and let every completion of it attend to that one copy. In the backward pass
the gradients of the K completions through the shared keys and values add up, exactly as they
would over K separate copies: the result is the same (tested to 1e-5 against ``transformers``),
for fewer FLOPs. With K = 8, prompts of 7 tokens and completions of 4, a training forward and
backward touches 312 token positions instead of 704. Inference engines call this prefix caching.

Used by :func:`rlcourse.lm.sampling.sample` (``GPT2Decoder``) and by
:func:`rlcourse.lm.logprobs.completion_logits` (``completion_window_logits``) for plain GPT-2
models (:func:`supports`), and by :func:`rlcourse.lm.value_model.token_values` for a seed-stacked
critic (``completion_window_values``, :func:`supports_scalar_head`); any other causal LM goes
through its own forward.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F


def _plain_body(model, body) -> bool:
    """Whether GPT-2 body ``body`` (a ``GPT2Model``) of ``model`` is computed exactly by this module.

    Plain means: GPT-2's own layer types (no adapters patched in), none of the rarely used
    attention options, and no dropout at work (eval mode, or every dropout probability 0).
    """
    from transformers.pytorch_utils import Conv1D

    cfg = getattr(model, "config", None)
    if cfg is None or type(body).__name__ != "GPT2Model":
        return False
    if (cfg.add_cross_attention or cfg.scale_attn_by_inverse_layer_idx or cfg.reorder_and_upcast_attn
            or not cfg.scale_attn_weights or cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu")):
        return False
    # Dropout can be switched on through the config or by setting a module's p (lesson 08 does).
    if model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return False
    layers = [m for b in body.h for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
    norms = [m for b in body.h for m in (b.ln_1, b.ln_2)] + [body.ln_f]
    return all(type(m) is Conv1D for m in layers) and all(type(m) is torch.nn.LayerNorm for m in norms)


def supports(model) -> bool:
    """True when ``model`` is a plain GPT-2 LM (``GPT2LMHeadModel``) that this module computes exactly."""
    if type(model).__name__ != "GPT2LMHeadModel":
        return False
    return _plain_body(model, model.transformer) and model.lm_head.bias is None


def supports_scalar_head(model) -> bool:
    """True for a :class:`~rlcourse.lm.scalar_head.ScalarHeadModel` (a reward model or critic) on a
    plain GPT-2 body whose head has the body's dtype: :func:`completion_window_values` computes it."""
    if type(model).__name__ != "ScalarHeadModel":
        return False
    head, body = model.head, model.body
    return (_plain_body(model, body) and head.bias is None
            and head.weight.dtype == next(body.parameters()).dtype)


def _body(model):
    """The GPT-2 body: ``model.transformer`` of an LM, ``model.body`` of a scalar-head model."""
    return model.transformer if hasattr(model, "transformer") else model.body


def num_seeds(model) -> int | None:
    """S for a seed-stacked model (:func:`rlcourse.lm.seed_stack.stack_models`), None for a plain one."""
    return getattr(model, "rlcourse_num_seeds", None)


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W + b`` (GPT-2's Conv1D stores ``W`` as (in, out)); seed-stacked: ``x[s] @ W[s] + b[s]``."""
    if layer.weight.dim() == 2:
        return torch.addmm(layer.bias, x, layer.weight)
    return torch.baddbmm(layer.bias.unsqueeze(1), x, layer.weight)


def _layer_norm(model, x: torch.Tensor, norm) -> torch.Tensor:
    """LayerNorm over the last dimension with ``norm``'s gain and bias (one per seed when stacked)."""
    width, eps = model.config.n_embd, model.config.layer_norm_epsilon
    if norm.weight.dim() == 1:
        return F.layer_norm(x, (width,), norm.weight, norm.bias, eps)
    return torch.addcmul(norm.bias.unsqueeze(1), F.layer_norm(x, (width,), None, None, eps), norm.weight.unsqueeze(1))


def _block(model, block, h: torch.Tensor, attend) -> torch.Tensor:
    """One GPT-2 block on hidden states ``h``: (N, W), or (S, N, W) for a seed-stacked model.

    ``attend(qkv) -> (rows, W)`` does the attention on the rows of every seed, flattened seed-major.
    """
    a = _layer_norm(model, h, block.ln_1)
    qkv = _linear(a, block.attn.c_attn)
    h = h + _linear(attend(qkv.reshape(-1, qkv.shape[-1])).view(h.shape), block.attn.c_proj)
    m = _layer_norm(model, h, block.ln_2)
    m = F.gelu(_linear(m, block.mlp.c_fc), approximate="none" if model.config.activation_function == "gelu" else "tanh")
    return h + _linear(m, block.mlp.c_proj)


def _heads(qkv: torch.Tensor, rows: int, n: int, n_head: int) -> tuple[torch.Tensor, ...]:
    """(rows * n, 3W) -> q, k, v of shape (rows, heads, n, head_dim)."""
    return qkv.view(rows, n, 3, n_head, qkv.shape[1] // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)


def _merge(att: torch.Tensor) -> torch.Tensor:
    """(rows, heads, n, head_dim) -> (rows * n, W)."""
    return att.transpose(1, 2).reshape(-1, att.shape[1] * att.shape[3])


def _causal_mask(valid_keys: torch.Tensor, n_queries: int) -> torch.Tensor:
    """(B, 1, n, S) bool for the last ``n`` of ``S`` columns: query i sees real keys at columns <= S - n + i.

    A pad query would see no key at all, and a fully masked softmax gives NaN (which would reach
    the cache or the backward pass); let each query always see itself (pads only ever see pads).
    """
    total = valid_keys.shape[1]
    cols = torch.arange(total, device=valid_keys.device)
    rows = torch.arange(total - n_queries, total, device=valid_keys.device)
    mask = (cols[None, :] <= rows[:, None])[None] & valid_keys[:, None, :]
    mask[:, torch.arange(n_queries), rows] = True
    return mask[:, None]


def _embed(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token plus position embeddings of ``ids`` (R, n): (R * n, W), or (S, R / S * n, W) when stacked.

    A stacked model's rows are seed-major (rows ``s * R / S`` onwards belong to seed ``s``), and seed
    ``s`` reads its own tables: row ``s * V + i`` of the flattened (S * V, W) table is its token ``i``.
    """
    tr, width = _body(model), model.config.n_embd
    wte, wpe = tr.wte.weight, tr.wpe.weight
    if wte.dim() == 2:
        return (F.embedding(ids, wte) + F.embedding(positions, wpe)).reshape(-1, width)
    seeds = torch.arange(wte.shape[0], device=ids.device)[:, None]
    ids, positions = ids.reshape(len(seeds), -1), positions.reshape(len(seeds), -1)
    return (F.embedding(ids + seeds * wte.shape[1], wte.reshape(-1, width))
            + F.embedding(positions + seeds * wpe.shape[1], wpe.reshape(-1, width)))


def _logits(model, h: torch.Tensor) -> torch.Tensor:
    """``LN_f(h) @ wte^T`` for hidden states (..., W); a stacked model's leading rows are seed-major."""
    head = model.lm_head.weight
    if head.dim() == 2:
        return _layer_norm(model, h, model.transformer.ln_f) @ head.T
    x = _layer_norm(model, h.reshape(head.shape[0], -1, h.shape[-1]), model.transformer.ln_f)
    return torch.bmm(x, head.transpose(1, 2)).view(*h.shape[:-1], -1)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_seeds: int = 1):
    """The distinct rows of a left-padded prompt batch: ``(ids (U, P), mask (U, P), inverse (B,))``.

    ``ids[inverse]`` and ``mask[inverse]`` rebuild the batch (pads read as 0). With ``num_seeds``
    S > 1 the batch is S seed-major blocks and rows are made distinct within each block (seed
    ``s``'s prompts run through seed ``s``'s weights): every block gets the same number of distinct
    rows U / S, a block with fewer repeating its first row (a copy nothing reads).
    """
    keyed = prompt_ids.long().masked_fill(prompt_mask == 0, -1)
    if num_seeds == 1:
        rows, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    else:
        blocks = [torch.unique(block, dim=0, return_inverse=True) for block in keyed.chunk(num_seeds)]
        width = max(len(r) for r, _ in blocks)
        rows = torch.cat([torch.cat([r, r[:1].expand(width - len(r), -1)]) for r, _ in blocks])
        inverse = torch.cat([inv + s * width for s, (_, inv) in enumerate(blocks)])
    return rows.clamp(min=0), (rows >= 0).long(), inverse


def _completion_window(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Hidden states (B, T + 1, W) before the final LayerNorm, at the prompt's last column and at
    every completion column, each distinct prompt run once (per seed, for a stacked model)."""
    n_head, seeds = model.config.n_head, num_seeds(model) or 1
    u_ids, u_mask, inverse = distinct_prompts(prompt_ids, prompt_mask, seeds)
    (n_unique, n_prompt), (batch, n_new) = u_ids.shape, completion_ids.shape
    prompt_positions = (u_mask.cumsum(1) - 1).clamp(min=0)
    # A completion token's position counts the real prompt tokens and the real completion tokens before it.
    new_positions = (u_mask.sum(1)[inverse, None] + completion_mask.cumsum(1) - 1).clamp(min=0)
    prompt_att = _causal_mask(u_mask.bool(), n_prompt)
    new_att = _causal_mask(torch.cat([u_mask[inverse], completion_mask], 1).bool(), n_new)
    # Each seed's positions are [its U/S prompts x P | its B/S completions x T]; without seeds, S = 1.
    split = n_unique // seeds * n_prompt

    def attend(qkv):
        per_seed = qkv.view(seeds, -1, qkv.shape[-1])
        qp, kp, vp = _heads(per_seed[:, :split].reshape(-1, qkv.shape[-1]), n_unique, n_prompt, n_head)
        qc, kc, vc = _heads(per_seed[:, split:].reshape(-1, qkv.shape[-1]), batch, n_new, n_head)
        out_p = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=prompt_att)
        # Every completion attends to the one copy of its prompt's keys and values.
        keys, values = torch.cat([kp[inverse], kc], 2), torch.cat([vp[inverse], vc], 2)
        out_c = F.scaled_dot_product_attention(qc, keys, values, attn_mask=new_att)
        width = out_p.shape[1] * out_p.shape[3]
        return torch.cat([_merge(out_p).view(seeds, -1, width), _merge(out_c).view(seeds, -1, width)], 1).view(-1, width)

    h = torch.cat([_embed(model, u_ids, prompt_positions).view(seeds, -1, model.config.n_embd),
                   _embed(model, completion_ids.long(), new_positions).view(seeds, -1, model.config.n_embd)], 1)
    if seeds == 1 and num_seeds(model) is None:
        h = h[0]                                   # a plain model's hidden states are (N, W)
    for block in _body(model).h:
        h = _block(model, block, h, attend)
    width = model.config.n_embd
    per_seed = h.view(seeds, -1, width)
    last_prompt = per_seed[:, :split].reshape(n_unique, n_prompt, width)[:, -1][inverse]     # (B, W)
    return torch.cat([last_prompt[:, None], per_seed[:, split:].reshape(batch, n_new, width)], 1)


def completion_window_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Logits (B, T + 1, V) at the prompt's last column and at every completion column, with grad.

    The same numbers as ``model(input_ids=[prompt | completion], ..., logits_to_keep=T + 1).logits``
    with position ids from the attention mask, computed with each distinct prompt run once.
    Inputs are validated by the caller (:func:`rlcourse.lm.logprobs.completion_logits`).
    """
    return _logits(model, _completion_window(model, prompt_ids, prompt_mask, completion_ids, completion_mask))


def completion_window_values(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """A scalar-head model's values (B, T + 1), ``v = LN_f(h) . w_head``, at the same columns, with grad.

    The same numbers as :class:`~rlcourse.lm.scalar_head.ScalarHeadModel`'s forward read at columns
    ``P - 1`` to ``P + T - 1`` (:func:`supports_scalar_head` models; stacked ones too: seed ``s``'s
    rows meet seed ``s``'s body and head).
    """
    window = _completion_window(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    head, ln_f = model.head.weight, model.body.ln_f          # (1, W), or (S, 1, W) when stacked
    if head.dim() == 2:
        return (_layer_norm(model, window, ln_f) @ head.T).squeeze(-1)
    x = _layer_norm(model, window.reshape(head.shape[0], -1, window.shape[-1]), ln_f)
    return torch.bmm(x, head.transpose(1, 2)).view(window.shape[:-1])


class GPT2Decoder:
    """Incremental decoding of a ``GPT2LMHeadModel`` for one batch of left-padded prompts.

    ``prefill(ids, positions)`` consumes the prompts and returns the next-token logits (B, V);
    ``step(tokens)`` appends one token per row and returns the next logits. Keys and values live
    in buffers of shape (B, heads, P + T, head_dim) allocated once. Pads (mask 0) are never
    attended to by real tokens. ``prefill_rows`` (optional, (B,) indices into the prompts given to
    ``prefill``) lets the prompts be passed once per distinct prompt: row b of the batch continues
    prompt ``prefill_rows[b]``.
    """

    def __init__(self, model, prompt_mask: torch.Tensor, max_new_tokens: int, prefill_rows: torch.Tensor | None = None):
        cfg = model.config
        self.model, self.n_head = model, cfg.n_head
        batch, prompt_len = prompt_mask.shape
        self.total = prompt_len + max_new_tokens
        p = next(model.parameters())
        shape = (batch, cfg.n_head, self.total, cfg.n_embd // cfg.n_head)
        # Every column is written before it is read (reads stop at the current length): no zeroing.
        self.keys = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        self.values = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        # Which key columns are real tokens: the prompt's mask, then every generated column.
        valid = torch.ones(batch, self.total, dtype=torch.bool, device=p.device)
        valid[:, :prompt_len] = prompt_mask.bool()
        self.valid, self.rows = valid, prefill_rows
        self.length = 0
        self.next_position = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Feed ``ids`` (R, n); write their keys/values to the cache (row ``rows[b]`` for batch row b)."""
        start, (n_rows, n) = self.length, ids.shape
        cache_rows = slice(None) if rows is None else rows
        valid = self.valid[:, :start + n]
        if n == 1 and start > 0:   # one new token sees every real column so far: a view, no new kernels
            mask = valid[:, None, None, :]
        else:
            mask = _causal_mask(valid if rows is None else valid[_first_batch_row(rows, n_rows)], n)
        layer = iter(range(len(self.keys)))

        def attend(qkv):
            i = next(layer)
            q, k, v = _heads(qkv, n_rows, n, self.n_head)
            self.keys[i][:, :, start:start + n] = k[cache_rows]
            self.values[i][:, :, start:start + n] = v[cache_rows]
            if rows is None:
                k, v = self.keys[i][:, :, :start + n], self.values[i][:, :, :start + n]
            return _merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

        h = _embed(self.model, ids, positions)
        for block in self.model.transformer.h:
            h = _block(self.model, block, h, attend)
        self.length += n
        last = _logits(self.model, h.view(n_rows, n, h.shape[-1])[:, -1])          # (R, V)
        return last if rows is None else last[rows]

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        self.next_position = (positions[:, -1:] if rows is None else positions[rows, -1:]) + 1
        return self._forward(prompt_ids, positions, rows)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.length >= self.total:
            raise RuntimeError(f"the cache holds {self.total} tokens and is full")
        logits = self._forward(tokens.view(-1, 1), self.next_position, None)
        self.next_position = self.next_position + 1
        return logits


class StaticGPT2Decoder(GPT2Decoder):
    """A ``GPT2Decoder`` whose one-token step has fixed shapes, so that a CUDA graph can replay it.

    **Why.** For a model of ~10M parameters a decoding step is ~170 small kernels, and on a GPU the
    time goes into launching them from Python, not into running them. A CUDA graph records the
    launches of one step once; ``graph.replay()`` then issues all of them in a single call.

    **What a graph needs.** The same shapes and the same memory addresses at every replay. So the
    step reads everything that changes from buffers allocated once: the token fed
    (``static_tokens``), each row's position (``position``) and the cache column to write
    (``write_at``, a tensor rather than a Python int). The keys and values are written with
    ``index_copy_`` at that column, and attention runs over all P + T columns with the columns not
    yet written masked out, which gives the same softmax as attending to the written ones only
    (the buffers start at zero, so a masked column holds finite numbers: 0 x NaN would be NaN).

    On a CUDA device the first step runs eagerly on a side stream (it warms up the kernels, which
    must not initialise themselves during a capture), then the step is captured and every later
    step is a replay. Elsewhere every step runs eagerly, so the CPU tests check the same arithmetic.
    ``step`` returns a buffer that the next step overwrites: read it before calling ``step`` again.
    """

    def __init__(self, model, prompt_mask: torch.Tensor, max_new_tokens: int, prefill_rows: torch.Tensor | None = None):
        super().__init__(model, prompt_mask, max_new_tokens, prefill_rows)
        for buffer in self.keys + self.values:
            buffer.zero_()
        dev = prompt_mask.device
        self.columns = torch.arange(self.total, device=dev)
        self.write_at = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(prompt_mask.shape[0], 1, dtype=torch.long, device=dev)
        self.static_tokens = torch.zeros(prompt_mask.shape[0], dtype=torch.long, device=dev)
        self.weights = [p.data_ptr() for p in model.parameters()]   # what a captured graph reads
        self.graph, self.graph_logits = None, None

    # Kept decoders live in a cache keyed weakly by the model: holding the model strongly here would
    # keep every model that ever sampled alive (and its GPU memory with it).
    @property
    def model(self):
        return self._model()

    @model.setter
    def model(self, model):
        self._model = weakref.ref(model)

    def restart(self, prompt_mask: torch.Tensor, prefill_rows: torch.Tensor | None) -> None:
        """Reuse the buffers (and a captured graph) for a new batch of the same shape."""
        self.valid[:, :prompt_mask.shape[1]].copy_(prompt_mask.bool())
        self.rows, self.length = prefill_rows, 0

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = super().prefill(prompt_ids, positions)
        self.position.copy_(self.next_position)
        self.write_at.fill_(self.length)
        return logits

    def _static_step(self) -> torch.Tensor:
        """One token per row from the buffers; advances ``position`` and ``write_at``. Capturable."""
        at = self.write_at
        mask = (self.valid & (self.columns <= at))[:, None, None, :]     # real columns written so far
        layer = iter(range(len(self.keys)))

        def attend(qkv):
            i = next(layer)
            q, k, v = _heads(qkv, len(self.static_tokens), 1, self.n_head)
            self.keys[i].index_copy_(2, at, k)
            self.values[i].index_copy_(2, at, v)
            return _merge(F.scaled_dot_product_attention(q, self.keys[i], self.values[i], attn_mask=mask))

        h = _embed(self.model, self.static_tokens.view(-1, 1), self.position)
        for block in self.model.transformer.h:
            h = _block(self.model, block, h, attend)
        self.position.add_(1)
        at.add_(1)
        return _logits(self.model, h.view(-1, h.shape[-1]))

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.length >= self.total:
            raise RuntimeError(f"the cache holds {self.total} tokens and is full")
        self.length += 1
        self.static_tokens.copy_(tokens)
        if self.columns.device.type != "cuda":
            return self._static_step()
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        side = torch.cuda.Stream(device=self.columns.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._static_step()          # the warm-up is a real step
        torch.cuda.current_stream().wait_stream(side)
        logits.record_stream(torch.cuda.current_stream())
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):   # records the launches; runs nothing
            self.graph_logits = self._static_step()
        return logits


_GRAPHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
MAX_GRAPHS_PER_MODEL = 8


def static_decoder(model, prompt_mask: torch.Tensor, max_new_tokens: int,
                   prefill_rows: torch.Tensor | None = None) -> StaticGPT2Decoder:
    """A ``StaticGPT2Decoder`` for this batch; on CUDA, one kept from an earlier call of the same shape.

    Capturing a graph costs about one more eager step plus the graph's instantiation, so graphs
    are kept per model and per (batch, prompt columns, total columns), the last
    ``MAX_GRAPHS_PER_MODEL`` of them: a training loop that samples the same batch size each step
    replays graphs captured in its first steps.
    A graph reads the weights in place, so an optimiser's in-place updates are seen; if a
    parameter tensor has been replaced (``model.to(...)``, say), the graph is captured again.
    """
    if prompt_mask.device.type != "cuda":
        return StaticGPT2Decoder(model, prompt_mask, max_new_tokens, prefill_rows)
    kept = _GRAPHED.setdefault(model, OrderedDict())
    key = (*prompt_mask.shape, prompt_mask.shape[1] + max_new_tokens, str(prompt_mask.device))
    decoder = kept.pop(key, None)
    if decoder is None or decoder.weights != [p.data_ptr() for p in model.parameters()]:
        decoder = StaticGPT2Decoder(model, prompt_mask, max_new_tokens, prefill_rows)
    else:
        decoder.restart(prompt_mask, prefill_rows)
    kept[key] = decoder
    while len(kept) > MAX_GRAPHS_PER_MODEL:
        kept.popitem(last=False)
    return decoder


def _first_batch_row(rows: torch.Tensor, n_distinct: int) -> torch.Tensor:
    """For each distinct prompt, one batch row that continues it (any will do: they share the prompt)."""
    # zeros: a distinct row no batch row continues (a seed block's filler copy) reads row 0's mask
    first = torch.zeros(n_distinct, dtype=torch.long, device=rows.device)
    first[rows] = torch.arange(len(rows), device=rows.device)
    return first
