"""Checks for lesson 11b (preference optimisation beyond offline DPO).

* :func:`check_simpo_loss` - SimPO from per-token log-probs: length-normalised, reference-free, with
  its target margin (the reference is TRL's ``CPOTrainer`` loss, ``tests/test_trl_parity_beyond_dpo.py``);
* :func:`check_orpo_loss` - ORPO's loss: the chosen answers' NLL plus ``beta`` times the odds-ratio term on
  per-token average probabilities (the reference is TRL's ``ORPOTrainer`` odds-ratio loss); where the value
  differs, the two terms are measured apart (the loss at two betas: intercept and slope);
* :func:`check_kto_loss` - KTO's per-example loss with its reference point from mismatched pairs,
  clamped at 0 and held constant (the reference is TRL's ``KTOTrainer`` loss);
* :func:`check_online_dpo_pairs` - the pairs online DPO forms from sampled, scored groups;
* :func:`check_fit_simpo_policy` - an experiment: a tabular policy fitted by SimPO on bandit comparisons
  must land on the policy those comparisons imply under SimPO (near SimPO's closed-form optimum,
  :func:`rlcourse.measure.preference_optima.simpo_optimum`, when they are many; elsewhere when they are few), not
  on the KL-regularised optimum;
* :func:`check_online_dpo_step` - one round of online DPO on ``preference-sft`` (sample, score, pair, DPO
  step), judged as lesson 11's DPO step is: its gradient against the reference round's
  (:mod:`rlcourse.grading._steps`), then what 30 rounds of it do to the gold score;
* :func:`check_train_online_dpo` - the find-the-bug exercise: rounds of online DPO against a reference
  that stays where the run started; judged by each round's gradient and logged loss and KL against the
  reference run's, with the symptom named where it shows.

Each check compares with the course's function, which the parity tests hold to TRL's code, and
measures what a wrong answer gets wrong: how the loss moves when only the reference log-probs move,
what it gives where padding sits, whether a gradient reaches the reference point's inputs, and so on.
The wrong answers each check refuses are listed with witnesses in ``tests/test_grading_lesson11b.py``.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, gradient_flowing, passed, references, to_numpy
from rlcourse.grading._routes import ONLINE_DPO, PREFERENCE_TRAINERS, SIGMOID_PAIR_LOSSES

__all__ = ["check_simpo_loss", "check_orpo_loss", "check_kto_loss", "check_online_dpo_pairs", "check_fit_simpo_policy",
           "check_online_dpo_step", "check_train_online_dpo"]


def _values(name, case, got, shape):
    """The answer as float64 numbers of ``shape``, or a failure saying what came back."""
    __tracebackhide__ = True
    if got is None:
        fail(name, case, f"a tensor of shape {shape}", None, "the function returned None")
    try:
        values = to_numpy(got)
    except (TypeError, ValueError):
        fail(name, case, f"a tensor of shape {shape}", f"{type(got).__name__}", "")
    if values.shape != shape:
        fail(name, case, f"shape {shape} (one loss per {'pair' if len(shape) == 1 else 'row'})", f"shape {values.shape}", "")
    return values


# --- SimPO ------------------------------------------------------------------------------------------

def _ragged_pairs(gen, B, T):
    """``(chosen_tok, rejected_tok, chosen_mask, rejected_mask)`` of ``B`` pairs padded to ``T`` columns,
    float64 log-probs exactly 0 on padding; pair 0 has a chosen answer of ``T`` tokens and a rejected one of 1."""
    lengths = torch.randint(1, T + 1, (2, B), generator=gen)
    lengths[0, 0], lengths[1, 0] = T, 1
    masks = [(torch.arange(T) < n[:, None]).long() for n in lengths]
    toks = [torch.where(m.bool(), -3 * torch.rand(B, T, generator=gen, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64))
            for m in masks]
    return (*toks, *masks)


def _simpo_cases():
    """(case, chosen_tok, rejected_tok, chosen_mask, rejected_mask, ref_chosen, ref_rejected, beta, gamma)."""
    gen = torch.Generator().manual_seed(1101)
    cases = []

    def batch(B, T):
        refs = [-12 * torch.rand(B, generator=gen, dtype=torch.float64) for _ in range(2)]
        return (*_ragged_pairs(gen, B, T), *refs)

    cases.append(("4 pairs of ragged lengths (T=6), beta=2, gamma=0.5", *batch(4, 6), 2.0, 0.5))
    cases.append(("8 pairs (T=9), beta=0.1, gamma=0", *batch(8, 9), 0.1, 0.0))
    cases.append(("5 pairs (T=4), beta=2.5, gamma=1.4", *batch(5, 4), 2.5, 1.4))
    cw, cl, mw, ml, rw, rl = batch(3, 5)
    cases.append(("3 pairs whose reference log-probs are far from the policy's (by -40 and +25)",
                  cw, cl, mw, ml, rw - 40.0, rl + 25.0, 1.0, 0.3))
    big = torch.tensor([[-400.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    ones = torch.tensor([[1, 0], [1, 0]])
    cases.append(("confident pairs: beta * margin = -2000 and +2000", big.clone(), big.flip(0).clone(), ones, ones.clone(),
                  torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), 5.0, 0.0))
    cw, cl, mw, ml, rw, rl = batch(6, 8)
    cases.append(("6 pairs (T=8) given as float32 tensors and an integer beta", cw.float(), cl.float(), mw, ml, rw.float(),
                  rl.float(), 2, 0.25))
    return cases


@references("rlcourse.losses.beyond_dpo:average_logps", *SIGMOID_PAIR_LOSSES, *PREFERENCE_TRAINERS)
def check_simpo_loss(fn) -> None:
    """``fn(chosen_token_logps, rejected_token_logps, chosen_mask, rejected_mask, ref_chosen_logps,
    ref_rejected_logps, beta, gamma) -> (B,)``: ``-log sigmoid(beta (avg log pi(y_w) - avg log pi(y_l)) - gamma)``,
    the averages over each completion's real tokens, the reference unused."""
    __tracebackhide__ = True
    from rlcourse.losses import average_logps, simpo_loss

    name = "check_simpo_loss"
    cases = _simpo_cases()
    for case, cw, cl, mw, ml, rw, rl, beta, gamma in cases:
        got = call_unmutated(name, case, fn, cw, cl, mw, ml, rw, rl, beta, gamma)
        aw, al = average_logps(cw.double(), mw), average_logps(cl.double(), ml)
        expected = simpo_loss(aw, al, beta, gamma)
        values = _values(name, case, got, tuple(expected.shape))
        if not np.isfinite(values).all():
            fail(name, case, expected, got, "non-finite losses where the expected ones are finite (the margins here "
                 "reach +-2000: -log(sigmoid(z)) in floating point gives inf there; logsigmoid does not)")
        shifted = call_unmutated(name, case, fn, cw, cl, mw, ml, rw + 3.0, rl - 2.0, beta, gamma)
        moved = float(np.abs(to_numpy(shifted) - values).max())
        if moved > 1e-9:
            fail(name, case, "the same losses when only the reference log-probs move (by +3 and -2)",
                 f"losses that moved by up to {moved:.4g}", "SimPO's implicit reward reads the policy alone")
        sums = simpo_loss(cw.double().sum(-1), cl.double().sum(-1), beta, gamma)
        if np.allclose(values, to_numpy(sums)) and not torch.allclose(sums, expected):
            fail(name, case, expected, got, "these are the losses of the summed (not averaged) log-probs: the "
                 "received values equal SimPO on sum_t log pi(y_t)")
        assert_close(name, case, expected, got, "the expected loss reads each completion's mean log-prob over its "
                     "real tokens (mask 1), times beta, minus gamma", atol=1e-6 if cw.dtype == torch.float32 else 1e-7,
                     rtol=1e-6 if cw.dtype == torch.float32 else 1e-7)
    passed(name, len(cases))


