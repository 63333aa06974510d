"""Checks for lesson 12b (what RL changes: forgetting and low rank).

* :func:`check_forward_kl` - the exact per-token forward KL ``KL(pi_0 || pi)`` from two sets of logits
  and a mask (mistakes caught: the reverse direction, the sign flipped, the padding counted, logits used
  as log-probs, the cross-entropy without the base's entropy, a mean over the vocabulary, the log-ratio
  summed unweighted, a sum over positions instead of one value per position);
* :func:`check_lora_linear` - a LoRA linear layer's output, compared with the merged weight
  ``W + (alpha / r) B A`` (mistakes caught: scaled by ``alpha``, by ``r / alpha``, by ``alpha / sqrt(r)``
  or not at all, the correction subtracted, the base or the bias left out, ``A`` and ``B`` cut off
  from the graph);
* :func:`check_pareto_front` - which points no other point dominates, both coordinates maximised
  (mistakes caught: minimising, equal points removing each other, weak domination missed, a point
  compared with itself, one coordinate only, the best sum only, the complement, a sweep that drops ties);
* :func:`check_rft_step` - one rejection-sampling fine-tuning step, checked by the gradient it hands the
  optimiser (mistakes caught: no filter, the wrong answers kept, a sum for the mean, the ``<eos>`` left out
  of the loss, the prompt trained on, the sign flipped, gradients left over from the last call), then by a
  short run from ``addition`` that must raise new-task validity.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references, to_numpy)

__all__ = ["check_forward_kl", "check_lora_linear", "check_pareto_front", "check_rft_step"]


# ----------------------------------------------------------------------- exercise 1: the forward KL
def _kl_cases():
    gen = torch.Generator().manual_seed(1201)
    cases = []
    for B, T, V, scale, holes in ((2, 3, 4, 1.0, False), (3, 5, 7, 2.0, True), (4, 6, 81, 3.0, True),
                                  (1, 4, 5, 40.0, True)):
        base, logits = scale * torch.randn(B, T, V, generator=gen), scale * torch.randn(B, T, V, generator=gen)
        mask = torch.ones(B, T, dtype=torch.long)
        if holes:
            for b in range(B):
                mask[b, T - 1 - b % T:] = 0       # padding after each completion, rows of different lengths
            mask[0, 0] = 1
        cases.append((f"random logits (B={B}, T={T}, V={V}, scale {scale:g}{', padded rows' if holes else ''})",
                      base, logits, mask))
    same = torch.randn(2, 3, 6, generator=gen)
    cases.append(("a model equal to the base (the KL is exactly 0)", same, same.clone(), torch.ones(2, 3, dtype=torch.long)))
    cases.append(_model_case())
    return cases


def _model_case():
    """The ``addition`` checkpoint and a perturbed copy, at the positions of the base's samples of digit-sum prompts."""
    from rlcourse.grading._steps import moved_copy
    from rlcourse.lm import load_checkpoint
    from rlcourse.lm.logprobs import completion_logits
    from rlcourse.lm.sampling import sample

    base, tokenizer = load_checkpoint("addition", device="cpu")
    moved = moved_copy(base, seed=12, scale=0.05).eval()
    prompts = [f"S={s:02d}:" for s in range(0, 19, 3) for _ in range(2)]
    with torch.no_grad():
        roll = sample(base, tokenizer, prompts, 3, generator=torch.Generator().manual_seed(5))
        args = (roll.prompt_ids, roll.completion_ids, roll.prompt_mask, roll.completion_mask)
        return ("the addition checkpoint against a perturbed copy, along the base's samples of digit-sum prompts",
                completion_logits(base, *args), completion_logits(moved, *args), roll.completion_mask)


