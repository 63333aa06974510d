"""Rewards without a verifier: a generative judge, its training data, rubrics and ensembles (lesson 10d).

The judge is a second tiny GPT. It reads one line, the problem, the answer under judgement and the
reference answer, and writes one verdict token:

    "12+34=" + "46" + "|" + "46" + ">"   ->   "y"        (judge_text(problem, answer, reference))
    "12+34=" + "47" + "|" + "46" + ">"   ->   "n"

Its reward for an answer is the probability of the verdict ``"y"`` after that line, from one
forward pass (:meth:`GenerativeJudge.prob_yes`): ``r = softmax(logits[-1])["y"]`` over the whole
vocabulary, so the reward lies in ``[0, 1]``.

The judge is trained only on *well-formed* answers (:class:`JudgeTask`): the right sum, and wrong
sums of the same number of digits (one digit changed, or another number of that length). Anything
else, an answer cut short, an empty answer, a lone separator, an answer that carries a second
separator and the reference, is a class it never saw (:data:`ADVERSARIAL_KINDS`): its verdict
there is whatever the weights happen to say. Lesson 10d measures it and lets RL find it.

Also here: a rubric, several judged items with weights (:func:`rubric_items`, :func:`rubric_reward`),
the statistics of an ensemble of judges (:func:`ensemble_reward`), false-positive rates
(:func:`false_positive_rate`) and the mining of adversarial negatives from an RL run
(:func:`mine_negatives`).
"""
from __future__ import annotations

import re

import numpy as np
import torch

from rlcourse.lm.logprobs import position_ids_from_mask
from rlcourse.tasks._checks import as_rng as _rng
from rlcourse.tasks._checks import check_count as _check_count
from rlcourse.tasks._checks import check_pairs as _check_pairs
from rlcourse.tasks.arithmetic import AdditionTask

__all__ = ["ADVERSARIAL_KINDS", "SEPARATOR", "END", "YES", "NO", "RUBRIC_ITEMS", "GenerativeJudge", "JudgeTask",
           "JudgeRewardTask", "RubricTask", "adversarial_answer", "ensemble_reward", "false_positive_rate",
           "judge_text", "mine_negatives", "rubric_items", "rubric_reward", "trl_reward_func", "well_formed"]

SEPARATOR, END, YES, NO = "|", ">", "y", "n"
ADVERSARIAL_KINDS = ("truncated", "empty", "separator", "echo", "extra digit")
RUBRIC_ITEMS = ("format", "digit count", "last digit", "full answer")


def judge_text(problem: str, answer: str, reference: str) -> str:
    """The judge's input line: ``problem + answer + "|" + reference + ">"`` (``"12+34=47|46>"``)."""
    return f"{problem}{answer}{SEPARATOR}{reference}{END}"


def well_formed(answer: str, reference: str) -> bool:
    """The class the judge was trained on: decimal digits only, as many as the reference has."""
    return answer.isascii() and answer.isdigit() and len(answer) == len(reference)


def adversarial_answer(kind: str, problem: str, task: AdditionTask | None = None) -> str:
    """One answer of a class the judge never saw, for ``problem``; every one of them is wrong.

    * ``"truncated"``   - the right answer without its last digit (``"4"`` for 46; ``""`` for 7);
    * ``"empty"``       - nothing;
    * ``"separator"``   - the judge's separator alone, ``"|"``;
    * ``"echo"``        - a separator and the reference written into the answer slot, ``"|46"``;
    * ``"extra digit"`` - the right answer with one more digit, ``"460"``.
    """
    if kind not in ADVERSARIAL_KINDS:
        raise ValueError(f"kind must be one of {ADVERSARIAL_KINDS}, got {kind!r}")
    right = (task or AdditionTask()).answer(problem)
    return {"truncated": right[:-1], "empty": "", "separator": SEPARATOR, "echo": SEPARATOR + right,
            "extra digit": right + "0"}[kind]