# --- ORPO -------------------------------------------------------------------------------------------

def _orpo_cases():
    """(case, chosen_tok, rejected_tok, chosen_mask, rejected_mask, beta)."""
    gen = torch.Generator().manual_seed(1104)
    cases = [("4 pairs of ragged lengths (T=6), beta=0.1", *_ragged_pairs(gen, 4, 6), 0.1),
             ("8 pairs (T=9), beta=1", *_ragged_pairs(gen, 8, 9), 1.0),
             ("5 pairs (T=5), beta=2.5", *_ragged_pairs(gen, 5, 5), 2.5)]
    # Rejected answers the policy is nearly sure of: per-token log-probs about -1e-8, whose exp is 1.0 in float32.
    cw, cl, mw, ml = _ragged_pairs(gen, 4, 5)
    sure = -1e-8 * (1 + torch.rand(4, 5, generator=gen, dtype=torch.float64))
    cl = torch.where(ml.bool(), sure, torch.zeros_like(sure))
    cases.append(("4 pairs in float32 whose rejected answers the policy is nearly sure of (per-token log-probs "
                  "about -1e-8), beta=0.5", cw.float(), cl.float(), mw, ml, 0.5))
    cw, cl, mw, ml = _ragged_pairs(gen, 6, 8)
    cases.append(("6 pairs (T=8) given as float32 tensors and an integer beta", cw.float(), cl.float(), mw, ml, 2))
    return cases


def _orpo_terms(cw, cl, mw, ml):
    """ORPO's two terms, in float64 and differentiable: (NLL of the chosen tokens, mean odds-ratio loss)."""
    from rlcourse.losses import average_logps, chosen_nll_loss, orpo_loss

    return chosen_nll_loss(cw, mw), orpo_loss(average_logps(cw, mw), average_logps(cl, ml), 1.0).mean()


def _orpo_diagnosis(cw, cl, mw, ml, nll: float, ratio_term: float, got_nll: float, got_ratio: float) -> str:
    """Which of the two terms differs (the learner's loss measured at two betas: intercept and slope), and
    what the differing one equals where it is a known other quantity."""
    from rlcourse.losses import average_logps, orpo_loss

    cw, cl, m = cw.double(), cl.double(), mw.double()
    close = lambda a, b: abs(a - b) <= 1e-6 * max(1.0, abs(b))     # noqa: E731
    if not close(got_nll, nll):
        said = (f"your loss less its beta term (its intercept, measured at two betas) is {got_nll:.6g}; the NLL "
                f"of the chosen answers is {nll:.6g}")
        known = {"the mean over every column of the padded batch": float(-cw.sum() / cw.numel()),
                 "the mean of each answer's own mean NLL": float((-(cw * m).sum(-1) / m.sum(-1)).mean()),
                 "the mean over the chosen and the rejected answers' tokens together":
                     float(-(cw.sum() + cl.sum()) / (mw.sum() + ml.sum())),
                 "0: no NLL term, or one multiplied by beta": 0.0,
                 "the summed NLL of the chosen tokens": float(-cw.sum())}
        return said + "".join(f" (it equals {what})" for what, value in known.items() if close(got_nll, value))
    avg_w, avg_l = average_logps(cw, mw), average_logps(cl, ml)
    said = (f"the NLL term is right; your beta term (the loss's slope in beta) is {got_ratio:.6g}, the mean over "
            f"the pairs of -log sigmoid(log odds(y_w) - log odds(y_l)) is {ratio_term:.6g}")
    known = {"the odds of the summed log-probs, not of the per-token averages": orpo_loss(cw.sum(-1), cl.sum(-1), 1.0),
             "the ratio with chosen and rejected swapped": orpo_loss(avg_l, avg_w, 1.0),
             "the plain log-prob difference, without the odds": -torch.nn.functional.logsigmoid(avg_w - avg_l),
             "the odds of averages over the padded width": orpo_loss(cw.mean(-1), cl.mean(-1), 1.0),
             "the pairs' losses summed, not averaged": orpo_loss(avg_w, avg_l, 1.0).sum()}
    return said + "".join(f" (it equals {what})" for what, values in known.items()
                          if close(got_ratio, float(values.mean())))


