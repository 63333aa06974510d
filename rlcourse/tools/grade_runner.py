"""Run the checks of one graded notebook in a clean process: ``python -m rlcourse.tools.grade_runner DIR``.

``grade`` executes the learner's notebook in a kernel, and at each check cell it saves (with
cloudpickle) the arguments of the check, the learner's function first, instead of running the
cell. This process, which has run none of the notebook's cells, then imports ``rlcourse.grading``
afresh and calls each ``check_*`` on those functions. A check redefined in the notebook, or a
grading helper patched there, therefore changes nothing.

It also tells whether an answer *is* the reference implementation, a copy of its code, or merely
calls it: every check names its references (``rlcourse.grading._core.references``), and while the
learner's function runs, a profiler watches for calls into them.

``DIR/captures.json`` lists ``{"index", "check", "file"}``; results go to ``DIR/results.json``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import sys
import traceback
from pathlib import Path


def resolve(name: str):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _unwrap(fn):
    seen = 0
    while seen < 10:
        seen += 1
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            return fn
    return fn


def _same_code(a, b) -> bool:
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return ca is not None and cb is not None and ca.co_code == cb.co_code and ca.co_names == cb.co_names \
        and ca.co_consts == cb.co_consts


def reference_verdict(fn, references: dict) -> str | None:
    """Why ``fn`` is the reference itself or a copy of it, or ``None``."""
    inner = _unwrap(fn)
    for name, ref in references.items():
        if fn is ref or inner is ref:
            return f"the answer is the reference implementation {name} itself"
        if _same_code(inner, ref):
            return f"the answer is a copy of the reference implementation {name}"
    return None


def traced(fn, references: dict, calls: set):
    """``fn`` wrapped so that any call into a reference while it runs is recorded in ``calls``."""
    codes = {getattr(_unwrap(ref), "__code__", None): name for name, ref in references.items()}
    codes.pop(None, None)

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            calls.add(codes[frame.f_code])

    @functools.wraps(fn)
    def learner_function(*args, **kwargs):
        previous = sys.getprofile()
        sys.setprofile(profiler)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(previous)

    return learner_function


def _learner_line(exc: BaseException) -> str:
    """Where in the learner's own code an unexpected error was raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/rlcourse/" not in f.filename.replace("\\", "/")
              and "site-packages" not in f.filename]
    if not frames:
        return ""
    last = frames[-1]
    return f" (in {last.name}, line {last.lineno}: {last.line})" if last.line else f" (in {last.name})"


def run_one(capture: dict) -> dict:
    import cloudpickle
    import rlcourse.grading as grading

    check = getattr(grading, capture["check"], None)
    if check is None:
        return {"outcome": "error", "message": f"rlcourse.grading has no {capture['check']}"}
    with open(capture["file"], "rb") as f:
        args, kwargs = cloudpickle.load(f)
    fn = args[0]
    references = {}
    for name in getattr(check, "references", ()):
        try:
            references[name] = resolve(name)
        except (ImportError, AttributeError):
            pass
    verdict = reference_verdict(fn, references)
    if verdict:
        return {"outcome": "reference", "message": verdict}
    calls: set = set()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            check(traced(fn, references, calls) if callable(fn) else fn, *args[1:], **kwargs)
    except NotImplementedError as e:
        return {"outcome": "not implemented", "message": f"NotImplementedError: {e}"}
    except AssertionError as e:
        if calls:
            return {"outcome": "reference", "message": f"the answer calls the reference {', '.join(sorted(calls))}"}
        return {"outcome": "failed", "message": str(e)}
    except Exception as e:  # the learner's code raised: report it as the learner would see it
        return {"outcome": "error", "message": f"{type(e).__name__}: {e}{_learner_line(e)}"}
    if calls:
        return {"outcome": "reference", "message": f"the answer calls the reference {', '.join(sorted(calls))}"}
    return {"outcome": "passed", "message": out.getvalue().strip()}


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    captures = json.loads((folder / "captures.json").read_text())
    results = {}
    for capture in captures:
        results[capture["index"]] = run_one(capture)
        (folder / "results.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
