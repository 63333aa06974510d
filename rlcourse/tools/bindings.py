"""What the names of a notebook are bound to, read from its text (nothing runs).

The grader judges what a name *is*, not how it is spelt: ``compile(...)`` after
``from re import compile`` compiles a regular expression, not source code, and ``run(s)`` after
``run = exec`` runs source code. :class:`Reader` walks a notebook's cells in order, as the kernel
runs them, and keeps, for each name, the *origins* it may be bound to: dotted paths such as
``"builtins.exec"``, ``"re.compile"`` or ``"rlcourse.grading.check_gae"``. A name bound by an
import or by an assignment of another name (``e = exec``, ``c = importlib.import_module("x")``,
``f = getattr(builtins, "exec")``) keeps the origin of what it names; a name bound to anything else
(a ``def``, a computed value, an argument) has no origin the text can tell. A binding that may not
run (under ``if``, ``for``, ``while``, ``try``) adds its origin to the ones the name had, so
``if False: from re import compile`` leaves ``compile`` possibly the built-in.

What the grader asks of it: which calls run code from strings (:func:`rlcourse.tools.grade.hidden_code`),
which cells rebind a check or patch ``rlcourse``, and which reach into the grader's private code
(:func:`rlcourse.tools.checkcells.audit`).
"""
from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field

_BUILTIN_NAMES = frozenset(dir(builtins))
_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.IfExp, ast.Match) + (
    (ast.TryStar,) if hasattr(ast, "TryStar") else ())


@dataclass
class Event:
    """One thing a cell does with a name: ``kind`` is ``call``, ``bind``, ``store`` (an attribute or item
    written), ``load`` (a name or attribute read) or ``import`` (a module imported)."""
    kind: str
    origins: frozenset
    node: ast.AST
    name: str = ""              # bind: the name bound; store: the attribute or item written


