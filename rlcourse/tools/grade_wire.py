"""What crosses between the grader and the process that runs a learner's function, and how.

``grade`` runs each check in a clean process (the *judge*) and the learner's function in another
(the *worker*, :mod:`rlcourse.tools.grade_worker`). The judge sends a call's arguments to the
worker with cloudpickle (the judge's own objects: nothing to fear). What comes back is untrusted,
so it is never unpickled as code: the worker turns it into a tree of tagged tuples holding only
Python scalars, strings and bytes, tensors and arrays as their raw bytes (:class:`Encoder`),
pickled, and read by the judge with an unpickler that refuses every global name (:func:`loads`),
so nothing but those builtin types can come out of it. The judge then
builds plain values from the tree (:class:`Decoder`): containers, tensors, arrays; objects of the
course's own trusted libraries rebuilt by ``object.__new__`` and their attributes, nothing
called; anything else a read-only :class:`Opaque` record; a function a :class:`RemoteFunction`
that calls back into the worker.

Three things make a call in the worker look, to the check, like a call in its own process:

* **in-place changes come back.** After each call the worker encodes its copies of the arguments
  again and the judge copies the differences onto its own objects (:meth:`Decoder.mirror`):
  tensor values, ``.grad`` and ``requires_grad``, arrays, list and dict items, module parameters,
  buffers and train/eval flags, optimizer and ``torch.Generator`` state, object attributes;
* **identity comes back.** An answer that returns one of its arguments, or a part of one (a
  parameter, a sub-module, a list item), gets the judge's own object: both sides name it by the
  same path (:func:`object_paths`);
* **gradients come back.** A returned tensor that hangs off the arguments in the worker's autograd
  graph becomes, in the judge, a tensor whose backward asks the worker for the vector-Jacobian
  product (:class:`RemoteGradient`) and hands it to the judge's own arguments: first order, exact.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import io
import math
import pickle
from collections import OrderedDict, defaultdict

import numpy as np
import torch

# Objects of these libraries may be rebuilt in the judge (by object.__new__ and their attributes,
# no constructor run); objects of other classes, the notebook's own among them, arrive as Opaque.
TRUSTED = ("rlcourse", "torch", "numpy", "transformers", "tokenizers", "trl", "collections", "types",
           "dataclasses")
MAX_NODES = 5_000_000
_PRIMITIVES = (type(None), bool, int, float, str, bytes)        # pickled without any global name


class WireError(RuntimeError):
    """What the worker sent cannot be read as an answer (too large, too deep, or malformed)."""


def _class_path(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted_class(path: str):
    """The class named ``module:qualname`` if it belongs to a trusted library and may be rebuilt."""
    module, _, qualname = path.partition(":")
    if module.split(".")[0] not in TRUSTED or "<" in qualname:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None


def _is_function(obj) -> bool:
    """Functions, methods and other callables that are not classes, modules or data: they stay
    where they were made and are called there (see :class:`RemoteFunction`)."""
    return callable(obj) and not isinstance(obj, (type, torch.nn.Module, torch.Tensor, np.ndarray, np.generic))


# ----------------------------------------------------------------------------------------- paths
def object_paths(args: tuple, kwargs: dict) -> list[tuple[tuple, object]]:
    """Every object reachable from a call's arguments, each with the path that names it.

    The judge and the worker walk their own copies of the same arguments in the same order, so a
    path names the same object on both sides: ``(("arg", 0), ("p", "transformer.wte.weight"))`` is
    a parameter of the first argument. Parameters and buffers of a module are named as the module
    names them; list items by index, dict items by (scalar) key, object attributes by name.
    """
    found, seen = [], set()

    def visit(obj, path, depth):
        if isinstance(obj, _PRIMITIVES) or id(obj) in seen or depth > 8 or _is_function(obj):
            return
        seen.add(id(obj))
        found.append((path, obj))
        if isinstance(obj, (torch.Tensor, np.ndarray, torch.Generator, torch.optim.Optimizer, type)):
            return
        if isinstance(obj, torch.nn.Module):
            for name, sub in obj.named_modules():
                if name and id(sub) not in seen:
                    seen.add(id(sub))
                    found.append((path + (("m", name),), sub))
            for name, t in [*obj.named_parameters(), *obj.named_buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    found.append((path + (("p", name),), t))
            return
        if isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                visit(item, path + (("i", i),), depth + 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                if isinstance(key, (str, int, float, bool)):
                    visit(item, path + (("k", key),), depth + 1)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] != "builtins":
            for key, item in list(vars(obj).items()):
                visit(item, path + (("a", key),), depth + 1)

    for i, a in enumerate(args):
        visit(a, (("arg", i),), 0)
    for key, a in kwargs.items():
        visit(a, (("kwarg", key),), 0)
    return found


# ----------------------------------------------------------------------------------- the worker
class Encoder:
    """Turn a worker-side value into a tree of tagged tuples (see the module docstring).

    ``arg_paths`` maps ``id(obj) -> path`` for the call's arguments: an answer that returns (a
    part of) an argument is sent as ``("arg", path)``. ``outputs`` and ``functions`` are the
    worker's registries: a tensor with an autograd graph back to the arguments is kept in
    ``outputs`` (the judge may ask for its gradient), a function in ``functions`` (the judge may
    call it). ``known_functions`` maps ``id(fn) -> ("cb", k)`` or ``("fn", k)`` for functions the
    judge already knows (its own callbacks, functions it was sent before).
    """

    def __init__(self, arg_paths: dict | None = None, outputs: list | None = None,
                 functions: list | None = None, known_functions: dict | None = None):
        self.arg_paths = arg_paths or {}
        self.outputs = outputs if outputs is not None else []
        self.functions = functions if functions is not None else []
        self.known_functions = known_functions if known_functions is not None else {}
        self.memo: dict[int, int] = {}
        self.alive: list = []          # keeps encoded objects alive so that their ids stay unique
        self.nodes = 0

    def _remember(self, obj) -> int:
        k = len(self.memo)
        self.memo[id(obj)] = k
        self.alive.append(obj)
        return k

    def encode(self, obj, depth: int = 0):
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > 200:
            raise WireError("the answer is too large or too deeply nested to send to the grader")
        if type(obj) in _PRIMITIVES:
            return ("v", obj)
        if isinstance(obj, complex):
            return ("cplx", obj.real, obj.imag)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            value = obj.item()
            return ("ns", obj.dtype.str, [value.real, value.imag] if isinstance(value, complex) else value)
        if isinstance(obj, _PRIMITIVES):        # a subclass (an enum, say): its plain value
            base = next(t for t in _PRIMITIVES if isinstance(obj, t))
            return ("v", base(obj) if base is not type(None) else None)
        if id(obj) in self.arg_paths:
            return ("arg", self.arg_paths[id(obj)])
        if id(obj) in self.memo:
            return ("m", self.memo[id(obj)])
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, depth)
        if isinstance(obj, np.ndarray):
            k = self._remember(obj)
            if obj.dtype.kind in "biufc" and obj.dtype.byteorder in "=|<":
                return ("nd", k, obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes())
            return ("ndlist", k, self.encode(obj.tolist(), depth + 1), obj.dtype.str, list(obj.shape))
        if isinstance(obj, torch.dtype):
            return ("dtype", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        if isinstance(obj, torch.Size):
            return ("size", list(obj))
        if isinstance(obj, torch.Generator):
            return ("gen", self._remember(obj), raw(obj.get_state()), str(obj.device))
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return ("tuple", [self.encode(x, depth + 1) for x in obj])
        if isinstance(obj, list):
            k = self._remember(obj)
            return ("list", k, [self.encode(x, depth + 1) for x in obj])
        if isinstance(obj, dict) and type(obj) in (dict, OrderedDict, defaultdict):
            k = self._remember(obj)
            return ("dict", k, [(self.encode(key, depth + 1), self.encode(v, depth + 1)) for key, v in obj.items()],
                    type(obj).__name__)
        if isinstance(obj, (set, frozenset)):
            return ("set", [self.encode(x, depth + 1) for x in obj], isinstance(obj, frozenset))
        if _is_function(obj):
            return self._function(obj)
        if isinstance(obj, torch.nn.Module):
            k = self._remember(obj)
            modules = dict(obj.named_modules())
            return ("module", k, _class_path(type(obj)),
                    [(n, self.encode(p, depth + 1)) for n, p in obj.named_parameters()],
                    [(n, self.encode(b, depth + 1)) for n, b in obj.named_buffers()],
                    [(n, m.training) for n, m in modules.items()])
        if isinstance(obj, torch.optim.Optimizer):
            k = self._remember(obj)
            return ("optim", k, _class_path(type(obj)), self.encode(obj.state_dict(), depth + 1))
        if isinstance(obj, type):
            return ("opaque", self._remember(obj), _class_path(obj), f"the class {obj.__qualname__}")
        return self._object(obj, depth)

    def _tensor(self, t: torch.Tensor, depth: int):
        k = self._remember(t)
        value = t.detach().clone()
        grad = self.encode(t.grad, depth + 1) if t.is_leaf and t.grad is not None and t.grad is not t else None
        how = None
        if t.requires_grad:
            if t.grad_fn is None:
                how = ("leaf",)
            else:
                reached = _leaves_reached(t, self.arg_paths)
                if reached:
                    self.outputs.append((t, [leaf for leaf, _ in reached]))
                    how = ("graph", len(self.outputs) - 1, [path for _, path in reached])
                else:
                    how = ("detached-graph",)
        return ("t", k, raw(value), isinstance(t, torch.nn.Parameter), how, grad)

    def _function(self, fn):
        if id(fn) in self.known_functions:
            return self.known_functions[id(fn)]
        self.functions.append(fn)
        handle = len(self.functions) - 1
        node = ("fn", handle, {a: getattr(fn, a) for a in ("__name__", "__qualname__", "__doc__")
                               if isinstance(getattr(fn, a, None), str)})
        self.known_functions[id(fn)] = node
        self.alive.append(fn)
        return node

    def _object(self, obj, depth: int):
        k = self._remember(obj)
        cls = type(obj)
        if isinstance(obj, np.random.Generator):
            return ("npgen", k, _class_path(type(obj.bit_generator)), self.encode(obj.bit_generator.state, depth + 1))
        if dataclasses.is_dataclass(obj):
            fields = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        elif hasattr(obj, "__dict__"):
            fields = list(vars(obj).items())
        elif hasattr(obj, "_fields"):          # a namedtuple
            fields = list(zip(obj._fields, obj))
        else:
            return ("opaque", k, _class_path(cls), repr(obj)[:200])
        encoded = [(name, self.encode(value, depth + 1)) for name, value in fields if isinstance(name, str)]
        kind = "namedtuple" if hasattr(obj, "_fields") and isinstance(obj, tuple) else "obj"
        return (kind, k, _class_path(cls), encoded, repr(obj)[:200] if kind == "obj" else "")


def _leaves_reached(t: torch.Tensor, arg_paths: dict) -> list:
    """The argument tensors (leaves of the worker's graph) that ``t``'s graph reaches, with paths."""
    reached, seen, stack = [], set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)       # an AccumulateGrad node: a leaf tensor
        if variable is not None and id(variable) in arg_paths:
            reached.append((variable, arg_paths[id(variable)]))
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return reached


def raw(t: torch.Tensor) -> tuple:
    """A tensor as plain data: ``("T", dtype, shape, device, bytes)``."""
    t = t.detach().contiguous()
    host = t.cpu()
    if host.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    return ("T", str(t.dtype).removeprefix("torch."), list(t.shape), str(t.device), host.numpy().tobytes())


def tensor(node) -> torch.Tensor:
    """The tensor that :func:`raw` wrote (a new one, on its device)."""
    if not (isinstance(node, tuple) and len(node) == 5 and node[0] == "T"):
        raise WireError("a tensor node without a tensor")
    _, dtype_name, shape, device, data = node
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype) or not isinstance(data, bytes):
        raise WireError(f"unreadable tensor of dtype {dtype_name!r}")
    stored = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(data), dtype=stored) if data else torch.empty(0, dtype=stored)
    value = flat.view(dtype) if stored is not dtype else flat
    return value.reshape(shape).to(device)


def rebuild(node, requires_grad: bool, is_param: bool, grad=None) -> torch.Tensor:
    """A tensor the judge sent (see ``grade_runner``'s pickler), as a leaf: raw bytes are faster to
    send than torch's own pickling of storages."""
    value = tensor(node)
    if is_param:
        value = torch.nn.Parameter(value, requires_grad=requires_grad)
    elif requires_grad:
        value.requires_grad_(True)
    if grad is not None:
        value.grad = tensor(grad)
    return value


def dumps(tree) -> bytes:
    return pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)


class _DataOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise WireError(f"the worker sent an object of {module}.{name}; the grader reads data only")


def loads(data: bytes):
    """Read what the worker sent: builtin containers, scalars, strings and bytes, nothing else."""
    try:
        return _DataOnly(io.BytesIO(data)).load()
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"the worker's message could not be read: {type(e).__name__}: {e}"[:300]) from None


