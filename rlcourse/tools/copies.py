"""Find a reference implementation copied into a notebook, by reading its text (nothing runs).

A copy is recognised by its shape, not its spelling: each function is parsed, its docstring,
annotations and decorators dropped, every variable renamed by order of first use (``x``, ``logp``
and ``chosen`` all become ``_0`` ...), every string replaced by one placeholder, and what is left
is compared with the reference's own normalised form. Renaming, re-wording messages, deleting the
docstring, or keeping the copy as a helper under another name changes nothing; source held in a
string (to be ``exec``'d) is parsed as well.

Only a *distinctive* reference is compared: a long one, or one that checks its inputs (it raises)
or calls the package's private helpers (``_check_beta``...), things a learner who writes the
formula does not write. A plain formula is written the same way by anyone who writes it right, so its "copy" proves
nothing (the call tripwires of :mod:`~rlcourse.tools.grade_worker` still catch it being *called*).
A function counts as a copy from a similarity of :data:`THRESHOLD` (difflib's ratio over the
normalised token sequences); the course's own solution notebooks, written with the references at
hand, stay below it (``tests/test_grading_copies.py``).

The same normal form finds an answer pasted from the course's own solution notebooks
(``solutions/``, which ship with the course): :func:`find_solution_copies` compares the functions of
an answer with the shipped solution's answer of the same exercise, and reports those equal to it
once renamed (answers of at least :data:`MIN_SOLUTION_STATEMENTS` statements: a one-line formula is
everyone's).
"""
from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import textwrap
from dataclasses import dataclass

THRESHOLD = 0.95


@dataclass
class Copy:
    reference: str
    cell: int
    function: str
    similarity: float

    def __str__(self) -> str:
        return (f"`{self.function}` (cell {self.cell}) is a copy of the reference implementation "
                f"{self.reference} (similarity {self.similarity:.2f})")


class _Normalise(ast.NodeTransformer):
    def __init__(self):
        self.names: dict[str, str] = {}

    def _rename(self, name: str) -> str:
        return self.names.setdefault(name, f"_{len(self.names)}")

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id=self._rename(node.id), ctx=node.ctx), node)

    def visit_arg(self, node):
        return ast.copy_location(ast.arg(arg=self._rename(node.arg), annotation=None), node)

    def visit_Constant(self, node):
        return ast.copy_location(ast.Constant(value="S" if isinstance(node.value, str) else node.value), node)

    def visit_JoinedStr(self, node):
        return ast.copy_location(ast.Constant(value="S"), node)

    def visit_FunctionDef(self, node):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        # a bare string statement elsewhere (a comment in disguise) does not count either
        body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        new = ast.FunctionDef(name="_f", args=self.visit(node.args), body=[self.visit(s) for s in body] or [ast.Pass()],
                              decorator_list=[], returns=None, type_comment=None)
        return ast.copy_location(new, node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[self.visit(node.target)], value=self.visit(node.value)), node)


