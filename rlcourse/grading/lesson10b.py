"""Checks for lesson 10b (verifiable rewards in practice).

* :func:`check_pass_at_k` - Chen et al.'s unbiased pass@k from n samples with c right, against exact
  enumeration of every k-subset (mistakes caught: the plug-in ``1 - (1 - c/n)^k``, the binomial
  ratio without ``1 -``, a union bound, an off-by-one in the product form, 0 where every k-subset holds
  a right sample, factorials in floating point that overflow for n in the hundreds);
* :func:`check_strict_answer` - a checker of ``..46`` answers that must reject adversarial
  completions, some of them held back from the exercise's text (mistakes caught: ``int()`` or
  ``float()`` on the answer, ``\\d`` or ``str.isdigit`` instead of ASCII digits, ``$`` before a
  final newline, a budget off by one or ignored, a prefix, a substring or the last number accepted);
* :func:`check_overlong_penalty` - DAPO's soft overlong punishment (mistakes caught: the sign, the
  ramp's ends off by one, dividing by ``max_completion_length``, no floor of -1 past the limit, a
  division by zero for a buffer of 0);
* :func:`check_reward_experiment` - an experiment: GRPO trained on the learner's reward must raise the
  strict accuracy of ``filler-addition`` on held-out prompts (a reward the policy can fool, or one
  that pays the format or the sum alone, does not).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references, to_numpy

__all__ = ["check_pass_at_k", "check_strict_answer", "check_overlong_penalty", "check_reward_experiment"]


def _subsets_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c right) holding a right one, by enumeration."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@references("rlcourse.lm.coverage:pass_at_k")
def check_pass_at_k(fn) -> None:
    """``fn(n, c, k) -> float``: the probability that k samples drawn without replacement from n, of which c
    are right, hold at least one right one, for every ``0 <= c <= n`` and ``1 <= k <= n``."""
    __tracebackhide__ = True
    name = "check_pass_at_k"
    # c = 0 and n - c < k last: there several mistakes give the same wrong value, so each is named first
    # on a case that tells it apart
    cases = sorted(((n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)),
                   key=lambda t: (t[1] == 0, t[0] - t[1] < t[2], t))
    n_cases = 0
    for n, c, k in cases:
        case = f"n={n}, c={c}, k={k} (every {k}-subset of {n} samples enumerated)"
        got = fn(n, c, k)
        expected = _subsets_pass_at_k(n, c, k)
        p = c / n
        if n - c < k:
            fail_if_mistake(name, case, expected, got, 0.0,
                            "when n - c < k every k-subset holds a right sample: pass@k is 1")
        fail_if_mistake(name, case, expected, got, 1 - (1 - p) ** k,
                        "1 - (1 - c/n)^k treats the n samples as if drawn with replacement: it is biased low; "
                        "count the k-subsets without a right sample instead")
        fail_if_mistake(name, case, expected, got, math.comb(n - c, k) / math.comb(n, k),
                        "C(n-c, k) / C(n, k) is the chance that a k-subset holds no right sample")
        fail_if_mistake(name, case, expected, got, min(1.0, k * c / n),
                        "k c / n counts a subset with two right samples twice")
        fail_if_mistake(name, case, expected, got, 1 - float(np.prod([1 - k / i for i in range(n - c, n + 1) if i > 0])),
                        "the product form runs over i = n-c+1, ..., n")
        assert_close(name, case, expected, got, atol=1e-9, hint="1 - C(n-c, k) / C(n, k)")
        n_cases += 1
    for n, c, k in [(200, 3, 100), (500, 1, 250), (1000, 990, 5)]:
        case = f"n={n}, c={c}, k={k} (large n: C(n, k) has hundreds of digits)"
        try:
            got = fn(n, c, k)
        except OverflowError as error:
            fail(name, case, f"{1 - math.comb(n - c, k) / math.comb(n, k):.6g}", f"OverflowError: {error}",
                 "factorials of hundreds overflow a float: use math.comb (exact integers) or the product form")
        assert_close(name, case, 1 - math.comb(n - c, k) / math.comb(n, k), got, atol=1e-9,
                     hint="exact integer binomials (math.comb) or the product 1 - prod_i (1 - k / i)")
        n_cases += 1
    passed(name, n_cases)


# Completions of "12+34=" (sum 46) under budget 3, with the right verdict. The exercise's text lists
# the first group; the second is held back: a checker must be strict by construction, not by list.
SHOWN = [("46", True), ("...46", True), ("....46", False), ("4", False), ("47", False)]
HELD_BACK = [("046", False), (" 46", False), ("46\n", False), ("467", False), ("\u0664\u0666", False), ("..4.6", False),
             ("+46", False), ("4_6", False), ("46 ", False), ("46.0", False), ("\uff14\uff16", False),
             ("\u2074\u2076", False), (".46.", False), ("", False), ("...", False), ("0046", False),
             ("\t46", False), ("46\r", False), ("x46", False), ("46+0", False), ("..4", False), ("-46", False),
             ("4\u0666", False), ("\u00a046", False), ("0x2e", False), ("1e1", False)]


def _reference(prompt: str, completion: str, budget: int) -> bool:
    from rlcourse.lm.tasks import FillerAdditionTask

    return FillerAdditionTask(max_filler=max(budget, 12), budget=budget).is_right(prompt, completion)


@references("rlcourse.lm.tasks:FillerAdditionTask.is_right", "rlcourse.lm.verifiers:FillerVerifiers.is_right",
            "rlcourse.lm.verifiers:extract_answer")
def check_strict_answer(fn) -> None:
    """``fn(prompt, completion, budget) -> bool``: True exactly when the completion is at most ``budget``
    dots and then the decimal sum of the prompt's two numbers, in ASCII digits without leading zeros, and
    nothing else."""
    __tracebackhide__ = True
    name = "check_strict_answer"
    gen = np.random.default_rng(1010)
    cases = [("12+34=", c, 3, f"{c!r} for 12+34= (budget 3)" + (", held back" if held else ""))
             for held, group in ((False, SHOWN), (True, HELD_BACK)) for c, _ in group]
    for budget in (0, 1, 3, 5):
        for _ in range(12):
            a, b = (int(x) for x in gen.integers(0, 100, size=2))
            answer, dots = str(a + b), int(gen.integers(0, budget + 3))
            wrong = str(a + b + int(gen.choice([-10, -1, 1, 9, 100])))
            for completion in ("." * dots + answer, "." * dots + wrong.lstrip("-")):
                cases.append((f"{a}+{b}=", completion, budget, f"{completion!r} for {a}+{b}= (budget {budget})"))
    cases += [("0+0=", "0", 3, "'0' for 0+0= (the sum 0 is one zero)"), ("0+0=", "00", 3, "'00' for 0+0="),
              ("99+1=", ".100", 1, "'.100' for 99+1= (budget 1)"), ("7+5=", "12", 0, "'12' for 7+5= (budget 0)"),
              ("7+5=", ".12", 0, "'.12' for 7+5= (budget 0)")]
    for prompt, completion, budget, case in cases:
        expected = _reference(prompt, completion, budget)
        try:
            got = fn(prompt, completion, budget)
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001  (a checker must not crash on a malformed answer)
            fail(name, case, expected, f"{type(error).__name__}: {error}",
                 "a checker meets every kind of text: return False for anything that is not dots then digits")
        if not isinstance(got, (bool, np.bool_)):
            fail(name, case, expected, f"{type(got).__name__} {got!r:.40}", "return True or False")
        if bool(got) != expected:
            hint = ("this completion is right: at most budget dots, then exactly the sum" if expected else
                    "this completion is not the sum in ASCII digits after at most budget dots: parse by characters "
                    "('.' then '0'-'9'), compare strings, and allow nothing before, between or after")
            fail(name, case, expected, bool(got), hint)
    passed(name, len(cases))


@references("rlcourse.losses.rlvr:overlong_penalty")
def check_overlong_penalty(fn) -> None:
    """``fn(lengths, max_completion_length, overlong_buffer_len) -> (B,)``: DAPO's soft overlong punishment
    of each length (a 1-D integer tensor), 0 up to ``L - C``, falling linearly to -1 at ``L``, -1 beyond."""
    __tracebackhide__ = True
    from rlcourse.losses.rlvr import overlong_penalty

    name = "check_overlong_penalty"
    n = 0
    for L, C in [(20, 5), (8, 8), (10, 1), (6, 0), (12, 4)]:
        lengths = torch.arange(0, L + 4)
        case = f"lengths 0..{L + 3}, max_completion_length={L}, overlong_buffer_len={C}"
        try:
            got = call_unmutated(name, case, fn, lengths, L, C)
        except ZeroDivisionError:
            fail(name, case, overlong_penalty(lengths, L, C), "ZeroDivisionError",
                 "with a buffer of 0 nothing is charged up to the limit and -1 beyond it")
        expected = overlong_penalty(lengths, L, C)
        try:
            finite = bool(np.isfinite(np.asarray(to_numpy(got))).all())
        except (TypeError, ValueError):
            finite = True                       # assert_close says what was wrong with the type
        if not finite:
            fail(name, case, expected, got, "a division by the buffer C: with C = 0 nothing is charged up to the limit "
                 "and -1 beyond it")
        y = lengths.double()
        start = L - C
        ramp = (start - y) / max(C, 1)
        mistakes = [(-expected, "a penalty: 0 or negative, never a bonus"),
                     (torch.where(y <= start + 1, 0.0, ramp).clamp(min=-1.0) if C > 1 else None,
                      "the charge starts right after L - C: |y| = L - C + 1 pays -1/C"),
                     (torch.where(y <= start, 0.0, (start - y + 1) / max(C, 1)).clamp(min=-1.0), "the ramp is ((L - C) - |y|) / C"),
                     (torch.where(y <= start, 0.0, (start - y) / L).clamp(min=-1.0), "the ramp is divided by the buffer C"),
                     (torch.where(y <= start, 0.0, ramp), "-1 past the limit: the ramp stops at -1"),
                     (torch.where(y <= start, 0.0, torch.where(y < L, ramp, -1.0)), "at |y| = L the ramp gives exactly -1")]
        for value, hint in mistakes:
            if value is not None:
                fail_if_mistake(name, case, expected, got, value, hint)
        assert_close(name, case, expected, got, atol=1e-6, hint="0 if |y| <= L - C; ((L - C) - |y|) / C up to L; -1 beyond")
        n += 1
    passed(name, n)


REWARD_EXPERIMENT = {"seeds": [0, 1], "steps": 60, "learning_rate": 1.5e-4, "held_out": 64, "samples": 8, "margin": 0.04}


def check_reward_experiment(fn) -> None:
    """``fn(prompts, completions) -> list[float]``: a reward for ``FillerAdditionTask``. GRPO trains
    ``filler-addition`` on it (seeds 0 and 1, 60 steps, lesson 10b's settings); the strict accuracy of
    its samples on 64 held-out prompts must end at least 4 points above the start's, on average."""
    __tracebackhide__ = True
    from rlcourse.lm import FillerAdditionTask, load_checkpoint
    from rlcourse.lm.policy_gradient import PolicyGradientConfig
    from rlcourse.lm.rlvr_runs import draw
    from rlcourse.lm.seed_batched import SeedBatchedPolicyGradientTrainer
    from rlcourse.lm.verifiers import FillerVerifiers, RewardedTask

    name = "check_reward_experiment"
    e = REWARD_EXPERIMENT
    task = FillerAdditionTask()
    strict = FillerVerifiers(task)
    probe = fn(["12+34=", "12+34=", "5+5="], ["46", "..47", "....10"])    # an unfinished exercise stops here
    if probe is None or len(probe) != 3:
        fail(name, "three completions", "a list of 3 rewards", probe, "return one number per completion")
    start, tokenizer = load_checkpoint("filler-addition", device="cpu")
    held_out = task.test_prompts(e["held_out"])

    def strict_accuracy(model):
        sampled = draw(model, tokenizer, held_out, e["samples"], 16, seed=2)
        return sampled.judge(strict.is_right).mean((1, 2)), sampled

    before, _ = strict_accuracy(start)
    config = PolicyGradientConfig(learning_rate=e["learning_rate"], per_device_train_batch_size=64, num_generations=8,
                                  max_completion_length=16, max_steps=e["steps"])
    try:
        trainer = SeedBatchedPolicyGradientTrainer(start, tokenizer, RewardedTask(task, [fn]), config, seeds=e["seeds"])
        trainer.train(progress=False)
    except ValueError as error:
        fail(name, "training on your reward", "one finite reward per completion", str(error),
             "return a list of floats, one per completion, for every batch")
    after, sampled = strict_accuracy(trainer.model)
    gain = float(after.mean() - before[0])
    if not gain >= e["margin"]:
        answers = [task.split(c)[1] for seed in sampled.completions for row in seed for c in row]
        targets = [task.answer(p) for p in held_out for _ in range(e["samples"])] * len(e["seeds"])
        prefixes = np.mean([0 < len(a) < len(t) and t.startswith(a) for a, t in zip(answers, targets)])
        fmt = np.mean(strict.format_reward([p for p in held_out for _ in range(e["samples"])] * len(e["seeds"]),
                                           [c for seed in sampled.completions for row in seed for c in row]))
        fail(name, f"GRPO on your reward, seeds {e['seeds']}, {e['steps']} steps, {e['held_out']} held-out prompts x "
             f"{e['samples']} samples", f"strict accuracy at least {before[0] + e['margin']:.3f} (start {before[0]:.3f} "
             f"+ {e['margin']})", f"{after.mean():.3f} (per seed {', '.join(f'{a:.3f}' for a in after)}); "
             f"{fmt:.0%} of the samples in format, {prefixes:.0%} a shorter prefix of the sum",
             "the policy learns what the reward pays: pay only a right sum after at most 3 dots, judged strictly")
    print(f"✔ {name}: GRPO on your reward raised held-out strict accuracy from {before[0]:.3f} to {after.mean():.3f} "
          f"(per seed {', '.join(f'{a:.3f}' for a in after)}; needed +{e['margin']:.2f})")
