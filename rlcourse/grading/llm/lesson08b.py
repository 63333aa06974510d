"""Checks for lesson 08b (reward over-optimisation): the optimum of the KL-regularised objective.

The learner's ``kl_regularised_optimum(ref_logprobs, rewards, kl_coef)`` is compared with
:func:`rlcourse.regularised_optimum.kl_regularised_optimum` on cases built so that each plausible
mistake shows: the reference left out, the reward multiplied by ``kl_coef`` instead of divided, no
normalisation, a normalisation over every prompt at once, ``exp(r / kl_coef)`` overflowing where
log space stays finite, probabilities returned instead of log-probabilities, and float64 inputs
answered in float32.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, passed, references, to_numpy
from rlcourse.grading.llm.lesson07b import kept_float64
from rlcourse.kl import exact_kl
from rlcourse.measure.overoptimisation import audit_labels
from rlcourse.regularised_optimum import kl_regularised_optimum

__all__ = ["check_kl_regularised_optimum", "check_optimum_stats", "check_audit_labels"]


@references("rlcourse.regularised_optimum:kl_regularised_optimum", "rlcourse.measure.categorical_bandit:CategoricalBandit.optimal_logprobs")
def check_kl_regularised_optimum(fn) -> None:
    """``fn(ref_logprobs, rewards, kl_coef) -> log pi*``, along the last dimension:
    ``pi*(y) = pi_ref(y) exp(r(y) / kl_coef) / Z``, returned as log-probabilities, any leading shape.

    ``ref_logprobs`` may hold ``-inf`` (an answer the reference never writes: it keeps probability
    0). Float64 inputs give a float64 answer."""
    __tracebackhide__ = True
    name = "check_kl_regularised_optimum"
    gen = torch.Generator().manual_seed(808)

    def ref_of(*shape):
        return torch.log_softmax(torch.randn(*shape, generator=gen, dtype=torch.float64), -1)

    cases = [
        ("one prompt, five answers, kl_coef = 1", ref_of(5), torch.randn(5, generator=gen, dtype=torch.float64), 1.0),
        ("one prompt, a small kl_coef = 0.1", ref_of(6), torch.randn(6, generator=gen, dtype=torch.float64), 0.1),
        ("three prompts (rows) of four answers, kl_coef = 0.5: each row is its own distribution",
         ref_of(3, 4), 2 * torch.randn(3, 4, generator=gen, dtype=torch.float64), 0.5),
        ("an answer the reference never writes (log-prob -inf) with the highest reward",
         torch.tensor([0.3, 0.7, 0.0], dtype=torch.float64).log(), torch.tensor([0.0, 1.0, 5.0], dtype=torch.float64), 0.5),
        ("rewards of a few hundred and kl_coef = 0.01: r / kl_coef is in the tens of thousands",
         ref_of(2, 5), 300 * torch.rand(2, 5, generator=gen, dtype=torch.float64), 0.01),
        ("a huge kl_coef = 1e6: the optimum is the reference itself", ref_of(4), torch.randn(4, generator=gen, dtype=torch.float64), 1e6),
        ("float32 inputs", ref_of(2, 3).float(), torch.randn(2, 3, generator=gen).float(), 0.3),
    ]
    for case, ref, rewards, coef in cases:
        got = call_unmutated(name, case, fn, ref, rewards, coef)
        kept_float64(name, case, got, ref, rewards)
        expected = kl_regularised_optimum(ref.double(), rewards.double(), coef)
        try:
            received = to_numpy(got)
        except (TypeError, ValueError):
            fail(name, case, "a tensor of log-probabilities", f"{type(got).__name__}", "return log pi*, a tensor")
        if received.shape != tuple(expected.shape):
            fail(name, case, f"shape {tuple(expected.shape)}", f"shape {received.shape}",
                 "one log-probability per answer: the same shape as ref_logprobs")
        if np.isnan(received).any() or np.isposinf(received).any():
            fail(name, case, expected, got, "nan or +inf in the answer: exp(r / kl_coef) overflows for large "
                 "r / kl_coef, and -inf - (-inf) is nan; stay in log space (log pi_ref + r / kl_coef, then "
                 "subtract a logsumexp)")
        if (received >= 0).all() and np.allclose(received.sum(-1), 1.0, atol=1e-6):
            fail(name, case, expected, got, "these are probabilities: return log-probabilities, log pi*")
        probs = np.exp(received)
        sums = probs.sum(-1)
        if not np.allclose(sums, 1.0, atol=1e-6):
            fail(name, case, "each row's exp(log pi*) sums to 1", f"sums {np.round(sums, 4)}",
                 "normalise each prompt's distribution over its answers (subtract log Z, a logsumexp over the "
                 "last dimension)")
        assert_close(name, case, expected.exp(), probs,
                     "pi*(y) is proportional to pi_ref(y) * exp(r(y) / kl_coef): the reference's probability, "
                     "tilted by the reward divided by kl_coef", atol=1e-7, rtol=1e-6)
    passed(name, len(cases))


def _optimum_stats(ref_probs, gold, proxy, kl_coef):
    """The reference answer of :func:`check_optimum_stats`: ``(KL(pi* || pi_ref), E_{pi*}[gold])``."""
    ref_probs, gold, proxy = (torch.as_tensor(x, dtype=torch.float64) for x in (ref_probs, gold, proxy))
    logp = kl_regularised_optimum(ref_probs.log(), proxy, kl_coef)
    return float(exact_kl(logp, ref_probs.log())), float(logp.exp() @ gold)


@references("rlcourse.measure.overoptimisation:optimum_curve", "rlcourse.regularised_optimum:kl_regularised_optimum",
            "rlcourse.measure.categorical_bandit:CategoricalBandit.optimal_logprobs", "rlcourse.kl:exact_kl")
def check_optimum_stats(fn) -> None:
    """``fn(ref_probs, gold, proxy, kl_coef) -> (kl, gold_mean)`` for one prompt: with
    ``pi* = kl_regularised_optimum(log ref_probs, proxy, kl_coef)``, ``kl = KL(pi* || pi_ref)`` in nats and
    ``gold_mean = E_{y ~ pi*}[gold(y)]``. The inputs are 1-D float64 tensors over the word classes of
    one prompt; ``ref_probs`` may hold zeros (a class the reference never writes)."""
    __tracebackhide__ = True
    from rlcourse.tasks.preference import PreferenceTask

    name = "check_optimum_stats"
    task = PreferenceTask(length_bias=0.3)
    cases = []
    for prompt, coef in (("ce:", 1.0), ("ah:", 0.1), ("dd:", 0.02)):
        lengths, gold, probs = task.word_classes(prompt)
        proxy = task.beta * (gold + task.length_bias * lengths)
        cases.append((f"the word classes of prompt {prompt!r}, kl_coef = {coef}", probs, gold, proxy, coef))
    gen = torch.Generator().manual_seed(880)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    cases.append(("four answers, one of them never written by the reference (probability 0)", probs,
                  torch.randn(4, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64), 0.5))
    cases.append(("a huge kl_coef = 1e6: pi* is the reference, so the KL is 0", probs[:3],
                  torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), 1e6))
    for case, probs, gold, proxy, coef in cases:
        probs, gold, proxy = (torch.as_tensor(x, dtype=torch.float64) for x in (probs, gold, proxy))
        got = call_unmutated(name, case, fn, probs, gold, proxy, coef)
        kl_ref, gold_ref = _optimum_stats(probs, gold, proxy, coef)
        try:
            kl_got, gold_got = (float(to_numpy(x)) for x in got)
        except (TypeError, ValueError):
            fail(name, case, "a pair (kl, gold_mean) of two numbers", repr(got)[:100], "return kl, gold_mean")
        if np.isnan(kl_got) or np.isnan(gold_got):
            fail(name, case, (kl_ref, gold_ref), (kl_got, gold_got),
                 "nan: a class with probability 0 contributes 0 to the KL (the limit of p log p), not 0 * log 0")
        assert_close(name, f"{case}: the KL", kl_ref, kl_got,
                     "KL(pi* || pi_ref) = sum_y pi*(y) (log pi*(y) - log pi_ref(y)): weighted by pi*, the optimum, "
                     "in nats", atol=1e-8, rtol=1e-6)
        assert_close(name, f"{case}: the gold score", gold_ref, gold_got,
                     "the gold score's expectation under pi* (not under the reference)", atol=1e-8, rtol=1e-6)
    passed(name, len(cases))


@references("rlcourse.measure.overoptimisation:audit_labels")
def check_audit_labels(fn) -> None:
    """``fn(pairs, gold_score) -> (gold_agreement, longer_chosen)``: over rated pairs
    ``{"prompt", "chosen", "rejected"}``, the share whose chosen completion has the higher gold score
    and the share whose chosen completion is the longer one, a tie counting one half in each."""
    __tracebackhide__ = True
    from rlcourse.tasks.preference import PreferenceTask

    name = "check_audit_labels"
    task = PreferenceTask()
    tied_gold = [{"prompt": "ab:", "chosen": "ab", "rejected": "ba"}, {"prompt": "cc:", "chosen": "cccc", "rejected": "cc"}]
    cases = [
        ("four hand-made pairs: two agree with the gold score, one does not, the chosen is longer in one",
         [{"prompt": "ab:", "chosen": "abab", "rejected": "hhhh"}, {"prompt": "ce:", "chosen": "cdce", "rejected": "h"},
          {"prompt": "ah:", "chosen": "d", "rejected": "aaaa"}, {"prompt": "bb:", "chosen": "bb", "rejected": "bbb"}]),
        ("pairs with ties on the gold score and on length", tied_gold + [{"prompt": "ab:", "chosen": "abc", "rejected": "hgf"}]),
        ("400 pairs of raters with a length bias", PreferenceTask(length_bias=0.35).preference_pairs(400, rng=8)),
        ("400 pairs of lesson 08's raters", task.preference_pairs(400, rng=9)),
    ]
    cases = [(case, pairs, task.gold_score) for case, pairs in cases]
    # The gold score is an argument: judged by another one (a task whose best answers have 2 letters), the
    # same labels agree less often.
    cases.append(("the 400 pairs of lesson 08's raters, audited against another gold score (best length 2)",
                  task.preference_pairs(400, rng=9), PreferenceTask(target_length=2).gold_score))
    for case, pairs, gold_score in cases:
        got = call_unmutated(name, case, fn, pairs, gold_score)
        expected = audit_labels(pairs, gold_score)
        try:
            gold_got, longer_got = (float(x) for x in got)
        except (TypeError, ValueError):
            fail(name, case, "a pair of two shares (gold_agreement, longer_chosen)", repr(got)[:100],
                 "return gold_agreement, longer_chosen: two numbers in [0, 1]")
        assert_close(name, f"{case}: the share agreeing with the gold score", expected[0], gold_got,
                     "the chosen completion's gold score is compared with the rejected one's; a tie counts one half",
                     atol=1e-9)
        assert_close(name, f"{case}: the share whose chosen completion is longer", expected[1], longer_got,
                     "len(chosen) > len(rejected) counts 1: a tie counts one half", atol=1e-9)
    passed(name, len(cases))
