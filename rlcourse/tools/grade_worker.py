"""The process that runs a learner's function for the grader, and nothing else.

The judge (:mod:`rlcourse.tools.grade_runner`) starts one worker per check. Before any of the
learner's code exists in it, the worker

* turns every reference implementation of the check into a **tripwire**: the function's code is
  replaced by code that reports the call on a channel of its own and raises
  :class:`ReferenceUsed`. A reference called from any thread, under any profiler, through any
  wrapper, reports itself and computes nothing. A reference inside a cache or a decorator
  (``functools.lru_cache``, ``torch.no_grad``) is the function it wraps; a method whose code cannot be
  swapped (it calls ``super()``) is replaced on its class;
* records a **fingerprint** of each distinctive reference's bytecode (see
  :func:`rlcourse.tools.copies.distinctive`), so that a copy of it (pasted, renamed, without its
  docstring, ``exec``'d) is recognised wherever it turns up in the learner's code;
* installs an **audit hook** (which Python lets no one remove) that refuses to re-execute a
  reference's module (``importlib.reload``) and reports source handed to ``compile``/``exec``
  that defines a reference by name (a method: by its name inside a class of its class's name).

Then it loads the learner's function (cloudpickle, as the notebook's kernel saved it) and serves
the judge: calls, gradients of what it returned, and calls of functions it returned, until the
judge says ``close``. What it sends is data only (:mod:`rlcourse.tools.grade_wire`); the verdict
is the judge's.
"""
from __future__ import annotations

import gc
import os
import sys
import traceback
import types

import cloudpickle
import numpy as np  # noqa: F401  (loaded before the learner's code, as the kernel had it)
import torch

import rlcourse  # noqa: F401
import rlcourse.lm  # noqa: F401  (what lessons 07-13 call; preloaded by the judge's fork server)
from rlcourse.tools import copies, grade_wire as wire

_STUB_GLOBAL = "__rlcourse_reference_used__"


class ReferenceUsed(BaseException):
    """Raised by a tripwire: the learner's code called a reference implementation."""


class GraderAbort(BaseException):
    """Raised in the learner's code when the judge has already failed the check (a callback failed)."""


