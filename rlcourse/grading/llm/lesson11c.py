"""Checks for lesson 11c (on-policy distillation).

* :func:`check_masked_reverse_kl` - the per-token reverse KL(student || teacher), exact over the
  vocabulary, masked, with the teacher under stop-gradient (mistakes caught: the forward KL, the sign
  flipped, probabilities for log-probabilities, the teacher's raw logits for its log-probabilities, a
  mean over the vocabulary for the sum, the mask left out, the mask multiplied in so that junk at a
  masked position leaks, a gradient reaching the teacher, one number per completion);
* :func:`check_gkd_jsd` - GKD's generalised JSD at a given ``beta``, TRL's convention at the ends
  (mistakes caught: the mixture's weights swapped, the two KL terms' weights swapped, the ends
  swapped or computed from the mixture formula, the KLs to the mixture taken the wrong way round,
  ``beta`` ignored, the mask left out);
* :func:`check_distillation_step` - one on-policy distillation step, checked by the gradient it hands
  the optimiser (against the reference step's, from the same weights and sampling stream) and by a
  short training run from ``addition-partial`` that must raise held-out exact match;
* :func:`check_distillation_step_fixed` - find the bug: a step that takes ``F.kl_div`` the wrong way
  round and so trains the forward KL; fixed, its gradient equals the reference's.
"""
from __future__ import annotations

import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references
from rlcourse.grading._routes import DISTILLATION

__all__ = ["check_masked_reverse_kl", "check_gkd_jsd", "check_distillation_step", "check_distillation_step_fixed"]


# ------------------------------------------------------------------------- shared: cases of logits
def _logit_cases():
    """``(case, student_logits, teacher_logits, mask)``: shapes, scales and masks varied; one case with junk."""
    cases = []
    for i, (B, T, V, scale, share) in enumerate(((2, 3, 5, 1.0, 1.0), (3, 4, 16, 3.0, 0.6), (4, 6, 81, 2.0, 0.5),
                                                 (1, 1, 7, 5.0, 1.0))):
        g = torch.Generator().manual_seed(1100 + i)
        zs = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
        zt = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
        mask = (torch.rand(B, T, generator=g) < share).long()
        mask[:, 0] = 1                                          # every row holds a token
        cases.append((f"B={B}, T={T}, V={V}, logits of scale {scale}, {int(mask.sum())}/{B * T} positions counted",
                      zs, zt, mask))
    g = torch.Generator().manual_seed(1199)
    zs, zt = torch.randn(3, 5, 11, generator=g, dtype=torch.float64), torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    zs[mask == 0], zt[mask == 0] = float("nan"), float("inf")
    cases.append(("padding positions holding NaN (student) and inf (teacher)", zs, zt, mask))
    return cases


def _log_softmaxes(zs, zt, mask):
    keep = mask.bool()[..., None]
    zs, zt = torch.where(keep, zs, 0.0), torch.where(keep, zt, 0.0)
    return torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)


def _kl(log_p, log_q):
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _call(name, case, fn, zs, zt, mask, *extra):
    """The learner's per-token result on fresh leaf copies of the logits: ``(result, student, teacher)``; the
    result must be a (B, T) tensor that carries the student's graph."""
    __tracebackhide__ = True
    student = zs.clone().requires_grad_(True)
    teacher = zt.clone().requires_grad_(True)
    got = call_unmutated(name, case, fn, student, teacher, mask, *extra)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(mask.shape):
        fail(name, case, f"a tensor of shape {tuple(mask.shape)}: one divergence per position",
             getattr(got, "shape", type(got).__name__),
             "sum over the vocabulary (the last dimension) only; averaging over positions is the loss's job, not this "
             "function's")
    if got.grad_fn is None:
        fail(name, case, "a result that carries the student's graph", "a tensor without a graph",
             "compute it from student_logits without .detach() or torch.no_grad(): the student learns through it")
    return got, student, teacher


def _check_gradient(name, case, got, student, teacher, zs, zt, mask, reference_fn, *extra):
    """The gradient of a weighted sum of the result reaches the student's logits as the reference's does, and
    never the teacher's."""
    __tracebackhide__ = True
    weights = torch.linspace(0.5, 1.5, mask.numel(), dtype=torch.float64).view(mask.shape)
    torch.where(mask.bool(), got * weights, 0.0).sum().backward()
    if teacher.grad is not None and float(teacher.grad.nan_to_num().abs().max()) > 0:
        fail(name, case, "no gradient on teacher_logits", "a gradient reached teacher_logits",
             "the teacher is frozen: detach its logits (stop-gradient) before using them")
    ref_student = zs.clone().requires_grad_(True)
    ref = reference_fn(ref_student, zt, mask, *extra)
    torch.where(mask.bool(), ref * weights, 0.0).sum().backward()
    received = student.grad if student.grad is not None else torch.zeros_like(zs)
    if not torch.isfinite(received).all():
        fail(name, case, "a finite gradient", "NaN or inf in the student's gradient",
             "select the padding away with torch.where before any arithmetic: x * mask is NaN where x is NaN")
    assert_close(name, f"{case}: gradient of sum(w * result) in student_logits", ref_student.grad, received,
                 atol=1e-6, rtol=1e-5, hint="the divergence's gradient flows through the student's distribution only")


