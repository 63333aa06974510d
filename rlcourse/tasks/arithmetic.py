"""Verifiable arithmetic tasks: the environments of the LLM lessons on a tiny GPT.

Each task makes prompts, demonstrations in TRL's data formats, and scores completions:

* ``task.prompts(n, rng)``          -> ``list[str]`` of training prompts;
* ``task.test_prompts(n)``          -> a fixed held-out list (never seen in training);
* ``task.sft_dataset(n, rng)``      -> ``[{"prompt": ..., "completion": ...}]`` (TRL "prompt-completion");
* ``task.reward(prompts, completions)`` -> ``torch.Tensor`` of floats, one per row;
* ``task.max_new_tokens``           -> enough tokens for any good answer plus ``<eos>``.

Completions are the decoded text *without* special tokens; the SFT trainer appends ``<eos>``.

The tasks:

* :class:`AdditionTask` - ``"12+34="`` -> ``"46"``, with an exact-match and a partial-credit reward.
* :class:`DigitSumTask` - ``"S=07:"`` -> K digits summing to S. Many answers are right, and the
  demonstrations are noisy (a fixed fraction is wrong), so imitation can at best reproduce the
  demonstrators' quality while a verifier's reward lets RL go past it.
* :class:`FillerAdditionTask` - ``"12+34="`` -> ``"...46"``: filler "thinking" dots, then the sum,
  right only within a budget of dots. Completion lengths vary, and a wrong answer can be long.

The preference task, whose answers a hidden gold score ranks, is :mod:`rlcourse.tasks.preference`.
"""
from __future__ import annotations

import re
from itertools import product

import numpy as np
import torch

from rlcourse.tasks._checks import check_count as _check_count
from rlcourse.tasks._checks import check_pairs as _check_pairs
from rlcourse.tasks._checks import as_rng as _rng


class AdditionTask:
    """``"a+b="`` answered with the decimal sum, operands uniform in ``[0, 10**n_digits)``.

    A pair ``(a, b)`` belongs to the held-out split when a fixed hash of it falls in the lowest
    ``test_fraction``: the split is the same on every machine and for every seed.
    """

    _PROMPT = re.compile(r"^(\d+)\+(\d+)=$")

    def __init__(self, n_digits: int = 2, test_fraction: float = 0.1, reward_kind: str = "exact"):
        if not isinstance(n_digits, int) or not 1 <= n_digits <= 6:
            raise ValueError(f"n_digits must be an integer in [1, 6], got {n_digits!r}")
        if not 0.0 < test_fraction < 0.5:
            raise ValueError(f"test_fraction must be in (0, 0.5), got {test_fraction!r}")
        if reward_kind not in ("exact", "partial"):
            raise ValueError(f"reward_kind must be 'exact' or 'partial', got {reward_kind!r}")
        self.n_digits, self.test_fraction, self.reward_kind = n_digits, test_fraction, reward_kind
        self.max_new_tokens = n_digits + 2  # the sum has at most n_digits + 1 digits, then <eos>

    def __repr__(self):
        return f"AdditionTask(n_digits={self.n_digits}, reward_kind={self.reward_kind!r})"

    def _is_test(self, a: int, b: int) -> bool:
        # Knuth's multiplicative hash of the pair, scaled to [0, 1).
        h = ((a * 1_000_003 + b) * 2_654_435_761) % 2**32
        return h < self.test_fraction * 2**32

    def _draw(self, n: int, rng: np.random.Generator, test: bool) -> list[str]:
        high = 10 ** self.n_digits
        out = []
        while len(out) < n:
            a, b = (int(x) for x in rng.integers(0, high, size=2))
            if self._is_test(a, b) == test:
                out.append(f"{a}+{b}=")
        return out

    def prompts(self, n: int, rng=None) -> list[str]:
        """``n`` training prompts (pairs outside the held-out split), drawn with ``rng``."""
        _check_count(n)
        return self._draw(n, _rng(rng), test=False)

    def test_prompts(self, n: int = 500) -> list[str]:
        """A fixed list of ``n`` held-out prompts, the same on every call and machine.

        Up to 2 digits the held-out pairs are enumerated, shuffled once and taken in order
        (cycling if ``n`` exceeds them); beyond that they are drawn from a fixed seed.
        """
        _check_count(n)
        rng = np.random.default_rng(12345)
        if self.n_digits > 2:
            return self._draw(n, rng, test=True)
        high = 10 ** self.n_digits
        pool = [f"{a}+{b}=" for a in range(high) for b in range(high) if self._is_test(a, b)]
        pool = [pool[i] for i in rng.permutation(len(pool))]
        return [pool[i % len(pool)] for i in range(n)]

    def answer(self, prompt: str) -> str:
        """The correct completion: ``"46"`` for ``"12+34="``."""
        m = self._PROMPT.match(prompt)
        if m is None:
            raise ValueError(f"prompt must look like '12+34=', got {prompt!r}")
        return str(int(m.group(1)) + int(m.group(2)))

    def demonstration(self, prompt: str, rng=None) -> str:
        """A demonstrator's completion: here always the answer (subclasses may draw from ``rng``)."""
        return self.answer(prompt)

    def sft_dataset(self, n: int, rng=None) -> list[dict]:
        """``n`` training examples ``{"prompt": "12+34=", "completion": self.demonstration(...)}``."""
        rng = _rng(rng)
        return [{"prompt": p, "completion": self.demonstration(p, rng)} for p in self.prompts(n, rng)]

    @staticmethod
    def exact_match(target: str, completion: str) -> float:
        """1 if the completion is exactly the answer, else 0."""
        return float(completion == target)

    @staticmethod
    def partial_credit(target: str, completion: str) -> float:
        """Fraction of digit places right, aligned at the units digit, over the longer length.

        ``partial_credit("46", "47") = 1/2``; ``("146", "46") = 2/3``; ``("46", "") = 0``. A wrong
        length costs: every missing or extra place counts as wrong.
        """
        longest = max(len(target), len(completion))
        if longest == 0:
            return 0.0
        right = sum(t == c for t, c in zip(reversed(target), reversed(completion)))
        return right / longest

    def reward(self, prompts: list[str], completions: list[str], kind: str | None = None) -> torch.Tensor:
        """Reward of each completion: ``kind`` (default ``self.reward_kind``) is ``"exact"`` or ``"partial"``."""
        _check_pairs(prompts, completions)
        kind = kind or self.reward_kind
        score = {"exact": self.exact_match, "partial": self.partial_credit}.get(kind)
        if score is None:
            raise ValueError(f"kind must be 'exact' or 'partial', got {kind!r}")
        return torch.tensor([score(self.answer(p), c) for p, c in zip(prompts, completions)],
                            dtype=torch.float32)