# ------------------------------------------------------------------------------------ the judge
class Opaque:
    """An object of a class the judge does not rebuild (the notebook's own, say): its attributes."""

    def __init__(self, class_path: str, text: str, attributes: dict):
        object.__setattr__(self, "_class_path", class_path)
        object.__setattr__(self, "_text", text)
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def __repr__(self):
        return self._text or f"<{self._class_path} object>"


class RemoteFunction:
    """A function that lives in the worker; calling it calls it there."""

    def __init__(self, session, handle: int, attributes: dict):
        self._session, self._handle = session, handle
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True
        return self._session.call(self._handle, args, kwargs)

    def __repr__(self):
        return f"<learner function {getattr(self, '__name__', '?')}>"

    # A copy is the same function, as Python's copy of a plain function is (a trainer that copies its
    # reward per seed, such as the seed-batched one, calls the one function in the worker).
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class RemoteGradient(torch.autograd.Function):
    """A returned value whose backward is the worker's vector-Jacobian product (first order)."""

    @staticmethod
    def forward(ctx, value, session, handle, *inputs):
        ctx.session, ctx.handle = session, handle
        ctx.shapes = [(x.shape, x.dtype) for x in inputs]
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        grads = ctx.session.vector_jacobian_product(ctx.handle, grad_output)
        out = []
        for g, (shape, dtype) in zip(grads, ctx.shapes):
            if g is not None and (tuple(g.shape) != tuple(shape)):
                raise WireError("the worker sent a gradient of the wrong shape")
            out.append(None if g is None else g.to(dtype))
        return (None, None, None, *out)


