"""Verifiers for answers with a format: reward functions, their weighted sum, and one that can be hacked.

The task is :class:`~rlcourse.tasks.arithmetic.FillerAdditionTask`: ``"12+34="`` answered with "reasoning"
dots, then the number, ``"..46"``. A completion has a *format* (at most ``budget`` dots, then
digits, nothing else) and an *answer* (the digits after the dots). Reward functions follow TRL's
convention, ``f(prompts, completions, **kwargs) -> list[float]``, one reward per completion (so
each can be handed to TRL's ``GRPOTrainer(reward_funcs=...)`` as it is):

* :meth:`FillerVerifiers.format_reward`   1 if the completion is ``\\.{0,budget}[0-9]+``;
* :meth:`FillerVerifiers.answer_reward`   1 if :func:`extract_answer` finds exactly the sum;
* :meth:`FillerVerifiers.digit_credit_reward`   a graded answer reward: the share of the sum's digit
  places the answer gets right (aligned at the units digit, over the longer of the two);
* :meth:`FillerVerifiers.thinking_cost`   minus the number of thinking dots: a reward on another scale
  than 0/1, for weighing several objectives (lesson 10b, GDPO);
* :meth:`FillerVerifiers.lenient_answer_reward`  a verifier with a false positive: it compares the
  answer with the sum digit by digit through ``zip``, which stops at the shorter of the two, so
  ``"1"`` passes for ``"12+99="`` (sum ``111``), and so does ``"1115"``;
* :class:`RandomReward`   a coin flip, independent of the completion (a control).

:class:`RewardedTask` is a task whose reward is ``sum_i w_i f_i`` (TRL's ``reward_funcs`` and
``reward_weights``); :func:`combine_rewards` computes it and refuses a reward function that
returns None, NaN, +-inf or the wrong number of rewards, naming the function and the completion.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch

from rlcourse.tasks._checks import check_pairs

__all__ = ["extract_answer", "FillerVerifiers", "RandomReward", "RewardedTask", "combine_rewards"]

# [0-9], not \d (which also matches other scripts' digits), and fullmatch, not ^...$ ($ also matches
# before a final newline).
_ANSWER = re.compile(r"\.*([0-9]+)")


def extract_answer(completion: str) -> str | None:
    """The digits after the leading dots when the completion is exactly dots then ASCII digits, else None.

    ``"..46" -> "46"``, ``"46" -> "46"``, ``"..046" -> "046"``, ``"..4.6" -> None``, ``"..46+" -> None``,
    ``"46\n" -> None``, ``"..." -> None``. Strict: nothing but dots may come before the number and
    nothing at all after it.
    """
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a string, got {type(completion).__name__}")
    m = _ANSWER.fullmatch(completion)
    return m.group(1) if m else None


class FillerVerifiers:
    """The reward functions of a :class:`~rlcourse.tasks.arithmetic.FillerAdditionTask` (see the module docstring).

    ``is_right`` is the strict judge of the lessons: right format *and* right answer, which is the
    task's own ``is_right``.
    """

    def __init__(self, task):
        if not all(hasattr(task, name) for name in ("budget", "answer", "is_right")):
            raise ValueError(f"task must be a FillerAdditionTask (with budget, answer and is_right), got {task!r}")
        self.task = task

    def format_reward(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        """1 if the completion is at most ``budget`` dots then ASCII digits (any digits), else 0."""
        check_pairs(prompts, completions)
        return [float(extract_answer(c) is not None and self.task.split(c)[0] <= self.task.budget) for c in completions]

    def answer_reward(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        """1 if the extracted answer is exactly the sum, however many dots came before, else 0."""
        check_pairs(prompts, completions)
        return [float(extract_answer(c) == self.task.answer(p)) for p, c in zip(prompts, completions)]

    def digit_credit_reward(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        """Partial credit in ``[0, 1]``: the share of digit places right, however many dots came before.

        The answer (:func:`extract_answer`; 0 when there is none) and the sum are aligned at the units
        digit, place by place, and the places that agree are divided by the longer length
        (:meth:`~rlcourse.tasks.arithmetic.AdditionTask.partial_credit`): for the sum ``165``, ``"165"``
        scores 1, ``"155"`` 2/3, ``"65"`` 2/3 (the hundreds place is missing), ``"1650"`` 0 (every digit
        shifted one place), ``"0165"`` 3/4. A missing or extra digit costs its place, so a length
        mismatch never scores 1.
        """
        check_pairs(prompts, completions)
        out = []
        for p, c in zip(prompts, completions):
            got = extract_answer(c)
            out.append(0.0 if got is None else float(self.task.partial_credit(self.task.answer(p), got)))
        return out

    def thinking_cost(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        """Minus the number of leading dots, one point per dot of thinking: ``"..46" -> -2``, ``"46" -> 0``."""
        check_pairs(prompts, completions)
        return [float(-self.task.split(c)[0]) for c in completions]

    def lenient_answer_reward(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        """The buggy verifier: the answer compared digit by digit with ``zip``, which stops at the shorter string.

        ``all(a == b for a, b in zip(answer, target))`` accepts every answer that is a prefix of the
        sum (``"4"`` for 46) or has the sum as a prefix (``"467"``): a false positive of the kind a
        hand-written comparison loop makes. Answers are :func:`extract_answer`'s (strict format).
        """
        check_pairs(prompts, completions)
        out = []
        for p, c in zip(prompts, completions):
            got = extract_answer(c)
            out.append(float(got is not None and all(a == b for a, b in zip(got, self.task.answer(p)))))
        return out

    def is_right(self, prompts: list[str], completions: list[str]) -> list[bool]:
        """The strict judge: at most ``budget`` dots, then exactly the sum."""
        check_pairs(prompts, completions)
        return [bool(self.task.is_right(p, c)) for p, c in zip(prompts, completions)]


class RandomReward:
    """A reward drawn independently of the completion: 1 with probability ``p``, from its own generator.

    The control of the "spurious rewards" experiments: whatever a run trained on it gains is not
    the reward's doing (it is the sampler's, the format's, or noise).
    """

    __name__ = "random_reward"

    def __init__(self, p: float = 0.5, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p!r}")
        self.p, self.rng = p, np.random.default_rng(seed)

    def __call__(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        check_pairs(prompts, completions)
        return (self.rng.random(len(completions)) < self.p).astype(float).tolist()


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _checked_weights(reward_funcs, reward_weights) -> tuple[list, list[float]]:
    funcs = list(reward_funcs)
    if not funcs:
        raise ValueError("reward_funcs must hold at least one function")
    weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != len(funcs) or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights must hold one finite weight per reward function ({len(funcs)}), got "
                         f"{reward_weights!r}")
    names = [_name(fn) for fn in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:   # rewards are kept by name: the second would overwrite the first
        raise ValueError(f"reward_funcs must have distinct names (each function's rewards are kept and logged under "
                         f"its __name__), got {names}: {twice} more than once; set a distinct __name__ on each")
    return funcs, weights


def combine_rewards(reward_funcs, prompts: list[str], completions: list[str],
                    reward_weights=None) -> tuple[torch.Tensor, dict]:
    """``r_j = sum_i w_i f_i(x_j, y_j)``: TRL's ``reward_funcs`` weighted by ``reward_weights`` (default all 1).

    Returns the float32 total ``(B,)`` and ``{name: (B,) rewards}`` of each function (``__name__``, or the
    class name; two functions of one name are refused, not renamed: set a distinct ``__name__``). Each function
    must return one finite number per completion: None, NaN, +-inf, a non-number or a list of the
    wrong length raises ``ValueError`` naming the function and (for a bad value) the completion.
    TRL differs on None: it reads None as "this function does not apply" and sums the others
    (``nansum``); here every function applies to every completion, so a None is a bug.
    """
    check_pairs(prompts, completions)
    funcs, weights = _checked_weights(reward_funcs, reward_weights)
    parts, total = {}, torch.zeros(len(completions), dtype=torch.float32)
    for fn, w in zip(funcs, weights):
        name = _name(fn)
        got = fn(prompts, completions)
        got = got.tolist() if isinstance(got, torch.Tensor) else got
        if got is None or isinstance(got, (str, bytes)) or not hasattr(got, "__len__"):
            what = "None" if got is None else f"a {type(got).__name__} ({got!r:.40})"
            raise ValueError(f"reward function {name!r} returned {what}, not a list of {len(completions)} rewards: "
                             f"it must return one number per completion")
        if len(got) != len(completions):
            raise ValueError(f"reward function {name!r} returned {len(got)} rewards for {len(completions)} completions: "
                             f"it must return one number per completion")
        values = []
        for i, v in enumerate(got):
            ok = isinstance(v, (int, float, np.integer, np.floating, np.bool_)) and math.isfinite(v)   # bools too, as TRL
            if not ok:
                raise ValueError(f"reward function {name!r} returned {v!r} for completion {i} {completions[i]!r} "
                                 f"(prompt {prompts[i]!r}): every reward must be a finite number")
            values.append(float(v))
        parts[name] = torch.tensor(values, dtype=torch.float32)
        total = total + w * parts[name]
    return total, parts


class RewardedTask:
    """``task`` with its reward replaced by ``sum_i w_i f_i`` (:func:`combine_rewards`).

    Prompts, held-out prompts and ``max_new_tokens`` are ``task``'s, so any trainer of
    :mod:`rlcourse.lm` takes it where it takes a task. ``last_rewards`` keeps the per-function
    rewards of the latest call by name (TRL logs their means as ``rewards/<name>/mean``): two reward
    functions of one ``__name__`` are refused here, not renamed.
    """

    def __init__(self, task, reward_funcs, reward_weights=None):
        self.task, self.reward_funcs = task, list(reward_funcs)
        self.reward_weights = None if reward_weights is None else list(reward_weights)
        _checked_weights(self.reward_funcs, self.reward_weights)   # refuse bad weights now, not at the first step
        self.max_new_tokens = task.max_new_tokens
        self.last_rewards: dict = {}

    def __repr__(self):
        names = ", ".join(_name(f) for f in self.reward_funcs)
        return f"RewardedTask({self.task!r}, [{names}], weights={self.reward_weights})"

    def prompts(self, n: int, rng=None) -> list[str]:
        return self.task.prompts(n, rng)

    def test_prompts(self, n: int = 500) -> list[str]:
        return self.task.test_prompts(n)

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        total, self.last_rewards = combine_rewards(self.reward_funcs, prompts, completions, self.reward_weights)
        return total