@references("rlcourse.losses.beyond_dpo:orpo_loss", "rlcourse.losses.beyond_dpo:orpo_log_odds_ratio",
            "rlcourse.losses.beyond_dpo:_log1mexp", "rlcourse.losses.beyond_dpo:average_logps",
            "rlcourse.losses.dpo:chosen_nll_loss", *SIGMOID_PAIR_LOSSES, *PREFERENCE_TRAINERS)
def check_orpo_loss(fn) -> None:
    """``fn(chosen_token_logps, rejected_token_logps, chosen_mask, rejected_mask, beta) -> scalar``: ORPO's loss,
    the NLL of the chosen answers (one mean over all their real tokens) plus ``beta`` times the mean over pairs of
    ``-log sigmoid(log odds(y_w) - log odds(y_l))``, ``odds = p / (1 - p)``, ``p = exp(mean log-prob per token)``.
    Checked for its value (and, where it differs, each term's, measured at two betas) and for its gradient at
    the real tokens."""
    __tracebackhide__ = True
    import math

    name = "check_orpo_loss"
    cases = _orpo_cases()
    for case, cw, cl, mw, ml, beta in cases:
        leaves = [cw.clone().requires_grad_(True), cl.clone().requires_grad_(True)]
        got = call_unmutated(name, case, fn, *leaves, mw.clone(), ml.clone(), beta)
        exact = [t.detach().double().clone().requires_grad_(True) for t in (cw, cl)]
        nll, ratio_term = _orpo_terms(*exact, mw, ml)
        expected = nll + beta * ratio_term
        nll, ratio_term, target = (float(t.detach()) for t in (nll, ratio_term, expected))
        if got is None:
            fail(name, case, "one number, the batch's loss", None, "the function returned None")
        values = to_numpy(got)
        if values.size != 1:
            fail(name, case, "one number, the batch's loss (a 0-d tensor)", f"shape {values.shape}",
                 "one loss for the batch: the NLL term plus beta times the mean over the pairs")
        value = float(values.reshape(()))
        if not math.isfinite(value):
            fail(name, case, f"{target:.8g}", value, "a non-finite loss where the expected one is finite: "
                 "here the rejected answers' per-token probability p = exp(mean log-prob) rounds to 1.0 in float32, "
                 "so 1 - p computed from p is 0")
        tol = 1e-5 if cw.dtype == torch.float32 else 1e-7
        if abs(value - target) > tol * max(1.0, abs(target)):
            other = 2 * beta + 0.5
            second = float(to_numpy(call_unmutated(name, case, fn, cw.clone(), cl.clone(), mw.clone(), ml.clone(),
                                                   other)).reshape(-1)[0])
            slope = (second - value) / (other - beta)
            fail(name, case, f"{target:.8g}", f"{value:.8g}",
                 _orpo_diagnosis(cw, cl, mw, ml, nll, ratio_term, value - beta * slope, slope))
        grads = gradient_flowing(name, case, got, leaves)
        expected_grads = torch.autograd.grad(expected, exact)
        for side, g, e, m in zip(("chosen_token_logps", "rejected_token_logps"), grads, expected_grads, (mw, ml)):
            real = m.bool()
            g, e = to_numpy(g)[real.numpy()], to_numpy(e)[real.numpy()]
            where = f"{case}: the gradient on {side} at the real tokens"
            if not np.isfinite(g).all():
                fail(name, where, "finite gradients (the loss is finite)", g,
                     "a NaN or inf reached the gradient: an operation whose value was discarded (a branch of "
                     "torch.where, a term multiplied by 0) still has an infinite derivative here")
            assert_close(name, where, e, g, "the expected gradient is the derivative of the expected loss",
                         atol=tol * float(np.abs(e).max()), rtol=1e-4 if cw.dtype == torch.float32 else 1e-7)
    passed(name, len(cases))


# --- KTO --------------------------------------------------------------------------------------------

def _kto_cases():
    """(case, chosen, rejected, ref_chosen, ref_rejected, kl, ref_kl, beta, desirable_weight, undesirable_weight)."""
    gen = torch.Generator().manual_seed(1102)

    def logps(n, scale=8.0):
        return -scale * torch.rand(n, generator=gen, dtype=torch.float64)

    cases = []
    w, l = logps(3), logps(3)
    cases.append(("policy equal to the reference everywhere (every loss is half its weight)", w, l, w.clone(), l.clone(),
                  logps(4), None, 0.1, 1.0, 1.0))
    w, l, kl = logps(4), logps(4), logps(6)
    cases.append(("4 desirable and 4 undesirable, mismatched log-ratio +1.5 on average (z0 = 1.5)",
                  w, l, w - torch.randn(4, generator=gen, dtype=torch.float64), l + 2 * torch.randn(4, generator=gen, dtype=torch.float64),
                  kl, kl - 1.5, 1.0, 1.0, 1.0))
    w, l, kl = logps(3), logps(5), logps(5)
    cases.append(("3 desirable and 5 undesirable (unpaired), weights 1.33 and 0.7, beta=0.5",
                  w, l, w + torch.randn(3, generator=gen, dtype=torch.float64), l - torch.rand(5, generator=gen, dtype=torch.float64),
                  kl, kl - 0.4 - 0.2 * torch.rand(5, generator=gen, dtype=torch.float64), 0.5, 1.33, 0.7))
    w, l, kl = logps(4), logps(4), logps(4)
    cases.append(("mismatched log-ratios negative on average (-2): the reference point is clamped at 0",
                  w, l, w + 0.5, l - 0.5, kl, kl + 2.0, 2.0, 1.0, 1.0))
    w, l, kl = logps(5), logps(2), logps(7)
    cases.append(("5 desirable and 2 undesirable, z0 near 3, beta=0.2", w, l, w - 4.0, l - 1.0, kl,
                  kl - 3.0 + 0.3 * torch.randn(7, generator=gen, dtype=torch.float64), 0.2, 1.0, 1.0))
    return [(c, w, l, rw, rl, kl, kl.clone() if rkl is None else rkl, b, dw, uw)
            for c, w, l, rw, rl, kl, rkl, b, dw, uw in cases]


