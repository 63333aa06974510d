"""Shared machinery of the ``check_*`` functions that exercise notebooks call.

A check runs the learner's function on edge cases and seeded random inputs, compares each answer
with the reference implementation in ``rlcourse``, and either prints one deterministic line or
raises ``AssertionError`` naming the case, the expected and received values, and a hint. A
``NotImplementedError`` from an unfinished exercise is left to propagate unchanged.

Every function here sets ``__tracebackhide__``: IPython (and pytest) then leave the grader's own
frames out of a traceback, so an error raised in the learner's function shows their cell and their
function, not the reference call inside the check. IPython always shows the frame that raised,
so for a failed check itself (``CheckFailed``, raised here) a handler installed in the kernel
shows the message alone: the case, expected, received and hint.

Inputs are the caller's own objects: a check passes the very arrays and tensors it keeps, and
compares them with a saved copy after the call (:func:`call_unmutated`), so an answer that writes
into its arguments is caught instead of hidden behind a defensive clone.
"""
from __future__ import annotations

import copy

import numpy as np


class CheckFailed(AssertionError):
    """Raised when a learner's function gives a wrong answer."""


def _show_check_failed(shell, etype, value, tb, tb_offset=None):
    """IPython's handler for CheckFailed: the message, without the grader's frames."""
    stb = [f"\x1b[0;31m{etype.__name__}\x1b[0m: {value}"]
    shell._showtraceback(etype, value, stb)
    return stb


def _install_ipython_handler() -> None:
    import sys

    if "IPython" not in sys.modules:      # not in a notebook kernel or IPython shell
        return
    shell = sys.modules["IPython"].get_ipython()
    if shell is not None and CheckFailed not in getattr(shell, "custom_exceptions", ()):
        shell.set_custom_exc(tuple(shell.custom_exceptions) + (CheckFailed,), _show_check_failed)


_install_ipython_handler()


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_numpy(x) -> np.ndarray:
    """Learners may answer with a float, a list, a NumPy array or a torch tensor."""
    __tracebackhide__ = True
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def fail(check: str, case: str, expected, received, hint: str = ""):
    __tracebackhide__ = True
    message = (f"{check} failed on {case}\n"
               f"  expected: {_show(expected)}\n"
               f"  received: {_show(received)}")
    if hint:
        message += f"\n  hint: {hint}"
    raise CheckFailed(message) from None


def assert_close(check: str, case: str, expected, received, hint: str = "", atol: float = 1e-6,
                 rtol: float = 1e-6):
    """Fail unless ``received`` has ``expected``'s shape and values (within tolerance)."""
    __tracebackhide__ = True
    if received is None:
        fail(check, case, expected, received, "the function returned None: did you forget `return`?")
    try:
        got = to_numpy(received)
    except (TypeError, ValueError):
        fail(check, case, expected, f"{type(received).__name__} {received!r:.80}", "return a number, an array or a tensor")
    exp = to_numpy(expected)
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
    __tracebackhide__ = True
    if received is None:
        return
    try:
        got = to_numpy(received)
    except (TypeError, ValueError):
        return
    exp, wrong = to_numpy(expected), to_numpy(mistake)
    if got.shape == exp.shape == wrong.shape and np.allclose(got, wrong) and not np.allclose(wrong, exp):
        fail(check, case, expected, received, hint)


def _snapshot(x):
    if _is_tensor(x):
        return x.detach().clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (list, dict)):
        return copy.deepcopy(x)
    return None


def _unchanged(old, new) -> bool:
    if old is None:
        return True
    if _is_tensor(new):
        new = new.detach()
        if old.shape != new.shape or old.dtype != new.dtype:
            return False
        same = old == new
        if old.is_floating_point() or old.is_complex():
            same = same | (old.isnan() & new.isnan())      # elementwise: a NaN left where it was is unchanged
        return bool(same.all())
    if isinstance(new, np.ndarray):
        return old.shape == new.shape and np.array_equal(old, new, equal_nan=new.dtype.kind == "f")
    return old == new


def call_unmutated(check: str, case: str, fn, *args, **kwargs):
    """Call ``fn`` on the caller's own arguments and fail if it modified any of them in place.

    Arrays, tensors, lists and dicts are saved before the call and compared after it. Nothing is
    cloned on the way in: a function that writes into its input is writing into the check's.
    """
    __tracebackhide__ = True
    named = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + list(kwargs.items())
    saved = [(name, _snapshot(value)) for name, value in named]
    result = fn(*args, **kwargs)
    for (name, old), (_, new) in zip(saved, named):
        if not _unchanged(old, new):
            fail(check, case, f"{name} left unchanged", f"{name} was modified in place",
                 "work on a copy (x = x.copy(), x = x.clone(), or out-of-place operations such as "
                 "x = x - y instead of x -= y) instead of writing into the argument: the caller still needs it")
    return result


def gradient_flowing(check: str, case: str, output, inputs, hint: str = ""):
    """The gradients of ``output`` (a scalar or summed tensor) with respect to ``inputs``.

    Fails unless ``output`` really hangs off ``inputs`` in autograd's graph: a tensor made with
    ``requires_grad=True`` by hand, or one rebuilt from ``.item()`` values, carries the flag but
    no path back to the inputs, and a trainer stepping on it would change nothing.
    """
    __tracebackhide__ = True
    import torch

    inputs = list(inputs)
    if not _is_tensor(output):
        fail(check, case, "a torch tensor connected to the inputs", f"{type(output).__name__}",
             hint or "compute the result with torch operations on the inputs")
    if not output.requires_grad or output.grad_fn is None:
        what = ("a leaf tensor with requires_grad set by hand" if output.requires_grad
                else "a tensor without a gradient")
        fail(check, case, "a result computed from the inputs by autograd (it has a grad_fn)", what,
             hint or "build the result with torch operations on the inputs: no .item(), no NumPy, no "
                     "torch.tensor(...) around a value, no .detach()")
    grads = torch.autograd.grad(output.sum(), inputs, allow_unused=True, retain_graph=True)
    if all(g is None for g in grads):
        fail(check, case, "a gradient reaching the inputs", "no path from the result back to the inputs",
             hint or "the result must be computed from the inputs with torch operations")
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def passed(check: str, n_cases: int) -> None:
    __tracebackhide__ = True
    print(f"✔ {check}: all {n_cases} cases passed")


def _show(x) -> str:
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = float(x)
    if isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "detach"):
        try:
            return np.array2string(to_numpy(x), precision=4, suppress_small=True, max_line_width=100)
        except (TypeError, ValueError):
            return repr(x)[:200]
    if isinstance(x, float):
        return f"{x:.6g}"
    return repr(x) if not isinstance(x, str) else x


def references(*names: str):
    """Name the library functions that compute a check's answer, under any name (``"module:qualname"``;
    :mod:`rlcourse.grading._routes` groups them); the check's own module's reference helpers
    (``_routes.REFERENCE_HELPERS``: the reference step or run it compares with) are added.

    ``python -m rlcourse grade`` flags an answer that is one of them, a copy of one, or calls one.
    """
    def mark(check):
        from rlcourse.grading._routes import helpers_of

        check.references = tuple(dict.fromkeys(names + helpers_of(check.__module__)))
        return check
    return mark
