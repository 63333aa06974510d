"""A calculator environment and a task where the tool matters: sums of three numbers (lesson 10e).

The task, :class:`ToolSumTask`: ``"12+34+56="`` answered with the sum, ``"102"``. The course's
tiny GPT adds two 2-digit numbers almost perfectly and three poorly, but it may call a
calculator on two numbers at a time and compose the results:

    12+34+56=(12+34)=46;(46+56)=102;102<eos>
             ^^^^^^^                          the policy writes a call ... up to ")"
                    ^^^^                      the environment writes the result
                        ^^^^^^^     ^^^^^^^^  the policy again: a second call, then the answer

The environment, :class:`CalculatorEnv`, has the interface of an RL environment for a language
model (the one TRL's ``environment_factory`` takes, and verl's and OpenRLHF's agent loops):

* ``reset(prompt) -> str``: start an episode for ``prompt``; the text returned (here ``""``) is
  appended to the prompt;
* ``step(model_text) -> (observation_text, done, reward)``: the policy's turn as text. A turn that
  ends with :attr:`CalculatorEnv.call_end` (``")"``) is a tool call; any other turn is the answer.
  A call ``(a+b)`` of two non-negative integers returns ``"=<a+b>;"`` and the episode goes on; a
  call that does not parse (``"(12+34+56)"``, ``"(1a+2)"``, ``")"``) returns the error observation
  ``"=?;"`` and ends the episode (never an exception); an answer ends it.

Rewards. The answer's reward is 1 when it is exactly the sum, else 0. A call's reward is the
per-turn (process) reward of lesson 10e's credit experiment: 1 for a *correct intermediate*, a call
whose result is the sum of two or more of the prompt's numbers and was not reached before (so
repeating a useful call earns nothing), else 0. A trainer that uses only the final reward reads
the answer's.

With ``tool_enabled=False`` the calculator is switched off: a call gets an empty observation and
the episode goes on, so the policy's next turn shows whether it writes the tool's output itself
(a turn starting with ``"="``: :attr:`CalculatorEnv.hallucinated`).

Search-R1 (Jin et al., 2025, arXiv 2503.09516) trains a model to interleave its reasoning with
search calls and masks the retrieved tokens out of the loss; ToRL (Li et al., 2025, arXiv
2503.23383) lets RL teach a base model when to call a code interpreter. This is the smallest task
with the same structure.
"""
from __future__ import annotations

import re
from itertools import combinations

import numpy as np
import torch

from rlcourse.tasks._checks import as_rng as _rng
from rlcourse.tasks._checks import check_count as _check_count
from rlcourse.tasks._checks import check_pairs as _check_pairs

__all__ = ["CalculatorEnv", "ToolSumTask", "CALL", "OBSERVATION", "ERROR_OBSERVATION"]

# [0-9], not \d (which matches other scripts' digits too); fullmatch, so nothing may come around.
CALL = re.compile(r"\(([0-9]{1,4})\+([0-9]{1,4})\)")
OBSERVATION = "={};"              # the calculator's answer to a call, e.g. "=46;"
ERROR_OBSERVATION = "=?;"         # its answer to a call that does not parse