def fingerprint(code: types.CodeType) -> tuple:
    """A function's bytecode and that of the functions inside it: renaming local variables,
    dropping the docstring, or changing string constants leaves it unchanged."""
    nested = tuple(fingerprint(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return (code.co_code, nested)


def _codes_of(fn, depth: int = 0, seen=None) -> list[types.CodeType]:
    """Code objects reachable from a function: its own, nested ones, and the helpers it names."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth > 6:
        return []
    seen.add(id(fn))
    code = getattr(fn, "__code__", None)
    if code is None:
        inner = getattr(fn, "__func__", None) or getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
        return _codes_of(inner, depth + 1, seen) if inner is not None else []
    found, stack = [], [code]
    while stack:
        c = stack.pop()
        found.append(c)
        stack.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
    names = set()
    for c in found:
        names.update(c.co_names)
    helpers = [fn.__globals__.get(n) for n in names] if hasattr(fn, "__globals__") else []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            helpers.append(cell.cell_contents)
        except ValueError:
            pass
    for h in helpers:
        if isinstance(h, types.FunctionType) and not (h.__module__ or "").startswith(("rlcourse", "torch", "numpy")):
            found += _codes_of(h, depth + 1, seen)
    return found


class Worker:
    def __init__(self, conn, trip_conn, references: dict[str, str]):
        self.conn, self.trip_conn = conn, trip_conn
        self.outputs: list = []            # returned tensors with a graph, and the leaves they reach
        self.functions: list = []          # functions the judge may call: 0 is the learner's answer
        self.known: dict = {}              # id(fn) -> node, for functions the judge already knows
        self.findings: list[str] = []
        self.fingerprints: dict[tuple, str] = {}
        self.tripwired: dict[str, tuple] = {}
        self.held: dict[str, object] = {}   # what each module-level reference's module holds once tripwired
        self.reference_files: set[str] = set()
        self._in_hook = False
        self.calls: list[dict] = []        # id(obj) -> path for each call under way, innermost last
        for name, target in references.items():
            self._tripwire(name, target)
        sys.addaudithook(self._audit)

    # -- before the learner's code -------------------------------------------------------------
    def _tripwire(self, name: str, target: str) -> None:
        try:
            obj = wire_resolve(target)
        except (ImportError, AttributeError):
            return
        if isinstance(obj, type):
            obj = obj.__dict__.get("__init__")
        fn = getattr(obj, "__func__", obj)
        for _ in range(5):      # the function inside a cache or a decorator (lru_cache, torch.no_grad, wraps):
            if getattr(fn, "__wrapped__", None) is None:      # the wrapper calls it, and its code is the reference's
                break
            fn = fn.__wrapped__
        if not isinstance(fn, types.FunctionType):
            return
        if copies.reference_tokens(target) is not None:      # distinctive: a copy proves something
            self.fingerprints[fingerprint(fn.__code__)] = target
        self.reference_files.add(fn.__code__.co_filename)
        fn.__globals__[_STUB_GLOBAL] = self._tripped
        if not fn.__code__.co_freevars:
            fn.__code__ = _stub(target, self._tripped).__code__.replace(co_name=fn.__code__.co_name)
        else:                  # a closure's code cannot be swapped (a method calling super()): replace what holds it
            module, _, qualname = target.partition(":")
            owner_name, _, attr = qualname.rpartition(".")
            owner = wire_resolve(f"{module}:{owner_name}") if owner_name else sys.modules[module]
            stub = _stub(target, self._tripped)
            held = owner.__dict__.get(attr) if isinstance(owner, type) else None
            setattr(owner, attr, type(held)(stub) if isinstance(held, (staticmethod, classmethod)) else stub)
        self.tripwired[target] = (fn, target)
        if "." not in target.partition(":")[2]:
            self.held[target] = wire_resolve(target)

    def _tripped(self, target: str):
        try:
            self.trip_conn.send_bytes(target.encode())
        except OSError:
            pass
        raise ReferenceUsed(target)

    def _audit(self, event: str, args) -> None:
        if self._in_hook or event not in ("exec", "compile"):
            return
        self._in_hook = True
        try:
            if event == "exec" and isinstance(args[0], types.CodeType) and args[0].co_filename in self.reference_files \
                    and args[0].co_name == "<module>":
                self._report(f"the module of a reference was executed again ({args[0].co_filename})")
                raise ImportError("the grader does not allow re-loading the course's reference implementations")
            if event == "compile" and isinstance(args[0], (str, bytes)) and len(args[0]) > 80:
                source = args[0].decode(errors="replace") if isinstance(args[0], bytes) else args[0]
                for target in self.tripwired:
                    *owners, name = target.rpartition(":")[2].split(".")
                    if f"def {name}(" in source and all(f"class {owner}" in source for owner in owners):
                        self._report(f"source defining the reference {target} was compiled at run time")
        finally:
            self._in_hook = False

    def _report(self, finding: str) -> None:
        self.findings.append(finding)
        try:
            self.trip_conn.send_bytes(b"!" + finding.encode())
        except OSError:
            pass

    def copies_in(self, codes) -> list[str]:
        hits = []
        for code in codes:
            target = self.fingerprints.get(fingerprint(code))
            if target is not None:
                hits.append(f"the answer holds a copy of the reference implementation {target}")
        return sorted(set(hits))

    # -- serving the judge ----------------------------------------------------------------------
    def send(self, *message) -> None:
        self.conn.send_bytes(wire.dumps(message))

    def receive(self):
        return cloudpickle.loads(self.conn.recv_bytes())

    def serve(self, until: tuple = ("close",)):
        """Answer the judge's requests until one of the kinds in ``until`` arrives; return it."""
        while True:
            message = self.receive()
            kind = message[0]
            if kind in until:
                return message
            if kind == "call":
                self.call(*message[1:])
            elif kind == "vjp":
                self.vjp(*message[1:])
            else:
                raise RuntimeError(f"unexpected message {kind!r} from the judge")

    def call(self, handle: int, args: tuple, kwargs: dict) -> None:
        paths = {id(obj): path for path, obj in wire.object_paths(args, kwargs)}
        self.calls.append(paths)
        try:
            self._call(handle, args, kwargs, paths)
        finally:
            self.calls.pop()

    def _call(self, handle: int, args: tuple, kwargs: dict, paths: dict) -> None:
        try:
            result = self.functions[handle](*args, **kwargs)
        except GraderAbort:
            self.send("aborted", self._state(args, kwargs))
            return
        except ReferenceUsed as e:
            self.send("raise", "ReferenceUsed", str(e), "", self._state(args, kwargs))
            return
        except BaseException as e:  # noqa: BLE001  (the learner's error, reported as the learner would see it)
            if isinstance(e, KeyboardInterrupt):
                raise
            self.send("raise", type(e).__name__, str(e)[:4000], _learner_line(e), self._state(args, kwargs))
            return
        try:
            encoded = wire.Encoder(paths, self.outputs, self.functions, self.known).encode(result)
        except (wire.WireError, RecursionError) as e:
            self.send("raise", "TypeError", f"the answer cannot be handed to the grader: {e}", "",
                      self._state(args, kwargs))
            return
        self.send("return", encoded, self._state(args, kwargs))

    def _state(self, args, kwargs):
        try:
            return wire.Encoder(None, [], self.functions, self.known).encode((tuple(args), dict(kwargs)))
        except (wire.WireError, RecursionError):
            return None

    def vjp(self, handle: int, grad_output) -> None:
        output, leaves = self.outputs[handle]
        try:
            grads = torch.autograd.grad(output, leaves, grad_outputs=grad_output.to(output.dtype),
                                        retain_graph=True, allow_unused=True)
        except BaseException as e:  # noqa: BLE001
            self.send("vjp_error", f"{type(e).__name__}: {e}"[:1000])
            return
        self.send("vjp_result", [None if g is None else wire.raw(g) for g in grads])

    def callback(self, index: int, name: str, args: tuple, kwargs: dict):
        """Run one of the judge's functions (a callback it passed) in the judge."""
        paths = self.calls[-1] if self.calls else None     # the judge's objects come back as its own
        encoded = wire.Encoder(paths, [], self.functions, self.known).encode((tuple(args), dict(kwargs)))
        self.send("callback", index, encoded)
        reply = self.serve(until=("callback_result",))
        _, ok, value = reply
        if not ok:
            raise GraderAbort(value)
        return value


_WORKER: Worker | None = None


def _stub(target: str, tripped):
    """A function that reports a call of ``target`` (through the global ``_STUB_GLOBAL``)."""
    namespace: dict = {}
    exec(compile(f"def stub(*args, **kwargs):\n    return {_STUB_GLOBAL}({target!r})\n", "<tripwire>", "exec"),
         {_STUB_GLOBAL: tripped}, namespace)
    return namespace["stub"]


def wire_resolve(name: str):
    import importlib

    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def judge_function(handle: int):
    """Unpickled in the worker for a function the judge got from it: the worker's own function."""
    return _WORKER.functions[handle]


def judge_callback(index: int, name: str):
    """Unpickled in the worker for a function of the judge's: calling it asks the judge to run it."""
    def callback(*args, **kwargs):
        return _WORKER.callback(index, name, args, kwargs)
    callback.__name__ = callback.__qualname__ = name
    _WORKER.known[id(callback)] = ("cb", index)
    _WORKER.functions.append(callback)       # keeps it alive (its id stays its own)
    return callback


def _unwrapped(fn) -> list:
    """``fn`` and what it wraps (a ``functools.partial``, a bound method, ``functools.wraps``)."""
    found = []
    for _ in range(10):
        found.append(fn)
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return found


def _learner_line(exc: BaseException) -> str:
    """Where in the learner's own code an unexpected error was raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/rlcourse/" not in f.filename.replace("\\", "/") and "site-packages" not in f.filename]
    if not frames:
        return ""
    last = frames[-1]
    return f" (in {last.name}, line {last.lineno}: {last.line})" if last.line else f" (in {last.name})"


def serve(conn, trip_conn, capture_file: str, references: dict[str, str]) -> None:
    """The worker's life: tripwires, the learner's function, the judge's requests, a last scan."""
    global _WORKER
    devnull = open(os.devnull, "w")
    sys.stdout = sys.stderr = devnull            # what the learner's code prints is not the grader's
    _WORKER = worker = Worker(conn, trip_conn, references)
    before = {id(f) for f in gc.get_objects() if isinstance(f, types.FunctionType)}
    try:
        with open(capture_file, "rb") as f:
            args, kwargs = cloudpickle.load(f)
        fn = args[0]
    except BaseException as e:  # noqa: BLE001
        worker.send("hello", False, None, [f"the answer could not be loaded: {type(e).__name__}: {e}"[:300]], [])
        return
    worker.functions.append(fn)
    worker.known[id(fn)] = ("fn", 0, {})
    copies = worker.copies_in(_codes_of(fn)) if callable(fn) else []
    copies += [f"the answer is the reference implementation {target} itself"
               for target, (ref, _) in worker.tripwired.items() if ref in _unwrapped(fn)]
    value = None if callable(fn) else wire.Encoder(None, [], worker.functions, worker.known).encode(fn)
    worker.send("hello", callable(fn), value, [], copies)
    try:
        worker.serve()
    except EOFError:
        return
    new = [f for f in gc.get_objects() if isinstance(f, types.FunctionType) and id(f) not in before]
    late = worker.copies_in(c for f in new for c in _codes_of(f))
    moved = [f"the reference {t} was replaced in its module" for t, held in worker.held.items()
             if getattr(sys.modules.get(t.partition(":")[0]), t.partition(":")[2], held) is not held]
    worker.send("bye", sorted(set(late + moved + worker.findings)))
