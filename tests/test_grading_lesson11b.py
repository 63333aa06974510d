"""Lesson 11b's checks pass right answers written several ways and refuse each plausible wrong one."""
import rlcourse  # noqa: F401  (before torch)
import copy
import math

import torch
import torch.nn.functional as F

from grading_asserts import grading_tests, mistake_tests
from rlcourse.grading.llm.lesson11b import (check_fit_simpo_policy, check_kto_loss, check_online_dpo_pairs,
                                        check_online_dpo_step, check_orpo_loss, check_simpo_loss,
                                        check_train_online_dpo)
from rlcourse.lm import frozen_copy, sample, sequence_logprobs
from rlcourse.losses import dpo_sigmoid_loss, online_dpo_pairs


# --- SimPO ------------------------------------------------------------------------------------------

def _avg(tok, mask):
    return (tok * mask).sum(-1) / mask.sum(-1)


def simpo_ok(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * (_avg(cw, mw) - _avg(cl, ml)) - gamma)


def simpo_ok_loop_float64(cw, cl, mw, ml, rw, rl, beta, gamma):     # pair by pair, softplus, float64
    out = []
    for i in range(cw.shape[0]):
        w = cw[i][mw[i].bool()].double().mean()
        l = cl[i][ml[i].bool()].double().mean()
        out.append(F.softplus(-(beta * (w - l) - gamma)))
    return torch.stack(out)


def simpo_ok_rescaled_gamma(cw, cl, mw, ml, rw, rl, beta, gamma):   # beta (margin - gamma / beta): the same number
    return -F.logsigmoid(beta * (_avg(cw, mw) - _avg(cl, ml) - gamma / beta))


def simpo_keeps_reference(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * ((cw.sum(-1) - rw) / mw.sum(-1) - (cl.sum(-1) - rl) / ml.sum(-1)) - gamma)


def simpo_sums(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * (cw.sum(-1) - cl.sum(-1)) - gamma)


def simpo_divides_by_width(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * (cw.mean(-1) - cl.mean(-1)) - gamma)


def simpo_adds_gamma(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * (_avg(cw, mw) - _avg(cl, ml)) + gamma)


def simpo_gamma_inside(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * (_avg(cw, mw) - _avg(cl, ml) - gamma))


