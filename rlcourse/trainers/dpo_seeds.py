"""S independent DPO runs in one stacked GPT-2: :func:`train_dpo_seeds` is :func:`rlcourse.trainers.dpo.train_dpo` for many seeds.

Seed ``s`` is the run ``train_dpo(models[s], tokenizer, pairs[s], args with seed=seeds[s])`` would
make: its own pairs, shuffle order, step count, learning-rate schedule, AdamW state and metrics.
What the seeds share is each step's forward and backward pass (:mod:`rlcourse.lm.seed_stack`):

    for step in 1 .. max_s steps_s:
        for every seed s still training: its next minibatch of pairs (a fresh shuffle each epoch)
        log pi(y|x) of every seed's chosen and rejected rows            # one forward, stacked model
        L = sum_s batch_loss(seed s's rows)                               # rlcourse.trainers.dpo.batch_loss
        one backward; each seed's gradient clipped; one AdamW step per seed at its own learning rate

A stacked forward needs the same number of rows from every seed, so a seed whose minibatch is
shorter (the last of an epoch) is filled with copies of its first pair, and a seed that has
finished (fewer pairs, fewer steps) keeps a dummy minibatch; neither enters its loss, and a
finished seed's weights and optimiser state do not move.

The runs need not share their settings: ``args`` may be one :class:`~rlcourse.trainers.dpo.DPOConfig` per
model (its own ``beta``, ``loss_type``, ``label_smoothing``, ``learning_rate``, steps), so that a
sweep over a setting trains as one stack. Only what the stack does for all runs at once must agree:
``per_device_train_batch_size``, ``weight_decay`` and ``max_grad_norm``.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rlcourse.trainers.dpo import (HISTORY_KEYS, DPOConfig, _reference_logps, batch_loss, check_preference_pairs,
                             dpo_metrics, kto_mismatched_pairs, lr_factor, reference_free, select_pairs, uses_kto)
from rlcourse.lm.fast_gpt2 import supports
from rlcourse.lm.logprobs import sequence_logprobs
from rlcourse.lm.model import frozen_copy
from rlcourse.tasks.reward_model import encode_preference_pairs
from rlcourse.lm.seed_stack import SeedAdam, stack_models

__all__ = ["train_dpo_seeds", "seed_losses"]

def _joint(batches: list[dict], pad_id: int) -> dict:
    """Seed batches of equal row counts as one seed-major batch: prompts left-padded, completions right-padded."""
    prompt_cols = max(b["prompt_ids"].shape[1] for b in batches)
    completion_cols = max(b["completion_ids"].shape[1] for b in batches)
    out = {}
    for key, cols, left, value in (("prompt_ids", prompt_cols, True, pad_id), ("prompt_mask", prompt_cols, True, 0),
                                   ("completion_ids", completion_cols, False, pad_id),
                                   ("completion_mask", completion_cols, False, 0)):
        parts = []
        for b in batches:
            missing = cols - b[key].shape[1]
            parts.append(F.pad(b[key], (missing, 0) if left else (0, missing), value=value))
        out[key] = torch.cat(parts)
    return out


def _filled(batch: dict, rows: int) -> dict:
    """``batch`` (chosen rows, then rejected rows) with its first pair repeated up to ``rows`` pairs."""
    n = batch["prompt_ids"].shape[0] // 2
    if n == rows:
        return batch
    pick = torch.cat([torch.arange(n), torch.zeros(rows - n, dtype=torch.long)])
    pick = torch.cat([pick, pick + n]).to(batch["prompt_ids"].device)
    return {k: v[pick] for k, v in batch.items()}


def _per_model(args, S: int) -> list[DPOConfig]:
    """``args`` as one config per model: a single config repeated, or a list checked for what the stack shares."""
    if args is None or isinstance(args, DPOConfig):
        return [args or DPOConfig()] * S
    configs = list(args)
    if len(configs) != S or not all(isinstance(a, DPOConfig) for a in configs):
        raise ValueError(f"args must be one DPOConfig or a list of one DPOConfig per model ({S}), got {args!r}")
    for name in ("per_device_train_batch_size", "weight_decay", "max_grad_norm"):
        values = {getattr(a, name) for a in configs}
        if len(values) != 1:
            raise ValueError(f"the runs of one stack must share {name}, got {sorted(values)}")
    return configs


def _stacked_logprobs(stack, data: list[dict], picked: list[torch.Tensor], pad_id: int):
    """Per-token log-probs of every seed's pairs ``picked[s]`` of ``data[s]`` from one stacked forward,
    and the row indices (chosen rows, then rejected rows) of each seed's real pairs in it."""
    dev = data[0]["prompt_ids"].device
    batches = [select_pairs(d, idx.to(dev)) for d, idx in zip(data, picked)]
    rows = max(len(idx) for idx in picked)
    joint = _joint([_filled(b, rows) for b in batches], pad_id)
    tok = sequence_logprobs(stack, joint["prompt_ids"], joint["completion_ids"], joint["completion_mask"],
                            joint["prompt_mask"])
    index = []
    for s, idx in enumerate(picked):
        n, start = len(idx), s * 2 * rows       # seed s's block: its chosen rows, then its rejected rows
        index.append(torch.cat([torch.arange(start, start + n), torch.arange(start + rows, start + rows + n)]).to(dev))
    return tok, joint["completion_mask"], index


