"""Grade exercise notebooks: ``python -m rlcourse grade [PATH ...] [--csv OUT.csv]`` (see :data:`USAGE`).

PATH is a notebook, a folder of notebooks, or a class folder (one sub-folder of notebooks per
learner); the default is ``exercises/``. ``--csv OUT.csv`` writes one row per learner and one
column per check; ``--manifests DIR`` grades against the check manifests in DIR instead of the
ones shipped with rlcourse (for an instructor's own exercises); ``--solutions DIR`` names the
solution notebooks answers are compared with (default: the course's ``solutions/``). Grading reads
the notebook *file*: save it first.

How a notebook is graded, so that the score can be trusted:

1. its code cells are compared with the manifest of its check cells written when the exercises
   were generated (:mod:`rlcourse.tools.checkcells`): a check cell missing, edited or moved, a
   ``check_*`` redefined, or the grader patched, is reported as *tampered*;
   The notebook's text is also read for copies of the checks' reference implementations and of the
   shipped solution notebook's answers (:mod:`rlcourse.tools.copies`; ``solutions/`` ships with the
   course, so an answer equal to the solution's once renamed is reported as ``solution``), and for
   code run from strings (the built-in ``exec``, ``eval``, ``compile``, ``importlib.reload``,
   assignments to ``__code__``: judged by what a name is bound to, so ``from re import compile`` is
   not one), which the grader cannot read;
2. the notebook runs top to bottom in a fresh kernel; at each check cell, instead of running the
   cell, the kernel hands over the learner's function as it is at that point (cloudpickle);
3. this process, which runs no learner code, calls ``rlcourse.grading``'s own check on it
   (:mod:`rlcourse.tools.grade_runner`), while the learner's function runs in a process of its own
   (:mod:`rlcourse.tools.grade_worker`) that flags an answer that is, copies or calls the
   reference implementation.

The exit status is 0 only when every check of every notebook passed, untampered, with no cell
failing.
"""
from __future__ import annotations

import ast
import csv
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from rlcourse.tools import checkcells, grade_runner

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CheckRow:
    check: str
    function: str
    outcome: str = "not run"     # passed, failed, error, not implemented, reference, solution, tampered, not run
    message: str = ""

    @property
    def label(self) -> str:
        return f"{self.check}({self.function})"


@dataclass
class NotebookGrade:
    path: Path
    rows: list[CheckRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)   # notebook-level tampering or failing cells

    @property
    def passed(self) -> int:
        return sum(r.outcome == "passed" for r in self.rows)

    @property
    def clean(self) -> bool:
        return not self.problems and all(r.outcome == "passed" for r in self.rows)


def notebooks_in(paths: list[str]) -> list[tuple[str, Path]]:
    """``(learner, notebook)`` pairs; the learner is the sub-folder's name in a class folder, else ''."""
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            own = sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))
            found += [("", p) for p in own]
            if not own:
                for sub in sorted(d for d in path.iterdir() if d.is_dir() and not d.name.startswith(".")):
                    found += [(sub.name, p) for p in sorted(sub.glob("*.ipynb")) if not p.name.startswith(".")]
        elif path.suffix == ".ipynb" and path.exists():
            found.append(("", path))
        else:
            raise SystemExit(f"grade: {name!r} is neither a folder nor an existing .ipynb file")
    if not found:
        raise SystemExit(f"grade: no notebooks found in {paths}")
    return found


