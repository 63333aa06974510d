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
  that pays the format or the sum alone, does not);
* :func:`check_high_entropy_mask` - the forking-token mask of ``top_entropy_quantile`` (mistakes caught:
  padding in the quantile, as itself or as zeros, a quantile per row, the bottom share, rho and 1 - rho
  swapped, ``>`` dropping ties, padding kept, ``lower`` or ``nearest`` interpolation, a float32
  threshold for float64 entropies, a crash on a 0/1 float mask, an empty mask or entropies that
  require grad).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references, to_numpy
from rlcourse.grading._routes import STRICT_FILLER_REWARD

__all__ = ["check_pass_at_k", "check_strict_answer", "check_overlong_penalty", "check_reward_experiment",
           "check_high_entropy_mask"]


def _subsets_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c right) holding a right one, by enumeration."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@references("rlcourse.measure.coverage:pass_at_k", "rlcourse.measure.coverage:coverage", "rlcourse.measure.rlvr_runs:pass_at_k_curve")
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
    from rlcourse.tasks.arithmetic import FillerAdditionTask

    return FillerAdditionTask(max_filler=max(budget, 12), budget=budget).is_right(prompt, completion)


@references(*STRICT_FILLER_REWARD)
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


@references("rlcourse.losses.rlvr:overlong_penalty", "rlcourse.trainers.policy_gradient:overlong_shaped")
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


REWARD_EXPERIMENT = {"seeds": [0, 1, 2, 3], "steps": 60, "learning_rate": 1.5e-4, "held_out": 64, "samples": 8, "margin": 0.04}


@references(*STRICT_FILLER_REWARD)
def check_reward_experiment(fn) -> None:
    """``fn(prompts, completions) -> list[float]``: a reward for ``FillerAdditionTask``. GRPO trains
    ``filler-addition`` on it (seeds 0 to 3, 60 steps, lesson 10b's settings); the strict accuracy of
    its samples on 64 held-out prompts must end at least 4 points above the start's, on average."""
    __tracebackhide__ = True
    from rlcourse.tasks import FillerAdditionTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.measure.rlvr_runs import draw
    from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer
    from rlcourse.tasks.verifiers import FillerVerifiers, RewardedTask

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


