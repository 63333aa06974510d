"""Batched sampling from a causal LM with a KV cache, returning what RL needs.

One call rolls out a batch of prompts and returns a :class:`Rollout`: the completion tokens, the
log-prob of each token under the sampling distribution, and masks that say which tokens count.

How it works (the same loop as ``model.generate``, with the RL bookkeeping kept visible):

1. Tokenise the prompts with **left** padding, so every row's last prompt token is in the last
   column and one column of logits gives every row's next-token distribution.
2. Position ids come from the attention mask (``cumsum - 1``): GPT-2's absolute positions must
   start at the first real token, not at the first pad.
3. One forward pass over the prompts fills the KV cache. Each later step feeds only the newly
   sampled token (B, 1) and reuses the cached keys and values: O(T) work per step, not O(T^2).
   Plain GPT-2 models use a lean forward with a preallocated cache (:mod:`rlcourse.lm.fast_gpt2`)
   that tokenises and prefills each distinct prompt once (a GRPO batch repeats every prompt K
   times); on a GPU its one-token step is replayed from a CUDA graph. Any other causal LM uses its
   own forward and a ``transformers.DynamicCache``.
4. The next token is drawn from ``softmax(logits / temperature)`` with the logits of ``<pad>``,
   ``<bos>`` and ``<unk>`` set to ``-inf`` (:func:`banned_token_ids`; ``<eos>`` stays allowed),
   optionally restricted to the ``top_k`` largest remaining logits. Its log-prob is read from the
   *unrestricted* temperature-scaled distribution, which is what
   :func:`rlcourse.lm.logprobs.sequence_logprobs` recomputes (see below).
5. A row that has produced ``<eos>`` is finished: it keeps receiving ``<pad>``, its mask is 0
   and its log-probs are 0. The loop stops early once every row is finished. With one generator
   per seed (a seed-stacked model), a seed whose rows have all finished stops drawing from its
   generator, as its solo run stops: each seed's stream advances exactly as alone, call after call.

Why special tokens are masked, and why the stored log-probs are not. A policy that writes
``<pad>`` mid-completion is trained on that token; if a verifier then read text with special
tokens erased, the pads would be invisible to it (six ``<pad>`` before the sum passed the filler
task's thinking budget where six dots fail). So the sampler never draws them, and
:func:`decode_completions` keeps any that a hand-built completion holds. The log-prob stored for a
drawn token is ``log softmax(logits / T)`` over the whole vocabulary, the same formula every
trainer recomputes for the current policy (:func:`rlcourse.lm.logprobs.sequence_logprobs`), so
the importance ratio ``pi_theta / pi_old`` is exactly 1 before the first update and both sides
share one convention (TRL does the same: its trainers recompute log-probs with the temperature
only, ignoring the sampler's top-k/top-p and other logit processors). The draw itself comes from
the masked distribution ``pi(y) / (1 - pi(special))``; the ratio of masked policies differs from
the stored one by ``(1 - pi_old(special)) / (1 - pi_theta(special))``, a factor 1 whenever the
policy puts no mass on the masked tokens (a policy fine-tuned on text that never holds them puts
very little; ``tests/test_lm_sampling.py`` checks the bookkeeping).
"""
from __future__ import annotations

import math
import numbers

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlcourse.lm import fast_gpt2
from rlcourse.lm.fast_gpt2 import GPT2Decoder, static_decoder
from rlcourse.lm.logprobs import position_ids_from_mask
from rlcourse.lm.tokenizer import check_encodable
from rlcourse.runtime import intra_op_threads


@dataclass
class Rollout:
    """A batch of sampled completions. Shapes: B prompts, P prompt columns, T completion columns.

    ``completion_mask[b, t]`` is 1 for the tokens up to and including the first ``<eos>`` and 0
    after it (or 1 everywhere if the row hit ``max_new_tokens`` without ending).
    ``logprobs[b, t] = log pi(completion_ids[b, t] | prompt, completion_ids[b, :t])`` at the
    sampling temperature, 0 where the mask is 0.
    """

    prompt_ids: torch.Tensor       # (B, P) long, left-padded
    prompt_mask: torch.Tensor      # (B, P) long, 0 on the left pads
    completion_ids: torch.Tensor   # (B, T) long, <pad> after <eos>
    completion_mask: torch.Tensor  # (B, T) long
    logprobs: torch.Tensor         # (B, T) float
    completions: list[str] = field(default_factory=list)  # decode_completions: what a reward sees
    prompts: list[str] = field(default_factory=list)
    eos_token_id: int = -1         # the tokenizer's <eos>, for :attr:`finished`

    @property
    def attention_mask(self) -> torch.Tensor:
        """Mask of the whole ``[prompt | completion]`` sequence, (B, P + T)."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def select(self, rows: slice) -> "Rollout":
        """The rollout of ``rows`` only (one seed's block of a seed-batched rollout, say)."""
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
                       self.completion_mask[rows], self.logprobs[rows], self.completions[rows], self.prompts[rows],
                       self.eos_token_id)

    @property
    def finished(self) -> torch.Tensor:
        """(B,) bool: the row produced ``<eos>`` (False when it was cut at ``max_new_tokens``)."""
        eos = (self.completion_ids == self.eos_token_id) & self.completion_mask.bool()
        return eos.any(dim=1)