# ----------------------------------------------------------------- exercise 1: the masked reverse KL
def _reverse_reference(zs, zt, mask):
    from rlcourse.losses.distillation import reverse_kl_per_token

    return reverse_kl_per_token(zs, zt, mask)


def _reverse_mistakes(zs, zt, mask):
    m = mask.bool()
    log_s, log_t = _log_softmaxes(zs, zt, mask)
    zero = torch.zeros(mask.shape, dtype=torch.float64)
    keep = lambda x: torch.where(m, x, zero)      # noqa: E731
    V = zs.shape[-1]
    return [
        (keep(_kl(log_t, log_s)), "that is the forward KL(teacher || student): the reverse KL averages over the "
                                  "student's distribution, sum_v pi_s(v) (log pi_s(v) - log pi_T(v))"),
        (keep(-_kl(log_s, log_t)), "the sign: a KL is >= 0, log pi_s - log pi_T weighted by pi_s"),
        (keep((log_s.exp() * (log_s.exp() - log_t.exp())).sum(-1)), "log-probabilities, not probabilities, inside "
                                                                   "the bracket: log_softmax of each model's logits"),
        (keep((log_s.exp() * (log_s - torch.where(m[..., None], zt, 0.0))).sum(-1)),
         "normalise the teacher's logits too: log_softmax(teacher_logits), not the raw logits"),
        (keep(_kl(log_s, log_t) / V), "sum over the vocabulary, do not average over it"),
        (_kl(torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)),
         "positions where the mask is 0 are not there: 0 at those positions"),
    ]


@references(*DISTILLATION)
def check_masked_reverse_kl(fn) -> None:
    """``fn(student_logits, teacher_logits, mask) -> (B, T)``: ``KL(pi_s || pi_T)`` at each position, exact over the
    vocabulary, 0 where ``mask`` is 0, with the teacher's logits under stop-gradient."""
    __tracebackhide__ = True
    name = "check_masked_reverse_kl"
    n = 0
    for case, zs, zt, mask in _logit_cases():
        out, student, teacher = _call(name, case, fn, zs, zt, mask)
        got = out.detach()
        expected = _reverse_reference(zs, zt, mask)
        if not torch.isfinite(got).all():
            fail(name, case, "finite values", "NaN or inf in the result",
                 "positions where the mask is 0 may hold anything: replace them with torch.where before any arithmetic")
        for mistake, hint in _reverse_mistakes(zs, zt, mask):
            if float((mistake - expected).abs().max()) > 1e-6:
                fail_if_mistake(name, case, expected, got, mistake, hint)
        assert_close(name, case, expected, got, atol=1e-8, rtol=1e-6,
                     hint="sum_v pi_s(v) (log pi_s(v) - log pi_T(v)) at each position where the mask is 1, 0 elsewhere")
        _check_gradient(name, case, out, student, teacher, zs, zt, mask, _reverse_reference)
        n += 1
    passed(name, n)


# --------------------------------------------------------------------- exercise 2: GKD's JSD at beta
BETAS = (0.0, 0.1, 0.5, 0.8, 1.0)


def _jsd_reference(zs, zt, mask, beta):
    from rlcourse.losses.distillation import generalized_jsd_per_token

    return generalized_jsd_per_token(zs, zt, mask, beta=beta)