class CalculatorEnv:
    """One episode of the calculator environment (module docstring). One instance per rollout row.

    ``operands_of(prompt)`` returns the prompt's numbers (:meth:`ToolSumTask.operands`);
    ``tool_enabled=False`` switches the calculator off (calls get ``""``). After each episode:
    ``calls`` (tool calls made, malformed ones included), ``malformed`` (True if a call did not
    parse), ``hallucinated`` (tool off only: a turn after a call started with ``"="``) and
    ``turn_rewards`` (one reward per ``step``).
    """

    call_end = ")"

    def __init__(self, operands_of, *, tool_enabled: bool = True):
        self.operands_of, self.tool_enabled = operands_of, bool(tool_enabled)
        self.reset_state()

    def reset_state(self) -> None:
        self.operands: list[int] = []
        self.reached: set[int] = set()
        self.calls, self.malformed, self.hallucinated, self.after_call = 0, False, False, False
        self.turn_rewards: list[float] = []

    def reset(self, prompt: str) -> str:
        """Start an episode for ``prompt``; returns the text appended to it (none here)."""
        self.reset_state()
        self.operands = [int(x) for x in self.operands_of(prompt)]
        self.answer = str(sum(self.operands))
        # every sum of two or more of the prompt's numbers: the correct intermediates
        self.partial_sums = {sum(c) for k in range(2, len(self.operands) + 1)
                             for c in combinations(self.operands, k)}
        return ""

    def step(self, model_text: str) -> tuple[str, bool, float]:
        """``(observation_text, done, reward)`` for the policy's turn ``model_text`` (module docstring)."""
        if not isinstance(model_text, str):
            raise ValueError(f"model_text must be the policy's turn as a string, got {type(model_text).__name__}")
        if self.after_call and not self.tool_enabled and model_text.startswith("="):
            self.hallucinated = True
        self.after_call = model_text.endswith(self.call_end)
        if not self.after_call:                                      # an answer ends the episode
            return self._reward("", True, float(model_text == self.answer))
        self.calls += 1
        call = CALL.fullmatch(model_text)
        if call is None:                                             # a malformed call: an error, not a crash
            self.malformed = True
            return self._reward(ERROR_OBSERVATION, True, 0.0)
        result = int(call.group(1)) + int(call.group(2))
        new_partial = result in self.partial_sums and result not in self.reached
        self.reached.add(result)
        observation = OBSERVATION.format(result) if self.tool_enabled else ""
        return self._reward(observation, False, float(new_partial))

    def _reward(self, observation: str, done: bool, reward: float) -> tuple[str, bool, float]:
        self.turn_rewards.append(reward)
        return observation, done, reward