def _kl_mistakes(base, logits, mask):
    m = mask.bool()
    lp0, lp = torch.log_softmax(base.double(), -1), torch.log_softmax(logits.double(), -1)
    p0, p = lp0.exp(), lp.exp()
    z = torch.zeros(mask.shape, dtype=torch.float64)
    kl = (p0 * (lp0 - lp)).sum(-1)
    out = [((p * (lp - lp0)).sum(-1), "that is KL(pi || pi_0), the reverse KL: the forward KL takes the expectation "
                                      "under the base model, sum_v pi_0(v) (log pi_0(v) - log pi(v))"),
           (-kl, "the sign: KL(pi_0 || pi) = sum_v pi_0 (log pi_0 - log pi) is >= 0"),
           (kl, "the padding (mask 0) must give exactly 0"),
           ((p0 * (base.double() - logits.double())).sum(-1), "log-probs, not raw logits: take log_softmax of each "
                                                              "set of logits over the vocabulary first"),
           (-(p0 * lp).sum(-1), "that is the cross-entropy H(pi_0, pi); the KL subtracts the base's entropy: "
                                "sum_v pi_0 (log pi_0 - log pi)"),
           ((p0 * (lp0 - lp)).mean(-1), "sum over the vocabulary, do not average over it"),
           ((lp0 - lp).sum(-1), "weight each token's log-ratio by its base probability pi_0(v)")]
    return [(torch.where(m, w, z) if i != 2 else w, hint) for i, (w, hint) in enumerate(out)]


@references("rlcourse.measure.forgetting:forward_kl_per_token", "rlcourse.kl:exact_kl",
            "rlcourse.losses.distillation:forward_kl_per_token", "rlcourse.losses.distillation:generalized_jsd_per_token",
            "rlcourse.losses.distillation:reverse_kl_per_token")
def check_forward_kl(fn) -> None:
    """``fn(base_logits, logits, mask) -> (B, T)``: ``sum_v pi_0(v) (log pi_0(v) - log pi(v))`` at each position where
    ``mask`` is 1, exactly 0 where it is 0. ``base_logits`` and ``logits``: ``(B, T, V)``; ``mask``: ``(B, T)``."""
    __tracebackhide__ = True
    from rlcourse.measure.forgetting import forward_kl_per_token

    name = "check_forward_kl"
    n = 0
    for case, base, logits, mask in _kl_cases():
        got = call_unmutated(name, case, fn, base, logits, mask)
        expected = forward_kl_per_token(base, logits, mask)
        if got is not None and tuple(np.shape(to_numpy(got))) == (base.shape[0],):
            fail(name, case, f"one KL per position, shape {tuple(mask.shape)}", f"shape {(base.shape[0],)}",
                 "keep the time axis: the lesson sums over positions afterwards (forward_kl_on_prompts)")
        for mistake, hint in _kl_mistakes(base, logits, mask):
            fail_if_mistake(name, case, expected, got, mistake, hint)
        got_np = to_numpy(got) if got is not None else None
        if got_np is not None and not np.isfinite(got_np).all():
            fail(name, case, "finite KLs", "inf or nan", "softmax then log overflows on large logits: use "
                 "torch.log_softmax, which subtracts the maximum first")
        assert_close(name, case, expected, got, atol=1e-5, rtol=1e-5,
                     hint="log_softmax both logits over the vocabulary; sum_v pi_0 (log pi_0 - log pi); 0 on the padding")
        n += 1
    passed(name, n)


# ----------------------------------------------------------------------- exercise 2: a LoRA linear layer
def _lora_cases():
    gen = torch.Generator().manual_seed(1202)
    cases = []
    for shape_x, d_in, d_out, r, alpha, bias, zero_b in (((5,), 4, 3, 1, 32.0, True, False),
                                                         ((2, 3), 8, 6, 2, 4.0, True, False),
                                                         ((7,), 6, 6, 4, 8.0, False, False),
                                                         ((2, 4), 64, 192, 1, 4.0, True, False),
                                                         ((3,), 5, 2, 3, 1.0, True, True)):
        x = torch.randn(*shape_x, d_in, generator=gen)
        w = torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5
        b = torch.randn(d_out, generator=gen) if bias else None
        a = torch.rand(r, d_in, generator=gen) * 2 - 1
        bb = torch.zeros(d_out, r) if zero_b else torch.randn(d_out, r, generator=gen)
        what = (f"x of shape {tuple(x.shape)}, W {d_out}x{d_in}, rank {r}, alpha {alpha:g}"
                f"{'' if bias else ', no bias'}{', B = 0 (the base layer exactly)' if zero_b else ''}")
        cases.append((what, x, w, b, a, bb, alpha))
    return cases


