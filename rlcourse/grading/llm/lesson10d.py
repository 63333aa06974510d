"""Checks for lesson 10d (rewards without a verifier).

* :func:`check_rubric_reward` - the weighted sum of a rubric's items, normalised by the weights' sum,
  and its refusals (mistakes caught: no normalisation, the items' plain mean, a division by the number
  of items, by the largest weight or by the number of non-zero weights, the weights applied to the
  wrong axis; negative weights or weights summing to zero accepted);
* :func:`check_false_positive_rate` - the share of the wrong answers that a judge approves (mistakes
  caught: a division by every answer, the right answers' approval rate, ``>=`` for ``>``, the mean
  probability instead of a count, the share of the approved answers that are wrong, the rejection rate,
  the threshold ignored; no NaN when there is no wrong answer);
* :func:`check_mine_negatives` - the distinct wrong-and-approved ``(prompt, completion)`` pairs of a run
  in order of first appearance (mistakes caught: right answers kept, rejected ones kept, duplicates
  kept, pairs sorted, ``>=`` for ``>``, duplicates found by completion alone or by prompt alone);
* :func:`check_judge_text` - find the bug: a judge line that writes the reference into the answer slot;
  fixed, it is the judge's line, and the shipped judge reading it rejects wrong answers again (measured).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references

__all__ = ["check_rubric_reward", "check_false_positive_rate", "check_mine_negatives", "check_judge_text"]


# -------------------------------------------------------------------------- exercise 1: the rubric reward
def _rubric_cases():
    rng = np.random.default_rng(10)
    cases = [("four 0/1 items, one weighing zero", torch.tensor([[1., 1., 0., 0.], [1., 1., 1., 1.], [0., 1., 1., 0.]]),
              torch.tensor([0., 5., 1., 1.])),
             ("four 0/1 items, equal weights", torch.tensor([[1., 1., 0., 0.], [1., 1., 1., 1.], [0., 0., 0., 0.]]),
              torch.tensor([1., 1., 1., 1.])),
             ("four items, the last weighs most", torch.tensor([[1., 1., 1., 0.], [1., 0., 1., 1.]]),
              torch.tensor([0.1, 0.2, 0.3, 2.0])),
             ("a zero weight", torch.tensor([[1., 0., 1.], [0., 1., 1.], [1., 1., 0.]]), torch.tensor([0.0, 2.0, 1.0])),
             ("one item", torch.tensor([[0.3], [1.0]]), torch.tensor([5.0]))]
    for i in range(3):
        B, n = int(rng.integers(2, 9)), int(rng.integers(2, 7))
        items = torch.tensor(rng.random((B, n)), dtype=torch.float32)
        weights = torch.tensor(rng.random(n) * rng.integers(1, 6), dtype=torch.float32)
        weights[int(rng.integers(n))] = 0.0
        cases.append((f"seeded items in [0, 1], B={B}, {n} items", items, weights))
    return cases


def _rubric_mistakes(items, w):
    s = items @ w
    return [(s, "divide by the sum of the weights: the reward must stay in [0, 1] whatever scale the weights have"),
            (items.mean(1), "weigh each item by its weight: the plain mean ignores them"),
            (s / items.shape[1], "divide by the sum of the weights, not by the number of items"),
            (s / w.max(), "divide by the sum of the weights, not by the largest one"),
            (s / (w > 0).sum(), "divide by the sum of the weights, not by how many are non-zero"),
            (s / w.sum() ** 2, "divide by the sum of the weights once")]


@references("rlcourse.tasks.judge:rubric_reward", "rlcourse.tasks.judge:RubricTask.reward")
def check_rubric_reward(fn) -> None:
    """``fn(items, weights) -> (B,)``: ``sum_i w_i s_bi / sum_i w_i``; a ``ValueError`` for negative weights
    or weights summing to zero."""
    __tracebackhide__ = True
    name = "check_rubric_reward"
    n = 0
    for case, items, weights in _rubric_cases():
        got = call_unmutated(name, case, fn, items, weights)
        expected = items @ weights / weights.sum()
        for mistake, hint in _rubric_mistakes(items, weights):
            fail_if_mistake(name, case, expected, got, mistake, hint)
        assert_close(name, case, expected, got, atol=1e-5, rtol=1e-5,
                     hint="r_b = sum_i w_i s_bi / sum_i w_i, one reward per row")
        n += 1
    for case, weights in (("a negative weight", torch.tensor([1.0, -0.5, 1.0])),
                          ("weights that are all zero", torch.zeros(3))):
        try:
            fn(torch.ones(2, 3), weights)
        except ValueError:
            n += 1
            continue
        except Exception as error:  # noqa: BLE001 - the learner's own exception type is the finding
            fail(name, case, "ValueError", f"{type(error).__name__}: {error}",
                 "raise ValueError (a clear message) for weights that are negative or sum to zero")
        fail(name, case, "ValueError", "no error",
             "a negative weight would reward failing an item, and a zero sum divides by zero: raise ValueError")
    passed(name, n)


# ------------------------------------------------------------------ exercise 2: the false-positive rate
def _fpr_cases():
    rng = np.random.default_rng(20)
    cases = [("six answers, two wrong", torch.tensor([0.9, 0.2, 0.7, 0.4, 0.95, 0.1]),
              torch.tensor([True, True, False, True, False, True]), 0.5),
             ("a probability exactly at the threshold", torch.tensor([0.5, 0.5, 0.9, 0.2]),
              torch.tensor([False, False, False, True]), 0.5),
             ("a stricter threshold", torch.tensor([0.6, 0.85, 0.95, 0.3, 0.92]),
              torch.tensor([False, False, True, False, True]), 0.9)]
    for i in range(3):
        B = int(rng.integers(20, 200))
        probs = torch.tensor(rng.random(B), dtype=torch.float32)
        right = torch.tensor(rng.random(B) < rng.uniform(0.2, 0.8))
        cases.append((f"seeded, B={B}", probs, right, float(rng.choice([0.3, 0.5, 0.7]))))
    return cases


def _fpr_mistakes(probs, right, t):
    wrong, approved = ~right, probs > t
    share = lambda mask: float(mask.float().mean()) if bool(mask.numel()) else float("nan")  # noqa: E731
    return [(float((approved & wrong).float().mean()), "divide by the number of wrong answers, not by every answer"),
            (share(approved[right]), "that is the approval rate of the right answers (the true-positive rate): "
                                     "count among the wrong ones"),
            (share((probs >= t)[wrong]), "approved means strictly above the threshold: use >, not >="),
            (float(probs[wrong].mean()), "count the wrong answers approved (probability above the threshold); "
                                         "do not average their probabilities"),
            (share(wrong[approved]), "that is the share of the approved answers that are wrong; the false-positive "
                                     "rate divides by the wrong answers"),
            (share(~approved[wrong]), "that is the rejection rate of the wrong answers (1 - the false-positive rate)"),
            (share((probs > 0.5)[wrong]), "use the threshold you were given, not 0.5")]


@references("rlcourse.tasks.judge:false_positive_rate")
def check_false_positive_rate(fn) -> None:
    """``fn(probs, right, threshold) -> float``: the share of the wrong answers with ``probs > threshold``;
    NaN when there is no wrong answer."""
    __tracebackhide__ = True
    name = "check_false_positive_rate"
    n = 0
    for case, probs, right, t in _fpr_cases():
        got = call_unmutated(name, case, fn, probs, right, t)
        expected = float((probs[~right] > t).float().mean())
        for mistake, hint in _fpr_mistakes(probs, right, t):
            fail_if_mistake(name, case, expected, got, mistake, hint)
        assert_close(name, f"{case}, threshold {t}", expected, got, atol=1e-6,
                     hint="(number of wrong answers with probs > threshold) / (number of wrong answers)")
        n += 1
    case = "every answer right"
    got = call_unmutated(name, case, fn, torch.tensor([0.9, 0.2]), torch.tensor([True, True]), 0.5)
    if not (isinstance(got, (float, np.floating, torch.Tensor)) and math.isnan(float(got))):
        fail(name, case, float("nan"), got, "with no wrong answer the rate is undefined: return float('nan'), "
                                            "not 0 (a judge that saw no wrong answer has shown nothing)")
    passed(name, n + 1)


# ------------------------------------------------------------------- exercise 3: mining the negatives
def _mining_cases():
    rng = np.random.default_rng(30)
    cases = [("a small run", ["1+2=", "1+2=", "5+5=", "5+5=", "1+2=", "7+1=", "7+1="], ["3", "", "1", "", "", "8", "2"],
              [0.9, 0.8, 0.7, 0.5, 0.9, 0.99, 0.1], [True, False, False, False, False, True, False], 0.5),
             ("one wrong completion on two prompts, and one prompt with two", ["1+2=", "3+4=", "1+2=", "3+4="],
              ["|", "|", "4", "7"], [0.95, 0.6, 0.55, 0.5], [False, False, False, True], 0.5)]
    for i in range(3):
        B = int(rng.integers(30, 90))
        ps = [f"{a}+{b}=" for a, b in rng.integers(0, 4, size=(B, 2))]
        cs = [str(x) if x >= 0 else "" for x in rng.integers(-2, 6, size=B)]
        probs = [float(p) for p in rng.choice([0.1, 0.4, 0.6, 0.7, 0.9], size=B)]
        right = [bool(int(c or -1) == int(p[0]) + int(p[2])) for p, c in zip(ps, cs)]
        cases.append((f"seeded, B={B}", ps, cs, probs, right, float(rng.choice([0.5, 0.65]))))
    return cases


def _mined(ps, cs, probs, right, t, keep=lambda q, ok, t: not ok and q > t, key=lambda p, c: (p, c), order=False,
           dedup=True):
    out, seen = [], set()
    for p, c, q, ok in zip(ps, cs, probs, right):
        if keep(q, ok, t) and (not dedup or key(p, c) not in seen):
            seen.add(key(p, c))
            out.append((p, c))
    return sorted(out) if order else out


def _mining_mistakes(ps, cs, probs, right, t):
    args = (ps, cs, probs, right, t)
    return [(_mined(*args, keep=lambda q, ok, t: q > t), "keep only the wrong answers: a right answer the judge "
                                                         "approves is no negative"),
            (_mined(*args, keep=lambda q, ok, t: not ok), "keep only the wrong answers the judge approved "
                                                          "(probability above the threshold): those it rejects "
                                                          "it already gets right"),
            (_mined(*args, dedup=False), "keep each (prompt, completion) pair once"),
            (_mined(*args, order=True), "keep the pairs in order of first appearance, not sorted"),
            (_mined(*args, keep=lambda q, ok, t: not ok and q >= t), "approved means strictly above the threshold"),
            (_mined(*args, key=lambda p, c: c), "a pair is a prompt and a completion: the same completion on another "
                                                "prompt is another negative"),
            (_mined(*args, key=lambda p, c: p), "a pair is a prompt and a completion: keep every distinct wrong "
                                                "completion of a prompt")]


def _as_pairs(got):
    try:
        return [(str(p), str(c)) for p, c in got]
    except (TypeError, ValueError):
        return None


@references("rlcourse.tasks.judge:mine_negatives")
def check_mine_negatives(fn) -> None:
    """``fn(prompts, completions, probs, right, threshold) -> [(prompt, completion), ...]``: each distinct
    wrong pair with ``probs > threshold`` once, in order of first appearance."""
    __tracebackhide__ = True
    name = "check_mine_negatives"
    n = 0
    for case, ps, cs, probs, right, t in _mining_cases():
        got = call_unmutated(name, case, fn, ps, cs, torch.tensor(probs), torch.tensor(right), t)
        expected = _mined(ps, cs, probs, right, t)
        pairs = _as_pairs(got) if got is not None else None
        if pairs is None:
            fail(name, case, expected, got, "return a list of (prompt, completion) tuples")
        for mistake, hint in _mining_mistakes(ps, cs, probs, right, t):
            if pairs == mistake and mistake != expected:
                fail(name, case, expected, pairs, hint)
        if pairs != expected:
            fail(name, f"{case}, threshold {t}", expected, pairs,
                 "keep (prompt, completion) when the answer is wrong and probs > threshold, each pair once, in order")
        n += 1
    passed(name, n)


# ------------------------------------------------------------- exercise 4: find the bug in the judge line
def leaky_judge_text(problem: str, answer: str, reference: str) -> str:
    """The buggy judge line of exercise 4 (the answer slot gets the reference)."""
    return f"{problem}{reference}|{reference}>"


def _line_mistakes(problem, answer, reference):
    return [(leaky_judge_text(problem, answer, reference), "the answer slot holds the reference: the judge then "
                                                           "compares the reference with itself and approves everything"),
            (f"{problem}{reference}|{answer}>", "the answer goes before the separator and the reference after it"),
            (f"{problem}{answer}|{reference}", "the line ends with '>': the judge writes its verdict after it"),
            (f"{problem}{answer}{reference}>", "the separator '|' goes between the answer and the reference"),
            (f"{problem}{answer}>{reference}|", "the separator is '|' and the end marker '>'"),
            (f"{problem} {answer} | {reference} >", "no spaces: the judge was trained on lines without them"),
            (f"{problem}{answer}|{answer}>", "the reference slot holds the answer: that also approves everything")]


@references("rlcourse.tasks.judge:judge_text")
def check_judge_text(fn) -> None:
    """``fn(problem, answer, reference) -> str``: the judge's line; then the shipped judge reads the learner's lines
    for held-out wrong answers and must reject most of them."""
    __tracebackhide__ = True
    from rlcourse.lm import load_checkpoint
    from rlcourse.tasks import AdditionTask
    from rlcourse.tasks.judge import GenerativeJudge, JudgeTask, judge_text

    name = "check_judge_text"
    cases = [("12+34=", "47", "46"), ("5+5=", "10", "10"), ("99+99=", "", "198"), ("3+4=", "|", "7"),
             ("60+7=", "76", "67"), ("0+0=", "0", "0")]
    n = 0
    for problem, answer, reference in cases:
        case = f"problem {problem!r}, answer {answer!r}, reference {reference!r}"
        got = call_unmutated(name, case, fn, problem, answer, reference)
        expected = judge_text(problem, answer, reference)
        for mistake, hint in _line_mistakes(problem, answer, reference):
            if got == mistake and mistake != expected:
                fail(name, case, expected, got, hint)
        if got != expected:
            fail(name, case, expected, got, "problem, answer, '|', reference, '>': nothing else")
        n += 1
    model, tokenizer = load_checkpoint("judge", device="cpu")
    judge, task, maker = GenerativeJudge(model, tokenizer), AdditionTask(), JudgeTask()
    rng = np.random.default_rng(40)
    problems = task.test_prompts(200)
    wrong = [maker.wrong_answer(task.answer(p), rng) for p in problems]
    probs = judge.prob_yes_lines([fn(p, a, task.answer(p)) for p, a in zip(problems, wrong)])
    fpr = float((probs > 0.5).float().mean())
    if fpr > 0.25:
        fail(name, "the shipped judge reading your lines for 200 held-out wrong answers", "a false-positive rate "
             "below 0.25", f"{fpr:.2f}", "the judge approves the wrong answers: is the answer in the answer slot?")
    print(f"✔ {name}: all {n + 1} cases passed; the shipped judge approves {fpr:.1%} of 200 held-out wrong "
          f"answers through your lines")