def _where(nb, index: int) -> str:
    """Name a cell as the learner sees it: the function it defines or the heading above it."""
    source = nb.cells[index].source
    try:
        defs = [n.name for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    except SyntaxError:
        defs = []
    if defs:
        return f"the cell defining `{defs[0]}`"
    for cell in reversed(nb.cells[:index]):
        if cell.cell_type == "markdown":
            heading = next((line.lstrip("# ").strip() for line in cell.source.splitlines() if line.startswith("#")), None)
            if heading:
                return f"a cell under '{heading}'"
    return "a cell near the top"


def _capture_code(entry: dict, path: Path) -> str:
    args = ", ".join(entry["args"]) + ("," if len(entry["args"]) == 1 else "")
    kwargs = ", ".join(f"{k!r}: {v}" for k, v in entry["kwargs"].items())
    return (f"with __import__('builtins').open({str(path)!r}, 'wb') as __rlcourse_f:\n"
            f"    __import__('cloudpickle').dump((({args}), {{{kwargs}}}), __rlcourse_f)\n"
            f"del __rlcourse_f")


def _error_of(outputs) -> str | None:
    for out in outputs:
        if out.get("output_type") == "error":
            return f"{out['ename']}: {_ANSI.sub('', out['evalue'])}"[:300]
    return None


# What runs code the grader cannot read, by what a called name is bound to (not by its spelling).
_HIDDEN_CODE = {"builtins.exec": "exec", "builtins.eval": "eval", "builtins.compile": "compile",
                "importlib.reload": "importlib.reload", "imp.reload": "importlib.reload"}


def hidden_code(source: str, reader=None) -> list[str]:
    """What in a cell runs code the grader cannot read: the built-in ``exec``/``eval``/``compile``, a module
    re-loaded, a function's code replaced. ``reader`` (a :class:`rlcourse.tools.bindings.Reader` that has read
    the cells before this one) says what each name is bound to: after ``from re import compile``,
    ``compile(...)`` compiles a regular expression; after ``run = exec``, ``run(...)`` runs source code."""
    from rlcourse.tools.bindings import Reader

    found = []
    for event in (reader or Reader()).read(source):
        if event.kind == "call":
            found += dict.fromkeys(_HIDDEN_CODE[o] for o in sorted(event.origins) if o in _HIDDEN_CODE)
        elif event.kind == "store" and event.name == "__code__":
            found.append("an assignment to __code__")
    return found


def hidden_code_in(nb) -> dict[int, list[str]]:
    """``{cell index: hidden_code(...)}`` for the code cells of a notebook, read in order in one namespace."""
    from rlcourse.tools.bindings import Reader

    reader = Reader()
    found = {i: hidden_code(cell.source, reader) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"}
    return {i: what for i, what in found.items() if what}


def static_copies(nb, manifest: list[dict]) -> dict[int, str]:
    """``{manifest index: why}`` for checks whose reference implementation the notebook's text copies."""
    import rlcourse.grading as grading
    from rlcourse.tools import copies

    cells = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    found = {}
    for k, entry in enumerate(manifest):
        references = getattr(getattr(grading, entry["check"], None), "references", ())
        hits = copies.find_copies(cells, list(references), answer=entry["function"])
        if hits:
            found[k] = "; ".join(str(h) for h in hits)
    return found


def default_solutions() -> Path | None:
    """The course's ``solutions/`` folder, where rlcourse runs from its repository (else None)."""
    folder = Path(__file__).resolve().parents[2] / "solutions"
    return folder if folder.is_dir() else None


def solution_copies(nb, manifest: list[dict], solution: Path) -> dict[int, str]:
    """``{manifest index: why}`` for answers equal, once renamed (:func:`rlcourse.tools.copies.tokens`), to the
    answer of the same exercise in the solution notebook ``solution``."""
    from rlcourse.tools import copies

    try:
        shipped = nbformat.read(solution, as_version=4)
    except Exception:  # noqa: BLE001  (no readable solution: nothing to compare with)
        return {}
    answers = copies.solution_answers([(i, c.source) for i, c in enumerate(shipped.cells) if c.cell_type == "code"])
    cells = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    found = {}
    for k, entry in enumerate(manifest):
        forms = answers.get(entry["function"])
        hits = copies.find_solution_copies(cells, forms, entry["function"]) if forms else []
        if hits:
            where = ", ".join(f"`{name}` (cell {cell})" for cell, name in hits)
            found[k] = (f"{where} is the shipped solution's answer ({solution.parent.name}/{solution.name}), "
                        f"equal once renamed")
    return found


def _manifest_for(path: Path, nb, manifests: Path | None):
    entries = checkcells.shipped_manifest(path.name, manifests or checkcells.MANIFESTS)
    if entries is not None:
        return entries, None
    embedded = nb.metadata.get("rlcourse", {}).get("checks")
    if embedded:
        return embedded, None
    return None, f"{path.name} is not a notebook of this course (no manifest of its check cells)"


def grade_notebook(path: Path, manifests: Path | None = None, timeout: int = 600,
                   solutions: Path | None = None) -> NotebookGrade:
    """Grade one notebook (see the module docstring). ``solutions``: a folder of solution notebooks; an answer
    equal to the one of the notebook of the same name there is reported as ``solution`` (the solution notebook
    itself is not compared with itself)."""
    from nbclient import NotebookClient

    grade = NotebookGrade(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # not JSON, not a notebook
        grade.problems.append(f"cannot read the notebook: {type(e).__name__}: {e}"[:200])
        return grade
    manifest, missing = _manifest_for(path, nb, manifests)
    if manifest is None:
        grade.problems.append(missing)
        return grade
    audit = checkcells.audit(nb, manifest)
    grade.rows = [CheckRow(e["check"], e["function"]) for e in manifest]
    for k, why in audit.problems.items():
        grade.rows[k].outcome, grade.rows[k].message = "tampered", why
    grade.problems += [f"tampered: {p}" for p in audit.notebook_problems]
    for i, found in hidden_code_in(nb).items():
        grade.problems += [f"tampered: {_where(nb, i)} runs code the grader cannot read ({what})"
                           for what in dict.fromkeys(found)]
    copied = static_copies(nb, manifest)
    pasted = {}
    if solutions is not None and (solutions / path.name).is_file() \
            and (solutions / path.name).resolve() != path.resolve():
        pasted = solution_copies(nb, manifest, solutions / path.name)
    at_cell = {c: k for k, c in enumerate(audit.cells) if c is not None and k not in audit.problems}
    tampered_cells = {c for k, c in enumerate(audit.cells) if c is not None and k in audit.problems}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        captures, i = [], 0
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        try:
            with client.setup_kernel(stderr=subprocess.DEVNULL):   # the kernel's own log lines, not the learner's output
                for i, cell in enumerate(nb.cells):
                    if cell.cell_type != "code" or i in tampered_cells:
                        continue
                    if i in at_cell:
                        k = at_cell[i]
                        file = tmp / f"check{k}.pkl"
                        probe = nbformat.v4.new_code_cell(_capture_code(manifest[k], file))
                        client.execute_cell(probe, i)
                        error = _error_of(probe.outputs)
                        if error:
                            grade.rows[k].outcome = "error"
                            grade.rows[k].message = (f"`{manifest[k]['function']}` is not defined when its check cell runs"
                                                     if error.startswith("NameError") else
                                                     f"the function could not be handed to the grader: {error}")
                        else:
                            captures.append({"index": k, "check": manifest[k]["check"], "file": str(file)})
                    else:
                        client.execute_cell(cell, i)
                        error = _error_of(cell.outputs)
                        if error:
                            grade.problems.append(f"{_where(nb, i)} raised {error}")
        except Exception as e:  # a cell ran past the time limit, or the kernel died: grade what was handed over
            first = (str(e).splitlines() or [""])[0]
            grade.problems.append(f"the notebook stopped at {_where(nb, i)}: {type(e).__name__}: {first}"[:300])
        for capture in captures:       # judged here: no learner code runs in this process
            row = grade.rows[capture["index"]]
            result = grade_runner.run_one(capture, timeout=timeout)
            row.outcome, row.message = result["outcome"], result["message"]
    for k, why in pasted.items():
        if grade.rows[k].outcome != "tampered":
            grade.rows[k].outcome, grade.rows[k].message = "solution", why
    for k, why in copied.items():
        if grade.rows[k].outcome != "tampered":
            grade.rows[k].outcome, grade.rows[k].message = "reference", why
    return grade


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return " / ".join(lines[:4])[:240]


def print_table(grades: list[tuple[str, NotebookGrade]]) -> None:
    """A score line per notebook, then each of its checks with its outcome (and why, where it did not pass)."""
    names = [f"{who}/{g.path.name}" if who else str(g.path) for who, g in grades]
    width = max(len(n) for n in names + ["notebook"])
    print(f"{'notebook':<{width}}  checks   score")
    total_passed = total = 0
    for name, (_, g) in zip(names, grades):
        n = len(g.rows)
        score = 100 * g.passed / n if n else 0.0
        flags = [flag for flag, hit in (("TAMPERED", any(r.outcome == "tampered" for r in g.rows)
                                         or any(p.startswith("tampered") for p in g.problems)),
                                        ("REFERENCE", any(r.outcome == "reference" for r in g.rows)),
                                        ("SOLUTION", any(r.outcome == "solution" for r in g.rows))) if hit]
        print(f"{name:<{width}}  {g.passed:>2} / {n:<2}  {score:5.0f}%{''.join('  ' + f for f in flags)}")
        label = max((len(r.label) for r in g.rows), default=0)
        for r in g.rows:
            why = "" if r.outcome == "passed" else f": {_first_line(r.message)}"
            print(f"{'':<{width}}    {r.label:<{label}}  {r.outcome}{why}")
        for p in g.problems:
            print(f"{'':<{width}}    {p}")
        total_passed, total = total_passed + g.passed, total + n
    print(f"{'total':<{width}}  {total_passed:>2} / {total:<2}  {100 * total_passed / max(total, 1):5.0f}%")


def write_csv(grades: list[tuple[str, NotebookGrade]], out: Path) -> None:
    """One row per learner, one column per check (``NN_topic:check_name``): the outcome of each."""
    columns, table, notes = [], {}, {}
    for who, g in grades:
        for r in g.rows:
            column = f"{g.path.stem}:{r.check}"
            if column not in columns:
                columns.append(column)
            table.setdefault(who, {})[column] = r.outcome
        notes.setdefault(who, []).extend(f"{g.path.stem}: {p}" for p in g.problems)
        notes[who] += [f"{g.path.stem}:{r.check}: {_first_line(r.message)}" for r in g.rows
                       if r.outcome in ("tampered", "reference", "solution")]
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", *columns, "passed", "total", "notes"])
        for who, outcomes in table.items():
            row = [outcomes.get(c, "missing") for c in columns]
            writer.writerow([who, *row, row.count("passed"), len(columns), "; ".join(notes[who])])


USAGE = """usage: python -m rlcourse grade [PATH ...] [--csv OUT.csv] [--manifests DIR] [--solutions DIR]

Grade exercise notebooks and print a score table: one line per notebook, then each check
passed or not (failed, error, not implemented, reference, solution, tampered) and why.

  PATH             a notebook, a folder of notebooks, or a class folder (one sub-folder of
                   notebooks per learner); default: exercises/
  --csv OUT.csv    also write one row per learner, one column per check (its outcome)
  --manifests DIR  the check manifests to grade against (default: rlcourse's own)
  --solutions DIR  the solution notebooks answers are compared with: an answer equal to the
                   solution's once renamed is reported as `solution` (default: the course's
                   solutions/)
  -h, --help       show this message

Grading reads the notebook files: save them first. The exit status is 0 only when every check
of every notebook passed, untampered, with no cell failing."""


def _option(argv: list[str], flag: str) -> Path | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
        raise SystemExit(f"grade: {flag} needs a path\n\n{USAGE}")
    value = Path(argv[i + 1])
    del argv[i:i + 2]
    return value


def main(argv: list[str]) -> int:
    """``grade [PATH ...] [--csv OUT.csv] [--manifests DIR] [--solutions DIR]`` (see :data:`USAGE`)."""
    import sys

    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    out = _option(argv, "--csv")
    manifests = _option(argv, "--manifests")
    solutions = _option(argv, "--solutions") or default_solutions()
    unknown = [a for a in argv if a.startswith("-")]
    if unknown:
        print(f"grade: unknown option {unknown[0]}\n\n{USAGE}", file=sys.stderr)
        return 2
    grades = [(who, grade_notebook(path, manifests, solutions=solutions))
              for who, path in notebooks_in(argv or ["exercises"])]
    print_table(grades)
    if out is not None:
        write_csv(grades, out)
        print(f"wrote {out}")
    return 0 if all(g.clean for _, g in grades) else 1