def _merged(x, w, b, a, bb, alpha, scale=None, sign=1.0, base=True, use_bias=True):
    r = a.shape[0]
    s = alpha / r if scale is None else scale
    weight = (w if base else torch.zeros_like(w)) + sign * s * bb @ a
    y = x @ weight.T
    return y + b if (b is not None and use_bias) else y


@references("rlcourse.lm.lora:LoRALinear")
def check_lora_linear(fn) -> None:
    """``fn(x, weight, bias, lora_A, lora_B, alpha) -> y``: ``x W^T + b + (alpha / r) (x A^T) B^T`` with ``W``:
    ``(out, in)``, ``A``: ``(r, in)``, ``B``: ``(out, r)``, ``bias`` a vector or None; ``x``: ``(..., in)``.
    Compared with the merged layer ``x (W + (alpha / r) B A)^T + b``, and ``A``, ``B`` must get gradients."""
    __tracebackhide__ = True
    name = "check_lora_linear"
    n = 0
    for case, x, w, b, a, bb, alpha in _lora_cases():
        a_leaf, b_leaf = a.clone().requires_grad_(True), bb.clone().requires_grad_(True)
        got = call_unmutated(name, case, fn, x, w, b, a_leaf, b_leaf, alpha)
        expected = _merged(x, w, b, a, bb, alpha)
        r = a.shape[0]
        mistakes = [(_merged(x, w, b, a, bb, alpha, scale=alpha), "scale the correction by alpha / r, not alpha"),
                    (_merged(x, w, b, a, bb, alpha, scale=r / alpha), "alpha / r, not r / alpha"),
                    (_merged(x, w, b, a, bb, alpha, scale=alpha / r ** 0.5), "alpha / sqrt(r) is rsLoRA's scale; "
                     "this layer (and peft's default) uses alpha / r"),
                    (_merged(x, w, b, a, bb, alpha, scale=1.0), "multiply the low-rank correction by alpha / r"),
                    (_merged(x, w, b, a, bb, alpha, sign=-1.0), "add the correction to the frozen layer's output"),
                    (_merged(x, w, b, a, bb, alpha, base=False), "keep the frozen layer: y = x W^T + b + the correction"),
                    (_merged(x, w, b, a, bb, alpha, use_bias=False), "the frozen layer's bias is part of its output")]
        for mistake, hint in mistakes:
            fail_if_mistake(name, case, expected, got, mistake, hint)
        assert_close(name, case, expected, got.detach() if hasattr(got, "detach") else got, atol=1e-5, rtol=1e-5,
                     hint="y = x W^T + b + (alpha / r) * (x A^T) B^T, the output of the merged weight W + (alpha / r) B A")
        grads = gradient_flowing(name, case, got, [a_leaf, b_leaf],
                                 hint="compute the correction from lora_A and lora_B with torch operations: they are "
                                      "what the optimiser trains")
        if not bb.any() and float(grads[1].abs().sum()) == 0:
            fail(name, case, "a gradient reaching lora_B while B = 0", "zero", "B's gradient is (alpha / r) * "
                 "dL/dy^T (x A^T): it must flow even when B starts at 0")
        n += 1
    passed(name, n)


# ---------------------------------------------------------------------- exercise 3: the Pareto front
def _front_cases():
    rng = np.random.default_rng(1203)
    cases = [("the hand-made frontier", [[0.1, 0.9], [0.5, 0.5], [0.4, 0.4], [0.9, 0.1], [0.5, 0.2]]),
             ("two equal points on the front, and one tied with them in a coordinate",
              [[0.3, 0.8], [0.3, 0.8], [0.3, 0.6], [0.7, 0.2]]),
             ("a single point", [[0.2, 0.3]]),
             ("points on a falling line (all on the front)", [[i / 5, 1 - i / 5] for i in range(6)]),
             ("ties in accuracy: same new-task accuracy, different old-task", [[0.5, 0.9], [0.5, 0.7], [0.6, 0.7], [0.2, 0.95]])]
    for k in (8, 30):
        pts = np.round(rng.random((k, 2)), 1)           # rounded: ties happen
        cases.append((f"{k} seeded points with ties", pts.tolist()))
    return cases