class ToolSumTask:
    """``"a+b+c="`` answered with the sum: ``n_operands`` numbers below ``10**n_digits``, calculator allowed.

    A triple belongs to the held-out split when a fixed hash of it falls in the lowest
    ``test_fraction`` (the same on every machine). :meth:`sft_dataset` makes the demonstrations the
    checkpoint ``tool-sum-sft`` was trained on: two-number sums answered directly, and sums of
    ``n_operands`` numbers answered directly, except a fraction ``tool_rate`` that shows the
    calculator trace (the spans the environment wrote are listed, so SFT can leave them out of its
    loss). :meth:`make_env` builds one :class:`CalculatorEnv` for a rollout row.

    ``reward(prompts, completions)`` scores a direct answer (a completion without any tool call):
    the task's interface of the single-turn lessons. Multi-turn episodes are scored by the environment.
    """

    def __init__(self, n_operands: int = 3, n_digits: int = 2, test_fraction: float = 0.1,
                 tool_rate: float = 0.1, pair_fraction: float = 0.3):
        if not isinstance(n_operands, int) or not 2 <= n_operands <= 4:
            raise ValueError(f"n_operands must be an integer in [2, 4], got {n_operands!r}")
        if not isinstance(n_digits, int) or not 1 <= n_digits <= 3:
            raise ValueError(f"n_digits must be an integer in [1, 3], got {n_digits!r}")
        if not 0.0 < test_fraction < 0.5:
            raise ValueError(f"test_fraction must be in (0, 0.5), got {test_fraction!r}")
        for name, value in (("tool_rate", tool_rate), ("pair_fraction", pair_fraction)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        self.n_operands, self.n_digits, self.test_fraction = n_operands, n_digits, test_fraction
        self.tool_rate, self.pair_fraction = tool_rate, pair_fraction
        self.max_new_tokens = n_digits + 2   # a direct answer: the sum's digits, then <eos>

    def __repr__(self):
        return (f"ToolSumTask(n_operands={self.n_operands}, n_digits={self.n_digits}, "
                f"tool_rate={self.tool_rate})")

    def _is_test(self, numbers) -> bool:
        h = 0
        for x in numbers:
            h = (h * 1_000_003 + int(x)) % 2**61
        return (h * 2_654_435_761) % 2**32 < self.test_fraction * 2**32

    def _draw(self, n: int, rng: np.random.Generator, test: bool, k: int | None = None) -> list[str]:
        k = self.n_operands if k is None else k
        out = []
        while len(out) < n:
            numbers = [int(x) for x in rng.integers(0, 10 ** self.n_digits, size=k)]
            if self._is_test(numbers) == test:
                out.append("+".join(map(str, numbers)) + "=")
        return out

    def prompts(self, n: int, rng=None) -> list[str]:
        """``n`` training prompts of ``n_operands`` numbers (outside the held-out split), drawn with ``rng``."""
        _check_count(n)
        return self._draw(n, _rng(rng), test=False)

    def test_prompts(self, n: int = 500) -> list[str]:
        """A fixed list of ``n`` held-out prompts, the same on every call and machine."""
        _check_count(n)
        return self._draw(n, np.random.default_rng(12345), test=True)

    @staticmethod
    def operands(prompt: str) -> list[int]:
        """The numbers of ``prompt``: ``[12, 34, 56]`` for ``"12+34+56="``."""
        if not isinstance(prompt, str) or re.fullmatch(r"[0-9]+(\+[0-9]+)+=", prompt) is None:
            raise ValueError(f"prompt must look like '12+34+56=', got {prompt!r}")
        return [int(x) for x in prompt[:-1].split("+")]

    def answer(self, prompt: str) -> str:
        """The correct final answer: ``"102"`` for ``"12+34+56="``."""
        return str(sum(self.operands(prompt)))

    def tool_trace(self, prompt: str) -> tuple[str, list[tuple[int, int]]]:
        """The calculator demonstration of ``prompt`` and the character spans the environment wrote.

        ``"12+34+56="`` -> ``("(12+34)=46;(46+56)=102;102", [(7, 11), (18, 23)])``: left to right,
        one call per number after the first, then the last result as the answer.
        """
        numbers = self.operands(prompt)
        text, spans, total = "", [], numbers[0]
        for x in numbers[1:]:
            text += f"({total}+{x})"
            observation = OBSERVATION.format(total + x)
            spans.append((len(text), len(text) + len(observation)))
            text += observation
            total += x
        return text + str(total), spans

    def sft_dataset(self, n: int, rng=None) -> list[dict]:
        """``n`` demonstrations ``{"prompt", "completion", "observation_spans"}`` (module docstring).

        A share ``pair_fraction`` are two-number sums answered directly; the rest are
        ``n_operands``-number sums, answered with the calculator trace with probability
        ``tool_rate`` and directly otherwise. ``observation_spans`` lists the ``(start, end)``
        characters of the completion that the environment wrote (empty for a direct answer).
        """
        _check_count(n)
        rng = _rng(rng)
        out = []
        for _ in range(n):
            if rng.random() < self.pair_fraction:
                prompt = self._draw(1, rng, test=False, k=2)[0]
                out.append({"prompt": prompt, "completion": self.answer(prompt), "observation_spans": []})
                continue
            prompt = self._draw(1, rng, test=False)[0]
            if rng.random() < self.tool_rate:
                text, spans = self.tool_trace(prompt)
                out.append({"prompt": prompt, "completion": text, "observation_spans": spans})
            else:
                out.append({"prompt": prompt, "completion": self.answer(prompt), "observation_spans": []})
        return out

    def make_env(self, *, tool_enabled: bool = True) -> CalculatorEnv:
        """A fresh :class:`CalculatorEnv` for this task's prompts (TRL's ``environment_factory`` calls one per row)."""
        return CalculatorEnv(self.operands, tool_enabled=tool_enabled)

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """1 for a completion that is exactly the sum (a direct answer), else 0."""
        _check_pairs(prompts, completions)
        return torch.tensor([float(c == self.answer(p)) for p, c in zip(prompts, completions)], dtype=torch.float32)