@references("rlcourse.losses.beyond_dpo:kto_loss", "rlcourse.losses.beyond_dpo:kto_reference_point",
            "rlcourse.losses.dpo:dpo_implicit_reward", "rlcourse.losses.beyond_dpo:preference_objective",
            *PREFERENCE_TRAINERS)
def check_kto_loss(fn) -> None:
    """``fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, kl_logps, ref_kl_logps, beta,
    desirable_weight, undesirable_weight) -> (n_desirable + n_undesirable,)``: KTO's loss per example,
    desirable first, with ``z0 = max(0, mean(kl_logps - ref_kl_logps))`` held constant (no gradient)."""
    __tracebackhide__ = True
    from rlcourse.losses import kto_loss, kto_reference_point

    name = "check_kto_loss"
    cases = _kto_cases()
    for case, w, l, rw, rl, kl, rkl, beta, dw, uw in cases:
        w, l, kl = (t.clone().requires_grad_(True) for t in (w, l, kl))
        got = call_unmutated(name, case, fn, w, l, rw, rl, kl, rkl, beta, dw, uw)
        z0 = kto_reference_point(kl.detach(), rkl)
        expected = kto_loss(w.detach(), l.detach(), rw, rl, z0, beta, dw, uw)
        _values(name, case, got, tuple(expected.shape))
        raw = float((kl.detach() - rkl).mean())
        if raw < 0:
            unclamped = kto_loss(w.detach(), l.detach(), rw, rl, raw, beta, dw, uw)
            if np.allclose(to_numpy(got), to_numpy(unclamped)):
                fail(name, case, expected, got, f"the received losses are KTO's with z0 = {raw:.3g}, the mean "
                     f"mismatched log-ratio itself; the expected z0 is max(0, {raw:.3g}) = 0")
        assert_close(name, case, expected, got, f"the expected losses use z0 = {float(z0):.4g}, desirable examples "
                     f"first: weight * (1 - sigmoid(beta (r - z0))) for them, weight * (1 - sigmoid(beta (z0 - r))) "
                     f"for the undesirable ones, r = log pi - log pi_ref", atol=1e-7, rtol=1e-7)
        grad_w, grad_l, grad_kl = gradient_flowing(name, case, got, [w, l, kl])
        if float(grad_kl.abs().max()) > 0:
            fail(name, case, "no gradient reaching kl_logps (z0 is a constant of the step)",
                 f"a gradient of size up to {float(grad_kl.abs().max()):.3g} on kl_logps", "")
        wl = [t.detach().clone().requires_grad_(True) for t in (w, l)]
        expected_grads = torch.autograd.grad(kto_loss(wl[0], wl[1], rw, rl, z0, beta, dw, uw).sum(), wl)
        for side, g, e in (("chosen_logps", grad_w, expected_grads[0]), ("rejected_logps", grad_l, expected_grads[1])):
            assert_close(name, f"{case}: the gradient of the summed losses on {side}", e, g,
                         "the expected gradient is the losses' derivative in the policy's log-probs with z0 fixed",
                         atol=1e-7, rtol=1e-6)
    passed(name, len(cases))


# --- online DPO's pairs -----------------------------------------------------------------------------

def _pair_cases():
    gen = torch.Generator().manual_seed(1103)
    cases = [
        ("two prompts of two answers, no ties (TRL's case)", torch.tensor([0.2, 0.9, 0.5, -0.1]), torch.tensor([0, 0, 1, 1])),
        ("a prompt whose answers all score alike (no pair), beside one that differs",
         torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 1.0]), torch.tensor([0, 0, 0, 1, 1, 1])),
        ("a group of one answer (no pair)", torch.tensor([0.7, 0.1, 0.3]), torch.tensor([4, 2, 2])),
        ("ties at the top and at the bottom of a group of six",
         torch.tensor([0.0, 3.0, 1.0, 3.0, 0.0, 2.0]), torch.tensor([7, 7, 7, 7, 7, 7])),
        ("interleaved groups with ids 5, 1, 3 (not sorted, not contiguous)",
         torch.tensor([0.4, 0.8, 0.1, 0.9, 0.3, 0.2, 0.6]), torch.tensor([5, 1, 3, 5, 1, 3, 5])),
        ("integer scores 0/1 of a verifier, 4 answers per prompt",
         torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])),
    ]
    groups = torch.randint(0, 6, (30,), generator=gen)
    cases.append(("30 answers in 6 random groups, scores with ties", torch.randint(0, 4, (30,), generator=gen).float(), groups))
    cases.append(("every prompt's answers score alike (no pair at all)", torch.tensor([0.5, 0.5, 0.2, 0.2]),
                  torch.tensor([0, 0, 1, 1])))
    return cases


