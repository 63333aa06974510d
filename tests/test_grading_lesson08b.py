"""Lesson 08b's check passes right answers written several ways and catches each plausible wrong one."""
import rlcourse  # noqa: F401  (before torch)
import numpy as np
import torch

from grading_asserts import grading_tests
from rlcourse.grading.llm.lesson08b import check_audit_labels, check_kl_regularised_optimum, check_optimum_stats


def optimum_ok(ref_logprobs, rewards, kl_coef):
    tilted = ref_logprobs + rewards / kl_coef
    return tilted - torch.logsumexp(tilted, -1, keepdim=True)


def optimum_ok_log_softmax(ref_logprobs, rewards, kl_coef):
    return torch.log_softmax(ref_logprobs + rewards / kl_coef, dim=-1)


def optimum_ok_numpy_loop(ref_logprobs, rewards, kl_coef):   # row by row, NumPy, max subtracted by hand
    ref, r = ref_logprobs.numpy(), rewards.numpy()
    out = np.empty(ref.shape, dtype=ref.dtype)
    for idx in np.ndindex(ref.shape[:-1]):
        t = ref[idx] + r[idx] / kl_coef
        top = t.max()
        out[idx] = t - top - np.log(np.exp(t - top).sum())
    return torch.from_numpy(out)


def optimum_without_reference(ref_logprobs, rewards, kl_coef):
    return torch.log_softmax(rewards / kl_coef, dim=-1)


def optimum_reward_times_coef(ref_logprobs, rewards, kl_coef):
    return torch.log_softmax(ref_logprobs + rewards * kl_coef, dim=-1)


def optimum_unnormalised(ref_logprobs, rewards, kl_coef):
    return ref_logprobs + rewards / kl_coef


def optimum_naive_exp(ref_logprobs, rewards, kl_coef):        # exp(r / beta) overflows
    w = ref_logprobs.exp() * torch.exp(rewards / kl_coef)
    return torch.log(w / w.sum(-1, keepdim=True))


def optimum_normalised_over_everything(ref_logprobs, rewards, kl_coef):
    tilted = ref_logprobs + rewards / kl_coef
    return tilted - torch.logsumexp(tilted.reshape(-1), 0)


def optimum_probabilities(ref_logprobs, rewards, kl_coef):
    return torch.softmax(ref_logprobs + rewards / kl_coef, dim=-1)


def optimum_wrong_sign(ref_logprobs, rewards, kl_coef):
    return torch.log_softmax(ref_logprobs - rewards / kl_coef, dim=-1)


def optimum_float32(ref_logprobs, rewards, kl_coef):
    return torch.log_softmax(ref_logprobs.float() + rewards.float() / kl_coef, dim=-1)


def optimum_in_place(ref_logprobs, rewards, kl_coef):
    ref_logprobs += rewards / kl_coef
    return torch.log_softmax(ref_logprobs, dim=-1)


RIGHT = [(check_kl_regularised_optimum, a) for a in (optimum_ok, optimum_ok_log_softmax, optimum_ok_numpy_loop)]

WRONG = [
    (check_kl_regularised_optimum, optimum_without_reference, "tilted by the reward"),
    (check_kl_regularised_optimum, optimum_reward_times_coef, "divided by kl_coef"),
    (check_kl_regularised_optimum, optimum_unnormalised, "normalise each prompt"),
    (check_kl_regularised_optimum, optimum_naive_exp, "stay in log space"),
    (check_kl_regularised_optimum, optimum_normalised_over_everything, "normalise each prompt"),
    (check_kl_regularised_optimum, optimum_probabilities, "return log-probabilities"),
    (check_kl_regularised_optimum, optimum_wrong_sign, "tilted by the reward"),
    (check_kl_regularised_optimum, optimum_float32, "float64"),
    (check_kl_regularised_optimum, optimum_in_place, "in place"),
]

test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


# --- the KL and gold score of the optimum ---------------------------------------------------------

def stats_ok(ref_probs, gold, proxy, kl_coef):
    logp = optimum_ok(ref_probs.log(), proxy, kl_coef)
    p = logp.exp()
    kl = torch.where(p > 0, p * (logp - ref_probs.log()), torch.zeros_like(p)).sum()
    return kl, (p * gold).sum()


def stats_ok_numpy(ref_probs, gold, proxy, kl_coef):
    ref, g, r = ref_probs.numpy(), gold.numpy(), proxy.numpy()
    keep = ref > 0
    t = np.log(ref[keep]) + r[keep] / kl_coef
    logp = t - t.max() - np.log(np.exp(t - t.max()).sum())
    p = np.exp(logp)
    return float(p @ (logp - np.log(ref[keep]))), float(p @ g[keep])


def stats_kl_reversed(ref_probs, gold, proxy, kl_coef):
    logp = optimum_ok(ref_probs.log(), proxy, kl_coef)
    keep = ref_probs > 0
    return (ref_probs[keep] * (ref_probs[keep].log() - logp[keep])).sum(), (logp.exp() * gold).sum()