def simpo_unstable(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -torch.log(torch.sigmoid(beta * (_avg(cw, mw) - _avg(cl, ml)) - gamma))


def simpo_batch_mean(cw, cl, mw, ml, rw, rl, beta, gamma):
    return simpo_ok(cw, cl, mw, ml, rw, rl, beta, gamma).mean()


def simpo_swapped(cw, cl, mw, ml, rw, rl, beta, gamma):
    return -F.logsigmoid(beta * (_avg(cl, ml) - _avg(cw, mw)) - gamma)


def simpo_one_length(cw, cl, mw, ml, rw, rl, beta, gamma):          # both divided by the chosen answer's length
    n = mw.sum(-1)
    return -F.logsigmoid(beta * (cw.sum(-1) - cl.sum(-1)) / n - gamma)


def simpo_in_place(cw, cl, mw, ml, rw, rl, beta, gamma):
    cw *= beta
    cl *= beta
    return -F.logsigmoid(_avg(cw, mw) - _avg(cl, ml) - gamma)


# --- ORPO ------------------------------------------------------------------------------------------

def _log_odds(avg):
    return avg - torch.log(-torch.expm1(avg))


def orpo_ok(cw, cl, mw, ml, beta):
    nll = -(cw * mw).sum() / mw.sum()
    ratio = _log_odds(_avg(cw, mw)) - _log_odds(_avg(cl, ml))
    return nll - beta * F.logsigmoid(ratio).mean()


def orpo_ok_loop_float64(cw, cl, mw, ml, beta):
    total_nll, n, terms = 0.0, 0, []
    for i in range(cw.shape[0]):
        w = cw[i][mw[i].bool()].double()
        l = cl[i][ml[i].bool()].double()
        total_nll = total_nll - w.sum()
        n += len(w)
        pw, pl = w.mean().exp(), l.mean().exp()
        z = torch.log(pw / (1 - pw)) - torch.log(pl / (1 - pl))
        terms.append(F.softplus(-z))
    return total_nll / n + beta * torch.stack(terms).mean()


def orpo_ok_log1mexp_where(cw, cl, mw, ml, beta):    # the two-branch log(1 - e^x), each branch fed its side
    def log1mexp(x):
        c = -math.log(2)
        return torch.where(x < c, torch.log1p(-torch.exp(torch.clamp(x, max=c))), torch.log(-torch.expm1(x)))
    aw, al = _avg(cw, mw), _avg(cl, ml)
    ratio = (aw - log1mexp(aw)) - (al - log1mexp(al))
    return -(cw * mw).sum() / mw.sum() - beta * F.logsigmoid(ratio).mean()


def _orpo(cw, cl, mw, ml, beta, nll=None, log_odds=_log_odds, avg=_avg, reduce="mean", nll_weight=1.0, sign=1.0):
    nll = -(cw * mw).sum() / mw.sum() if nll is None else nll
    ratio = sign * (log_odds(avg(cw, mw)) - log_odds(avg(cl, ml)))
    term = -F.logsigmoid(ratio)
    return nll_weight * nll + beta * (term.mean() if reduce == "mean" else term.sum())


def orpo_summed_logps(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, avg=lambda t, m: (t * m).sum(-1))


def orpo_unstable_log1m(cw, cl, mw, ml, beta):           # log1p(-exp(x)) on both sides of -log 2 (TRL's formula)
    return _orpo(cw, cl, mw, ml, beta, log_odds=lambda a: a - torch.log1p(-torch.exp(a)))


def orpo_unstable_logit(cw, cl, mw, ml, beta):           # odds from the probability itself
    return _orpo(cw, cl, mw, ml, beta, log_odds=lambda a: torch.logit(a.exp()))


def orpo_where_nan_gradient(cw, cl, mw, ml, beta):       # two branches, the log1p one fed every x
    return _orpo(cw, cl, mw, ml, beta, log_odds=lambda a: a - torch.where(a < -math.log(2), torch.log1p(-torch.exp(a)),
                                                                       torch.log(-torch.expm1(a))))


def orpo_nll_over_padding(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, nll=-cw.mean())


def orpo_nll_with_rejected(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, nll=-((cw * mw).sum() + (cl * ml).sum()) / (mw.sum() + ml.sum()))


def orpo_nll_per_answer(cw, cl, mw, ml, beta):            # each answer's mean NLL, then the mean over answers
    return _orpo(cw, cl, mw, ml, beta, nll=(-(cw * mw).sum(-1) / mw.sum(-1)).mean())


def orpo_beta_on_everything(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, nll_weight=beta)


def orpo_ratio_swapped(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, sign=-1.0)


def orpo_no_odds(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, log_odds=lambda a: a)


def orpo_average_over_width(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, avg=lambda t, m: t.mean(-1))


def orpo_pairs_summed(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, reduce="sum")


def orpo_per_pair(cw, cl, mw, ml, beta):                  # one loss per pair
    nll = -(cw * mw).sum(-1) / mw.sum(-1)
    return nll - beta * F.logsigmoid(_log_odds(_avg(cw, mw)) - _log_odds(_avg(cl, ml)))


def orpo_no_nll(cw, cl, mw, ml, beta):
    return _orpo(cw, cl, mw, ml, beta, nll=torch.zeros(()))


def orpo_detached(cw, cl, mw, ml, beta):                  # computed through .item()
    return torch.tensor(orpo_ok(cw, cl, mw, ml, beta).item(), requires_grad=True)


# --- KTO --------------------------------------------------------------------------------------------

def _z0(kl, rkl):
    return (kl - rkl).mean().clamp(min=0).detach()


def kto_ok(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = _z0(kl, rkl)
    return torch.cat([dw * (1 - torch.sigmoid(beta * ((w - rw) - z0))), uw * (1 - torch.sigmoid(beta * (z0 - (l - rl))))])


def kto_ok_other_form(w, l, rw, rl, kl, rkl, beta, dw, uw):         # 1 - s(a) = s(-a); z0 through a Python float
    z0 = max(0.0, (kl - rkl).mean().item())
    return torch.cat([dw * torch.sigmoid(-beta * (w - rw - z0)), uw * torch.sigmoid(beta * (l - rl - z0))])


def kto_z0_not_detached(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = (kl - rkl).mean().clamp(min=0)
    return torch.cat([dw * (1 - torch.sigmoid(beta * ((w - rw) - z0))), uw * (1 - torch.sigmoid(beta * (z0 - (l - rl))))])


def kto_z0_not_clamped(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = (kl - rkl).mean().detach()
    return torch.cat([dw * (1 - torch.sigmoid(beta * ((w - rw) - z0))), uw * (1 - torch.sigmoid(beta * (z0 - (l - rl))))])


def kto_everything_detached(w, l, rw, rl, kl, rkl, beta, dw, uw):   # the policy's log-ratios detached too
    return kto_ok(w.detach(), l.detach(), rw, rl, kl, rkl, beta, dw, uw).requires_grad_(True)


def kto_z0_from_own_examples(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = torch.cat([w - rw, l - rl]).mean().clamp(min=0).detach()
    return torch.cat([dw * (1 - torch.sigmoid(beta * ((w - rw) - z0))), uw * (1 - torch.sigmoid(beta * (z0 - (l - rl))))])


def kto_same_side_twice(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = _z0(kl, rkl)
    return torch.cat([dw * (1 - torch.sigmoid(beta * ((w - rw) - z0))), uw * (1 - torch.sigmoid(beta * ((l - rl) - z0)))])


def kto_weights_swapped(w, l, rw, rl, kl, rkl, beta, dw, uw):
    return kto_ok(w, l, rw, rl, kl, rkl, beta, uw, dw)


def kto_no_reference_point(w, l, rw, rl, kl, rkl, beta, dw, uw):
    return kto_ok(w, l, rw, rl, kl, kl, beta, dw, uw)


def kto_z0_summed(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = (kl - rkl).sum().clamp(min=0).detach()
    return torch.cat([dw * (1 - torch.sigmoid(beta * ((w - rw) - z0))), uw * (1 - torch.sigmoid(beta * (z0 - (l - rl))))])


def kto_mean(w, l, rw, rl, kl, rkl, beta, dw, uw):
    return kto_ok(w, l, rw, rl, kl, rkl, beta, dw, uw).mean()


def kto_undesirable_first(w, l, rw, rl, kl, rkl, beta, dw, uw):
    out = kto_ok(w, l, rw, rl, kl, rkl, beta, dw, uw)
    return torch.cat([out[len(w):], out[:len(w)]])


def kto_no_reference_model(w, l, rw, rl, kl, rkl, beta, dw, uw):
    z0 = _z0(kl, rkl)
    return torch.cat([dw * (1 - torch.sigmoid(beta * (w - z0))), uw * (1 - torch.sigmoid(beta * (z0 - l)))])


# --- online DPO's pairs -----------------------------------------------------------------------------

def pairs_ok(scores, groups):
    chosen, rejected = [], []
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().flatten()
        s = scores[idx]
        if len(idx) > 1 and s.max() != s.min():
            chosen.append(int(idx[s.argmax()]))          # argmax: the first maximal index
            rejected.append(int(idx[s.argmin()]))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


def pairs_ok_python(scores, groups):                     # plain Python lists, dict of groups
    by_group = {}
    for i, g in enumerate(groups.tolist()):
        by_group.setdefault(g, []).append(i)
    chosen, rejected = [], []
    for g in sorted(by_group):
        members = by_group[g]
        values = [float(scores[i]) for i in members]
        if max(values) > min(values):
            chosen.append(members[values.index(max(values))])
            rejected.append(members[values.index(min(values))])
    return chosen, rejected


def pairs_keep_equal_groups(scores, groups):             # a pair even when every score is the same
    chosen, rejected = [], []
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().flatten()
        if len(idx) > 1:
            chosen.append(int(idx[scores[idx].argmax()]))
            rejected.append(int(idx[len(idx) - 1 - int(scores[idx].flip(0).argmin())]))
    return chosen, rejected


def pairs_from_groups_of_one(scores, groups):            # a lone answer paired with itself
    chosen, rejected = [], []
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().flatten()
        s = scores[idx]
        if len(idx) == 1 or s.max() != s.min():
            chosen.append(int(idx[s.argmax()]))
            rejected.append(int(idx[s.argmin()]))
    return chosen, rejected


def pairs_last_on_ties(scores, groups):                   # the last maximal index, not the first
    chosen, rejected = [], []
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().flatten()
        s = scores[idx].double()
        if len(idx) > 1 and s.max() != s.min():
            chosen.append(int(idx[len(idx) - 1 - int(s.flip(0).argmax())]))
            rejected.append(int(idx[len(idx) - 1 - int(s.flip(0).argmin())]))
    return chosen, rejected


def pairs_contiguous_twos(scores, groups):               # TRL's rule: answers 2i and 2i+1 form a pair
    first, second = scores[0::2], scores[1::2]
    keep = first != second
    i = torch.arange(0, len(scores), 2)[keep]
    better = (first >= second)[keep]
    return torch.where(better, i, i + 1), torch.where(better, i + 1, i)


def pairs_swapped(scores, groups):
    c, r = pairs_ok(scores, groups)
    return r, c


def pairs_first_appearance_order(scores, groups):        # groups in the order they first appear
    order = []
    for g in groups.tolist():
        if g not in order:
            order.append(g)
    chosen, rejected = [], []
    for g in order:
        idx = (groups == g).nonzero().flatten()
        s = scores[idx]
        if len(idx) > 1 and s.max() != s.min():
            chosen.append(int(idx[s.argmax()]))
            rejected.append(int(idx[s.argmin()]))
    return chosen, rejected


def pairs_local_indices(scores, groups):                 # the position inside the group, not in scores
    chosen, rejected = [], []
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().flatten()
        s = scores[idx]
        if len(idx) > 1 and s.max() != s.min():
            chosen.append(int(s.argmax()))
            rejected.append(int(s.argmin()))
    return chosen, rejected


def pairs_best_against_second(scores, groups):           # best against the runner-up instead of the worst
    chosen, rejected = [], []
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().flatten()
        s = scores[idx].double()
        if len(idx) > 1 and s.max() != s.min():
            order = torch.argsort(s, descending=True, stable=True)
            chosen.append(int(idx[order[0]]))
            rejected.append(int(idx[order[1]]))
    return chosen, rejected


RIGHT = [(check_simpo_loss, simpo_ok), (check_simpo_loss, simpo_ok_loop_float64), (check_simpo_loss, simpo_ok_rescaled_gamma),
         (check_orpo_loss, orpo_ok), (check_orpo_loss, orpo_ok_loop_float64), (check_orpo_loss, orpo_ok_log1mexp_where),
         (check_kto_loss, kto_ok), (check_kto_loss, kto_ok_other_form),
         (check_online_dpo_pairs, pairs_ok), (check_online_dpo_pairs, pairs_ok_python)]

WRONG = [
    (check_simpo_loss, simpo_keeps_reference, "moved by up to"),
    (check_simpo_loss, simpo_sums, "summed (not averaged)"),
    (check_simpo_loss, simpo_divides_by_width, "mean log-prob over its real tokens"),
    (check_simpo_loss, simpo_adds_gamma, "minus gamma"),
    (check_simpo_loss, simpo_gamma_inside, "minus gamma"),
    (check_simpo_loss, simpo_unstable, "non-finite"),
    (check_simpo_loss, simpo_batch_mean, "one loss per pair"),
    (check_simpo_loss, simpo_swapped, "check_simpo_loss failed"),
    (check_simpo_loss, simpo_one_length, "check_simpo_loss failed"),
    (check_simpo_loss, simpo_in_place, "modified in place"),
    (check_orpo_loss, orpo_summed_logps, "the odds of the summed log-probs"),
    (check_orpo_loss, orpo_unstable_log1m, "a non-finite loss"),
    (check_orpo_loss, orpo_unstable_logit, "a non-finite loss"),
    (check_orpo_loss, orpo_where_nan_gradient, "a NaN or inf reached the gradient"),
    (check_orpo_loss, orpo_nll_over_padding, "every column of the padded batch"),
    (check_orpo_loss, orpo_nll_with_rejected, "the chosen and the rejected answers' tokens together"),
    (check_orpo_loss, orpo_nll_per_answer, "each answer's own mean NLL"),
    (check_orpo_loss, orpo_beta_on_everything, "multiplied by beta"),
    (check_orpo_loss, orpo_no_nll, "no NLL term"),
    (check_orpo_loss, orpo_ratio_swapped, "chosen and rejected swapped"),
    (check_orpo_loss, orpo_no_odds, "without the odds"),
    (check_orpo_loss, orpo_average_over_width, "averages over the padded width"),
    (check_orpo_loss, orpo_pairs_summed, "summed, not averaged"),
    (check_orpo_loss, orpo_per_pair, "one number, the batch's loss"),
    (check_orpo_loss, orpo_detached, "grad_fn"),
    (check_kto_loss, kto_z0_not_detached, "no gradient reaching kl_logps"),
    (check_kto_loss, kto_z0_not_clamped, "the mean mismatched log-ratio itself"),
    (check_kto_loss, kto_everything_detached, "a result computed from the inputs"),
    (check_kto_loss, kto_z0_from_own_examples, "z0 = "),
    (check_kto_loss, kto_same_side_twice, "check_kto_loss failed"),
    (check_kto_loss, kto_weights_swapped, "z0 = "),
    (check_kto_loss, kto_no_reference_point, "z0 = "),
    (check_kto_loss, kto_z0_summed, "z0 = "),
    (check_kto_loss, kto_mean, "shape"),
    (check_kto_loss, kto_undesirable_first, "desirable examples first"),
    (check_kto_loss, kto_no_reference_model, "r = log pi - log pi_ref"),
    (check_online_dpo_pairs, pairs_keep_equal_groups, "compares two answers of equal score"),
    (check_online_dpo_pairs, pairs_from_groups_of_one, "compares two answers of equal score"),
    (check_online_dpo_pairs, pairs_last_on_ties, "pair(s) expected"),
    (check_online_dpo_pairs, pairs_contiguous_twos, "check_online_dpo_pairs failed"),
    (check_online_dpo_pairs, pairs_swapped, "pair(s) expected"),
    (check_online_dpo_pairs, pairs_first_appearance_order, "in another order"),
    (check_online_dpo_pairs, pairs_local_indices, "check_online_dpo_pairs failed"),
    (check_online_dpo_pairs, pairs_best_against_second, "pair(s) expected"),
]

test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


def test_each_check_has_at_least_six_distinct_wrong_answers():
    assert len({fn.__name__ for _, fn, _ in WRONG}) == len(WRONG)
    for check in (check_simpo_loss, check_orpo_loss, check_kto_loss, check_online_dpo_pairs):
        assert sum(c is check for c, _, _ in WRONG) >= 6
    assert len(FIT_WRONG) >= 6


# --- fitting SimPO on the bandit (an experiment) ----------------------------------------------------

def _fit_simpo(bandit, pairs, lengths, beta, steps=300, lr=0.3, keep_reference=False, use_lengths=True,
               margin=0.0, swap=False, logits_out=False):
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    p, w, l = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    if swap:
        w, l = l, w
    L = lengths.expand_as(bandit.ref_logprobs) if use_lengths else torch.ones_like(bandit.ref_logprobs)
    for _ in range(steps):
        logp = torch.log_softmax(logits, -1)
        reward = (logp - bandit.ref_logprobs if keep_reference else logp) / L
        loss = -F.logsigmoid(beta * (reward[p, w] - reward[p, l]) - margin).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return logits.detach() if logits_out else torch.log_softmax(logits.detach(), -1)


def fit_simpo_ok(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta)


def fit_simpo_ok_lbfgs(bandit, pairs, lengths, beta):          # another optimiser, in float64 throughout
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([logits], max_iter=200, line_search_fn="strong_wolfe")
    p, w, l = pairs["prompt"], pairs["chosen"], pairs["rejected"]

    def closure():
        optimizer.zero_grad()
        avg = torch.log_softmax(logits, -1) / lengths
        loss = F.softplus(-beta * (avg[p, w] - avg[p, l])).mean()
        loss.backward()
        return loss
    optimizer.step(closure)
    return torch.log_softmax(logits.detach(), -1)


def fit_simpo_keeps_reference(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta, keep_reference=True)


def fit_simpo_without_lengths(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta, use_lengths=False)


def fit_simpo_with_a_margin(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta, margin=1.0)


def fit_simpo_swapped(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta, swap=True)


def fit_simpo_returns_logits(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta, logits_out=True) + 1.0


def fit_simpo_too_few_steps(bandit, pairs, lengths, beta):
    return _fit_simpo(bandit, pairs, lengths, beta, steps=5)


def fit_simpo_closed_form(bandit, pairs, lengths, beta):      # reads no comparison: the hidden reward's optimum
    from rlcourse.measure.preference_optima import simpo_optimum
    return simpo_optimum(bandit.reward, lengths, beta)


def fit_simpo_closed_form_by_hand(bandit, pairs, lengths, beta):
    """log pi = |y| (r / beta + c), c found by bisection so that each row sums to 1: typed from the lesson."""
    u, L = bandit.reward / beta, lengths.expand_as(bandit.reward)
    lo, hi = torch.full((bandit.n_prompts, 1), -50.0, dtype=torch.float64), torch.full((bandit.n_prompts, 1), 50.0,
                                                                                       dtype=torch.float64)
    for _ in range(200):
        c = (lo + hi) / 2
        over = torch.logsumexp(L * (u + c), -1, keepdim=True) > 0
        hi, lo = torch.where(over, c, hi), torch.where(over, lo, c)
    return torch.log_softmax(L * (u + (lo + hi) / 2), -1)


FIT_WRONG = [(check_fit_simpo_policy, fit_simpo_keeps_reference, "nearest to the fit with the reference kept"),
             (check_fit_simpo_policy, fit_simpo_without_lengths, "every length 1"),
             (check_fit_simpo_policy, fit_simpo_with_a_margin, "the policy these comparisons imply under SimPO"),
             (check_fit_simpo_policy, fit_simpo_swapped, "the policy these comparisons imply under SimPO"),
             (check_fit_simpo_policy, fit_simpo_closed_form, "not a fit to these comparisons"),
             (check_fit_simpo_policy, fit_simpo_closed_form_by_hand, "computed from the bandit's reward"),
             (check_fit_simpo_policy, fit_simpo_returns_logits, "exp sums to 1"),
             (check_fit_simpo_policy, fit_simpo_too_few_steps, "where the policy started")]
test_fit_right_answers_pass, test_fit_wrong_answers_fail_with_a_hint = grading_tests(
    [(check_fit_simpo_policy, fit_simpo_ok), (check_fit_simpo_policy, fit_simpo_ok_lbfgs)], FIT_WRONG)


# --- one online-DPO round --------------------------------------------------------------------------

def step_ok(model, ref_model, optimizer, tokenizer, prompts, reward_fn, generator, num_generations, beta, temperature,
            max_new_tokens, *, mistake=None):
    group = [p for p in prompts for _ in range(num_generations)]
    if mistake == "prompts interleaved":
        group = list(prompts) * num_generations
    if mistake == "the task's budget, not max_new_tokens":
        max_new_tokens = 8
    if mistake == "the checkpoint as reference":           # ref_model ignored: the start loaded again
        from rlcourse.lm import load_checkpoint
        ref_model = load_checkpoint("preference-sft", device="cpu")[0].eval()
    roll = sample(model, tokenizer, group, max_new_tokens, generator=generator,
                  temperature=1.0 if mistake == "sampled at temperature 1" else temperature)
    scores = torch.as_tensor(reward_fn(group, roll.completions), dtype=torch.float32)
    groups = torch.arange(len(prompts)).repeat_interleave(num_generations)
    if mistake == "pairs across prompts" or mistake == "prompts interleaved":
        groups = torch.arange(num_generations).repeat(len(prompts))
    args = (roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    tokens = sequence_logprobs(model, *args, temperature=temperature if mistake == "log-probs at the sampling temperature" else 1.0)
    logps = tokens.sum(-1) / roll.completion_mask.sum(-1) if mistake == "token mean" else tokens.sum(-1)
    if mistake == "reference with grad":
        ref_logps = sequence_logprobs(ref_model, *args).sum(-1)
    else:
        with torch.no_grad():
            ref_logps = sequence_logprobs(model if mistake == "policy as reference" else ref_model, *args).sum(-1)
    if mistake == "pairs by implicit reward":
        scores_for_pairs = (logps - ref_logps).detach()
    else:
        scores_for_pairs = scores
    chosen, rejected = online_dpo_pairs(scores_for_pairs, groups)
    if mistake == "swapped":
        chosen, rejected = rejected, chosen
    if len(chosen) == 0 and mistake != "update without pairs":
        return float(scores.mean()), None
    loss = dpo_sigmoid_loss(logps[chosen], logps[rejected], ref_logps[chosen], ref_logps[rejected], beta)
    loss = loss.sum() if mistake == "sum over pairs" else loss.mean()
    if mistake != "no zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(scores.mean()), loss.item()


ONLINE_STEP_MISTAKES = ["prompts interleaved", "sampled at temperature 1", "pairs across prompts",
                        "log-probs at the sampling temperature", "token mean", "reference with grad",
                        "policy as reference", "pairs by implicit reward", "swapped", "update without pairs",
                        "sum over pairs", "no zero_grad", "the task's budget, not max_new_tokens",
                        "the checkpoint as reference"]


test_online_dpo_step_check, test_online_dpo_step_check_catches = mistake_tests(
    check_online_dpo_step, step_ok, ONLINE_STEP_MISTAKES, "raised the held-out gold score")


# --- find the bug: rounds of online DPO against a reference that must stay put ---------------------

def train_ok(model, optimizer, tokenizer, prompt_batches, reward_fn, generator, num_generations=2, beta=0.1,
             max_new_tokens=8, ref_model=None, *, mistake=None):
    reference = model if mistake == "alias" else frozen_copy(model)
    if ref_model is not None and mistake != "ref_model ignored":
        reference = ref_model
    max_new_tokens = 8 if mistake == "the task's budget, not max_new_tokens" else max_new_tokens
    logs = []
    for r, prompts in enumerate(prompt_batches):
        group = [p for p in prompts for _ in range(num_generations)]
        if mistake == "the shipped bug" or (mistake == "refreshed every other round" and r % 2 == 0):
            reference = ref_model if ref_model is not None and mistake == "the shipped bug" else frozen_copy(model)
        roll = sample(reference if mistake == "sampled from the reference" else model, tokenizer, group, max_new_tokens,
                      generator=generator)
        scores = torch.as_tensor(reward_fn(group, roll.completions), dtype=torch.float32)
        chosen, rejected = online_dpo_pairs(scores, torch.arange(len(prompts)).repeat_interleave(num_generations))
        if len(chosen) == 0:
            continue
        args = (roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
        logps = sequence_logprobs(model, *args).sum(-1)
        with torch.no_grad():
            ref_logps = sequence_logprobs(reference, *args).sum(-1)
        if mistake == "own log-probs detached":
            ref_logps = logps.detach()
        if mistake == "reference dropped":
            ref_logps = torch.zeros_like(logps)
        loss = dpo_sigmoid_loss(logps[chosen], logps[rejected], ref_logps[chosen], ref_logps[rejected], beta).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kl = (ref_logps - logps.detach()) if mistake == "kl reversed" else (logps.detach() - ref_logps)
        logs.append({"loss": loss.item(), "objective/kl": kl.mean().item(), "objective/scores": scores.mean().item()})
    return logs


ONLINE_RUN_MISTAKES = ["the shipped bug", "refreshed every other round", "alias", "sampled from the reference",
                       "own log-probs detached", "reference dropped", "kl reversed",
                       "the task's budget, not max_new_tokens", "ref_model ignored"]
test_train_online_dpo_check, test_train_online_dpo_check_catches = mistake_tests(
    check_train_online_dpo, train_ok, ONLINE_RUN_MISTAKES, "match the reference's gradients and logs")


def test_step_checks_catch_at_least_six_mistakes():
    assert len(set(ONLINE_STEP_MISTAKES)) >= 6 and len(set(ONLINE_RUN_MISTAKES)) >= 6


def step_ok_pair_rows_only(model, ref_model, optimizer, tokenizer, prompts, reward_fn, generator, num_generations, beta,
                           temperature, max_new_tokens):
    """Written otherwise: log-probs of the pairs' rows only, in float64, the loss as a softplus, a Python loop
    for the pairs, the reference model frozen by hand."""
    group = [p for p in prompts for _ in range(num_generations)]
    roll = sample(model, tokenizer, group, max_new_tokens, temperature=temperature, generator=generator)
    scores = reward_fn(group, roll.completions)
    chosen, rejected = [], []
    for g in range(len(prompts)):
        block = [float(s) for s in scores[g * num_generations:(g + 1) * num_generations]]
        if max(block) > min(block):
            chosen.append(g * num_generations + block.index(max(block)))
            rejected.append(g * num_generations + block.index(min(block)))
    if not chosen:
        return sum(float(s) for s in scores) / len(group), None
    rows = torch.tensor(chosen + rejected)
    args = (roll.prompt_ids[rows], roll.completion_ids[rows], roll.completion_mask[rows], roll.prompt_mask[rows])
    logps = sequence_logprobs(model, *args).double().sum(-1)
    ref_model.requires_grad_(False)
    ref_logps = sequence_logprobs(ref_model, *args).double().sum(-1)
    n = len(chosen)
    margin = (logps[:n] - ref_logps[:n]) - (logps[n:] - ref_logps[n:])
    loss = F.softplus(-beta * margin).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return sum(float(s) for s in scores) / len(group), float(loss.detach())


def test_online_dpo_step_check_accepts_a_round_written_otherwise(capsys):
    check_online_dpo_step(step_ok_pair_rows_only)
    assert "raised the held-out gold score" in capsys.readouterr().out


def train_ok_with_a_step(model, optimizer, tokenizer, prompt_batches, reward_fn, generator, num_generations=2,
                         beta=0.1, max_new_tokens=8, ref_model=None):
    """Written otherwise: the reference a deep copy made before the loop; each round calls a step function
    (the step above), and the KL is measured after the round from the log-probs the round saw."""
    reference = copy.deepcopy(model).requires_grad_(False) if ref_model is None else ref_model
    logs = []
    for prompts in prompt_batches:
        group = [p for p in prompts for _ in range(num_generations)]
        seen = {}

        def scored(g, completions):
            seen["scores"] = reward_fn(g, completions)
            return seen["scores"]

        before = copy.deepcopy(model)
        gen_state = generator.get_state()
        score, loss = step_ok_pair_rows_only(model, reference, optimizer, tokenizer, prompts, scored, generator,
                                             num_generations, beta, 1.0, max_new_tokens)
        if loss is None:
            continue
        after_state = generator.get_state()
        generator.set_state(gen_state)
        roll = sample(before, tokenizer, group, max_new_tokens, generator=generator)     # the same draw again
        generator.set_state(after_state)
        with torch.no_grad():
            args = (roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
            kl = (sequence_logprobs(before, *args).sum(-1) - sequence_logprobs(reference, *args).sum(-1)).mean()
        logs.append({"loss": loss, "objective/kl": float(kl), "objective/scores": score})
    return logs


def test_train_online_dpo_check_accepts_a_run_written_otherwise(capsys):
    check_train_online_dpo(train_ok_with_a_step)
    assert "match the reference's gradients and logs" in capsys.readouterr().out