class DigitSumTask:
    """``"S=07:"`` answered with ``n_digits`` digits that sum to S (e.g. ``"1303"``).

    Demonstrations are right with probability ``demo_accuracy`` (a uniformly random valid answer)
    and otherwise plausibly wrong (right length, but summing to S +/- 1..3). Validity is checked
    exactly, so many different answers earn the full reward.
    """

    _PROMPT = re.compile(r"^S=(\d+):$")

    def __init__(self, n_digits: int = 4, demo_accuracy: float = 0.5):
        if not isinstance(n_digits, int) or not 1 <= n_digits <= 5:
            raise ValueError(f"n_digits must be an integer in [1, 5], got {n_digits!r}")
        if not 0.0 <= demo_accuracy <= 1.0:
            raise ValueError(f"demo_accuracy must be in [0, 1], got {demo_accuracy!r}")
        self.n_digits, self.demo_accuracy = n_digits, demo_accuracy
        self.max_sum = 9 * n_digits
        self.max_new_tokens = n_digits + 1
        # Every answer string, grouped by digit sum: exact enumeration is cheap (<= 10^5 strings).
        self._by_sum: list[list[str]] = [[] for _ in range(self.max_sum + 1)]
        for digits in product("0123456789", repeat=n_digits):
            self._by_sum[sum(map(int, digits))].append("".join(digits))

    def __repr__(self):
        return f"DigitSumTask(n_digits={self.n_digits}, demo_accuracy={self.demo_accuracy})"

    def make_prompt(self, target: int) -> str:
        if not 0 <= target <= self.max_sum:
            raise ValueError(f"target must be in [0, {self.max_sum}], got {target!r}")
        return f"S={target:02d}:"

    def target(self, prompt: str) -> int:
        m = self._PROMPT.match(prompt)
        if m is None or int(m.group(1)) > self.max_sum:
            raise ValueError(f"prompt must look like 'S=07:' with S <= {self.max_sum}, got {prompt!r}")
        return int(m.group(1))

    def n_valid(self, prompt: str) -> int:
        """How many different answers are right for this prompt (exact count)."""
        return len(self._by_sum[self.target(prompt)])

    def prompts(self, n: int, rng=None) -> list[str]:
        """``n`` prompts with S uniform in ``[0, 9 * n_digits]``."""
        _check_count(n)
        return [self.make_prompt(int(s)) for s in _rng(rng).integers(0, self.max_sum + 1, size=n)]

    def test_prompts(self, n: int | None = None) -> list[str]:
        """Every target once (``n=None``), or ``n`` prompts cycling through the targets.

        There are only ``9 * n_digits + 1`` prompts, so this set is not disjoint from training:
        the question here is not generalisation but whether answers are valid (and how varied).
        """
        n = self.max_sum + 1 if n is None else n
        _check_count(n)
        return [self.make_prompt(i % (self.max_sum + 1)) for i in range(n)]

    def demonstration(self, prompt: str, rng=None) -> str:
        """One noisy demonstration: valid with probability ``demo_accuracy``."""
        rng, s = _rng(rng), self.target(prompt)
        if rng.random() >= self.demo_accuracy:
            wrong = [t for t in range(s - 3, s + 4) if t != s and 0 <= t <= self.max_sum]
            s = int(rng.choice(wrong))
        pool = self._by_sum[s]
        return pool[int(rng.integers(len(pool)))]

    def sft_dataset(self, n: int, rng=None) -> list[dict]:
        """``n`` noisy demonstrations ``{"prompt": "S=07:", "completion": "1303"}``."""
        rng = _rng(rng)
        return [{"prompt": p, "completion": self.demonstration(p, rng)} for p in self.prompts(n, rng)]

    def is_valid(self, prompt: str, completion: str) -> bool:
        """Exactly ``n_digits`` decimal digits whose sum is the prompt's S."""
        return (len(completion) == self.n_digits and completion.isdigit() and completion.isascii()
                and sum(map(int, completion)) == self.target(prompt))

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """1 for a valid answer, 0 otherwise."""
        _check_pairs(prompts, completions)
        return torch.tensor([float(self.is_valid(p, c)) for p, c in zip(prompts, completions)],
                            dtype=torch.float32)

    def first_digits(self, prompt: str) -> list[str]:
        """The digits a right answer to ``prompt`` can begin with (``"S=34:"``: ``["7", "8", "9"]``)."""
        return sorted({answer[0] for answer in self._by_sum[self.target(prompt)]})

    def distinct_valid(self, prompts: list[str], completions: list[str]) -> float:
        """Mean over distinct prompts of the number of *different* valid answers given to it.

        Sample each prompt several times and call this to see diversity: a policy that collapsed
        onto one answer per prompt scores at most 1.
        """
        _check_pairs(prompts, completions)
        answers: dict[str, set] = {}
        for p, c in zip(prompts, completions):
            answers.setdefault(p, set())
            if self.is_valid(p, c):
                answers[p].add(c)
        return float(np.mean([len(v) for v in answers.values()])) if answers else 0.0