def seed_losses(stack, args, data: list[dict], picked: list[torch.Tensor], tables, active,
                pad_id: int, kl_data: list[dict] | None = None, kl_tables=None) -> dict:
    """Each active seed's DPO loss on its pairs ``picked[s]`` of ``data[s]``, from one stacked forward.

    ``args``: one :class:`~rlcourse.trainers.dpo.DPOConfig`, or one per seed. ``tables[s]`` holds seed ``s``'s
    reference log-probs of every pair (chosen, rejected). Seeds training with KTO also need
    ``kl_data[s]`` (the encoded :func:`~rlcourse.trainers.dpo.kto_mismatched_pairs`) and ``kl_tables[s]``
    (their reference log-probs): one more stacked forward, without gradient. Returns ``{s: (loss,
    chosen_logps, rejected_logps)}`` (:func:`rlcourse.trainers.dpo.batch_loss`).
    """
    configs = _per_model(args, len(data))
    dev = data[0]["prompt_ids"].device
    tok, mask, index = _stacked_logprobs(stack, data, picked, pad_id)
    kl_tok = None
    if kl_data is not None and any(uses_kto(c) for c, on in zip(configs, active) if on):
        with torch.no_grad():
            kl_tok, _, kl_index = _stacked_logprobs(stack, kl_data, picked, pad_id)
    out = {}
    for s in range(len(data)):
        if not active[s]:
            continue
        chosen_tok, rejected_tok = tok[index[s]].chunk(2, dim=0)
        ref_chosen, ref_rejected = (t[picked[s].to(dev)] for t in tables[s])
        kl = ref_kl = None
        if uses_kto(configs[s]):
            kl = kl_tok[kl_index[s]].sum(-1)
            ref_kl = torch.cat([t[picked[s].to(dev)] for t in kl_tables[s]])
        out[s] = batch_loss(configs[s], chosen_tok, rejected_tok, mask[index[s]], ref_chosen, ref_rejected, kl, ref_kl)
    return out