def _as_indices(name, case, got):
    __tracebackhide__ = True
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        fail(name, case, "a pair (chosen_idx, rejected_idx)", repr(got)[:100], "")
    out = []
    for side, x in zip(("chosen_idx", "rejected_idx"), got):
        values = to_numpy(x).reshape(-1)
        if not np.all(values == np.round(values)):
            fail(name, case, f"{side}: integer indices into scores", values, "")
        out.append(values.astype(int).tolist())
    return out


@references("rlcourse.losses.beyond_dpo:online_dpo_pairs", "rlcourse.trainers.online_dpo:OnlineDPOTrainer.step",
            "rlcourse.trainers.online_dpo:OnlineDPOTrainer.train")
def check_online_dpo_pairs(fn) -> None:
    """``fn(scores, groups) -> (chosen_idx, rejected_idx)``: for each group with two different scores, in
    increasing group id, the first index of its highest score against the first index of its lowest."""
    __tracebackhide__ = True
    from rlcourse.losses import online_dpo_pairs

    name = "check_online_dpo_pairs"
    cases = _pair_cases()
    for case, scores, groups in cases:
        got = call_unmutated(name, case, fn, scores, groups)
        chosen, rejected = _as_indices(name, case, got)
        exp_c, exp_r = (t.tolist() for t in online_dpo_pairs(scores, groups))
        if len(chosen) != len(rejected):
            fail(name, case, "as many rejected indices as chosen ones", (len(chosen), len(rejected)), "")
        received = list(zip(chosen, rejected))
        expected = list(zip(exp_c, exp_r))
        same_score = [(c, r) for c, r in received if 0 <= c < len(scores) and 0 <= r < len(scores)
                      and float(scores[c]) == float(scores[r])]
        if same_score:
            fail(name, case, f"pairs {expected}", f"pairs {received}",
                 f"pair {same_score[0]} compares two answers of equal score {float(scores[same_score[0][0]]):g}")
        if sorted(received) == sorted(expected) and received != expected:
            fail(name, case, f"pairs {expected} (in increasing group id)", f"pairs {received}", "the same pairs in another order")
        if received != expected:
            fail(name, case, f"pairs {expected}", f"pairs {received}",
                 f"{len(expected)} pair(s) expected, {len(received)} received")
    passed(name, len(cases))


# --- SimPO on the bandit: an experiment ---------------------------------------------------------------

@references("rlcourse.measure.preference_optima:simpo_optimum", "rlcourse.measure.preference_optima:minimise_expected_loss",
            "rlcourse.measure.preference_optima:expected_preference_loss", "rlcourse.measure.categorical_bandit:train_tabular_policy",
            "rlcourse.losses.beyond_dpo:average_logps", "rlcourse.grading.llm.lesson11:optimum_of_the_data",
            *SIGMOID_PAIR_LOSSES)
def check_fit_simpo_policy(fn) -> None:
    """``fn(bandit, pairs, lengths, beta) -> (P, K)`` log-probs of a tabular policy fitted by SimPO (margin 0)
    to ``pairs``.

    Judged by where it lands: each sample of Bradley-Terry comparisons implies one policy, the minimiser of
    the mean SimPO loss over them (:func:`~rlcourse.grading.llm.lesson11.optimum_of_the_data`, found here by
    L-BFGS), and the fit must be within 0.002 nats of KL per prompt of it. With 20000 comparisons that
    policy is close to SimPO's closed-form optimum ``log pi(y|x) = |y| (r(x, y) / beta + c(x))``, far from
    ``pi*``; with 100 and 300 it is 0.20 and 0.03 nats from that closed form, which only a fit to these
    comparisons finds.
    """
    __tracebackhide__ = True
    from rlcourse.measure.categorical_bandit import CategoricalBandit
    from rlcourse.grading.llm.lesson11 import FIT_TOLERANCE, fitted_table, optimum_of_the_data
    from rlcourse.measure.preference_optima import simpo_optimum

    name = "check_fit_simpo_policy"
    worst, closed_far, closed_near = 0.0, 0.0, 0.0
    for kwargs, lengths, beta, n, data_seed in FIT_SIMPO_CASES:
        bandit = CategoricalBandit.random(**kwargs)
        case = (f"{bandit.n_prompts} prompts x {bandit.n_answers} answers of lengths {[int(x) for x in lengths]}, "
                f"beta={beta}, {n} comparisons")
        pairs = bandit.sample_pairs(n, rng=data_seed)
        L = torch.tensor(lengths, dtype=torch.float64)
        got = fitted_table(name, case, fn(bandit, {k: v.clone() for k, v in pairs.items()}, L.clone(), beta), bandit)

        def fit(per_token):
            return optimum_of_the_data(bandit, pairs, lambda lp, x, a, b: torch.nn.functional.softplus(
                -beta * (per_token(lp)[x, a] - per_token(lp)[x, b])))

        target = fit(lambda lp: lp / L)
        closed = simpo_optimum(bandit.reward, L, beta)
        kl = float(bandit.kl(got, target).mean())
        gap = float(bandit.kl(closed, target).mean())
        closed_far, closed_near = (max(closed_far, gap), closed_near) if n < 1000 else (closed_far, gap)
        if not kl < FIT_TOLERANCE:
            if float(bandit.kl(got, closed).mean()) < 1e-6:
                hint = (f"this is SimPO's closed form, computed from the bandit's reward, not a fit to these "
                        f"comparisons: {n} of them lead SimPO to a policy {gap:.3f} nats from it. Minimise the "
                        f"mean SimPO loss over pairs")
            else:
                measured = {"the fit with the reference kept, (log pi - log pi_ref) / |y|":
                                float(bandit.kl(got, fit(lambda lp: (lp - bandit.ref_logprobs) / L)).mean()),
                            "the fit with every length 1": float(bandit.kl(got, fit(lambda lp: lp)).mean()),
                            "pi_ref, where the policy started": float(bandit.kl(got).mean())}
                nearest = min(measured, key=measured.get)
                hint = f"the fitted policy is nearest to {nearest} (KL {measured[nearest]:.4f})"
            fail(name, case, f"KL(pi_fit || the policy these comparisons imply under SimPO) < {FIT_TOLERANCE}",
                 f"KL = {kl:.4f}", hint)
        worst = max(worst, kl)
    print(f"✔ {name}: all {len(FIT_SIMPO_CASES)} cases passed; each fit lands on the policy its comparisons imply "
          f"(KL at most {worst:.0e}), which is {closed_near:.4f} nats from SimPO's closed form with 20000 comparisons "
          f"and up to {closed_far:.3f} with fewer")