def _jsd_mistakes(zs, zt, mask, beta):
    m = mask.bool()
    log_s, log_t = _log_softmaxes(zs, zt, mask)
    zero = torch.zeros(mask.shape, dtype=torch.float64)
    keep = lambda x: torch.where(m, x, zero)      # noqa: E731

    def mix(w_t):    # log of w_t pi_T + (1 - w_t) pi_s
        return torch.log(w_t * log_t.exp() + (1 - w_t) * log_s.exp())

    out = []
    if 0 < beta < 1:
        log_m, swapped = mix(beta), mix(1 - beta)
        out += [
            (keep(beta * _kl(log_t, swapped) + (1 - beta) * _kl(log_s, swapped)),
             f"the mixture is M = beta pi_T + (1 - beta) pi_s: beta weighs the teacher (beta={beta})"),
            (keep((1 - beta) * _kl(log_t, log_m) + beta * _kl(log_s, log_m)),
             "the terms' weights: beta KL(pi_T || M) + (1 - beta) KL(pi_s || M)"),
            (keep(beta * _kl(log_m, log_t) + (1 - beta) * _kl(log_m, log_s)),
             "KL(pi_T || M) and KL(pi_s || M): each model's distribution first, the mixture second"),
            (keep(0.5 * _kl(log_t, mix(0.5)) + 0.5 * _kl(log_s, mix(0.5))), "use beta: this is the symmetric JSD"),
        ]
    else:
        other = _kl(log_s, log_t) if beta == 0 else _kl(log_t, log_s)
        out += [(keep(other), "TRL's convention: beta = 0 is the forward KL(teacher || student), beta = 1 the reverse "
                              "KL(student || teacher)"),
                (zero, f"at beta = {beta:g} the mixture formula gives 0 (M is one of the two models); TRL computes the "
                       f"KL itself at the two ends")]
        w = min(max(beta, 1e-12), 1 - 1e-12)
        near = mix(w)
        out.append((keep(w * _kl(log_t, near) + (1 - w) * _kl(log_s, near)),
                    f"at beta = {beta:g} compute the KL directly: the mixture formula tends to 0 there, not to the KL"))
    raw_s, raw_t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    raw_m = torch.log(beta * raw_t.exp() + (1 - beta) * raw_s.exp())
    full = (_kl(raw_t, raw_s) if beta == 0 else _kl(raw_s, raw_t) if beta == 1 else
            beta * _kl(raw_t, raw_m) + (1 - beta) * _kl(raw_s, raw_m))
    out.append((full, "positions where the mask is 0 are not there: 0 at those positions"))
    return out


@references(*DISTILLATION)
def check_gkd_jsd(fn) -> None:
    """``fn(student_logits, teacher_logits, mask, beta) -> (B, T)``: GKD's generalised JSD at each position,
    ``beta KL(pi_T || M) + (1 - beta) KL(pi_s || M)`` with ``M = beta pi_T + (1 - beta) pi_s``, the forward KL at
    ``beta = 0`` and the reverse KL at ``beta = 1``; 0 where ``mask`` is 0; the teacher under stop-gradient."""
    __tracebackhide__ = True
    name = "check_gkd_jsd"
    n = 0
    cases = _logit_cases()
    for k, beta in enumerate(BETAS):
        for case, zs, zt, mask in (cases[k % len(cases)], cases[(k + 2) % len(cases)]):
            label = f"beta={beta}, {case}"
            out, student, teacher = _call(name, label, fn, zs, zt, mask, beta)
            got = out.detach()
            expected = _jsd_reference(zs, zt, mask, beta)
            if not torch.isfinite(got).all():
                fail(name, label, "finite values", "NaN or inf in the result",
                     "at beta = 0 or 1 log(beta) or log(1 - beta) is -inf: compute the KL directly there; and replace "
                     "masked positions with torch.where before any arithmetic")
            for mistake, hint in _jsd_mistakes(zs, zt, mask, beta):
                if float((mistake - expected).abs().max()) > 1e-6:
                    fail_if_mistake(name, label, expected, got, mistake, hint)
            assert_close(name, label, expected, got, atol=1e-8, rtol=1e-6,
                         hint="beta KL(pi_T || M) + (1 - beta) KL(pi_s || M), M = beta pi_T + (1 - beta) pi_s; the KL "
                              "itself at the two ends")
            _check_gradient(name, label, out, student, teacher, zs, zt, mask, _jsd_reference, beta)
            n += 1
    passed(name, n)