def train_dpo_seeds(models, tokenizer, pairs, args: DPOConfig | list[DPOConfig] | None = None, seeds=None,
                    ref_models=None, progress: bool = True, callback=None) -> list[dict]:
    """Train every ``models[s]`` in place by DPO on ``pairs[s]`` with seed ``seeds[s]``; one history per seed.

    ``models``: plain GPT-2 models (:func:`rlcourse.lm.fast_gpt2.supports`), one per seed.
    ``pairs``: one list of ``{"prompt", "chosen", "rejected"}`` pairs for every seed, or one list
    per seed. ``args``: one config for every run, or one per model (see the module's docstring).
    ``seeds`` (default ``args.seed + s``, with model ``s``'s config) seed each run's shuffles.
    ``ref_models`` default to frozen copies of the models as they are now. Histories are :func:`rlcourse.trainers.dpo.train_dpo`'s,
    ``seconds`` being the shared training time divided by the seeds. The reference log-probs are
    computed once up front (as ``train_dpo`` does with ``precompute_ref_log_probs``). ``callback(step,
    stack)``, if given, runs after each step (``step`` from 1) with the seed-stacked model, e.g. to sample
    every seed at once (:func:`rlcourse.lm.sample` with one generator per seed); its time is not counted.
    """
    models = list(models)
    S = len(models)
    configs = _per_model(args, S)
    args = configs[0]                      # what the stack shares: batch size, weight decay, clipping
    for i, m in enumerate(models):
        if not supports(m):
            raise ValueError(f"models[{i}] is not a plain GPT-2 model (rlcourse.lm.fast_gpt2.supports): use train_dpo")
    if not pairs or not isinstance(pairs[0], (list, tuple)):
        pairs = [pairs] * S
    if len(pairs) != S:
        raise ValueError(f"pairs must be one list of pairs or one per model ({S}), got {len(pairs)} lists")
    seeds = [configs[s].seed + s for s in range(S)] if seeds is None else [int(s) for s in seeds]
    if len(seeds) != S:
        raise ValueError(f"seeds must hold one seed per model ({S}), got {seeds}")
    refs = [frozen_copy(m) for m in models] if ref_models is None else list(ref_models)
    dev = next(models[0].parameters()).device
    for p in pairs:
        check_preference_pairs(tokenizer, p)
    # Runs given the same list of pairs (or the same reference and pairs) share its encoding (or its table).
    encoded = {}
    for p in pairs:
        if id(p) not in encoded:
            encoded[id(p)] = encode_preference_pairs(tokenizer, p, dev)
    data = [encoded[id(p)] for p in pairs]
    bs = args.per_device_train_batch_size
    steps = [a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * math.ceil(len(p) / bs))
             for a, p in zip(configs, pairs)]
    # The reference log-probs of every pair, once (what train_dpo does with precompute_ref_log_probs).
    # Runs whose losses never read the reference (SimPO, ORPO) get zeros and cost no reference forward.
    computed = {}
    for r, p, d, a in zip(refs, pairs, data, configs):
        if reference_free(a):
            continue
        if (id(r), id(p)) not in computed:
            computed[id(r), id(p)] = _reference_logps(r.eval(), d, max(bs, 64))
    tables = [tuple(torch.zeros(len(p), device=dev) for _ in range(2)) if reference_free(a) else computed[id(r), id(p)]
              for r, p, a in zip(refs, pairs, configs)]
    kl_data = kl_tables = None
    if any(uses_kto(a) for a in configs):     # KTO's mismatched pairs, encoded and scored by the reference once
        kl_encoded, kl_computed = {}, {}
        for p in pairs:
            if id(p) not in kl_encoded:
                kl_encoded[id(p)] = encode_preference_pairs(tokenizer, kto_mismatched_pairs(p), dev)
        for r, p, a in zip(refs, pairs, configs):
            if uses_kto(a) and (id(r), id(p)) not in kl_computed:
                kl_computed[id(r), id(p)] = _reference_logps(r.eval(), kl_encoded[id(p)], max(bs, 64))
        kl_data = [kl_encoded[id(p)] for p in pairs]
        kl_tables = [kl_computed.get((id(r), id(p))) for r, p in zip(refs, pairs)]

    stack = stack_models(models)
    opt = SeedAdam(stack.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    orders = [torch.empty(0, dtype=torch.long) for _ in seeds]
    histories = [{"step": [], **{k: [] for k in HISTORY_KEYS}} for _ in seeds]
    start = time.perf_counter()
    kinds = sorted({f"{'+'.join(a.loss_types)}, beta={a.beta}" for a in configs})
    bar = tqdm(range(max(steps)), desc=f"DPO x{S} seeds ({kinds[0] if len(kinds) == 1 else f'{len(kinds)} settings'})",
               disable=not progress)
    for step in bar:
        active = torch.tensor([step < n for n in steps])
        picked = []
        for s in range(S):
            if not active[s]:
                picked.append(torch.arange(min(bs, len(pairs[s]))))   # a dummy minibatch: never in a loss
                continue
            if orders[s].numel() == 0:                                # a new epoch: a fresh shuffle
                orders[s] = torch.randperm(len(pairs[s]), generator=gens[s])
            picked.append(orders[s][:bs])
            orders[s] = orders[s][bs:]
        losses = seed_losses(stack, configs, data, picked, tables, active, tokenizer.pad_token_id, kl_data, kl_tables)
        for s, (loss, _, _) in losses.items():
            if not torch.isfinite(loss):
                raise FloatingPointError(f"DPO loss of seed {seeds[s]} is {loss.item()} at step {step}: lower "
                                         f"learning_rate or check the data")
        lrs = [a.learning_rate * lr_factor(a, step, n) for a, n in zip(configs, steps)]
        opt.zero_grad()
        opt.backward(sum(loss for loss, _, _ in losses.values()))
        if args.max_grad_norm and args.max_grad_norm > 0:
            opt.clip_grad_norm_(args.max_grad_norm)
        opt.step(active, lr=lrs)
        for s, (loss, chosen, rejected) in losses.items():
            h = histories[s]
            h["step"].append(step + 1)
            h["loss"].append(loss.item())
            h["learning_rate"].append(lrs[s])
            ref_chosen, ref_rejected = (t[picked[s].to(dev)] for t in tables[s])
            for k, v in dpo_metrics(chosen, rejected, ref_chosen, ref_rejected, configs[s].beta).items():
                h[k].append(v)
        bar.set_postfix(loss=f"{sum(loss.item() for loss, _, _ in losses.values()) / len(losses):.3f}")
        if callback is not None:
            paused = time.perf_counter()
            callback(step + 1, stack)
            start += time.perf_counter() - paused     # the callback's time is not training time
    for h in histories:                      # the seeds shared the clock: each is charged its share
        h["seconds"] = (time.perf_counter() - start) / S
    with torch.no_grad():                    # each seed's weights back into its own model
        for s, m in enumerate(models):
            for p, q in zip(m.parameters(), stack.parameters()):
                p.copy_(q[s])
    return histories