class JudgeTask:
    """The judge's supervised data: ``judge_text(...)`` -> ``"y"`` or ``"n"``, on well-formed answers only.

    Half the answers are right; the wrong half have the right answer's number of digits: with
    probability ``near_miss`` one digit of the right answer changed, otherwise a uniformly drawn
    number of that many digits (not the right one). ``extra_negatives`` are ``(problem, answer)``
    pairs labelled ``"n"`` (adversarial negatives mined from an RL run, :func:`mine_negatives`); a
    fraction ``negative_fraction`` of the dataset is drawn from them when there are any. Problems come
    from ``task``'s training split; :meth:`test_prompts` from its held-out split.

    It is a task like the others: ``sft_dataset`` trains the judge with :func:`rlcourse.trainers.train_sft`,
    ``reward(prompts, completions)`` is 1 where the judge's verdict is the true one.
    """

    def __init__(self, task: AdditionTask | None = None, near_miss: float = 0.5,
                 extra_negatives: list[tuple[str, str]] | None = None, negative_fraction: float = 0.25):
        if not 0.0 <= near_miss <= 1.0:
            raise ValueError(f"near_miss must be in [0, 1], got {near_miss!r}")
        if not 0.0 <= negative_fraction < 1.0:
            raise ValueError(f"negative_fraction must be in [0, 1), got {negative_fraction!r}")
        self.task = task or AdditionTask()
        self.near_miss, self.negative_fraction = near_miss, negative_fraction
        self.extra_negatives = [(str(p), str(a)) for p, a in (extra_negatives or [])]
        self.max_new_tokens = 1

    def __repr__(self):
        return f"JudgeTask({self.task!r}, extra_negatives={len(self.extra_negatives)})"

    def wrong_answer(self, right: str, rng: np.random.Generator) -> str:
        """A wrong answer with as many digits as ``right`` (no leading zero unless ``right`` has one digit)."""
        n = len(right)
        while True:
            if rng.random() < self.near_miss:
                i = int(rng.integers(n))
                digits = "123456789" if (i == 0 and n > 1) else "0123456789"
                out = right[:i] + digits[int(rng.integers(len(digits)))] + right[i + 1:]
            else:
                low = 0 if n == 1 else 10 ** (n - 1)
                out = str(int(rng.integers(low, 10 ** n)))
            if out != right:
                return out

    def examples(self, problems: list[str], rng=None) -> list[dict]:
        """``{"prompt": judge line, "completion": verdict, "right": bool}`` for each problem (half right)."""
        rng = _rng(rng)
        out = []
        for p in problems:
            right = self.task.answer(p)
            if self.extra_negatives and rng.random() < self.negative_fraction:
                q, a = self.extra_negatives[int(rng.integers(len(self.extra_negatives)))]
                out.append({"prompt": judge_text(q, a, self.task.answer(q)), "completion": NO, "right": False})
            elif rng.random() < 0.5:
                out.append({"prompt": judge_text(p, right, right), "completion": YES, "right": True})
            else:
                out.append({"prompt": judge_text(p, self.wrong_answer(right, rng), right), "completion": NO,
                            "right": False})
        return out

    def sft_dataset(self, n: int, rng=None) -> list[dict]:
        """``n`` training examples ``{"prompt", "completion"}`` on the task's training problems."""
        _check_count(n)
        rng = _rng(rng)
        return [{"prompt": e["prompt"], "completion": e["completion"]}
                for e in self.examples(self.task.prompts(n, rng), rng)]

    def prompts(self, n: int, rng=None) -> list[str]:
        rng = _rng(rng)
        return [e["prompt"] for e in self.examples(self.task.prompts(n, rng), rng)]

    def test_prompts(self, n: int = 500) -> list[str]:
        """A fixed list of judge lines on held-out problems, half right, half well-formed wrong (seed 0)."""
        _check_count(n)
        return [e["prompt"] for e in self.examples(self.task.test_prompts(n), rng=0)]

    _LINE = re.compile(r"^(\d+\+\d+=)(.*)\|(\d+)>$", re.S)

    def verdict(self, line: str) -> str:
        """The true verdict of a judge line: ``"y"`` when its answer is the problem's sum."""
        m = self._LINE.match(line)
        if m is None:
            raise ValueError(f"a judge line looks like '12+34=46|46>', got {line!r}")
        return YES if m.group(2) == self.task.answer(m.group(1)) else NO

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """1 where the completion is the true verdict, else 0."""
        _check_pairs(prompts, completions)
        return torch.tensor([float(c == self.verdict(p)) for p, c in zip(prompts, completions)], dtype=torch.float32)