# (bandit, lengths, beta, comparisons, their seed): with 100 and 300 comparisons the data imply a policy 0.20
# and 0.03 nats from SimPO's closed form, so a closed form typed from the bandit's reward fails.
FIT_SIMPO_CASES = [({"n_prompts": 3, "n_answers": 5, "reward_scale": 1.5, "seed": 21}, [1.0, 2.0, 3.0, 4.0, 5.0], 0.5,
                    20000, 21),
                   ({"n_prompts": 3, "n_answers": 3, "reward_scale": 2.0, "seed": 24}, [1.0, 2.0, 3.0], 1.0, 100, 0),
                   ({"n_prompts": 2, "n_answers": 4, "reward_scale": 1.5, "seed": 22}, [2.0, 1.0, 4.0, 3.0], 1.0, 300,
                    222)]


# --- one online-DPO round, and a run of them (find the bug) -------------------------------------------

def _online_round(model, ref_model, optimizer, tokenizer, prompts, reward_fn, generator, num_generations, beta,
                  temperature, max_new_tokens):
    """The reference round: ``(mean score, loss or None, mean log-ratio of the sampled answers)``. No pair
    formed (every prompt's answers score alike): no update, loss None."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.losses import dpo_sigmoid_loss, online_dpo_pairs

    group = [p for p in prompts for _ in range(num_generations)]
    roll = sample(model, tokenizer, group, max_new_tokens, temperature=temperature, generator=generator)
    scores = torch.as_tensor(reward_fn(group, roll.completions), dtype=torch.float32)
    chosen, rejected = online_dpo_pairs(scores, torch.arange(len(prompts)).repeat_interleave(num_generations))
    args = (roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    logps = sequence_logprobs(model, *args).sum(-1)
    with torch.no_grad():
        ref_logps = sequence_logprobs(ref_model, *args).sum(-1)
    kl = float((logps.detach() - ref_logps).mean())
    if len(chosen) == 0:
        return float(scores.mean()), None, kl
    loss = dpo_sigmoid_loss(logps[chosen], logps[rejected], ref_logps[chosen], ref_logps[rejected], beta).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(scores.mean()), float(loss.detach()), kl


def _reward(kind: str, task, seed: int):
    """The reward function of a step case: a Bradley-Terry rater (Gumbel noise, seeded), the gold score
    (ties between equal answers), or a constant (no pair can form). The rater is wrapped in a local
    function: under ``python -m rlcourse grade`` such a function runs in the check's process, so its
    noise stream advances there, call after call, as the reference's does."""
    from rlcourse.trainers.online_dpo import BradleyTerryRater

    if kind == "rater":
        rater = BradleyTerryRater(task.rater_utility, task.beta, seed=seed)

        def rated(prompts, completions):
            return rater(prompts, completions)
        return rated
    if kind == "gold":
        return task.reward
    return lambda prompts, completions: torch.zeros(len(completions))