def _forking_cases():
    """``(case, entropies, mask, rho)``; the check gives each mask as bools and again as 0/1 floats."""
    gen = torch.Generator().manual_seed(2506)
    out = []
    # rows of different entropy scales: one threshold for the batch is not one per row
    h = torch.rand(3, 10, generator=gen, dtype=torch.float64) * torch.tensor([[0.05], [1.0], [4.0]], dtype=torch.float64)
    m = torch.ones(3, 10, dtype=torch.bool)
    for rho in (0.2, 0.5):
        out.append((f"3 rows of 10 tokens, of entropy scales 0.05, 1 and 4, rho={rho}", h, m, rho))
    # ragged completions whose padding holds large entropies
    ragged = torch.rand(4, 8, generator=gen, dtype=torch.float64) * 2
    ragged_mask = torch.arange(8) < torch.tensor([[8], [5], [3], [6]])
    ragged = torch.where(ragged_mask, ragged, torch.full_like(ragged, 9.0))
    ragged_case = "4 ragged rows (lengths 8, 5, 3, 6; the padding holds entropy 9), rho={}"
    for rho in (0.2, 0.5):
        out.append((ragged_case.format(rho), ragged, ragged_mask, rho))
    # one prompt's completions: their first token has one entropy for the whole group, and other
    # values repeat too (0.3 and 0.1 are not float32 numbers)
    values = torch.tensor([0.3, 0.1, 0.7, 1.1, 0.3, 1.1, 0.1, 0.7], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        h = values[torch.randint(0, 8, (6, 5), generator=gen)]
        h[:, 0] = 0.3
        m = torch.arange(5) < torch.tensor([[5], [5], [4], [5], [3], [5]])
        for rho in (0.5, 0.2, 1.0):
            out.append((f"6 completions of one prompt in {str(dtype)[6:]}, entropies repeated (ties), rho={rho}",
                        h.to(dtype), m, rho))
    for rho in (0.0, 1.0):
        out.append((ragged_case.format(rho), ragged, ragged_mask, rho))
    return out


def _forking_mistakes(h: torch.Tensor, m: torch.Tensor, rho: float):
    """What each known mistake keeps on ``(h, m, rho)``, with the hint that names it."""
    real = h[m]

    def keep(threshold, above=True):
        return ((h >= threshold) if above else (h <= threshold)) & m

    q = torch.quantile(real, 1 - rho)
    per_row = torch.stack([torch.quantile(row[k], 1 - rho) if k.any() else row.max() for row, k in zip(h, m)])
    return [
        (keep(torch.quantile(h.flatten(), 1 - rho)),
         "the quantile is over the real tokens only: padded positions are not completion tokens, and the entropy "
         "they hold must not move the threshold"),
        (keep(torch.quantile((h * m).flatten(), 1 - rho)),
         "padded positions are not tokens of entropy 0: take the quantile over the real tokens only"),
        (keep(per_row[:, None]),
         "one threshold for the whole batch, the (1-rho)-quantile of all its real tokens (as TRL): a quantile per "
         "row keeps rho of every completion instead of the batch's most uncertain tokens"),
        (keep(torch.quantile(real, rho), above=False),
         "keep the top rho share, H_t >= the (1-rho)-quantile: the high-entropy tokens are the forking ones"),
        (keep(torch.quantile(real, rho)),
         "rho is the share kept, so the threshold is the (1-rho)-quantile: rho=0.2 keeps the top 20%"),
        # a float32 threshold for float64 entropies drops the ties that round up, as ``>`` does: the
        # cases show ``>`` first where the float32 threshold is right, so each is named by its own hint
        (keep(torch.quantile(real.float(), 1 - rho)),
         "compute the threshold in the entropies' own dtype: a float32 threshold compared with float64 entropies "
         "is rounded, and the tokens tied with it are lost"),
        ((h > q) & m,
         "keep H_t >= q: tokens tied with the threshold stay (rho=1 keeps every token, rho=0 the highest; the first "
         "token of a prompt's completions shares one entropy, so ties are common)"),
        (h >= q,
         "a padded position is never kept: AND the result with the mask"),
    ] + [(keep(torch.quantile(real, 1 - rho, interpolation=how)),
          "interpolate linearly between the two order statistics around position (1-rho)(n-1), torch.quantile's "
          "default (as TRL): 'lower' or 'nearest' can put the threshold one token too low") for how in ("lower", "nearest")]


def _as_keep(name: str, case: str, expected: torch.Tensor, got) -> np.ndarray:
    """The learner's answer as a bool array of ``expected``'s shape, or a failure saying what it is."""
    __tracebackhide__ = True
    if got is None:
        fail(name, case, expected, got, "the function returned None: did you forget `return`?")
    if isinstance(got, torch.Tensor) and got.requires_grad:
        fail(name, case, "a bool tensor", "a tensor that requires grad",
             "the mask selects tokens, it is not differentiated: compare values, return a bool tensor")
    try:
        array = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    except (TypeError, ValueError, RuntimeError):
        fail(name, case, expected, f"{type(got).__name__} {got!r:.80}", "return a bool tensor of the entropies' shape")
    if array.shape != tuple(expected.shape):
        fail(name, case, f"shape {tuple(expected.shape)}", f"shape {array.shape}",
             "one flag per position: a bool tensor of the entropies' shape (B, T)")
    if array.dtype != np.bool_:
        if array.dtype.kind not in "biuf" or not np.isin(array, (0, 1)).all():
            fail(name, case, expected, got, "return a bool tensor: True where the token stays in the loss")
        array = array.astype(bool)
    return array


@references("rlcourse.losses.rlvr:high_entropy_mask", "rlcourse.trainers.policy_gradient:_entropy_terms")
def check_high_entropy_mask(fn) -> None:
    """``fn(entropies, mask, top_entropy_quantile) -> bool (B, T)``: the tokens whose entropy is at least the
    ``(1 - rho)``-quantile (linear interpolation) of the real tokens' entropies, padded positions never."""
    __tracebackhide__ = True
    from rlcourse.losses.rlvr import high_entropy_mask

    name = "check_high_entropy_mask"
    n = 0
    for case, h, m, rho in _forking_cases():
        expected = high_entropy_mask(h, m, rho)
        for mask, how in ((m, "bool mask"), (m.to(h.dtype), "0/1 float mask")):
            where = f"{case}, {how}"
            try:
                got = call_unmutated(name, where, fn, h, mask, rho)
            except NotImplementedError:
                raise
            except (IndexError, RuntimeError, TypeError) as error:
                if how == "bool mask":
                    raise
                fail(name, where, expected, f"{type(error).__name__}: {error}",
                     "the mask may hold 0/1 as numbers as well as bools: turn it into bools (mask.bool()) first")
            keep = _as_keep(name, where, expected, got)
            if how == "bool mask":
                for mistake, hint in _forking_mistakes(h, m, rho):
                    fail_if_mistake(name, where, expected, keep, mistake, hint)
            assert_close(name, where, expected, keep, atol=0,
                         hint="keep_t = m_t and H_t >= q, q the (1-rho)-quantile of the real tokens' entropies")
            n += 1
    where = "a mask of zeros (no real token), rho=0.2"
    h, m = torch.rand(2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64), torch.zeros(2, 4, dtype=torch.bool)
    try:
        got = call_unmutated(name, where, fn, h, m, 0.2)
    except NotImplementedError:
        raise
    except (IndexError, RuntimeError, ValueError) as error:
        fail(name, where, "all False", f"{type(error).__name__}: {error}",
             "with no real token there is no quantile to take, and nothing to keep: return all False")
    assert_close(name, where, torch.zeros(2, 4, dtype=torch.bool), _as_keep(name, where, m, got), atol=0,
                 hint="with no real token there is nothing to keep: return all False")
    n += 1
    where = "entropies computed from logits that require grad, as in a trainer, rho=0.2"
    logits = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(logits, dim=-1)
    h = -(logp.exp() * logp).sum(-1)
    m = torch.arange(6) < torch.tensor([[6], [4], [5]])
    expected = high_entropy_mask(h, m, 0.2)
    try:
        got = call_unmutated(name, where, fn, h, m, 0.2)
    except NotImplementedError:
        raise
    except RuntimeError as error:
        fail(name, where, expected, f"RuntimeError: {error}",
             "a trainer's entropies hang off the policy's graph; the mask is not differentiated: work on "
             "entropies.detach()")
    assert_close(name, where, expected, _as_keep(name, where, expected, got), atol=0,
                 hint="keep_t = m_t and H_t >= q, q the (1-rho)-quantile of the real tokens' entropies")
    passed(name, n + 1)