def tokens(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The normalised form of a function, as a sequence of tokens to compare."""
    normal = _Normalise().visit(ast.parse(ast.unparse(function)).body[0])
    return ast.dump(normal, annotate_fields=False).replace("(", " ( ").replace(")", " ) ").replace(",", " ").split()


def functions_in(source: str, depth: int = 0) -> list[ast.FunctionDef]:
    """Every function defined in ``source``, nested ones and those in code held in strings."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(node)
        elif depth < 2 and isinstance(node, ast.Constant) and isinstance(node.value, str) and "def " in node.value:
            found += functions_in(textwrap.dedent(node.value), depth + 1)
    return found


LONG = 12    # statements: a function this long is not written the same way twice by chance


def distinctive(function: ast.FunctionDef) -> bool:
    """Whether a function's shape identifies it: it is long, or it does what only a library function
    does (raise, assert, call a private helper)."""
    if sum(isinstance(node, ast.stmt) for node in ast.walk(function)) > LONG:
        return True
    for node in ast.walk(function):
        if isinstance(node, (ast.Raise, ast.Assert)):
            return True
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if name.startswith("_") and not name.startswith("__"):
            return True
    return False


def reference_tokens(name: str) -> list[str] | None:
    """The normalised form of a distinctive reference ``module:qualname``, else ``None``. The grading modules'
    own reference helpers are never compared: they are written as a learner writes the answer (the reference
    step of an exercise is its solution's twin), so a copy of one proves nothing; calling one is what is caught."""
    module, _, qualname = name.partition(":")
    if module == "rlcourse.grading" or module.startswith("rlcourse.grading."):
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
        return None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return tokens(defs[0]) if defs and distinctive(defs[0]) else None


def similarity(a: list[str], b: list[str]) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def reachable(cells: list[tuple[int, str]], start: str) -> set[str]:
    """Names of the notebook's functions that ``start`` can reach by naming them (its helpers,
    theirs, ...), ``start`` included: the code that makes up one answer."""
    defs: dict[str, list[ast.FunctionDef]] = {}
    for _, source in cells:
        for function in functions_in(source):
            defs.setdefault(function.name, []).append(function)
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        for function in defs[name]:
            todo += [n.id for n in ast.walk(function) if isinstance(n, ast.Name)]
    return seen


def find_copies(cells: list[tuple[int, str]], references: list[str], answer: str | None = None) -> list[Copy]:
    """The copies of ``references`` among the functions of ``cells`` (``(index, source)`` pairs);
    with ``answer``, only among the functions that the answer ``answer`` reaches."""
    forms = {name: reference_tokens(name) for name in references}
    forms = {name: form for name, form in forms.items() if form is not None}
    part_of_answer = reachable(cells, answer) if answer is not None else None
    found = []
    for index, source in cells:
        for function in functions_in(source):
            if part_of_answer is not None and function.name not in part_of_answer:
                continue
            mine = tokens(function)
            for name, form in forms.items():
                if not 0.5 * len(form) <= len(mine) <= 2 * len(form):
                    continue
                score = similarity(mine, form)
                if score >= THRESHOLD:
                    found.append(Copy(name, index, function.name, score))
    return found


# --------------------------------------------------------------------------- the shipped solutions
BEGIN_SOLUTION = "### BEGIN SOLUTION"
MIN_SOLUTION_STATEMENTS = 3   # a shorter answer is written the same way by anyone who writes it right


def statements(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The statements of a function's body, nested ones included (a docstring does not count)."""
    body = function.body[1:] if function.body and isinstance(function.body[0], ast.Expr) \
        and isinstance(function.body[0].value, ast.Constant) else function.body
    return sum(isinstance(node, ast.stmt) for statement in body for node in ast.walk(statement))


def solution_answers(cells: list[tuple[int, str]]) -> dict[str, list[list[str]]]:
    """``{name: [normalised form, ...]}`` of the answers of a solution notebook: each function defined in a cell
    that holds a solution region (``### BEGIN SOLUTION``) and has at least :data:`MIN_SOLUTION_STATEMENTS`."""
    answers: dict[str, list[list[str]]] = {}
    for _, source in cells:
        if BEGIN_SOLUTION not in source:
            continue
        for function in functions_in(source):
            if statements(function) >= MIN_SOLUTION_STATEMENTS:
                answers.setdefault(function.name, []).append(tokens(function))
    return answers


def find_solution_copies(cells: list[tuple[int, str]], forms: list[list[str]], answer: str) -> list[tuple[int, str]]:
    """``(cell, function)`` for each function of the answer ``answer`` (itself and the helpers it reaches) whose
    normalised form equals one of ``forms``: the shipped solution's answer, renamed or not."""
    part_of_answer = reachable(cells, answer)
    found = []
    for index, source in cells:
        for function in functions_in(source):
            if function.name in part_of_answer and tokens(function) in forms:
                found.append((index, function.name))
    return found
