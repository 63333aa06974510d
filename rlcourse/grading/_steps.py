"""Shared machinery of the checks that run a learner's whole training step.

A step check runs the learner's step and a reference step from the same weights and the same
random stream, each with a :class:`RecordingSGD` that keeps the gradient it was asked to apply,
and compares the two gradients (:func:`assert_same_gradient`); then it trains a fresh model with
the learner's step and measures what it learned. The gradient is what a step computes: the loss's
value can be right while its gradient is not (a detached ratio, a missing mask), and a wrong
normaliser shows as the right direction at the wrong length.
"""
from __future__ import annotations

import torch

from rlcourse.grading._core import fail

__all__ = ["addition_start", "moved_copy", "train_from_addition", "RecordingSGD", "twin_runs", "assert_same_gradient",
           "assert_call_gradient", "relative_gap",
           "check_sampling_step"]


def addition_start():
    """``(task, model, tokenizer)``: the addition task and the ``addition-partial`` checkpoint in eval mode,
    which the step checks train."""
    from rlcourse.tasks import AdditionTask
    from rlcourse.lm import load_checkpoint

    start, tokenizer = load_checkpoint("addition-partial", device="cpu")
    return AdditionTask(), start.eval(), tokenizer


def moved_copy(model: torch.nn.Module, seed: int, scale: float = 0.02) -> torch.nn.Module:
    """A copy of ``model`` with seeded Gaussian noise of std ``scale`` added to every parameter.

    What a check hands over where a shipped checkpoint would do (a policy, a reference model): an answer
    that loads the checkpoint again instead of using the model it was given is then seen."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return out


class RecordingSGD(torch.optim.Optimizer):
    """Plain SGD that keeps a copy of the gradient of every ``step()``; ``seen`` lists them, flat.

    Parameters without a gradient count as zeros, so every record has the model's size. The copies
    live in the optimizer's per-parameter ``state``: under ``python -m rlcourse grade`` the learner's
    step runs in another process, and an optimizer's state is what comes back from it.
    """

    def __init__(self, params, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})

    def _params(self) -> list:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                self.state[p].setdefault("seen", []).append(grad)
                if p.grad is not None:          # as torch's optimizers: a parameter without a gradient is left alone
                    p.add_(grad, alpha=-group["lr"])

    @property
    def seen(self) -> list[torch.Tensor]:
        params = self._params()
        steps = len(self.state[params[0]].get("seen", [])) if params[0] in self.state else 0
        return [torch.cat([self.state[p]["seen"][k].flatten().double() for p in params]) for k in range(steps)]


def twin_runs(start: torch.nn.Module, lr: float):
    """Two copies of ``start``, each with its own :class:`RecordingSGD`: ``(mine, theirs, opt_mine, opt_theirs)``,
    the learner's side and the reference's."""
    import copy

    mine, theirs = copy.deepcopy(start), copy.deepcopy(start)
    return mine, theirs, RecordingSGD(mine.parameters(), lr=lr), RecordingSGD(theirs.parameters(), lr=lr)


def relative_gap(received: torch.Tensor, expected: torch.Tensor) -> float:
    """``|received - expected| / |expected|``."""
    return float((received - expected).norm() / expected.norm().clamp(min=1e-30))


def assert_same_gradient(check: str, case: str, expected: torch.Tensor, received: torch.Tensor | None,
                         otherwise: str, tol: float = 1e-4, longer: str | None = None, close: str | None = None) -> None:
    """Fail unless the gradient the learner's step applied equals the reference step's (relative ``tol``).

    The message says what was measured: no step, a zero gradient, the opposite direction, the right
    direction at another length (``longer`` says why it may be), almost the same direction (``close``
    says which weighting to look at), or another direction (``otherwise`` says where to look).
    """
    __tracebackhide__ = True
    if received is None:
        fail(check, case, "one optimizer.step() per call", "no step", "call optimizer.step() after loss.backward()")
    gap = relative_gap(received, expected)
    if gap <= tol:
        return
    norm, ref_norm = float(received.norm()), float(expected.norm())
    if norm == 0.0:
        fail(check, case, f"a gradient of norm {ref_norm:.4g}", "a gradient of norm 0 at optimizer.step()",
             "the loss must be computed from log-probs that carry the model's graph, and backward() must run "
             "before step()")
    cosine = float(received @ expected) / (norm * ref_norm)
    measured = f"gradient of norm {norm:.4g}, cosine {cosine:+.4f} with the reference's (norm {ref_norm:.4g})"
    if cosine < -0.999:
        fail(check, case, "the reference step's gradient", measured,
             "your gradient points the other way: the optimiser minimises the loss, so the loss is -J")
    if cosine > 0.999:
        fail(check, case, "the reference step's gradient", measured,
             f"the right direction at {norm / ref_norm:.3g} times the length: {longer or _LONGER}")
    if cosine > 0.99:
        fail(check, case, "the reference step's gradient", measured, close or _CLOSE)
    fail(check, case, "the reference step's gradient", measured, otherwise)


_LONGER = "the average is taken over the wrong number of terms (check the normaliser of loss_type and the mask)"
_CLOSE = ("almost the reference's direction: the same terms weighted a little differently (check each average: over "
          "which tokens, with which normaliser)")


def assert_call_gradient(check: str, case: str, call: int, mine: RecordingSGD, theirs: RecordingSGD, otherwise: str,
                         longer: str = _LONGER, close: str | None = None) -> None:
    """After call ``call`` (0-based) of the learner's step and of the reference's: one ``step()`` per call
    so far, no gradient left over from the previous call, and the same gradient (:func:`assert_same_gradient`)."""
    __tracebackhide__ = True
    if len(mine.seen) != call + 1:
        fail(check, case, f"{call + 1} optimizer.step() call(s) so far", f"{len(mine.seen)}",
             "one update per call: zero_grad, backward, step")
    received, expected = mine.seen[call], theirs.seen[call]
    if (call > 0 and relative_gap(received, expected) > 1e-4           # (a zero last gradient adds nothing)
            and relative_gap(received, expected + mine.seen[call - 1]) < 1e-4):
        fail(check, case, "the gradient of this call's loss", "the sum of this call's and the last call's",
             "gradients add up in .grad across backward() calls: zero them before backward")
    assert_same_gradient(check, case, expected, received, otherwise, longer=longer, close=close)


def train_from_addition(step, steps: int, lr: float, prompts_per_step: int, held_out: int) -> tuple[float, float, list]:
    """Train a copy of ``addition-partial`` with ``steps`` calls of ``step(model, optimizer, tokenizer, task, prompts,
    generator)`` (Adam at ``lr``; each call gets ``prompts_per_step`` fresh prompts; prompts and generator seeded
    with 0), the training run every check that trains shares. Returns greedy exact match on ``held_out`` test
    prompts before and after, and what each call returned."""
    import copy

    import numpy as np

    from rlcourse.trainers import exact_match

    task, start, tokenizer = addition_start()
    prompts = task.test_prompts(held_out)
    before = exact_match(start, tokenizer, task, prompts)
    model = copy.deepcopy(start)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    returned = [step(model, optimizer, tokenizer, task, task.prompts(prompts_per_step, rng), gen) for _ in range(steps)]
    return before, exact_match(model, tokenizer, task, prompts), returned


def check_sampling_step(name: str, fn, reference, settings: list, learning: dict, otherwise: str,
                        call_prompts: int = 6, call_completions: int = 4, close: str | None = None) -> None:
    """The two measurements of a sampling policy-gradient step (lessons 09, 10 and 10c) on ``addition-partial``.

    ``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, *extra) -> mean reward``
    and ``reference`` (same signature; it returns ``(mean reward, ...)``). For each ``(label, extra)`` of
    ``settings``: two calls (``call_prompts`` x ``call_completions``) from the same weights and generator seed
    as the reference's, each call's gradient compared (:func:`assert_same_gradient`, ``otherwise`` for
    another direction). A setting ``(label, extra, options)`` may change, for its calls alone, the number
    of ``prompts`` or ``completions`` per prompt, or the task's completion budget ``max_new_tokens`` (a
    budget no completion fills tells ``task.max_new_tokens`` from the batch's padded width). Then
    ``learning["steps"]`` calls with Adam (``lr``, ``groups`` prompts x ``num_generations``, ``extra``)
    must raise greedy exact match on ``held_out`` prompts by ``margin``.
    """
    __tracebackhide__ = True
    import copy

    import numpy as np

    task, start, tokenizer = addition_start()
    for case, extra, *options in settings:
        options = options[0] if options else {}
        K, N, here = options.get("completions", call_completions), options.get("prompts", call_prompts), task
        if "max_new_tokens" in options:
            here = copy.copy(task)
            here.max_new_tokens = options["max_new_tokens"]
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.05)
        gen_mine, gen_theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for call in (0, 1):                      # the second call starts from the weights the first one moved
            prompts = here.prompts(N, rng=30 + call)
            reward = fn(mine, opt_mine, tokenizer, here, list(prompts), gen_mine, K, *extra)
            expected_reward = reference(theirs, opt_theirs, tokenizer, here, prompts, gen_theirs, K, *extra)[0]
            label = f"{case}, {N} prompts x {K} completions, call {call + 1}"
            if reward is None or abs(float(reward) - expected_reward) > 1e-6:
                fail(name, label, f"mean reward {expected_reward:.4f} of the completions drawn", reward,
                     "draw the completions once per call: each prompt num_generations times in a row "
                     "([p for p in prompts for _ in range(num_generations)]), with sample(..., generator=generator); "
                     "return the mean of their rewards")
            assert_call_gradient(name, label, call, opt_mine, opt_theirs, otherwise, close=close)
    s = learning

    def step(model, optimizer, tokenizer, task, prompts, generator):
        return float(fn(model, optimizer, tokenizer, task, prompts, generator, s["num_generations"], *s["extra"]))

    before, after, rewards = train_from_addition(step, s["steps"], s["lr"], s["groups"], s["held_out"])
    if not after >= before + s["margin"]:
        fail(name, f"{s['steps']} steps of your step (Adam, lr {s['lr']}, {s['groups']} prompts x {s['num_generations']})",
             f"held-out exact match at least {before + s['margin']:.3f} (from {before:.3f})", f"{after:.3f}",
             f"the mean reward of the training batches went {np.mean(rewards[:5]):.3f} -> {np.mean(rewards[-5:]):.3f} "
             f"(first and last 5 steps)")
    print(f"✔ {name}: gradients equal the reference step's ({len(settings)} setting{'s' * (len(settings) > 1)} x 2 calls); "
          f"{s['steps']} steps raised held-out exact match {before:.3f} -> {after:.3f}")
