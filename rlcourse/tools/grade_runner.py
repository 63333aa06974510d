"""Judge one check of a graded notebook: :func:`run_one`.

``grade`` executes the learner's notebook in a kernel and, at each check cell, saves the learner's
function (cloudpickle) instead of running the cell. The *judge* (the ``grade`` process) runs no
cell of the notebook and never loads the learner's code: it calls ``rlcourse.grading``'s own
``check_*`` on a stand-in, a :class:`~rlcourse.tools.grade_wire.RemoteFunction`. Each call of the
stand-in is carried out by a *worker* process (:mod:`rlcourse.tools.grade_worker`) that holds the
learner's function, and what it returns comes back as data (:mod:`rlcourse.tools.grade_wire`).
Every comparison and the verdict happen here, where no learner code has run: an answer that patches
``sys.modules``, the grading helpers or the check itself patches them in the worker only.

The verdict ``reference`` (the answer is, copies or calls the reference implementation) comes from
the worker's tripwires and fingerprints (see :mod:`~rlcourse.tools.grade_worker`) and, before the
notebook runs, from :mod:`rlcourse.tools.copies` on the notebook's text.

The fork server the workers come from imports this module's :data:`_PRELOAD` once; like any
``multiprocessing`` fork server it also re-imports the judge's ``__main__`` module, which must
therefore do nothing on import (``python -m rlcourse``, pytest and a guarded script all qualify).
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import multiprocessing
import types

import cloudpickle
import torch

from rlcourse.tools import grade_wire as wire

# Built-in exceptions a learner's error keeps its type as (a check may expect a ValueError).
_BUILTIN_ERRORS = {name: obj for name, obj in vars(builtins).items()
                   if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == "builtins"}
_PRELOAD = ["rlcourse.tools.grade_worker"]
_context = None


def resolve(name: str):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _fork_context():
    """Workers are forked from a server that imported torch and rlcourse once (and ran nothing)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


class ReferenceUsed(Exception):
    """The answer called a reference implementation (its tripwire fired in the worker)."""


class WorkerGone(Exception):
    """The worker died, hung or sent something unreadable."""


class _JudgePickler(cloudpickle.Pickler):
    """Pickles a call's arguments for the worker: the judge's own local functions stay here."""

    def __init__(self, file, session):
        super().__init__(file)
        self.session = session

    def reducer_override(self, obj):
        from rlcourse.tools import grade_worker

        if isinstance(obj, wire.RemoteFunction):
            if obj._session is not self.session:
                raise wire.WireError("a learner function from another worker was passed on")
            return grade_worker.judge_function, (obj._handle,)
        if isinstance(obj, (types.FunctionType, types.MethodType)) and self.session.keeps_here(obj):
            return grade_worker.judge_callback, (self.session.register_callback(obj), getattr(obj, "__name__", "f"))
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided:
            grad = wire.raw(obj.grad) if obj.is_leaf and obj.grad is not None else None
            return wire.rebuild, (wire.raw(obj), obj.requires_grad, isinstance(obj, torch.nn.Parameter), grad)
        return super().reducer_override(obj)


