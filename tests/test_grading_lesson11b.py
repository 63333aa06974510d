"""Lesson 11b's checks pass right answers written several ways and refuse each plausible wrong one."""
import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from grading_asserts import grading_tests
from rlcourse.grading.lesson11b import check_fit_simpo_policy, check_kto_loss, check_online_dpo_pairs, check_simpo_loss


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
    for check in (check_simpo_loss, check_kto_loss, check_online_dpo_pairs):
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


FIT_WRONG = [(check_fit_simpo_policy, fit_simpo_keeps_reference, "nearest to pi* = pi_ref"),
             (check_fit_simpo_policy, fit_simpo_without_lengths, "every length 1"),
             (check_fit_simpo_policy, fit_simpo_with_a_margin, "KL(pi_fit || SimPO's optimum) < 0.01"),
             (check_fit_simpo_policy, fit_simpo_swapped, "KL(pi_fit || SimPO's optimum) < 0.01"),
             (check_fit_simpo_policy, fit_simpo_returns_logits, "exp sums to 1"),
             (check_fit_simpo_policy, fit_simpo_too_few_steps, "where the policy started")]
test_fit_right_answers_pass, test_fit_wrong_answers_fail_with_a_hint = grading_tests(
    [(check_fit_simpo_policy, fit_simpo_ok), (check_fit_simpo_policy, fit_simpo_ok_lbfgs)], FIT_WRONG)
