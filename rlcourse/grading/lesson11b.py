"""Checks for lesson 11b (preference optimisation beyond offline DPO).

* :func:`check_simpo_loss` - SimPO from per-token log-probs: length-normalised, reference-free, with
  its target margin (the reference is TRL's ``CPOTrainer`` loss, ``tests/test_trl_parity_beyond_dpo.py``);
* :func:`check_kto_loss` - KTO's per-example loss with its reference point from mismatched pairs,
  clamped at 0 and held constant (the reference is TRL's ``KTOTrainer`` loss);
* :func:`check_online_dpo_pairs` - the pairs online DPO forms from sampled, scored groups;
* :func:`check_fit_simpo_policy` - an experiment: a tabular policy fitted by SimPO on bandit comparisons
  must land on SimPO's closed-form optimum (:func:`rlcourse.preference_optima.simpo_optimum`), not on
  the KL-regularised optimum.

Each check compares with the course's function, which the parity tests hold to TRL's code, and
measures what a wrong answer gets wrong: how the loss moves when only the reference log-probs move,
what it gives where padding sits, whether a gradient reaches the reference point's inputs, and so on.
The wrong answers each check refuses are listed with witnesses in ``tests/test_grading_lesson11b.py``.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, gradient_flowing, passed, references, to_numpy

__all__ = ["check_simpo_loss", "check_kto_loss", "check_online_dpo_pairs", "check_fit_simpo_policy"]


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

def _simpo_cases():
    """(case, chosen_tok, rejected_tok, chosen_mask, rejected_mask, ref_chosen, ref_rejected, beta, gamma)."""
    gen = torch.Generator().manual_seed(1101)
    cases = []

    def batch(B, T, min_len=1):
        lengths = torch.randint(min_len, T + 1, (2, B), generator=gen)
        lengths[0, 0], lengths[1, 0] = T, 1                          # a long chosen answer, a one-token rejected one
        masks = [(torch.arange(T) < n[:, None]).long() for n in lengths]
        toks = [torch.where(m.bool(), -3 * torch.rand(B, T, generator=gen, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64))
                for m in masks]
        refs = [-12 * torch.rand(B, generator=gen, dtype=torch.float64) for _ in range(2)]
        return (*toks, *masks, *refs)

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


@references("rlcourse.losses.beyond_dpo:simpo_loss", "rlcourse.losses.beyond_dpo:average_logps",
            "rlcourse.losses.beyond_dpo:preference_objective")
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
            "rlcourse.losses.beyond_dpo:preference_objective")
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


@references("rlcourse.losses.beyond_dpo:online_dpo_pairs")
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

@references("rlcourse.preference_optima:simpo_optimum", "rlcourse.preference_optima:minimise_expected_loss",
            "rlcourse.preference_optima:expected_preference_loss", "rlcourse.categorical_bandit:train_tabular_policy")
def check_fit_simpo_policy(fn) -> None:
    """``fn(bandit, pairs, lengths, beta) -> (P, K)`` log-probs of a tabular policy fitted by SimPO (margin 0).

    Judged by where it lands: on 20000 Bradley-Terry comparisons its KL to SimPO's closed-form optimum
    ``log pi(y|x) = |y| (r(x, y) / beta + c(x))`` must be below 0.01 nats per prompt (the reference
    solution reaches 0.002 or less), a policy that the closed form says is far from ``pi*``.
    """
    __tracebackhide__ = True
    from rlcourse.categorical_bandit import CategoricalBandit
    from rlcourse.preference_optima import simpo_optimum

    name = "check_fit_simpo_policy"
    cases = [(CategoricalBandit.random(n_prompts=3, n_answers=5, reward_scale=1.5, seed=21), [1.0, 2.0, 3.0, 4.0, 5.0], 0.5, 21),
             (CategoricalBandit.random(n_prompts=2, n_answers=4, reward_scale=1.5, seed=22), [2.0, 1.0, 4.0, 3.0], 1.0, 22)]
    for bandit, lengths, beta, data_seed in cases:
        case = (f"{bandit.n_prompts} prompts x {bandit.n_answers} answers of lengths {[int(n) for n in lengths]}, "
                f"beta={beta}, 20000 pairs")
        pairs = bandit.sample_pairs(20000, rng=data_seed)
        L = torch.tensor(lengths, dtype=torch.float64)
        got = fn(bandit, {k: v.clone() for k, v in pairs.items()}, L.clone(), beta)
        if got is None:
            fail(name, case, "a (P, K) tensor of log-probs", None, "the function returned None")
        got = torch.as_tensor(to_numpy(got), dtype=torch.float64)
        if got.shape != bandit.ref_logprobs.shape:
            fail(name, case, f"shape {tuple(bandit.ref_logprobs.shape)}", f"shape {tuple(got.shape)}", "")
        sums = got.exp().sum(-1)
        if not torch.allclose(sums, torch.ones_like(sums), atol=1e-6):
            fail(name, case, "rows of log-probabilities (exp sums to 1 per prompt)", f"row sums {sums.numpy().round(4)}", "")
        target = simpo_optimum(bandit.reward, L, beta)
        kl = float(bandit.kl(got, target).mean())
        if not kl < 0.01:
            measured = {"pi* = pi_ref exp(r / beta) / Z": float(bandit.kl(got, bandit.optimal_logprobs(beta)).mean()),
                        "SimPO's optimum with every length 1": float(bandit.kl(got, simpo_optimum(bandit.reward, torch.ones_like(L), beta)).mean()),
                        "pi_ref, where the policy started": float(bandit.kl(got).mean())}
            nearest = min(measured, key=measured.get)
            fail(name, case, "KL(pi_fit || SimPO's optimum) < 0.01", f"KL = {kl:.4f}",
                 f"the fitted policy is nearest to {nearest} (KL {measured[nearest]:.4f})")
    passed(name, len(cases))
