"""Lesson 10d's checks pass right answers written in other ways and catch plausible wrong ones.

The right answers are written from the exercise texts, independently of the solution notebook."""
import numpy as np

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.grading.llm.lesson10d import (check_false_positive_rate, check_judge_text, check_mine_negatives,
                                            check_rubric_reward, leaky_judge_text)
from grading_asserts import grading_tests


# ---------------------------------------------------------------------------- exercise 1: the rubric reward
def rubric_loop(items, weights):
    w = [float(x) for x in weights]
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    return torch.tensor([sum(wi * float(s) for wi, s in zip(w, row)) / sum(w) for row in items])


def rubric_numpy(items, weights):
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not w.sum() > 0:
        raise ValueError("bad weights")
    return np.average(np.asarray(items, dtype=np.float64), axis=1, weights=w)


def rubric_unnormalised(items, weights):
    rubric_loop(items, weights)
    return items @ weights


def rubric_plain_mean(items, weights):
    rubric_loop(items, weights)
    return items.mean(1)


def rubric_by_count(items, weights):
    rubric_loop(items, weights)
    return items @ weights / items.shape[1]


def rubric_by_max(items, weights):
    rubric_loop(items, weights)
    return items @ weights / weights.max()


def rubric_by_nonzero(items, weights):
    rubric_loop(items, weights)
    return items @ weights / (weights > 0).sum()


def rubric_squared(items, weights):
    rubric_loop(items, weights)
    return items @ weights / weights.sum() ** 2


def rubric_accepts_negative(items, weights):
    return items @ weights / weights.sum()


def rubric_wrong_axis(items, weights):
    rubric_loop(items, weights)
    return (items * weights).sum(0) / weights.sum()


# ------------------------------------------------------------------ exercise 2: the false-positive rate
def fpr_loop(probs, right, threshold):
    wrong = [float(p) for p, ok in zip(probs, right) if not bool(ok)]
    return sum(p > threshold for p in wrong) / len(wrong) if wrong else float("nan")


def fpr_numpy(probs, right, threshold):
    probs, right = np.asarray(probs), np.asarray(right, dtype=bool)
    return float(np.mean(probs[~right] > threshold)) if (~right).any() else float("nan")


def fpr_over_all(probs, right, threshold):
    return float(((probs > threshold) & ~right).float().mean())


def fpr_true_positive(probs, right, threshold):
    return float((probs[right] > threshold).float().mean())


def fpr_at_or_above(probs, right, threshold):
    return float((probs[~right] >= threshold).float().mean()) if bool((~right).any()) else float("nan")


def fpr_mean_prob(probs, right, threshold):
    return float(probs[~right].mean()) if bool((~right).any()) else float("nan")


def fpr_false_discovery(probs, right, threshold):
    approved = probs > threshold
    return float((~right[approved]).float().mean()) if bool((~right).any()) else float("nan")


def fpr_rejection(probs, right, threshold):
    return float((probs[~right] <= threshold).float().mean()) if bool((~right).any()) else float("nan")


def fpr_fixed_half(probs, right, threshold):
    return float((probs[~right] > 0.5).float().mean()) if bool((~right).any()) else float("nan")


def fpr_zero_when_none(probs, right, threshold):
    return float((probs[~right] > threshold).float().mean()) if bool((~right).any()) else 0.0


# ------------------------------------------------------------------- exercise 3: mining the negatives
def mine_dict(prompts, completions, probs, right, threshold):
    found = {}
    for p, c, q, ok in zip(prompts, completions, probs.tolist(), right.tolist()):
        if not ok and q > threshold:
            found.setdefault((p, c), None)
    return list(found)


def mine_with_right(prompts, completions, probs, right, threshold):
    out = []
    for p, c, q in zip(prompts, completions, probs.tolist()):
        if q > threshold and (p, c) not in out:
            out.append((p, c))
    return out


def mine_all_wrong(prompts, completions, probs, right, threshold):
    out = []
    for p, c, ok in zip(prompts, completions, right.tolist()):
        if not ok and (p, c) not in out:
            out.append((p, c))
    return out


def mine_duplicates(prompts, completions, probs, right, threshold):
    return [(p, c) for p, c, q, ok in zip(prompts, completions, probs.tolist(), right.tolist()) if not ok and q > threshold]