@dataclass
class Reader(ast.NodeVisitor):
    """Reads cells in order; ``scopes[0]`` is the notebook's namespace, kept from cell to cell."""

    scopes: list = field(default_factory=lambda: [{}])
    events: list = field(default_factory=list)
    _branch: int = 0

    # -- reading ------------------------------------------------------------------------------
    def read(self, source: str) -> list[Event]:
        """The events of one cell (a cell that does not parse has none)."""
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return []
        start = len(self.events)
        self.visit(tree)
        return self.events[start:]

    def origins(self, node) -> frozenset:
        """What an expression may be bound to (empty: the text cannot tell)."""
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            if node.id == "__builtins__":
                return frozenset({"builtins"})
            return frozenset({f"builtins.{node.id}"}) if node.id in _BUILTIN_NAMES else frozenset()
        if isinstance(node, ast.Attribute):
            return _extend(self.origins(node.value), node.attr)
        if isinstance(node, ast.Subscript):           # sys.modules["m"], builtins.__dict__["exec"], vars(m)["x"]
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                base = self.origins(node.value)
                if base == {"sys.modules"}:
                    return frozenset({key.value})
                return _extend(frozenset(b[:-len(".__dict__")] for b in base if b.endswith(".__dict__")), key.value)
            return frozenset()
        if isinstance(node, ast.Call):
            return self._call_result(node)
        if isinstance(node, ast.NamedExpr):
            return self.origins(node.value)
        return frozenset()

    def _call_result(self, node: ast.Call) -> frozenset:
        func = self.origins(node.func)
        first = node.args[0] if node.args else None
        second = node.args[1] if len(node.args) > 1 else None
        if func & {"builtins.getattr"} and isinstance(second, ast.Constant) and isinstance(second.value, str):
            return _extend(self.origins(first), second.value)
        if func & {"builtins.vars"} and first is not None:
            return _extend(self.origins(first), "__dict__")
        if func & {"importlib.import_module", "builtins.__import__"} and isinstance(first, ast.Constant) \
                and isinstance(first.value, str):
            name = first.value
            fromlist = node.args[3] if len(node.args) > 3 else next(
                (k.value for k in node.keywords if k.arg == "fromlist"), None)
            if func == {"builtins.__import__"} and not fromlist:
                name = name.split(".")[0]
            return frozenset({name})
        return frozenset()

    # -- bindings -----------------------------------------------------------------------------
    def bind(self, name: str, origins: frozenset, node) -> None:
        scope = self.scopes[-1]
        if self._branch and name in scope:
            origins = origins | scope[name]
        elif self._branch:                      # bound only if the branch runs: else what it was before
            origins = origins | self.origins(ast.Name(id=name, ctx=ast.Load()))
        scope[name] = frozenset(origins)
        self.events.append(Event("bind", frozenset(origins), node, name))

    def bind_target(self, target, value_origins: frozenset | None, node) -> None:
        """Bind an assignment target; ``value_origins`` is what the value may be (None: a value with no origin)."""
        if isinstance(target, ast.Name):
            self.bind(target.id, value_origins or frozenset(), node)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.bind_target(element.value if isinstance(element, ast.Starred) else element, None, node)
        elif isinstance(target, ast.Starred):
            self.bind_target(target.value, None, node)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            self.visit(target.value)
            if isinstance(target, ast.Subscript):
                self.visit(target.slice)
            what = target.attr if isinstance(target, ast.Attribute) else (
                target.slice.value if isinstance(target.slice, ast.Constant) else "")
            self.events.append(Event("store", self.origins(target.value), target, str(what)))

    def visit_Import(self, node):
        for alias in node.names:
            self.events.append(Event("import", frozenset({alias.name}), node))
            if alias.asname:
                self.bind(alias.asname, frozenset({alias.name}), node)
            else:
                top = alias.name.split(".")[0]
                self.bind(top, frozenset({top}), node)

    def visit_ImportFrom(self, node):
        module = node.module or ""
        known = node.level == 0
        if known:
            self.events.append(Event("import", frozenset({module}), node))
        for alias in node.names:
            if alias.name == "*":
                continue
            origin = frozenset({f"{module}.{alias.name}"}) if known else frozenset()
            self.bind(alias.asname or alias.name, origin, node)

    def visit_Assign(self, node):
        self.visit(node.value)
        value = self.origins(node.value)
        if len(node.targets) == 1 and isinstance(node.targets[0], (ast.Tuple, ast.List)) \
                and isinstance(node.value, (ast.Tuple, ast.List)) and len(node.targets[0].elts) == len(node.value.elts):
            for target, element in zip(node.targets[0].elts, node.value.elts):     # a, b = exec, eval
                self.bind_target(target, self.origins(element), node)
            return
        for target in node.targets:
            self.bind_target(target, value, node)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
            self.bind_target(node.target, self.origins(node.value), node)

    def visit_AugAssign(self, node):
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self.events.append(Event("load", self.origins(node.target), node.target))
        self.bind_target(node.target, None, node)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.bind_target(node.target, self.origins(node.value), node)

    def visit_Delete(self, node):
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.scopes[-1].pop(target.id, None)
            else:
                self.bind_target(target, None, node)

    def _function(self, node, name: str | None):
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for decorator in getattr(node, "decorator_list", []):
            self.visit(decorator)
        if name is not None:
            self.bind(name, frozenset(), node)
        self.scopes.append({})
        branch, self._branch = self._branch, 0
        args = node.args
        for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if a is not None:
                self.scopes[-1][a.arg] = frozenset()
        body = node.body if isinstance(node.body, list) else [node.body]
        for statement in body:
            self.visit(statement)
        self.scopes.pop()
        self._branch = branch

    def visit_FunctionDef(self, node):
        self._function(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._function(node, None)

    def visit_ClassDef(self, node):
        for expr in node.bases + [k.value for k in node.keywords] + node.decorator_list:
            self.visit(expr)
        self.scopes.append({})
        for statement in node.body:
            self.visit(statement)
        self.scopes.pop()
        self.bind(node.name, frozenset(), node)

    def _comprehension(self, node, elements):
        self.visit(node.generators[0].iter)
        self.scopes.append({})
        for k, generator in enumerate(node.generators):
            if k:
                self.visit(generator.iter)
            self.bind_target(generator.target, None, node)
            for condition in generator.ifs:
                self.visit(condition)
        for element in elements:
            self.visit(element)
        self.scopes.pop()

    def visit_ListComp(self, node):
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        self._comprehension(node, [node.key, node.value])

    def visit_For(self, node):
        self.visit(node.iter)
        self._branch += 1
        self.bind_target(node.target, None, node)
        for statement in node.body + node.orelse:
            self.visit(statement)
        self._branch -= 1

    visit_AsyncFor = visit_For

    def visit_With(self, node):
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.bind_target(item.optional_vars, None, node)
        for statement in node.body:
            self.visit(statement)

    visit_AsyncWith = visit_With

    def visit_ExceptHandler(self, node):
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bind(node.name, frozenset(), node)
        for statement in node.body:
            self.visit(statement)

    def generic_visit(self, node):
        if isinstance(node, _BRANCHES):
            self._branch += 1
            super().generic_visit(node)
            self._branch -= 1
        else:
            super().generic_visit(node)

    # -- uses ---------------------------------------------------------------------------------
    def visit_Call(self, node):
        self.generic_visit(node)
        self.events.append(Event("call", self.origins(node.func), node))
        func = self.origins(node.func)
        if func & {"builtins.setattr", "builtins.delattr"} and node.args:
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
            self.events.append(Event("store", self.origins(node.args[0]), node, str(name)))

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.events.append(Event("load", self.origins(node), node))

    def visit_Attribute(self, node):
        self.visit(node.value)
        if isinstance(node.ctx, ast.Load):
            self.events.append(Event("load", self.origins(node), node))
        elif isinstance(node.ctx, (ast.Store, ast.Del)):
            self.events.append(Event("store", self.origins(node.value), node, node.attr))


def _extend(bases: frozenset, attr: str) -> frozenset:
    return frozenset(f"{b}.{attr}" for b in bases if b)


def read_cells(sources) -> list[list[Event]]:
    """The events of each cell of a notebook, read in order in one namespace."""
    reader = Reader()
    return [reader.read(source) for source in sources]