class FillerAdditionTask(AdditionTask):
    """``"12+34="`` answered with filler dots, then the sum: ``"...46"``, within a thinking budget.

    The dots stand for the "thinking" tokens of a reasoning model: they carry no information. The
    reward is 1 when the completion is at most ``budget`` dots followed by exactly the sum, else 0:
    thinking past the budget fails, as a reasoning model fails when it runs out of room. The
    demonstrators think for a uniform 0..``max_filler`` dots, so the ones that think longer than
    ``budget`` are wrong demonstrations, and a policy imitating them produces completions whose
    length varies. Once a completion is past the budget it is wrong whatever follows, and
    ``max_new_tokens`` leaves room for it to grow ``max_filler`` dots longer than any
    demonstration: the room in which lesson 10 measures whether wrong answers grow. Prompts, the
    held-out split and :meth:`answer` are :class:`AdditionTask`'s.
    """

    FILLER = "."

    def __init__(self, n_digits: int = 2, max_filler: int = 12, budget: int = 3, test_fraction: float = 0.1):
        if not isinstance(max_filler, int) or not 0 <= max_filler <= 24:
            raise ValueError(f"max_filler must be an integer in [0, 24], got {max_filler!r}")
        if not isinstance(budget, int) or not 0 <= budget <= max_filler:
            raise ValueError(f"budget must be an integer in [0, max_filler={max_filler}], got {budget!r}")
        super().__init__(n_digits=n_digits, test_fraction=test_fraction, reward_kind="exact")
        self.max_filler, self.budget = max_filler, budget
        # The longest demonstration (max_filler dots, n_digits + 1 digits, <eos>) plus max_filler more dots.
        self.max_new_tokens = 2 * max_filler + n_digits + 2

    def __repr__(self):
        return f"FillerAdditionTask(n_digits={self.n_digits}, max_filler={self.max_filler}, budget={self.budget})"

    def demonstration(self, prompt: str, rng=None) -> str:
        """The sum after a uniformly random number of dots in ``[0, max_filler]`` (over budget: wrong)."""
        dots = int(_rng(rng).integers(0, self.max_filler + 1))
        return self.FILLER * dots + self.answer(prompt)

    def split(self, completion: str) -> tuple[int, str]:
        """``(number of leading dots, what follows them)``: ``(3, "46")`` for ``"...46"``."""
        answer = completion.lstrip(self.FILLER)
        return len(completion) - len(answer), answer

    def is_right(self, prompt: str, completion: str) -> bool:
        dots, answer = self.split(completion)
        return dots <= self.budget and answer == self.answer(prompt)

    def reward(self, prompts: list[str], completions: list[str], kind: str | None = None) -> torch.Tensor:
        """1 for at most ``budget`` dots followed by exactly the sum, else 0."""
        if kind not in (None, "exact"):
            raise ValueError(f"FillerAdditionTask has only the 'exact' reward, got kind={kind!r}")
        _check_pairs(prompts, completions)
        return torch.tensor([float(self.is_right(p, c)) for p, c in zip(prompts, completions)],
                            dtype=torch.float32)