def mine_sorted(prompts, completions, probs, right, threshold):
    return sorted(mine_dict(prompts, completions, probs, right, threshold))


def mine_at_or_above(prompts, completions, probs, right, threshold):
    found = {}
    for p, c, q, ok in zip(prompts, completions, probs.tolist(), right.tolist()):
        if not ok and q >= threshold:
            found.setdefault((p, c), None)
    return list(found)


def mine_by_completion(prompts, completions, probs, right, threshold):
    out, seen = [], set()
    for p, c, q, ok in zip(prompts, completions, probs.tolist(), right.tolist()):
        if not ok and q > threshold and c not in seen:
            seen.add(c)
            out.append((p, c))
    return out


def mine_by_prompt(prompts, completions, probs, right, threshold):
    out, seen = [], set()
    for p, c, q, ok in zip(prompts, completions, probs.tolist(), right.tolist()):
        if not ok and q > threshold and p not in seen:
            seen.add(p)
            out.append((p, c))
    return out


# ------------------------------------------------------------- exercise 4: find the bug in the judge line
def line_join(problem, answer, reference):
    return "".join([problem, answer, "|", reference, ">"])


def line_format(problem, answer, reference):
    return "{}{}|{}>".format(problem, answer, reference)


def line_swapped(problem, answer, reference):
    return f"{problem}{reference}|{answer}>"


def line_no_end(problem, answer, reference):
    return f"{problem}{answer}|{reference}"


def line_no_separator(problem, answer, reference):
    return f"{problem}{answer}{reference}>"


def line_markers_swapped(problem, answer, reference):
    return f"{problem}{answer}>{reference}|"


def line_spaces(problem, answer, reference):
    return f"{problem} {answer} | {reference} >"


def line_answer_twice(problem, answer, reference):
    return f"{problem}{answer}|{answer}>"


RIGHT = [(check_rubric_reward, rubric_loop), (check_rubric_reward, rubric_numpy),
         (check_false_positive_rate, fpr_loop), (check_false_positive_rate, fpr_numpy),
         (check_mine_negatives, mine_dict), (check_judge_text, line_join), (check_judge_text, line_format)]
WRONG = [(check_rubric_reward, rubric_unnormalised, "divide by the sum of the weights"),
         (check_rubric_reward, rubric_plain_mean, "plain mean"),
         (check_rubric_reward, rubric_by_count, "not by the number of items"),
         (check_rubric_reward, rubric_by_max, "not by the largest one"),
         (check_rubric_reward, rubric_by_nonzero, "how many are non-zero"),
         (check_rubric_reward, rubric_squared, "once"),
         (check_rubric_reward, rubric_accepts_negative, "raise ValueError"),
         (check_rubric_reward, rubric_wrong_axis, "one reward per row"),
         (check_false_positive_rate, fpr_over_all, "not by every answer"),
         (check_false_positive_rate, fpr_true_positive, "true-positive rate"),
         (check_false_positive_rate, fpr_at_or_above, "strictly above"),
         (check_false_positive_rate, fpr_mean_prob, "do not average"),
         (check_false_positive_rate, fpr_false_discovery, "share of the approved answers"),
         (check_false_positive_rate, fpr_rejection, "rejection rate"),
         (check_false_positive_rate, fpr_fixed_half, "not 0.5"),
         (check_false_positive_rate, fpr_zero_when_none, "float('nan')"),
         (check_mine_negatives, mine_with_right, "keep only the wrong answers"),
         (check_mine_negatives, mine_all_wrong, "it already gets right"),
         (check_mine_negatives, mine_duplicates, "once"),
         (check_mine_negatives, mine_sorted, "not sorted"),
         (check_mine_negatives, mine_at_or_above, "strictly above"),
         (check_mine_negatives, mine_by_completion, "another negative"),
         (check_mine_negatives, mine_by_prompt, "every distinct wrong completion"),
         (check_judge_text, leaky_judge_text, "approves everything"),
         (check_judge_text, line_swapped, "before the separator"),
         (check_judge_text, line_no_end, "ends with '>'"),
         (check_judge_text, line_no_separator, "between the answer and the reference"),
         (check_judge_text, line_markers_swapped, "end marker"),
         (check_judge_text, line_spaces, "no spaces"),
         (check_judge_text, line_answer_twice, "reference slot")]

test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)
