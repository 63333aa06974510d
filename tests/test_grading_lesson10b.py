"""Lesson 10b's checks pass right answers written several ways and catch plausible wrong ones."""
import math
import re
from fractions import Fraction

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from grading_asserts import assert_fails, grading_tests
from rlcourse.grading.llm.lesson10b import (check_high_entropy_mask, check_overlong_penalty, check_pass_at_k,
                                        check_reward_experiment, check_strict_answer)


# ---------------------------------------------------------------- pass@k
def pass_comb(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_product(n, c, k):                  # Chen et al.'s numerically stable form
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_fraction(n, c, k):                 # exact rational arithmetic, then a float
    no_right = Fraction(1)
    for i in range(k):
        no_right *= Fraction(n - c - i, n - i)
    return float(1 - no_right)


def pass_plug_in(n, c, k):
    return 1 - (1 - c / n) ** k


def pass_without_one_minus(n, c, k):
    return math.comb(n - c, k) / math.comb(n, k)


def pass_union_bound(n, c, k):
    return min(1.0, k * c / n)


def pass_product_off_by_one(n, c, k):
    return 1.0 - float(np.prod([1.0 - k / i for i in range(n - c, n + 1) if i > 0]))


def pass_zero_when_short(n, c, k):
    return 0.0 if n - c < k else pass_comb(n, c, k)


def pass_float_factorials(n, c, k):
    f = lambda m: float(math.factorial(m))  # noqa: E731
    if n - c < k:
        return 1.0
    return 1.0 - (f(n - c) / (f(k) * f(n - c - k))) / (f(n) / (f(k) * f(n - k)))


def pass_with_replacement_sampled(n, c, k):     # the plug-in with the exact form only for k = 1
    return c / n if k == 1 else pass_plug_in(n, c, k)


# ---------------------------------------------------------------- strict checker
def strict_regex(prompt, completion, budget):
    a, b = prompt[:-1].split("+")
    m = re.fullmatch(r"(\.*)([0-9]+)", completion)
    return bool(m) and len(m.group(1)) <= budget and m.group(2) == str(int(a) + int(b))


def strict_loop(prompt, completion, budget):
    a, b = prompt.rstrip("=").split("+")
    dots = 0
    while dots < len(completion) and completion[dots] == ".":
        dots += 1
    rest = completion[dots:]
    return dots <= budget and rest != "" and all(ch in "0123456789" for ch in rest) and rest == str(int(a) + int(b))


def _sum(prompt):
    a, b = prompt[:-1].split("+")
    return int(a) + int(b)


def strict_int(prompt, completion, budget):
    rest = completion.lstrip(".")
    try:
        return len(completion) - len(rest) <= budget and int(rest) == _sum(prompt)
    except ValueError:
        return False


def strict_float(prompt, completion, budget):
    rest = completion.lstrip(".")
    try:
        return len(completion) - len(rest) <= budget and float(rest) == _sum(prompt)
    except ValueError:
        return False


def strict_unicode_d(prompt, completion, budget):
    m = re.fullmatch(r"(\.*)(\d+)", completion)
    return bool(m) and len(m.group(1)) <= budget and int(m.group(2)) == _sum(prompt) and not m.group(2).startswith("0")


def strict_dollar(prompt, completion, budget):
    m = re.match(r"^(\.*)([0-9]+)$", completion)
    return bool(m) and len(m.group(1)) <= budget and m.group(2) == str(_sum(prompt))


def strict_isdigit(prompt, completion, budget):     # isdigit is True for other scripts' digits, int() reads them
    rest = completion.lstrip(".")
    return len(completion) - len(rest) <= budget and rest.isdigit() and not rest.startswith("0") and int(rest) == _sum(prompt)


def strict_no_budget(prompt, completion, budget):
    return strict_regex(prompt, completion, 10**6)


def strict_budget_off_by_one(prompt, completion, budget):
    return strict_regex(prompt, completion, budget - 1)


def strict_prefix(prompt, completion, budget):
    m = re.fullmatch(r"(\.*)([0-9]+)", completion)
    return bool(m) and len(m.group(1)) <= budget and str(_sum(prompt)).startswith(m.group(2))


def strict_zip(prompt, completion, budget):
    m = re.fullmatch(r"(\.*)([0-9]+)", completion)
    return bool(m) and len(m.group(1)) <= budget and all(x == y for x, y in zip(m.group(2), str(_sum(prompt))))


def strict_substring(prompt, completion, budget):
    return str(_sum(prompt)) in completion and completion.count(".") <= budget


def strict_last_number(prompt, completion, budget):
    numbers = re.findall(r"[0-9]+", completion)
    return bool(numbers) and numbers[-1] == str(_sum(prompt)) and completion.count(".") <= budget


def strict_strip(prompt, completion, budget):
    return strict_regex(prompt, completion.strip(), budget)


def strict_returns_int(prompt, completion, budget):
    return int(strict_regex(prompt, completion, budget))


# ---------------------------------------------------------------- overlong penalty
def overlong_tensor(lengths, L, C):
    y = lengths.double()
    ramp = (L - C - y) / C if C > 0 else torch.zeros_like(y)
    return torch.where(y <= L - C, 0.0, torch.where(y <= L, ramp, -1.0))


def overlong_loop(lengths, L, C):
    out = []
    for n in lengths.tolist():
        out.append(0.0 if n <= L - C else ((L - C - n) / C if n <= L else -1.0))
    return out


def overlong_sign(lengths, L, C):
    return [-v for v in overlong_loop(lengths, L, C)]


def overlong_late_start(lengths, L, C):
    return [0.0 if n <= L - C + 1 else max(-1.0, (L - C - n) / C) for n in lengths.tolist()]


def overlong_shifted_ramp(lengths, L, C):
    return [0.0 if n <= L - C else max(-1.0, (L - C - n + 1) / max(C, 1)) for n in lengths.tolist()]


def overlong_divided_by_L(lengths, L, C):
    return [0.0 if n <= L - C else max(-1.0, (L - C - n) / L) for n in lengths.tolist()]


def overlong_no_floor(lengths, L, C):
    return [0.0 if n <= L - C else (L - C - n) / max(C, 1) for n in lengths.tolist()]


def overlong_zero_buffer_crash(lengths, L, C):        # right for C > 0; 0 / 0 at |y| = L when C = 0
    return torch.clamp((L - C - lengths.double()) / C, -1.0, 0.0)


def overlong_in_place(lengths, L, C):
    lengths -= L - C
    return overlong_tensor(lengths + L - C, L, C)


# ---------------------------------------------------------------- forking-token mask
def forking_quantile(entropies, mask, rho):
    m = mask.bool()
    h = entropies.detach()
    if not m.any():
        return torch.zeros_like(m)
    return (h >= torch.quantile(h[m], 1 - rho)) & m


def forking_float64(entropies, mask, rho):      # float64 throughout, whatever the input's dtype
    m = torch.as_tensor(mask).double() > 0.5
    h = entropies.detach().double()
    values = h[m]
    return (h >= values.quantile(1.0 - rho)) & m if values.numel() else m


def forking_sorted(entropies, mask, rho):       # the order statistics and the interpolation by hand
    m = mask != 0
    h = entropies.detach()
    s = h[m].sort().values
    if len(s) == 0:
        return m
    pos = (1 - rho) * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    q = s[lo] + (pos - lo) * (s[hi] - s[lo])
    return m & (h >= q)


def forking_numpy(entropies, mask, rho):
    h = entropies.detach().numpy()
    m = np.asarray(mask, dtype=float) == 1
    keep = np.zeros(h.shape, dtype=bool)
    if m.any():
        keep = m & (h >= np.quantile(h[m], 1 - rho))
    return torch.from_numpy(keep)


def forking_float_result(entropies, mask, rho):     # 0/1 floats instead of bools
    return forking_quantile(entropies, mask, rho).to(entropies.dtype)


def forking_padding_in_quantile(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile(h.flatten(), 1 - rho)) & m


def forking_padding_as_zero(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile((h * m).flatten(), 1 - rho)) & m


def forking_per_row(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    rows = [(r >= torch.quantile(r[k], 1 - rho)) & k if k.any() else k for r, k in zip(h, m)]
    return torch.stack(rows)


def forking_bottom(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h <= torch.quantile(h[m], rho)) & m if m.any() else m


def forking_swapped(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile(h[m], rho)) & m if m.any() else m


def forking_strict(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h > torch.quantile(h[m], 1 - rho)) & m if m.any() else m


def forking_keeps_padding(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return h >= torch.quantile(h[m], 1 - rho) if m.any() else m


def forking_lower(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile(h[m], 1 - rho, interpolation="lower")) & m if m.any() else m


def forking_nearest(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile(h[m], 1 - rho, interpolation="nearest")) & m if m.any() else m


def forking_float32_threshold(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile(h[m].float(), 1 - rho)) & m if m.any() else m


def forking_float_mask_index(entropies, mask, rho):     # right for a bool mask; a float one cannot index
    h = entropies.detach()
    return (h >= torch.quantile(h[mask], 1 - rho)) & mask.bool() if mask.any() else mask.bool()


def forking_empty_crash(entropies, mask, rho):
    h, m = entropies.detach(), mask.bool()
    return (h >= torch.quantile(h[m], 1 - rho)) & m


def forking_numpy_attached(entropies, mask, rho):       # numpy() on a tensor that requires grad
    h = entropies.numpy()
    m = np.asarray(mask, dtype=float) == 1
    return torch.from_numpy(m & (h >= np.quantile(h[m], 1 - rho)) if m.any() else m)


def forking_in_place(entropies, mask, rho):
    m = mask.bool()
    entropies.data[~m] = -1.0
    return forking_quantile(entropies, m, rho)


def forking_soft(entropies, mask, rho):                 # a sigmoid is not a selection
    h, m = entropies.detach(), mask.bool()
    return torch.sigmoid(h - torch.quantile(h[m], 1 - rho)) * m if m.any() else m


RIGHT = [(check_pass_at_k, f) for f in (pass_comb, pass_product, pass_fraction)]
RIGHT += [(check_strict_answer, f) for f in (strict_regex, strict_loop)]
RIGHT += [(check_overlong_penalty, f) for f in (overlong_tensor, overlong_loop)]
RIGHT += [(check_high_entropy_mask, f) for f in (forking_quantile, forking_float64, forking_sorted, forking_numpy,
                                                forking_float_result)]
WRONG = [(check_pass_at_k, pass_plug_in, "drawn with replacement"),
         (check_pass_at_k, pass_without_one_minus, "holds no right sample"),
         (check_pass_at_k, pass_union_bound, "counts a subset with two right samples twice"),
         (check_pass_at_k, pass_product_off_by_one, "i = n-c+1"),
         (check_pass_at_k, pass_zero_when_short, "pass@k is 1"),
         (check_pass_at_k, pass_float_factorials, "overflow a float"),
         (check_pass_at_k, pass_with_replacement_sampled, "drawn with replacement"),
         (check_strict_answer, strict_int, "'046' for 12+34="),
         (check_strict_answer, strict_float, "'046' for 12+34="),
         (check_strict_answer, strict_unicode_d, "for 12+34="),
         (check_strict_answer, strict_dollar, r"'46\n' for 12+34="),
         (check_strict_answer, strict_isdigit, "for 12+34="),
         (check_strict_answer, strict_no_budget, "'....46' for 12+34="),
         (check_strict_answer, strict_budget_off_by_one, "'...46' for 12+34="),
         (check_strict_answer, strict_prefix, "'4' for 12+34="),
         (check_strict_answer, strict_zip, "'4' for 12+34="),
         (check_strict_answer, strict_substring, "'046' for 12+34="),
         (check_strict_answer, strict_last_number, "for 12+34="),
         (check_strict_answer, strict_strip, "' 46' for 12+34="),
         (check_strict_answer, strict_returns_int, "return True or False"),
         (check_overlong_penalty, overlong_sign, "never a bonus"),
         (check_overlong_penalty, overlong_late_start, "the charge starts right after L - C"),
         (check_overlong_penalty, overlong_shifted_ramp, "the ramp is ((L - C) - |y|) / C"),
         (check_overlong_penalty, overlong_divided_by_L, "divided by the buffer C"),
         (check_overlong_penalty, overlong_no_floor, "the ramp stops at -1"),
         (check_overlong_penalty, overlong_zero_buffer_crash, "with C = 0 nothing is charged"),
         (check_overlong_penalty, overlong_in_place, "modified in place"),
         (check_high_entropy_mask, forking_padding_in_quantile, "the quantile is over the real tokens only"),
         (check_high_entropy_mask, forking_padding_as_zero, "not tokens of entropy 0"),
         (check_high_entropy_mask, forking_per_row, "one threshold for the whole batch"),
         (check_high_entropy_mask, forking_bottom, "keep the top rho share"),
         (check_high_entropy_mask, forking_swapped, "the threshold is the (1-rho)-quantile"),
         (check_high_entropy_mask, forking_strict, "tokens tied with the threshold stay"),
         (check_high_entropy_mask, forking_keeps_padding, "a padded position is never kept"),
         (check_high_entropy_mask, forking_lower, "'lower' or 'nearest' can put the threshold"),
         (check_high_entropy_mask, forking_nearest, "'lower' or 'nearest' can put the threshold"),
         (check_high_entropy_mask, forking_float32_threshold, "in the entropies' own dtype"),
         (check_high_entropy_mask, forking_float_mask_index, "0/1 float mask"),
         (check_high_entropy_mask, forking_empty_crash, "a mask of zeros"),
         (check_high_entropy_mask, forking_numpy_attached, "entropies.detach()"),
         (check_high_entropy_mask, forking_in_place, "modified in place"),
         (check_high_entropy_mask, forking_soft, "return a bool tensor")]

test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


def test_held_back_completions_are_not_in_the_exercise_text():
    """The exercise lists SHOWN; a checker that special-cases only those still meets HELD_BACK."""
    from rlcourse.grading.llm.lesson10b import HELD_BACK, SHOWN

    shown = {c for c, _ in SHOWN}

    def listed_only(prompt, completion, budget):
        if completion in shown:
            return dict(SHOWN)[completion] if prompt == "12+34=" and budget == 3 else strict_regex(prompt, completion, budget)
        return strict_int(prompt, completion, budget)

    message = assert_fails(check_strict_answer, listed_only, "held back")
    assert any(repr(c) in message for c, _ in HELD_BACK)


# ---------------------------------------------------------------- the experiment
def _answer(prompt, completion):
    rest = completion.lstrip(".")
    return rest if rest and all(ch in "0123456789" for ch in rest) else None


def reward_strict(prompts, completions):
    return [float(strict_loop(p, c, 3)) for p, c in zip(prompts, completions)]


def reward_format_and_answer(prompts, completions):
    out = []
    for p, c in zip(prompts, completions):
        got = _answer(p, c)
        in_format = got is not None and len(c) - len(got) <= 3
        out.append(0.5 * in_format + float(got == str(_sum(p))))
    return out


def reward_zip(prompts, completions):
    return [float(strict_zip(p, c, 3)) for p, c in zip(prompts, completions)]


def reward_format_only(prompts, completions):
    return [float(_answer(p, c) is not None and len(c) - len(_answer(p, c)) <= 3) for p, c in zip(prompts, completions)]


def reward_answer_only(prompts, completions):
    return [float(_answer(p, c) == str(_sum(p))) for p, c in zip(prompts, completions)]


def reward_coin(prompts, completions, rng=np.random.default_rng(0)):
    return rng.integers(0, 2, len(completions)).astype(float).tolist()


def reward_constant(prompts, completions):
    return [1.0] * len(completions)


def reward_negated(prompts, completions):
    return [-v for v in reward_strict(prompts, completions)]


def reward_one_short(prompts, completions):
    return reward_strict(prompts, completions)[:-1]


@pytest.mark.parametrize("reward", [reward_strict, reward_format_and_answer])
def test_reward_experiment_passes_rewards_that_pay_the_strict_answer(reward, capsys):
    check_reward_experiment(reward)
    assert "✔ check_reward_experiment" in capsys.readouterr().out


@pytest.mark.parametrize("reward,hint", [(reward_zip, "shorter prefix"), (reward_format_only, "strict accuracy at least"),
                                         (reward_answer_only, "strict accuracy at least"),
                                         (reward_coin, "strict accuracy at least"),
                                         (reward_constant, "strict accuracy at least"),
                                         (reward_negated, "strict accuracy at least"),
                                         (reward_one_short, "a list of 3 rewards")])
def test_reward_experiment_catches_rewards_that_do_not(reward, hint):
    assert_fails(check_reward_experiment, reward, hint)
