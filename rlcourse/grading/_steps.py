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

__all__ = ["RecordingSGD", "twin_runs", "assert_same_gradient", "relative_gap"]


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
                         otherwise: str, tol: float = 1e-4,
                         longer: str = "the average is taken over the wrong number of terms (check the normaliser "
                                       "of loss_type and the mask)") -> None:
    """Fail unless the gradient the learner's step applied equals the reference step's (relative ``tol``).

    The message says what was measured: no step, a zero gradient, the opposite direction, the right
    direction at another length (``longer`` says why it may be), or another direction (``otherwise`` says
    where to look).
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
             f"the right direction at {norm / ref_norm:.3g} times the length: {longer}")
    if cosine > 0.99:
        fail(check, case, "the reference step's gradient", measured,
             "almost the reference's direction: the same tokens weighted differently (check the average that "
             "loss_type asks for)")
    fail(check, case, "the reference step's gradient", measured, otherwise)