def stats_gold_under_reference(ref_probs, gold, proxy, kl_coef):
    kl, _ = stats_ok(ref_probs, gold, proxy, kl_coef)
    return kl, (ref_probs * gold).sum()


def stats_zero_times_log_zero(ref_probs, gold, proxy, kl_coef):
    logp = optimum_ok(ref_probs.log(), proxy, kl_coef)
    p = logp.exp()
    return (p * (logp - ref_probs.log())).sum(), (p * gold).sum()


def stats_unweighted_kl(ref_probs, gold, proxy, kl_coef):
    logp = optimum_ok(ref_probs.log(), proxy, kl_coef)
    keep = ref_probs > 0
    return (logp[keep] - ref_probs[keep].log()).mean(), (logp.exp() * gold).sum()


def stats_proxy_instead_of_gold(ref_probs, gold, proxy, kl_coef):
    kl, _ = stats_ok(ref_probs, gold, proxy, kl_coef)
    return kl, (optimum_ok(ref_probs.log(), proxy, kl_coef).exp() * proxy).sum()


def stats_kl_in_bits(ref_probs, gold, proxy, kl_coef):
    kl, g = stats_ok(ref_probs, gold, proxy, kl_coef)
    return kl / np.log(2), g


def stats_reward_times_coef(ref_probs, gold, proxy, kl_coef):
    return stats_ok(ref_probs, gold, proxy * kl_coef ** 2, kl_coef)


test_stats_right, test_stats_wrong = grading_tests(
    [(check_optimum_stats, stats_ok), (check_optimum_stats, stats_ok_numpy)],
    [(check_optimum_stats, stats_kl_reversed, "weighted by pi*"),
     (check_optimum_stats, stats_gold_under_reference, "under pi*"),
     (check_optimum_stats, stats_zero_times_log_zero, "0 * log 0"),
     (check_optimum_stats, stats_unweighted_kl, "weighted by pi*"),
     (check_optimum_stats, stats_proxy_instead_of_gold, "under pi*"),
     (check_optimum_stats, stats_kl_in_bits, "in nats"),
     (check_optimum_stats, stats_reward_times_coef, "KL(pi* || pi_ref)")])


# --- auditing the raters' labels -----------------------------------------------------------------

def _shares(pairs, gold_score, tie=0.5, swap=False, longer=lambda c, r: len(c) - len(r), exclude_ties=False):
    def share(values):
        if exclude_ties:
            values = [v for v in values if v != 0]
        return float(np.mean([1.0 if v > 0 else tie if v == 0 else 0.0 for v in values]))
    gold = share([gold_score(p["prompt"], p["chosen"]) - gold_score(p["prompt"], p["rejected"]) for p in pairs])
    length = share([longer(p["chosen"], p["rejected"]) for p in pairs])
    return (length, gold) if swap else (gold, length)


def audit_ok(pairs, gold_score):
    return _shares(pairs, gold_score)


def audit_ok_numpy(pairs, gold_score):
    g = np.array([gold_score(p["prompt"], p["chosen"]) - gold_score(p["prompt"], p["rejected"]) for p in pairs])
    n = np.array([len(p["chosen"]) - len(p["rejected"]) for p in pairs])
    return (np.sign(g) + 1).mean() / 2, (np.sign(n) + 1).mean() / 2


def audit_ties_lose(pairs, gold_score):
    return _shares(pairs, gold_score, tie=0.0)


def audit_ties_win(pairs, gold_score):
    return _shares(pairs, gold_score, tie=1.0)


def audit_swapped(pairs, gold_score):
    return _shares(pairs, gold_score, swap=True)


def audit_rejected_longer(pairs, gold_score):
    return _shares(pairs, gold_score, longer=lambda c, r: len(r) - len(c))


def audit_ties_dropped(pairs, gold_score):
    return _shares(pairs, gold_score, exclude_ties=True)


def audit_gold_of_chosen_positive(pairs, gold_score):
    gold = float(np.mean([gold_score(p["prompt"], p["chosen"]) > 0 for p in pairs]))
    return gold, _shares(pairs, gold_score)[1]


def audit_lesson_gold_score(pairs, gold_score):      # the argument ignored: lesson 08's gold score, always
    from rlcourse.tasks.preference import PreferenceTask
    return _shares(pairs, PreferenceTask().gold_score)


test_audit_right, test_audit_wrong = grading_tests(
    [(check_audit_labels, audit_ok), (check_audit_labels, audit_ok_numpy)],
    [(check_audit_labels, audit_ties_lose, "a tie counts one half"),
     (check_audit_labels, audit_ties_win, "a tie counts one half"),
     (check_audit_labels, audit_swapped, "compared with the rejected"),
     (check_audit_labels, audit_rejected_longer, "len(chosen) > len(rejected)"),
     (check_audit_labels, audit_ties_dropped, "a tie counts one half"),
     (check_audit_labels, audit_gold_of_chosen_positive, "compared with the rejected"),
     (check_audit_labels, audit_lesson_gold_score, "another gold score")])