def _front_mistakes(points):
    from rlcourse.measure.forgetting import pareto_front

    p = np.asarray(points, dtype=float)
    n = len(p)
    ge = (p[None] >= p[:, None]).all(-1)
    gt = (p[None] > p[:, None]).any(-1)
    strict = (p[None] > p[:, None]).all(-1)
    sweep = np.zeros(n, bool)
    best = -np.inf
    for i in sorted(range(n), key=lambda i: (-p[i, 0], -p[i, 1])):
        if p[i, 1] > best:
            sweep[i], best = True, p[i, 1]
    right = pareto_front(p)
    return [(pareto_front(-p), "both coordinates are accuracies: maximise them (a point dominates when it is at "
                               "least as high in both)"),
            (~(ge & ~np.eye(n, dtype=bool)).any(1), "equal points do not dominate each other: domination needs one "
                                                    "coordinate strictly higher"),
            (~strict.any(1), "a point that ties in one coordinate and loses in the other is dominated too: >= in both, "
                             "> in at least one"),
            (np.zeros(n, bool) if n > 0 else right, "a point does not dominate itself: compare it with the others"),
            (p[:, 0] == p[:, 0].max(), "the front trades one accuracy against the other: look at both coordinates"),
            (np.arange(n) == int(np.argmax(p.sum(1))), "not only the best sum: every point no other point beats on "
                                                        "both coordinates"),
            (~right, "return True for the points on the front (not dominated)"),
            (sweep, "a sweep by decreasing x must keep a point equal to the last kept one (ties stay on the front)")]


@references("rlcourse.measure.forgetting:pareto_front")
def check_pareto_front(fn) -> None:
    """``fn(points) -> (N,) bools``: True where no other point is at least as high in both coordinates and higher
    in one (both maximised). ``points``: an ``(N, 2)`` list or array."""
    __tracebackhide__ = True
    from rlcourse.measure.forgetting import pareto_front

    name = "check_pareto_front"
    n = 0
    for case, points in _front_cases():
        for form, arg in (("a list", [list(q) for q in points]), ("an array", np.asarray(points, dtype=float))):
            got = call_unmutated(name, f"{case} (given as {form})", fn, arg)
            expected = pareto_front(points)
            if got is not None and np.shape(got) != expected.shape:
                fail(name, case, f"{len(points)} booleans, one per point", f"shape {np.shape(got)}",
                     "return a mask over the points (True on the front), not the indices or the front's points")
            for mistake, hint in _front_mistakes(points):
                fail_if_mistake(name, case, expected.astype(float), None if got is None else np.asarray(got, dtype=float),
                                mistake.astype(float), hint)
            assert_close(name, case, expected.astype(float), None if got is None else np.asarray(got, dtype=float),
                         atol=0, rtol=0, hint="True where no other point is >= in both coordinates and > in one")
            n += 1
    passed(name, n)