def _pair_of(x):
    """``(mean score, loss)`` from an answer: a pair of numbers, the loss None when nothing was updated."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        return None
    score, loss = x
    as_float = lambda v: None if v is None else float(v.detach()) if isinstance(v, torch.Tensor) else float(v)  # noqa: E731
    try:
        return as_float(score), as_float(loss)
    except (TypeError, ValueError):
        return None


# (reward, answers per prompt, beta, temperature, a reference other than the start, max_new_tokens or None for
# the task's 8, which no answer of these calls fills; at 5 some answers are cut)
ONLINE_STEP_SETTINGS = [("rater", 2, 0.1, 1.0, False, None), ("gold", 4, 0.5, 0.7, True, 5)]
ONLINE_STEP_LEARNING = {"steps": 30, "prompts": 16, "num_generations": 2, "lr": 1e-3, "beta": 0.3, "held_out": 128,
                        "margin": 0.2}
_REWARD_NAMES = {"rater": "a Bradley-Terry rater", "gold": "the gold score (equal answers tie)",
                 "constant": "a reward that scores every answer 0"}


@references(*ONLINE_DPO)
def check_online_dpo_step(fn) -> None:
    """``fn(model, ref_model, optimizer, tokenizer, prompts, reward_fn, generator, num_generations, beta, temperature,
    max_new_tokens) -> (mean score, loss)``: one online-DPO round on ``preference-sft``. Checked as the course's
    other steps are: two calls' gradients (and scores and losses) against the reference round's from the same
    weights, generator and reward, for a rater and for the gold score (the second with a reference other than
    the policy's start and a budget of 5 new tokens, which cuts some answers); no update when no pair forms; no
    gradient into ``ref_model``. Then 30 rounds with Adam must raise the gold score of sampled answers on 128 held-out
    prompts by at least 0.2."""
    __tracebackhide__ = True
    import copy
    import math

    from rlcourse.grading._steps import assert_call_gradient, moved_copy, twin_runs
    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.trainers.dpo import reward_and_kl

    name = "check_online_dpo_step"
    start, tokenizer = load_checkpoint("preference-sft", device="cpu")
    start.eval()
    task = PreferenceTask()
    K = task.max_new_tokens
    n = 0
    for kind, G, beta, temperature, moved, budget in ONLINE_STEP_SETTINGS + [("constant", 2, 0.1, 1.0, False, None)]:
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.1)
        # its parameters require grad, as a plain copy's do: none may get one; moved, it is not the policy's start
        ref = moved_copy(start, seed=71) if moved else copy.deepcopy(start)
        budget = budget or K
        updates = 0
        rewards = _reward(kind, task, 7), _reward(kind, task, 7)
        gens = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for call in (0, 1):            # the second call: the policy has moved, the reference has not
            prompts = task.prompts(6, rng=70 + call)
            case = (f"{_REWARD_NAMES[kind]}, 6 prompts x {G} answers, beta={beta}, temperature {temperature}, "
                    f"max_new_tokens={budget}{', ref_model not the policy start (moved by seeded noise)' * moved}, "
                    f"call {call + 1}")
            got = _pair_of(fn(mine, ref, opt_mine, tokenizer, list(prompts), rewards[0], gens[0], G, beta, temperature,
                              budget))
            score, loss, _ = _online_round(theirs, ref, opt_theirs, tokenizer, prompts, rewards[1], gens[1], G, beta,
                                           temperature, budget)
            if got is None:
                fail(name, case, "a pair (mean score, loss): two floats, the loss None without an update", got, "")
            if got[0] is None or abs(got[0] - score) > 1e-5:
                fail(name, case, f"mean score {score:.4f} of the answers drawn", got[0],
                     f"draw the answers once per call: each prompt num_generations times in a row, with "
                     f"sample(..., max_new_tokens, temperature=temperature, generator=generator); return the mean of "
                     f"their scores")
            if loss is None:
                if len(opt_mine.seen) != updates:
                    fail(name, case, "no update (every prompt's answers score alike: no pair forms)",
                         f"{len(opt_mine.seen) - updates} optimizer.step() call(s) in this call", "")
                if got[1] is not None:
                    fail(name, case, "loss None (no pair, no update)", got[1], "")
                continue
            grads = [p.grad for p in ref.parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)]
            if grads:
                fail(name, case, "no gradient in ref_model's parameters", f"{len(grads)} of its tensors received one "
                     f"(norm {float(torch.cat([g.flatten() for g in grads]).norm()):.3g})",
                     "the reference's log-probs are constants of the loss: without a graph through ref_model, the "
                     "backward pass costs one model, not two")
            if call == 1 and got[1] is not None and abs(got[1] - math.log(2)) < 1e-6 < abs(loss - math.log(2)):
                fail(name, case, f"loss {loss:.4f}", f"{got[1]:.6f} = log 2",
                     "every implicit reward is 0 although the policy has moved since call 1: the reference "
                     "log-probs must come from ref_model, which stays where it was")
            updates += 1
            if len(opt_mine.seen) == updates and float(opt_mine.seen[-1] @ opt_theirs.seen[-1]) < -0.999 * float(
                    opt_mine.seen[-1].norm() * opt_theirs.seen[-1].norm()):
                fail(name, case, "the reference round's gradient", "the same gradient with the opposite sign",
                     "your update pushes each pair the other way: the best-scored answer of a prompt is the chosen one")
            assert_call_gradient(name, case, updates - 1, opt_mine, opt_theirs,
                                 "another direction: each prompt's pair is its best-scored answer (chosen) against its "
                                 "worst; a sequence's log-prob sums its real tokens, under the model itself "
                                 "(temperature 1); the reference is a constant",
                                 longer="the loss is averaged over another number of terms (one loss per pair, "
                                        "averaged over the pairs), or beta is applied differently",
                                 close=None if not moved else
                                 "almost the reference's direction: the reference log-probs come from ref_model, "
                                 "which here is not the model the policy started from")
            if got[1] is None or abs(got[1] - loss) > 1e-5:
                fail(name, case, f"loss {loss:.6f} (the mean over the pairs)", got[1],
                     "return the loss the update minimised")
            n += 1
    s = ONLINE_STEP_LEARNING
    held_out = task.test_prompts(s["held_out"])

    def gold(model):
        return reward_and_kl(model, start, tokenizer, task, held_out, generator=torch.Generator().manual_seed(0))[0]

    before = gold(start)
    model, frozen = copy.deepcopy(start), copy.deepcopy(start).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    rater, gen, rng = _reward("rater", task, 0), torch.Generator().manual_seed(0), np.random.default_rng(0)
    scores = []
    for _ in range(s["steps"]):
        got = _pair_of(fn(model, frozen, optimizer, tokenizer, task.prompts(s["prompts"], rng), rater, gen,
                          s["num_generations"], s["beta"], 1.0, K))
        scores.append(float("nan") if got is None or got[0] is None else got[0])
    after = gold(model)
    if not after >= before + s["margin"]:
        fail(name, f"{s['steps']} rounds of your step (Adam, lr {s['lr']}, {s['prompts']} prompts x "
                   f"{s['num_generations']}, beta {s['beta']}, a Bradley-Terry rater)",
             f"a gold score of at least {before + s['margin']:.3f} on {s['held_out']} held-out prompts (from {before:.3f})",
             f"{after:.3f}", f"the rater's mean score went {np.mean(scores[:5]):.3f} -> {np.mean(scores[-5:]):.3f} "
                             f"(first and last 5 rounds)")
    print(f"✔ {name}: gradients equal the reference round's ({n} calls, a rater and the gold score; no update "
          f"without a pair); {s['steps']} rounds raised the held-out gold score {before:.3f} -> {after:.3f}")


def _reference_online_dpo(model, optimizer, tokenizer, prompt_batches, reward_fn, generator, num_generations, beta,
                          max_new_tokens, ref_model=None):
    """The corrected find-the-bug function: rounds of :func:`_online_round` (temperature 1) against ``ref_model``,
    or without one against a frozen copy of ``model`` made before the first; one log per round that updated."""
    from rlcourse.lm import frozen_copy

    reference = ref_model if ref_model is not None else frozen_copy(model)
    logs = []
    for prompts in prompt_batches:
        score, loss, kl = _online_round(model, reference, optimizer, tokenizer, prompts, reward_fn, generator,
                                        num_generations, beta, 1.0, max_new_tokens)
        if loss is not None:
            logs.append({"loss": loss, "objective/kl": kl, "objective/scores": score})
    return logs


# (answers per prompt, beta, reward, max_new_tokens or None for the task's 8, ref_model handed over): the
# second run gets a reference of its own (preference-sft moved by seeded noise), the first none.
ONLINE_RUN_SETTINGS = [(2, 0.1, "rater", None, False), (4, 0.3, "gold", 5, True)]
_LOGGED = ("loss", "objective/kl", "objective/scores")


@references(*ONLINE_DPO)
def check_train_online_dpo(fn) -> None:
    """``fn(model, optimizer, tokenizer, prompt_batches, reward_fn, generator, num_generations, beta, max_new_tokens,
    ref_model=None) -> [{"loss", "objective/kl", "objective/scores"} per round]``: the fixed find-the-bug
    function. Three rounds from ``preference-sft`` beside the reference's (same generator, same reward), twice:
    with a rater and no ``ref_model``, then with the gold score, a budget of 5 new tokens and a ``ref_model``
    of its own. Every round's gradient and logs must match. Measured where they do not: the loss and KL
    logged at each round, against the reference's."""
    __tracebackhide__ = True
    import math

    from rlcourse.grading._steps import assert_same_gradient, moved_copy, twin_runs
    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint

    name = "check_train_online_dpo"
    start, tokenizer = load_checkpoint("preference-sft", device="cpu")
    start.eval()
    task = PreferenceTask()
    n = 0
    for G, beta, kind, budget, with_ref in ONLINE_RUN_SETTINGS:
        budget = budget or task.max_new_tokens
        ref = moved_copy(start, seed=81).requires_grad_(False) if with_ref else None
        case = (f"3 rounds of 6 prompts x {G} answers, beta={beta}, {_REWARD_NAMES[kind]}, max_new_tokens={budget}, "
                + ("ref_model given (preference-sft moved by seeded noise)" if with_ref else "no ref_model"))
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.5)
        batches = [task.prompts(6, rng=80 + r) for r in range(3)]
        extra = {"ref_model": ref} if with_ref else {}
        logs = fn(mine, opt_mine, tokenizer, [list(b) for b in batches], _reward(kind, task, 8),
                  torch.Generator().manual_seed(9), G, beta, budget, **extra)
        expected = _reference_online_dpo(theirs, opt_theirs, tokenizer, batches, _reward(kind, task, 8),
                                         torch.Generator().manual_seed(9), G, beta, budget, ref)
        if len(opt_mine.seen) != len(expected):
            fail(name, case, f"{len(expected)} optimizer steps, one per round", f"{len(opt_mine.seen)}", "")
        if not isinstance(logs, list) or len(logs) != len(expected) or not all(
                isinstance(row, dict) and all(k in row for k in _LOGGED) for row in logs):
            fail(name, case, f"a list of {len(expected)} dicts with keys {list(_LOGGED)}", repr(logs)[:200], "")
        got = [{k: float(row[k]) for k in _LOGGED} for row in logs]
        table = "; ".join(f"round {r + 1}: loss {g['loss']:.4f} (expected {e['loss']:.4f}), KL {g['objective/kl']:.4f} "
                          f"(expected {e['objective/kl']:.4f})" for r, (g, e) in enumerate(zip(got, expected)))
        flat = [r for r in range(1, len(got)) if abs(got[r]["loss"] - math.log(2)) < 1e-6 and abs(got[r]["objective/kl"]) < 1e-6
                and abs(expected[r]["loss"] - math.log(2)) > 1e-4]
        if with_ref and got and abs(got[0]["objective/kl"]) < 1e-6 < abs(expected[0]["objective/kl"]):
            fail(name, f"{case}, round 1", f"objective/kl {expected[0]['objective/kl']:.4f}, against the ref_model "
                 f"handed over", f"{got[0]['objective/kl']:.6f}", "a ref_model was handed over: it is the reference; "
                 "a frozen copy of the model is the reference only when ref_model is None")
        if flat:
            fail(name, case, "the reference's losses and KLs", table,
                 f"at round(s) {', '.join(str(r + 1) for r in flat)} the loss is log 2 and the KL 0 although the "
                 f"weights moved before: every implicit reward is 0 there, so the policy was compared with itself "
                 f"rather than with the model the run started from")
        for r, (e, g) in enumerate(zip(opt_theirs.seen, opt_mine.seen)):
            assert_same_gradient(name, f"{case}, round {r + 1}", e, g,
                                 f"another direction at round {r + 1}{' (the rounds before agreed)' if r else ''}; "
                                 f"measured: {table}")
            n += 1
        for r, (e, g) in enumerate(zip(expected, got)):
            for key in _LOGGED:
                if abs(g[key] - e[key]) > 1e-5 * max(1.0, abs(e[key])):
                    fail(name, f"{case}, round {r + 1}", f"{key} {e[key]:.6f}", f"{g[key]:.6f}",
                         "objective/kl is the mean over the sampled answers of log pi(y|x) - log pi_ref(y|x), "
                         "objective/scores their mean score, loss the loss the round minimised")
    print(f"✔ {name}: all {n} rounds match the reference's gradients and logs (the loss leaves log 2 once the "
          f"policy moves)")