def _check_prompts(prompts) -> None:
    # A lone string would be read as a list of one-character prompts.
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {type(prompts).__name__}")


def encode_prompts(tokenizer, prompts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` for a list of prompt strings."""
    _check_prompts(prompts)
    enc = tokenizer(list(prompts), padding=True, padding_side="left", return_tensors="pt")
    if tokenizer.unk_token_id is not None and bool((enc["input_ids"] == tokenizer.unk_token_id).any()):
        check_encodable(tokenizer, list(prompts), "prompts")  # names the offending prompt
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


class _HFDecoder:
    """Incremental decoding through the model's own forward and a ``DynamicCache`` (any causal LM)."""

    def __init__(self, model, prompt_mask: torch.Tensor):
        self.model, self.cache, self.attention_mask = model, DynamicCache(config=model.config), prompt_mask
        self.next_position = None

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=prompt_ids, attention_mask=self.attention_mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next_position = positions[:, -1:] + 1
        return out.logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        # Feed only the new token; the cache holds every earlier key and value.
        self.attention_mask = torch.cat([self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], 1)
        out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=self.attention_mask,
                         position_ids=self.next_position, past_key_values=self.cache, use_cache=True)
        self.next_position = self.next_position + 1
        return out.logits[:, -1]


def banned_token_ids(tokenizer) -> list[int]:
    """Ids the sampler never draws: ``<pad>``, ``<bos>`` and ``<unk>``, less ``<eos>`` (which ends a row).

    A tokenizer whose ``<pad>`` is its ``<eos>`` (GPT-2's usual setting) keeps that id allowed.
    """
    eos = tokenizer.eos_token_id
    ids = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id} - {None, eos}
    return sorted(ids)


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None,
                banned: torch.Tensor | None = None,
                alive: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` (B, V); return it (B,) and its log-prob (B,).

    The draw is from ``softmax(logits / temperature)`` with the ``banned`` ids' logits at ``-inf``
    (and, with ``top_k``, only the ``top_k`` largest remaining logits kept); ``temperature=0`` takes
    the argmax of the same masked logits. The log-prob returned is that of the token under the
    unmasked ``log_softmax(logits / temperature)`` (``temperature=1`` when greedy): the quantity
    :func:`rlcourse.lm.logprobs.sequence_logprobs` recomputes (module docstring).

    ``generator`` may be a list of S generators, one per equal block of rows (a seed-stacked
    model's seeds). A block none of whose rows is ``alive`` (B,) then draws nothing and gets
    token 0 (the caller pads it): its generator stays where that seed's solo run stops drawing.
    """
    allowed = logits if banned is None or banned.numel() == 0 else logits.index_fill(1, banned, float("-inf"))
    if temperature == 0:  # greedy decoding; the log-prob reported is that of the T=1 policy
        logp_all = F.log_softmax(logits, dim=-1)
        token = allowed.argmax(dim=-1)
    else:
        logp_all = F.log_softmax(logits / temperature, dim=-1)
        scaled = allowed / temperature
        if top_k is not None and top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = F.softmax(scaled, dim=-1)
        if isinstance(generator, (list, tuple)):   # a seed-stacked model: each seed's rows from its own stream
            live = [True] * len(generator) if alive is None else alive.view(len(generator), -1).any(1).tolist()
            token = torch.cat([torch.multinomial(p, 1, generator=g) if on else   # a finished seed draws nothing
                               torch.zeros(len(p), 1, dtype=torch.long, device=p.device)
                               for p, g, on in zip(probs.chunk(len(generator)), generator, live)]).squeeze(1)
        else:
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return token, logp_all.gather(1, token.unsqueeze(1)).squeeze(1)


ENGINES = ("auto", "lean", "static", "hf")

# A decoding step multiplies a (batch, width) block of hidden states by every weight matrix: ~50
# kernels per token, each tiny for the course's models. Up to this many elements per block, waking
# a second OpenMP thread for each kernel costs more than the thread saves. Measured on the 2-core
# laptop: the tiny model (width 64) samples 64 prompts x 4 tokens in 5.4 ms on one thread against
# 7.4 ms on two; at 256 x 64 or 64 x 128 two threads win. `python -m rlcourse.bench sampling`
# times both.
ONE_THREAD_MAX_ELEMENTS = 64 * 64


def decode_threads(model, batch: int) -> int:
    """Intra-op threads for decoding ``batch`` rows on a CPU: 1 for a small step, else torch's count.

    Small means ``batch * width <= ONE_THREAD_MAX_ELEMENTS``, with ``width`` the model's embedding
    size. The choice changes the speed, not the draws: one thread and two give the same tokens
    (but for a draw within ~1e-6 of the line between two tokens) and log-probs that agree to ~1e-6
    (a few sums are added in another order; ``tests/test_lm_sampling.py``).
    """
    width = model.get_input_embeddings().embedding_dim
    return 1 if batch * width <= ONE_THREAD_MAX_ELEMENTS else torch.get_num_threads()


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Each completion's text as a reward function must see it: every real token, the end excluded.

    A row's real tokens are those of ``completion_mask``; its closing ``<eos>`` is dropped (it
    ends the text, it is not part of it). Any other special token the policy wrote *inside* the
    completion (``<pad>``, ``<bos>``, ``<unk>``) is kept as its text: decoding with
    ``skip_special_tokens=True`` would erase it, and a policy trained on what it wrote but scored
    on what was left could hide tokens from the verifier (six ``<pad>`` before an answer would pass
    for no thinking at all).
    """
    eos = tokenizer.eos_token_id
    texts = []
    for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist()):
        real = [t for t, m in zip(ids, mask) if m]
        if real and real[-1] == eos:
            real = real[:-1]
        texts.append(tokenizer.decode(real, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return texts


def _distinct_prompts(prompts: list[str], num_seeds: int = 1) -> tuple[list[str], list[int]]:
    """Each distinct prompt once, and the index of every prompt's copy: ``distinct[rows[i]] == prompts[i]``.

    With ``num_seeds`` S > 1 the prompts are S seed-major blocks, each made distinct on its own (a
    seed's prompts run through its own weights) and filled to the same count with copies of its
    first prompt, so the distinct prompts are S equal blocks too.
    """
    size = len(prompts) // num_seeds
    blocks = [list(dict.fromkeys(prompts[s * size:(s + 1) * size])) for s in range(num_seeds)]
    width = max(len(b) for b in blocks)
    distinct, rows = [], []
    for s, block in enumerate(blocks):
        where = {p: s * width + i for i, p in enumerate(block)}
        rows += [where[p] for p in prompts[s * size:(s + 1) * size]]
        distinct += block + block[:1] * (width - len(block))
    return distinct, rows


def _positive_int(n) -> bool:
    """An integer >= 1 (a NumPy integer counts; a bool or a float such as 4.0 does not)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None,
           engine: str = "auto", cpu_threads: int | None = None, stop_token_ids=()) -> Rollout:
    """Sample one completion per prompt, batched, with a KV cache. See the module docstring.

    ``temperature=0`` decodes greedily (the argmax; a temperature must otherwise be finite and > 0).
    ``<pad>``, ``<bos>`` and ``<unk>`` are never drawn (:func:`banned_token_ids`). ``generator`` (a ``torch.Generator`` on the model's
    device) makes the draw reproducible. The model is put in eval mode during the call and
    returned to its previous mode.

    ``engine`` picks the decoder: ``"auto"`` decodes plain GPT-2 models with the lean forward of
    :mod:`rlcourse.lm.fast_gpt2` (``"static"`` on a GPU, ``"lean"`` elsewhere) and anything else
    with the model's own forward and a ``DynamicCache`` (``"hf"`` forces that). ``"lean"`` attends
    to the columns written so far; ``"static"`` runs a fixed-shape step that a CUDA graph replays
    on a GPU (on a CPU it runs the same step eagerly). All four give the same log-probs to ~1e-6.

    ``cpu_threads`` is the intra-op thread count while decoding on a CPU (torch's count is restored
    after); ``None`` lets :func:`decode_threads` pick one thread for a small batch and torch's
    count otherwise.

    ``stop_token_ids`` (lesson 10e's tool calls): ids that end a row as ``<eos>`` does, but stay part
    of its text (a call's closing ``")"``); the row's mask is 1 up to and including it.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not _positive_int(max_new_tokens):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and not _positive_int(top_k):
        raise ValueError(f"top_k must be None or a positive integer, got {top_k!r}")
    max_new_tokens, top_k = int(max_new_tokens), (None if top_k is None else int(top_k))
    if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
        raise ValueError(f"cpu_threads must be None or a positive integer, got {cpu_threads!r}")
    dev = next(model.parameters()).device
    seeds = fast_gpt2.num_seeds(model)
    if seeds is not None:
        _check_prompts(prompts)
        if len(prompts) % seeds:
            raise ValueError(f"a model stacking {seeds} seeds samples {seeds} equal blocks of prompts, seed-major; "
                             f"got {len(prompts)} prompts")
        if generator is not None and (not isinstance(generator, (list, tuple)) or len(generator) != seeds):
            raise ValueError(f"a model stacking {seeds} seeds needs a list of {seeds} generators (one stream per "
                             f"seed) or None, got {generator!r}")
        if engine == "hf":
            raise ValueError("a seed-stacked model decodes with rlcourse.lm.fast_gpt2 only: engine='hf' runs the "
                             "model's own forward, which holds no seed dimension")
    for g in (generator if isinstance(generator, (list, tuple)) else [generator]):
        if g is not None and g.device.type != dev.type:
            raise ValueError(f"generator must live on the model's device ({dev}), got one on {g.device}")
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos_id is None or pad_id is None:
        raise ValueError("tokenizer must define both eos_token and pad_token")
    stops = [eos_id, *stop_token_ids]
    if not all(isinstance(t, numbers.Integral) and 0 <= t < len(tokenizer) for t in stops):
        raise ValueError(f"stop_token_ids must be token ids of the tokenizer, got {list(stop_token_ids)!r}")

    # Tokenise and prefill each distinct prompt once (GRPO repeats every prompt K times).
    _check_prompts(prompts)
    distinct, rows = _distinct_prompts(list(prompts), seeds or 1)
    rows = torch.tensor(rows, dtype=torch.long, device=dev)
    distinct_ids, distinct_mask = encode_prompts(tokenizer, distinct, dev)
    prompt_ids, prompt_mask = distinct_ids[rows], distinct_mask[rows]
    batch = prompt_ids.shape[0]
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt length {prompt_ids.shape[1]} + max_new_tokens {max_new_tokens} "
                         f"exceeds the model's {limit} positions")

    # On a CPU a small batch decodes on one thread (decode_threads); the tokens are the same.
    threads = (cpu_threads or decode_threads(model, batch)) if dev.type == "cpu" else torch.get_num_threads()
    was_training = model.training
    if was_training:        # toggling every module's mode costs ~1 ms per call on a tiny model
        model.eval()
    try:
        # inference_mode skips autograd's bookkeeping (version counters, view tracking) that no_grad
        # still pays on every operation: 0.8 ms of a 17.6 ms GRPO step on a CPU. Its tensors cannot
        # enter a backward pass, so the Rollout's tensors are built after the block, as ordinary
        # tensors. On CUDA, where a graph replay has no per-operation cost, decoding stays under
        # no_grad: the way its graph capture was verified on an H100.
        with intra_op_threads(threads), torch.inference_mode(dev.type != "cuda"):
            fast_path = engine != "hf" and fast_gpt2.supports(model)     # one of fast_gpt2's decoders
            if engine in ("lean", "static") and not fast_path:
                raise ValueError(f"engine={engine!r} decodes plain GPT-2 models only (rlcourse.lm.fast_gpt2."
                                 f"supports); use engine='auto' or 'hf' for a {type(model).__name__}")
            if fast_path:
                if engine == "static" or (engine == "auto" and dev.type == "cuda"):
                    decoder = static_decoder(model, prompt_mask, max_new_tokens, prefill_rows=rows)
                else:
                    decoder = GPT2Decoder(model, prompt_mask, max_new_tokens, prefill_rows=rows)
                logits = decoder.prefill(distinct_ids, position_ids_from_mask(distinct_mask))
            else:
                decoder = _HFDecoder(model, prompt_mask)
                logits = decoder.prefill(prompt_ids, position_ids_from_mask(prompt_mask))
            finished = torch.zeros(batch, dtype=torch.bool, device=dev)
            banned = torch.tensor(banned_token_ids(tokenizer), dtype=torch.long, device=dev)
            stop = torch.tensor(stops, dtype=torch.long, device=dev)
            tokens, logps, masks = [], [], []
            for step in range(max_new_tokens):
                alive = ~finished
                token, logp = _next_token(logits.float(), temperature, top_k, generator, banned, alive)
                token = torch.where(alive, token, torch.full_like(token, pad_id))
                tokens.append(token)
                logps.append(torch.where(alive, logp, torch.zeros_like(logp)))
                masks.append(alive.long())
                finished = finished | (token == eos_id if len(stops) == 1 else torch.isin(token, stop))
                if step == max_new_tokens - 1 or bool(finished.all()):
                    break
                logits = decoder.step(token)
    finally:
        if was_training:
            model.train()

    completion_ids = torch.stack(tokens, dim=1)
    completion_mask = torch.stack(masks, dim=1)
    texts = decode_completions(tokenizer, completion_ids, completion_mask)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   completion_mask=completion_mask, logprobs=torch.stack(logps, dim=1),
                   completions=texts, prompts=list(prompts), eos_token_id=eos_id)