_MISSING = object()


class Decoder:
    """Build the judge's values from the worker's tree, and copy the worker's in-place changes.

    ``paths`` maps ``path -> object`` for the call's arguments on the judge's side (the same walk
    as the worker's, :func:`object_paths`). ``session`` is what :class:`RemoteFunction` and
    :class:`RemoteGradient` call back into.
    """

    def __init__(self, session, paths: dict | None = None, functions: dict | None = None):
        self.session = session
        self.paths = paths or {}
        self.functions = functions if functions is not None else {}   # node tag + handle -> object
        self.memo: dict[int, object] = {}

    # -- values ------------------------------------------------------------------------------
    def decode(self, node):
        tag = node[0]
        if tag == "v":
            return node[1]
        if tag == "arg":
            return self._arg(node[1])
        if tag == "m":
            return self.memo[node[1]]
        if tag == "t":
            return self._tensor(node)
        if tag == "nd":
            _, k, dtype, shape, data = node
            value = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
            self.memo[k] = value
            return value
        if tag == "ndlist":
            _, k, items, dtype, shape = node
            value = np.array(self.decode(items), dtype=np.dtype(dtype)).reshape(shape)
            self.memo[k] = value
            return value
        if tag == "ns":
            value = node[2]
            return np.dtype(node[1]).type(complex(*value) if isinstance(value, list) else value)
        if tag == "cplx":
            return complex(node[1], node[2])
        if tag == "dtype":
            value = getattr(torch, node[1], None)
            if not isinstance(value, torch.dtype):
                raise WireError(f"unknown dtype {node[1]!r}")
            return value
        if tag == "device":
            return torch.device(node[1])
        if tag == "size":
            return torch.Size(node[1])
        if tag == "gen":
            _, k, state, device = node
            gen = torch.Generator(device=device)
            gen.set_state(tensor(state))
            self.memo[k] = gen
            return gen
        if tag == "tuple":
            return tuple(self.decode(x) for x in node[1])
        if tag == "list":
            out: list = []
            self.memo[node[1]] = out
            out.extend(self.decode(x) for x in node[2])
            return out
        if tag == "dict":
            _, k, items, kind = node
            out = OrderedDict() if kind == "OrderedDict" else {}
            self.memo[k] = out
            for key, value in items:
                out[self.decode(key)] = self.decode(value)
            return out
        if tag == "set":
            items = [self.decode(x) for x in node[1]]
            return frozenset(items) if node[2] else set(items)
        if tag in ("fn", "cb"):
            return self._function(node)
        if tag == "module":
            return self._module(node)
        if tag == "optim":
            value = Opaque(node[2], f"<a {node[2]} optimizer>", {"state_dict": self.decode(node[3])})
            self.memo[node[1]] = value
            return value
        if tag in ("obj", "namedtuple"):
            return self._object(node)
        if tag == "opaque":
            value = Opaque(node[2], node[3], {})
            self.memo[node[1]] = value
            return value
        if tag == "npgen":
            _, k, bit_class, state = node
            bits = _trusted_class(bit_class)
            if bits is None or not issubclass(bits, np.random.BitGenerator):
                raise WireError(f"unknown random generator {bit_class!r}")
            value = np.random.Generator(bits())
            value.bit_generator.state = self.decode(state)
            self.memo[k] = value
            return value
        raise WireError(f"unknown node {tag!r}")

    def _arg(self, path):
        path = tuple(tuple(step) for step in path)
        if path not in self.paths:
            raise WireError(f"the worker named an argument the judge does not have: {path}")
        return self.paths[path]

    def _tensor(self, node):
        _, k, value, is_param, how, grad = node
        value = tensor(value)
        if how is None:
            out = value
        elif how[0] == "leaf":
            out = value.requires_grad_(True)
        elif how[0] == "detached-graph":
            out = value.requires_grad_(True) * 1     # has a graph, reaches none of the arguments
        else:
            _, handle, paths = how
            inputs = [self._arg(p) for p in paths]
            out = RemoteGradient.apply(value, self.session, handle, *inputs)
        if is_param:
            out = torch.nn.Parameter(out.detach(), requires_grad=out.requires_grad)
        if grad is not None:
            out.grad = self.decode(grad)
        self.memo[k] = out
        return out

    def _function(self, node):
        key = (node[0], node[1])
        if key not in self.functions:
            if node[0] == "cb":
                raise WireError(f"the worker named a callback the judge never sent: {node[1]}")
            self.functions[key] = RemoteFunction(self.session, node[1], node[2])
        return self.functions[key]

    def _module(self, node):
        _, k, class_path, params, buffers, training = node
        template = next((obj for obj in self.paths.values() if isinstance(obj, torch.nn.Module)
                         and _class_path(type(obj)) == class_path), None)
        if template is None:
            value = Opaque(class_path, f"<a {class_path} module the grader cannot rebuild>", {})
            self.memo[k] = value
            return value
        module = copy.deepcopy(template)
        self.memo[k] = module
        self._mirror_module(module, params, buffers, training)
        return module

    def _object(self, node):
        kind, k, class_path, fields, text = node
        cls = _trusted_class(class_path)
        if kind == "namedtuple":
            values = [self.decode(v) for _, v in fields]
            value = cls(*values) if cls is not None and issubclass(cls, tuple) else tuple(values)
            self.memo[k] = value
            return value
        if cls is not None and cls.__new__ is object.__new__ and not hasattr(cls, "__slots__"):
            value = object.__new__(cls)
            self.memo[k] = value
            for name, v in fields:
                object.__setattr__(value, name, self.decode(v))
            return value
        value = Opaque(class_path, text, {})
        self.memo[k] = value
        for name, v in fields:
            object.__setattr__(value, name, self.decode(v))
        return value

    # -- in-place changes ----------------------------------------------------------------------
    def mirror(self, target, node):
        """Copy onto ``target`` (the judge's object) what the worker's copy of it now holds.

        Returns what should stand where ``target`` stood: ``target`` itself, changed in place,
        when it can be (so the check's references to it see the change), else a new value.
        """
        tag = node[0]
        if tag == "m":
            return self.memo[node[1]]
        if tag == "t" and isinstance(target, torch.Tensor):
            _, k, value, _, _, grad = node
            self.memo[k] = target
            _copy_tensor(target, tensor(value))
            new_grad = None if grad is None else self.decode(grad)
            if target.is_leaf and not _same_tensor(target.grad, new_grad):
                target.grad = None if new_grad is None else new_grad.detach().to(target.dtype).clone()
            return target
        if tag == "nd" and isinstance(target, np.ndarray) and target.dtype.str == node[2]:
            _, k, dtype, shape, data = node
            self.memo[k] = target
            new = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
            if new.shape == target.shape and not np.array_equal(new, target, equal_nan=target.dtype.kind in "fc"):
                np.copyto(target, new)
            return target if new.shape == target.shape else self.decode(node)
        if tag == "list" and isinstance(target, list):
            _, k, items = node
            self.memo[k] = target
            if len(items) == len(target):
                for i, item in enumerate(items):
                    target[i] = self.mirror(target[i], item)
            else:
                target[:] = [self.decode(x) for x in items]
            return target
        if tag == "tuple" and isinstance(target, tuple) and len(target) == len(node[1]):
            values = [self.mirror(t, n) for t, n in zip(target, node[1])]
            return target if all(a is b for a, b in zip(values, target)) else type(target)(values) \
                if not hasattr(target, "_fields") else type(target)(*values)
        if tag == "dict" and isinstance(target, dict):
            _, k, items, _ = node
            self.memo[k] = target
            new = [(self.decode(key), value) for key, value in items]
            keys = {key for key, _ in new if isinstance(key, (str, int, float, bool, bytes, type(None)))}
            for key in [key for key in target if key not in keys]:
                del target[key]
            for key, value in new:
                target[key] = self.mirror(target.get(key, _MISSING), value)
            return target
        if tag == "module" and isinstance(target, torch.nn.Module) and _class_path(type(target)) == node[2]:
            _, k, _, params, buffers, training = node
            self.memo[k] = target
            self._mirror_module(target, params, buffers, training)
            return target
        if tag == "optim" and isinstance(target, torch.optim.Optimizer):
            self.memo[node[1]] = target
            state = self.decode(node[3])
            if isinstance(state, dict) and set(state) == {"state", "param_groups"}:
                target.load_state_dict(state)
            return target
        if tag == "npgen" and isinstance(target, np.random.Generator) \
                and _class_path(type(target.bit_generator)) == node[2]:
            self.memo[node[1]] = target
            target.bit_generator.state = self.decode(node[3])
            return target
        if tag == "opaque" and target is not _MISSING and _class_path(type(target)) == node[2]:
            self.memo[node[1]] = target        # nothing the judge can read: it keeps its own object
            return target
        if tag == "gen" and isinstance(target, torch.Generator):
            _, k, state, _ = node
            self.memo[k] = target
            target.set_state(tensor(state))
            return target
        if tag in ("obj", "namedtuple") and tag == "obj" and target is not _MISSING \
                and _class_path(type(target)) == node[2] and not isinstance(target, Opaque):
            _, k, _, fields, _ = node
            self.memo[k] = target
            names = {name for name, _ in fields}
            if hasattr(target, "__dict__") and not dataclasses.is_dataclass(target):
                for name in [n for n in vars(target) if n not in names]:
                    object.__delattr__(target, name)
            for name, value in fields:
                old = getattr(target, name, _MISSING)
                new = self.mirror(old, value)
                if new is not old:
                    object.__setattr__(target, name, new)
            return target
        if tag == "v" and not isinstance(target, (torch.Tensor, np.ndarray)) and _equal_scalars(target, node[1]):
            return target
        return self.decode(node)

    def _mirror_module(self, module, params, buffers, training):
        named = dict(module.named_parameters())
        named.update(module.named_buffers())
        for name, value in [*params, *buffers]:
            if name in named:
                self.mirror(named[name], value)
        modules = dict(module.named_modules())
        for name, flag in training:
            if name in modules:
                modules[name].training = bool(flag)


def _equal_scalars(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _same_tensor(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(a.detach(), b.detach()) or (a.is_floating_point() and
                                                ((a == b) | (a.isnan() & b.isnan())).all()))


def _copy_tensor(target: torch.Tensor, value: torch.Tensor) -> None:
    """Write the worker's value into the judge's tensor, only where it changed."""
    if _same_tensor(target.detach(), value):
        return
    with torch.no_grad():
        if target.shape == value.shape and target.dtype == value.dtype:
            target.copy_(value)
        else:
            target.data = value.clone()