# ------------------------------------------------------------------ exercise 4: one RFT step (an experiment)
def _reference_rft_step(model, optimizer, tokenizer, task, prompts, generator) -> int:
    """The reference RFT step: one sample (T=1) per prompt row, the rows whose reward is 1 kept, one update on
    the mean negative log-likelihood of the kept completions' tokens (their ``<eos>`` included). Returns how
    many were kept (no update when none)."""
    from rlcourse.lm import sample, sequence_logprobs

    roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=generator)
    keep = task.reward(prompts, roll.completions) >= 1.0
    if not bool(keep.any()):
        return 0
    logp = sequence_logprobs(model, roll.prompt_ids[keep], roll.completion_ids[keep], roll.completion_mask[keep],
                             roll.prompt_mask[keep])
    mask = roll.completion_mask[keep].to(logp.dtype)
    loss = -(logp * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return int(keep.sum())


RFT_SETTINGS = [("8 prompts x 8 samples", 8, 8), ("19 prompts x 4 samples", 19, 4)]
RFT_LEARNING = {"steps": 40, "lr": 1e-4, "prompts": 8, "num_generations": 8, "margin": 0.06}
_RFT_OTHERWISE = ("another direction: keep only the completions whose reward is 1, and train on their tokens (the "
                  "completion mask: the answer and its <eos>), never on the prompt")
_RFT_LONGER = ("the mean is over the kept completions' tokens (the sum of their completion mask): not a sum, and not "
               "over every sampled row")


def _rft_base():
    from rlcourse.lm import load_checkpoint
    from rlcourse.tasks.arithmetic import DigitSumTask

    model, tokenizer = load_checkpoint("addition", device="cpu")
    return DigitSumTask(n_digits=2), model.eval(), tokenizer


@functools.lru_cache(maxsize=1)
def _rft_start():
    """``(task, model, tokenizer)``: ``addition`` after 60 SFT steps on oracle digit sums (lr 1e-3), a policy whose
    samples are valid about half the time, so that every compared batch keeps some and drops some. Built once per
    process (a few seconds)."""
    from rlcourse.tasks.arithmetic import DigitSumTask
    from rlcourse.trainers.sft import train_sft

    task, model, tokenizer = _rft_base()
    data = DigitSumTask(n_digits=2, demo_accuracy=1.0).sft_dataset(2000, rng=0)
    train_sft(model, tokenizer, data, steps=60, lr=1e-3, batch_size=64, seed=0, progress=False)
    return task, model.eval(), tokenizer


@references("rlcourse.trainers.rft:RFTTrainer.step", "rlcourse.trainers.rft:RFTTrainer.train",
            "rlcourse.trainers.sft:train_sft", "rlcourse.trainers.sft:sft_loss")
def check_rft_step(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator) -> kept``: one RFT update. Two calls per setting
    from the same weights and generator seed as the reference: the same count kept and the same gradient; then
    40 steps (Adam, lr 1e-4) from ``addition`` on two-digit digit sums must raise the validity of samples."""
    __tracebackhide__ = True
    import copy

    import numpy as np

    from rlcourse.grading._steps import assert_call_gradient, twin_runs
    from rlcourse.measure.forgetting_runs import ForgettingSetup, new_task_accuracy

    name = "check_rft_step"
    task, start, tokenizer = _rft_start()
    n = 0
    for case, n_prompts, k in RFT_SETTINGS:
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.05)
        gen_mine, gen_theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for call in (0, 1):
            prompts = [p for p in task.prompts(n_prompts, rng=40 + call) for _ in range(k)]
            kept = fn(mine, opt_mine, tokenizer, task, list(prompts), gen_mine)
            expected = _reference_rft_step(theirs, opt_theirs, tokenizer, task, prompts, gen_theirs)
            label = f"{case}, call {call + 1}"
            if kept is None or int(kept) != expected:
                fail(name, label, f"{expected} completions kept (reward 1)", kept,
                     "sample once per call with sample(model, tokenizer, prompts, task.max_new_tokens, generator="
                     "generator); keep the rows whose task.reward is 1 and return how many")
            assert_call_gradient(name, label, call, opt_mine, opt_theirs, _RFT_OTHERWISE, longer=_RFT_LONGER)
            n += 1
    s = RFT_LEARNING
    _, base, _ = _rft_base()
    model = copy.deepcopy(base)
    setup = ForgettingSetup(base, tokenizer, kl_samples=1)
    before = new_task_accuracy(base, setup)
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    kept = [fn(model, optimizer, tokenizer, task, [p for p in task.prompts(s["prompts"], rng)
                                                  for _ in range(s["num_generations"])], gen)
            for _ in range(s["steps"])]
    after = new_task_accuracy(model.eval(), setup)
    if not after >= before + s["margin"]:
        fail(name, f"{s['steps']} steps of your step (Adam, lr {s['lr']}, {s['prompts']} prompts x {s['num_generations']})",
             f"valid samples at least {before + s['margin']:.3f} (from {before:.3f})", f"{after:.3f}",
             f"your step kept {np.mean(kept[:5]):.1f} -> {np.mean(kept[-5:]):.1f} completions per call")
    print(f"✔ {name}: all {n} cases passed; {s['steps']} steps raised valid samples {before:.3f} -> {after:.3f}")