# ------------------------------------------------------------------- exercise 3: one distillation step
def _reference_step(model, teacher, optimizer, tokenizer, task, prompts, generator) -> float:
    """The reference step: one completion per prompt from the student at temperature 1, the per-token reverse KL to
    the teacher exact over the vocabulary, averaged over every completion token of the batch, one update. Returns
    the loss before the update."""
    from rlcourse.lm.logprobs import completion_logits
    from rlcourse.lm.sampling import sample
    from rlcourse.losses.distillation import generalized_jsd

    roll = sample(model, tokenizer, prompts, task.max_new_tokens, temperature=1.0, generator=generator)
    args = (roll.prompt_ids, roll.completion_ids, roll.prompt_mask, roll.completion_mask)
    student_logits = completion_logits(model, *args)
    with torch.no_grad():
        teacher_logits = completion_logits(teacher, *args)
    loss = generalized_jsd(student_logits, teacher_logits, roll.completion_mask, beta=1.0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


# (prompts per call, seed of the teacher's perturbation, the task's completion budget: None keeps the task's own)
STEP_SETTINGS = [(6, 11, None), (16, 12, 3)]
STEP_LEARNING = {"steps": 40, "lr": 3e-4, "prompts": 64, "held_out": 300, "margin": 0.1}
_SPAN = ("the right direction at another length: average the per-token KL over every completion token of the batch "
         "(sum over tokens / number of tokens, <eos> included), not per completion and not over the padding")


def _teacher():
    from rlcourse.lm import load_checkpoint

    return load_checkpoint("addition", device="cpu")[0].eval()


def _compare_steps(name, fn, otherwise):
    """Two calls of ``fn`` and of the reference per setting, from the same (moved) weights and generator seed: the
    same returned loss and the same gradient at each call."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import addition_start, assert_call_gradient, moved_copy, twin_runs

    import copy

    task, start, tokenizer = addition_start()
    n = 0
    for n_prompts, teacher_seed, budget in STEP_SETTINGS:
        teacher = moved_copy(_teacher(), seed=teacher_seed, scale=0.01).eval()   # not a checkpoint an answer could load
        if budget is not None:     # a budget that cuts three-digit sums: the step must read task.max_new_tokens
            task = copy.copy(task)
            task.max_new_tokens = budget
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.05)
        gen_mine, gen_theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for call in (0, 1):
            prompts = task.prompts(n_prompts, rng=40 + call)
            got = fn(mine, teacher, opt_mine, tokenizer, task, list(prompts), gen_mine)
            expected = _reference_step(theirs, teacher, opt_theirs, tokenizer, task, prompts, gen_theirs)
            label = (f"{n_prompts} prompts, call {call + 1}, teacher perturbed with seed {teacher_seed}, "
                     f"task.max_new_tokens={task.max_new_tokens}")
            assert_call_gradient(name, label, call, opt_mine, opt_theirs, otherwise, longer=_SPAN)
            if got is None or not abs(float(got) - expected) <= 1e-5 * max(1.0, abs(expected)):
                fail(name, label, f"the batch's mean per-token reverse KL before the update, {expected:.5f}", got,
                     "return the loss you differentiated, as a float (float(loss.detach())), computed before "
                     "optimizer.step()")
            n += 1
    return n


def _train(fn):
    """40 steps of ``fn`` from ``addition-partial`` with Adam; held-out greedy exact match before and after."""
    from rlcourse.grading._steps import train_from_addition

    teacher, s = _teacher(), STEP_LEARNING

    def step(model, optimizer, tokenizer, task, prompts, generator):
        return float(fn(model, teacher, optimizer, tokenizer, task, prompts, generator))

    return train_from_addition(step, s["steps"], s["lr"], s["prompts"], s["held_out"])


def _check_step(name, fn, otherwise):
    __tracebackhide__ = True
    import numpy as np

    n = _compare_steps(name, fn, otherwise)
    s = STEP_LEARNING
    before, after, losses = _train(fn)
    if not after >= before + s["margin"]:
        fail(name, f"{s['steps']} steps of your step (Adam, lr {s['lr']}, {s['prompts']} prompts a step)",
             f"held-out exact match at least {before + s['margin']:.3f} (from {before:.3f})", f"{after:.3f}",
             f"the returned loss went {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f} (first and last 5 steps)")
    print(f"✔ {name}: all {n} cases passed; {s['steps']} steps raised held-out exact match {before:.3f} -> {after:.3f}")


@references(*DISTILLATION)
def check_distillation_step(fn) -> None:
    """``fn(model, teacher, optimizer, tokenizer, task, prompts, generator) -> float``: one on-policy distillation
    step. The gradient of each of two calls equals the reference step's (same weights, same sampling stream), the
    returned value is the batch's mean per-token reverse KL before the update; then 40 steps from
    ``addition-partial`` must raise held-out greedy exact match by 10 points."""
    __tracebackhide__ = True
    _check_step("check_distillation_step", fn,
                "another direction: the loss is the reverse KL(student || teacher) at each completion position of the "
                "student's own samples (one per prompt, drawn at temperature 1 with the generator given), exact over the "
                "vocabulary, the teacher's logits detached, averaged over the completion tokens")


@references(*DISTILLATION)
def check_distillation_step_fixed(fn) -> None:
    """``fn(model, teacher, optimizer, tokenizer, task, prompts, generator) -> float``: the fixed find-the-bug step.
    Its gradient equals the reference step's (the reverse KL); then 40 steps must raise held-out exact match."""
    __tracebackhide__ = True
    _check_step("check_distillation_step_fixed", fn,
                "another direction: F.kl_div(input, target, log_target=True) computes KL(target || input), so "
                "F.kl_div(student_logp, teacher_logp, ...) is the forward KL(teacher || student). The reverse KL "
                "takes the student's log-probs as target")