class Session:
    """One worker holding one learner function, and the judge's side of the conversation."""

    def __init__(self, capture_file: str, references: dict[str, str], timeout: float = 600.0):
        from rlcourse.tools import grade_worker

        context = _fork_context()
        self.timeout = timeout
        self.conn, child = context.Pipe()
        self.trips, trip_child = context.Pipe(duplex=False)
        self.process = context.Process(target=grade_worker.serve, daemon=True,
                                       args=(child, trip_child, capture_file, references))
        self.process.start()
        child.close()
        trip_child.close()
        self.callbacks: list = []
        self.functions: dict = {}
        self.pending: BaseException | None = None      # a callback's error, raised when the call ends
        self.calls: list[dict] = []                     # path -> object for each call under way
        _, self.callable, value, problems, self.copies = self._wait(("hello",))
        if problems:
            raise WorkerGone(problems[0])
        self.answer = (wire.RemoteFunction(self, 0, {}) if self.callable
                       else wire.Decoder(self, {}, self.functions).decode(value))
        self.functions[("fn", 0)] = self.answer

    # -- the conversation ------------------------------------------------------------------------
    def keeps_here(self, fn) -> bool:
        """The judge's own local functions (a check's callback) run here, not in the worker."""
        qualname = getattr(fn, "__qualname__", "")
        return "<locals>" in qualname or "<lambda>" in qualname or getattr(fn, "__module__", None) == "__main__"

    def register_callback(self, fn) -> int:
        self.callbacks.append(fn)
        self.functions[("cb", len(self.callbacks) - 1)] = fn
        return len(self.callbacks) - 1

    def _send(self, *message) -> None:
        buffer = io.BytesIO()
        _JudgePickler(buffer, self).dump(message)
        try:
            self.conn.send_bytes(buffer.getvalue())
        except (OSError, EOFError):
            raise WorkerGone("the process running the answer stopped") from None

    def _wait(self, kinds: tuple):
        """Read the worker's messages, running the callbacks it asks for, until one of ``kinds``."""
        while True:
            try:
                if not self.conn.poll(self.timeout):
                    self.close(kill=True)
                    raise WorkerGone(f"the answer ran past {self.timeout:.0f} s")
                message = wire.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                raise WorkerGone("the process running the answer stopped (it crashed or exited)") from None
            if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
                raise WorkerGone("the process running the answer sent something unreadable")
            if message[0] in kinds:
                return message
            if message[0] == "callback":
                self._run_callback(message[1], message[2])
            else:
                raise WorkerGone(f"unexpected message {message[0]!r} from the worker")

    def _run_callback(self, index: int, encoded) -> None:
        __tracebackhide__ = True
        if not isinstance(index, int) or not 0 <= index < len(self.callbacks):
            raise WorkerGone("the worker asked for a callback it was never given")
        paths = self.calls[-1] if self.calls else {}
        args, kwargs = wire.Decoder(self, paths, self.functions).decode(encoded)
        try:
            value = self.callbacks[index](*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (the check's own failure: it ends the call)
            self.pending = self.pending or e
            self._send("callback_result", False, f"{type(e).__name__}")
            return
        self._send("callback_result", True, value)

    def call(self, handle: int, args: tuple, kwargs: dict):
        """Call the worker's function ``handle`` on the judge's arguments, as if it ran here."""
        __tracebackhide__ = True
        paths = dict(wire.object_paths(args, kwargs))
        self._send("call", handle, args, kwargs)
        self.calls.append(paths)
        try:
            reply = self._wait(("return", "raise", "aborted"))
        finally:
            self.calls.pop()
        state = reply[-1]
        if state is not None:
            mirror = wire.Decoder(self, paths, self.functions)
            new_args, new_kwargs = state[1]
            for target, node in zip(args, new_args[1]):
                mirror.mirror(target, node)
            for key, node in new_kwargs[2]:
                if isinstance(key, tuple) and key[0] == "v" and key[1] in kwargs:
                    mirror.mirror(kwargs[key[1]], node)
        if self.pending is not None:
            error, self.pending = self.pending, None
            raise error
        if reply[0] == "aborted":
            raise WorkerGone("the answer was stopped")
        if reply[0] == "raise":
            _, name, message, where, _ = reply
            raise _learner_error(name, message, where)
        return wire.Decoder(self, paths, self.functions).decode(reply[1])

    def vector_jacobian_product(self, handle: int, grad_output):
        self._send("vjp", handle, grad_output.detach())
        reply = self._wait(("vjp_result", "vjp_error"))
        if reply[0] == "vjp_error":
            raise RuntimeError(f"the answer's gradient could not be computed: {reply[1]}")
        if not isinstance(reply[1], list):
            raise WorkerGone("the worker sent an unreadable gradient")
        return [None if g is None else wire.tensor(g) for g in reply[1]]

    def close(self, kill: bool = False) -> list[str]:
        """End the worker; return what its last scan found (copies, replaced references)."""
        found = []
        if not kill and self.process.is_alive():
            try:
                self._send("close")
                found = list(self._wait(("bye",))[1])
            except (WorkerGone, wire.WireError):
                found = []
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return found

    def tripped(self) -> list[str]:
        """The references the answer called, and the worker's own reports, from the trip channel."""
        seen = []
        try:
            while self.trips.poll(0):
                seen.append(self.trips.recv_bytes().decode(errors="replace"))
        except (EOFError, OSError):
            pass
        return seen


def _learner_error(name: str, message: str, where: str) -> BaseException:
    if name == "ReferenceUsed":
        return ReferenceUsed(message)
    if name == "CheckFailed":
        name = "AssertionError"
    cls = _BUILTIN_ERRORS.get(name)
    error = cls(message) if cls is not None else RuntimeError(f"{name}: {message}")
    error.learner_line = where
    return error


def run_one(capture: dict, timeout: float = 600.0) -> dict:
    import rlcourse.grading as grading

    check = getattr(grading, capture["check"], None)
    if check is None:
        return {"outcome": "error", "message": f"rlcourse.grading has no {capture['check']}"}
    references = {name: name for name in getattr(check, "references", ())}
    try:
        session = Session(capture["file"], references, timeout)
    except (WorkerGone, wire.WireError) as e:
        return {"outcome": "error", "message": str(e)}
    outcome = _judge(check, session)
    trips = session.tripped()
    late = session.close(kill=outcome.get("kill", False))
    trips += session.tripped()
    called = sorted({t for t in trips if not t.startswith("!")})
    reports = sorted({t[1:] for t in trips if t.startswith("!")} | set(late))
    if session.copies:
        return {"outcome": "reference", "message": "; ".join(session.copies)}
    if called:
        return {"outcome": "reference", "message": f"the answer calls the reference {', '.join(called)}"}
    if reports:
        copies = [r for r in reports if "copy" in r or "compiled" in r]
        return {"outcome": "reference" if copies else "tampered", "message": "; ".join(reports)}
    outcome.pop("kill", None)
    return outcome


def _judge(check, session: Session) -> dict:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            check(session.answer)
    except NotImplementedError as e:
        return {"outcome": "not implemented", "message": f"NotImplementedError: {e}"}
    except ReferenceUsed as e:
        return {"outcome": "reference", "message": f"the answer calls the reference {e}"}
    except WorkerGone as e:
        return {"outcome": "error", "message": str(e), "kill": True}
    except wire.WireError as e:
        return {"outcome": "error", "message": str(e), "kill": True}
    except AssertionError as e:
        return {"outcome": "failed", "message": str(e)}
    except Exception as e:  # the learner's code raised: report it as the learner would see it
        return {"outcome": "error", "message": f"{type(e).__name__}: {e}{getattr(e, 'learner_line', '')}"}
    return {"outcome": "passed", "message": out.getvalue().strip()}