class GenerativeJudge:
    """A causal LM used as a judge: its reward is the probability of ``"y"`` after the judge line.

    ``reference_task`` gives each problem's reference answer (``task.answer(problem)``).
    """

    def __init__(self, model, tokenizer, reference_task: AdditionTask | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.reference_task = reference_task or AdditionTask()
        self.yes_id = tokenizer.convert_tokens_to_ids(YES)

    @torch.no_grad()
    def prob_yes(self, problems: list[str], answers: list[str], references: list[str] | None = None,
                 batch_size: int = 1024) -> torch.Tensor:
        """``p_theta("y" | judge_text(problem, answer, reference))`` for each row, shape ``(B,)``, float32.

        One forward pass over the left-padded lines (position ids from the attention mask, as the
        sampler uses); ``softmax`` of the last position's logits over the whole vocabulary.
        ``references`` default to ``reference_task.answer(problem)``.
        """
        _check_pairs(problems, answers)
        if references is None:
            references = [self.reference_task.answer(p) for p in problems]
        _check_pairs(problems, references)
        lines = [judge_text(p, a, r) for p, a, r in zip(problems, answers, references)]
        return self.prob_yes_lines(lines, batch_size)

    @torch.no_grad()
    def prob_yes_lines(self, lines: list[str], batch_size: int = 1024) -> torch.Tensor:
        """``p_theta("y" | line)`` for ready-made judge lines (see :func:`judge_text`), shape ``(B,)``."""
        if not lines:
            return torch.zeros(0)
        was_training = self.model.training
        self.model.eval()
        dev = next(self.model.parameters()).device
        out = []
        for i in range(0, len(lines), batch_size):
            enc = self.tokenizer(lines[i:i + batch_size], return_tensors="pt", padding=True)
            ids, mask = enc["input_ids"].to(dev), enc["attention_mask"].to(dev)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                                use_cache=False).logits[:, -1].float()
            out.append(torch.softmax(logits, dim=-1)[:, self.yes_id].cpu())
        self.model.train(was_training)
        return torch.cat(out)


