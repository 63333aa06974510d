"""A reference implementation copied into a notebook is found by reading the notebook's text.

The oracle: every distinctive reference of every check, pasted in the ways a learner would paste
it (renamed, docstring dropped, variables renamed, messages re-worded, kept as a helper, held in a
string to ``exec``), must be found; the course's own solution notebooks must not be.
"""
import ast
import inspect
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

import rlcourse  # noqa: F401  (before torch)
import rlcourse.grading as grading
from rlcourse.tools import checkcells, copies, grade

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = sorted({r for name in grading.__all__ if name.startswith("check_")
                     for r in getattr(getattr(grading, name), "references", ())})
DISTINCTIVE = [r for r in REFERENCES if copies.reference_tokens(r) is not None]


def source_of(name: str) -> str:
    module, _, qualname = name.partition(":")
    obj = __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return textwrap.dedent(inspect.getsource(obj))


def disguised(source: str) -> str:
    """The reference as a learner would paste it: renamed, no docstring, variables renamed, messages re-worded."""
    tree = ast.parse(source)
    function = tree.body[0]
    function.name = "my_answer"
    function.decorator_list = []
    if isinstance(function.body[0], ast.Expr) and isinstance(function.body[0].value, ast.Constant):
        function.body = function.body[1:] or [ast.Pass()]
    args = [a.arg for a in function.args.args]
    renamed = {name: f"v{i}" for i, name in enumerate(args)}
    for node in ast.walk(function):
        if isinstance(node, ast.arg) and node.arg in renamed:
            node.arg = renamed[node.arg]
        elif isinstance(node, ast.Name) and node.id in renamed:
            node.id = renamed[node.id]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = "oops"
    return ast.unparse(tree)


def test_most_references_are_distinctive():
    """Of the library's references (the grading modules' own helpers are written as the answers are, and never
    compared: calling one is what is caught)."""
    library = [r for r in REFERENCES if not r.startswith("rlcourse.grading")]
    assert len(DISTINCTIVE) >= 0.75 * len(library), sorted(set(library) - set(DISTINCTIVE))
    assert not [r for r in DISTINCTIVE if r.startswith("rlcourse.grading")]


@pytest.mark.parametrize("reference", DISTINCTIVE)
def test_a_pasted_reference_is_found(reference):
    pasted = disguised(source_of(reference))
    answer = "def answer(*args):\n    return my_answer(*args)"
    as_helper = copies.find_copies([(1, pasted), (2, answer)], [reference], answer="answer")
    assert as_helper and as_helper[0].function == "my_answer", pasted
    in_a_string = copies.find_copies([(1, f"exec({pasted!r})"), (2, answer)], [reference], answer="answer")
    assert in_a_string, "source held in a string is read too"


def test_a_copy_the_answer_does_not_use_is_not_charged_to_it():
    reference = "rlcourse.returns:discounted_return"
    cells = [(1, disguised(source_of(reference))), (2, "def answer(r, g):\n    return sum(r)")]
    assert copies.find_copies(cells, [reference], answer="answer") == []
    assert copies.find_copies(cells, [reference]) != []


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_the_course_solutions_are_not_copies(path):
    nb = nbformat.read(path, as_version=4)
    assert grade.static_copies(nb, checkcells.manifest_of(nb)) == {}


@pytest.mark.parametrize("source, found", [
    ("exec(code)", ["exec"]), ("x = eval('1 + 1')", ["eval"]), ("c = compile(s, 'f', 'exec')", ["compile"]),
    ("import importlib\nimportlib.reload(m)", ["importlib.reload"]), ("f.__code__ = g.__code__", ["an assignment to __code__"]),
    ("import builtins\nbuiltins.exec(s)", ["exec"]), ("from importlib import reload\nreload(m)", ["importlib.reload"]),
    ("model.eval()", []), ("torch.compile(model)", []), ("print(f.__code__)", []),
    # judged by what the called name is bound to, not by its spelling
    ("from re import compile\np = compile(r'[0-9]+')", []), ("import re as something\nsomething.compile('a')", []),
    ("config.reload()", []), ("def f(compile):\n    return compile('x')", []),
    ("run = exec\nrun(s)", ["exec"]), ("from builtins import exec as run\nrun(s)", ["exec"]),
    ("import builtins as b\nb.eval('1')", ["eval"]), ("getattr(__builtins__, 'exec')(s)", ["exec"]),
    ("import importlib\nb = importlib.import_module('builtins')\nb.compile(s, 'f', 'exec')", ["compile"]),
    ("if False:\n    from re import compile\ncompile(s, 'f', 'exec')", ["compile"]),   # maybe re's: maybe not
    ("def f():\n    from re import compile\n    return compile('x')\ncompile(s, 'f', 'exec')", ["compile"]),
    ("setattr(f, '__code__', g.__code__)", ["an assignment to __code__"]),
])
def test_code_run_from_strings_is_found(source, found):
    assert grade.hidden_code(source) == found


def test_a_name_bound_in_an_earlier_cell_keeps_its_binding():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in (
        "import re as regex\nfrom re import compile", "pattern = compile(r'[0-9]+')", "from builtins import compile",
        "code = compile(src, 'f', 'exec')")])
    assert grade.hidden_code_in(nb) == {3: ["compile"]}


def test_no_shipped_notebook_runs_code_from_strings():
    for folder in ("course", "solutions", "exercises"):
        for path in (ROOT / folder).glob("*.ipynb"):
            nb = nbformat.read(path, as_version=4)
            found = grade.hidden_code_in(nb)
            assert not found, [(path.name, re.sub(r"\s+", " ", nb.cells[i].source)[:80]) for i in found]
