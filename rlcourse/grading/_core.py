"""Shared machinery of the ``check_*`` functions that exercise notebooks call.

A check runs the learner's function on edge cases and seeded random inputs, compares each answer
with the reference implementation in ``rlcourse``, and either prints one deterministic line or
raises ``AssertionError`` naming the case, the expected and received values, and a hint. A
``NotImplementedError`` from an unfinished exercise is left to propagate unchanged.
"""
from __future__ import annotations

import copy

import numpy as np


class CheckFailed(AssertionError):
    """Raised when a learner's function gives a wrong answer."""


def to_numpy(x) -> np.ndarray:
    """Learners may answer with a float, a list, a NumPy array or a torch tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def fail(check: str, case: str, expected, received, hint: str = ""):
    message = (f"{check} failed on {case}\n"
               f"  expected: {_show(expected)}\n"
               f"  received: {_show(received)}")
    if hint:
        message += f"\n  hint: {hint}"
    raise CheckFailed(message)


def assert_close(check: str, case: str, expected, received, hint: str = "", atol: float = 1e-6,
                 rtol: float = 1e-6):
    """Fail unless ``received`` has ``expected``'s shape and values (within tolerance)."""
    if received is None:
        fail(check, case, expected, received, "the function returned None: did you forget `return`?")
    exp, got = to_numpy(expected), to_numpy(received)
    if exp.shape != got.shape:
        fail(check, case, f"shape {exp.shape}", f"shape {got.shape}", hint)
    if not np.allclose(got, exp, atol=atol, rtol=rtol, equal_nan=False):
        fail(check, case, exp, got, hint)


def fail_if_mistake(check: str, case: str, expected, received, mistake, hint: str) -> None:
    """Fail with a targeted hint when ``received`` is what a known mistake would have produced.

    Only when the mistake's answer differs from the right one on this case (otherwise the case
    cannot tell them apart) and has the right shape. Call it before :func:`assert_close`, so
    a recognised mistake gets its specific hint instead of the generic one.
    """
    if received is None:
        return
    got, exp, wrong = to_numpy(received), to_numpy(expected), to_numpy(mistake)
    if got.shape == exp.shape == wrong.shape and np.allclose(got, wrong) and not np.allclose(wrong, exp):
        fail(check, case, expected, received, hint)


def call_unmutated(check: str, case: str, fn, *args, **kwargs):
    """Call ``fn`` and fail if it modified any of its array arguments in place."""
    before = copy.deepcopy((args, kwargs))
    result = fn(*args, **kwargs)
    for old, new in zip(list(before[0]) + list(before[1].values()), list(args) + list(kwargs.values())):
        if isinstance(old, np.ndarray) and not np.array_equal(old, new, equal_nan=True):
            fail(check, case, "inputs left unchanged", "an input array was modified in place",
                 "work on a copy (e.g. `x = x.copy()` or `np.array(x)`) instead of writing into the argument")
    return result


def passed(check: str, n_cases: int) -> None:
    print(f"✔ {check}: all {n_cases} cases passed")


def _show(x) -> str:
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = float(x)
    if isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "detach"):
        return np.array2string(to_numpy(x), precision=4, suppress_small=True, max_line_width=100)
    if isinstance(x, float):
        return f"{x:.6g}"
    return repr(x) if not isinstance(x, str) else x