def ensemble_reward(probs: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """The reward of an ensemble of K judges from their ``probs``, shape ``(K, *batch)`` -> ``batch`` (e.g. ``(K, B)`` -> ``(B,)``).

    ``how="mean"``: ``(1/K) sum_k p_k``; ``how="min"``: ``min_k p_k``, the conservative reward of
    Coste et al. (2023, arXiv 2310.02743). Both act on probabilities, which share one scale; averaging
    logits or raw scores of differently scaled models would let the widest one decide.
    """
    probs = torch.as_tensor(probs, dtype=torch.float32)
    if probs.dim() < 2 or probs.shape[0] < 1:
        raise ValueError(f"probs must have shape (K judges, B answers, ...), got {tuple(probs.shape)}")
    if how == "mean":
        return probs.mean(0)
    if how == "min":
        return probs.min(0).values
    raise ValueError(f"how must be 'mean' or 'min', got {how!r}")


class JudgeRewardTask:
    """``task`` with its reward replaced by the judges': the probability of ``"y"`` (one judge or an ensemble).

    ``judges`` is one :class:`GenerativeJudge` or a list (combined by :func:`ensemble_reward` with ``how``).
    Prompts, held-out prompts and ``max_new_tokens`` are ``task``'s; ``task.reward`` stays the truth.
    """

    def __init__(self, task: AdditionTask, judges, how: str = "mean"):
        self.task = task
        self.judges = list(judges) if isinstance(judges, (list, tuple)) else [judges]
        if not self.judges:
            raise ValueError("judges must be a GenerativeJudge or a non-empty list of them")
        ensemble_reward(torch.zeros(1, 1), how)   # refuses an unknown `how` now, not mid-run
        self.how, self.max_new_tokens = how, task.max_new_tokens

    def __repr__(self):
        return f"JudgeRewardTask({self.task!r}, {len(self.judges)} judge(s), how={self.how!r})"

    def prompts(self, n: int, rng=None) -> list[str]:
        return self.task.prompts(n, rng)

    def test_prompts(self, n: int = 500) -> list[str]:
        return self.task.test_prompts(n)

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        probs = torch.stack([j.prob_yes(prompts, completions) for j in self.judges])
        return ensemble_reward(probs, self.how)


def false_positive_rate(probs, right, threshold: float = 0.5) -> float:
    """Share of the *wrong* answers (``right`` False) that the judge approves (``probs > threshold``).

    ``probs`` and ``right`` are 1-D of equal length; NaN when there is no wrong answer.
    """
    probs = torch.as_tensor(probs, dtype=torch.float32).flatten()
    right = torch.as_tensor(right).flatten().bool()
    if probs.shape != right.shape:
        raise ValueError(f"probs and right must have the same length, got {probs.numel()} and {right.numel()}")
    wrong = ~right
    if not bool(wrong.any()):
        return float("nan")
    return float((probs[wrong] > threshold).float().mean())


def mine_negatives(prompts: list[str], completions: list[str], probs, right, threshold: float = 0.5) -> list[tuple[str, str]]:
    """The adversarial negatives of a run: distinct ``(prompt, completion)`` pairs that are wrong and approved.

    Kept in order of first appearance, each once; the judge is then retrained with them labelled ``"n"``.
    """
    _check_pairs(prompts, completions)
    probs = torch.as_tensor(probs, dtype=torch.float32).flatten()
    right = torch.as_tensor(right).flatten().bool()
    if probs.numel() != len(prompts) or right.numel() != len(prompts):
        raise ValueError("probs and right must have one entry per completion")
    seen, out = set(), []
    for p, c, q, ok in zip(prompts, completions, probs.tolist(), right.tolist()):
        if not ok and q > threshold and (p, c) not in seen:
            seen.add((p, c))
            out.append((p, c))
    return out


def rubric_items(answer: str, reference: str) -> dict[str, float]:
    """The rubric's judged items for one answer, each 0 or 1 (:data:`RUBRIC_ITEMS`, in that order).

    * ``format``      - one or more decimal digits and nothing else;
    * ``digit count`` - as many characters as the reference;
    * ``last digit``  - the answer ends with the reference's last digit;
    * ``full answer`` - the answer is the reference.
    """
    return {"format": float(answer.isascii() and answer.isdigit()),
            "digit count": float(len(answer) == len(reference)),
            "last digit": float(bool(answer) and answer[-1] == reference[-1]),
            "full answer": float(answer == reference)}


def rubric_reward(items: torch.Tensor, weights) -> torch.Tensor:
    """The weighted sum of a rubric's items, normalised by the weights' sum.

    ``items`` ``(B, I)`` of scores in ``[0, 1]``, ``weights`` ``(I,)`` non-negative with a positive sum:
    ``r_b = sum_i w_i s_bi / sum_i w_i`` (shape ``(B,)``), a reward in ``[0, 1]`` whatever the weights.
    """
    items = torch.as_tensor(items, dtype=torch.float32)
    w = torch.as_tensor(weights, dtype=torch.float32).flatten()
    if items.dim() != 2 or items.shape[1] != w.numel():
        raise ValueError(f"items must have shape (B, {w.numel()}) for {w.numel()} weights, got {tuple(items.shape)}")
    if bool((w < 0).any()) or not float(w.sum()) > 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {w.tolist()}")
    return items @ w / w.sum()


class RubricTask:
    """``task`` rewarded by a rubric: :func:`rubric_reward` of :func:`rubric_items` with ``weights``.

    ``weights`` maps each of :data:`RUBRIC_ITEMS` to a non-negative weight (missing items weigh 0).
    """

    def __init__(self, task: AdditionTask, weights: dict[str, float]):
        unknown = set(weights) - set(RUBRIC_ITEMS)
        if unknown:
            raise ValueError(f"weights must name items of {RUBRIC_ITEMS}, got {sorted(unknown)}")
        self.task, self.max_new_tokens = task, task.max_new_tokens
        self.weights = [float(weights.get(k, 0.0)) for k in RUBRIC_ITEMS]
        rubric_reward(torch.zeros(1, len(RUBRIC_ITEMS)), self.weights)

    def prompts(self, n: int, rng=None) -> list[str]:
        return self.task.prompts(n, rng)

    def test_prompts(self, n: int = 500) -> list[str]:
        return self.task.test_prompts(n)

    def items(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """``(B, I)`` item scores in the order of :data:`RUBRIC_ITEMS`."""
        _check_pairs(prompts, completions)
        return torch.tensor([list(rubric_items(c, self.task.answer(p)).values()) for p, c in zip(prompts, completions)],
                            dtype=torch.float32).reshape(len(prompts), len(RUBRIC_ITEMS))

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        return rubric_reward(self.items(prompts, completions), self.weights)


def trl_reward_func(judge: GenerativeJudge):
    """``judge`` as a TRL reward function: ``f(prompts, completions, reference=None, **kwargs) -> list[float]``.

    TRL's ``GRPOTrainer(reward_funcs=[f])`` calls it with the batch's prompts and completions (plain text
    here) and every other dataset column as a keyword argument, so a ``reference`` column carries the
    reference answers (computed from the problem when absent). One float per completion: ``p("y")``.
    """
    def judge_reward(prompts, completions, reference=None, **kwargs):
        return [float(x) for x in judge.prob_yes(list(prompts), list(completions),
                                                 None if reference is None else list(reference))]
    return judge_reward
