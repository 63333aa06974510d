"""Check cells and their manifest: what makes grading tamper-evident.

A *check cell* is a code cell that calls one of ``rlcourse.grading``'s ``check_*`` functions on
the learner's function, e.g. ``check_gae(gae)``. When exercises are generated, each notebook's
check cells are recorded, in order, with a checksum of their text, in a *manifest*: one JSON file
per notebook in ``rlcourse/grading/manifests/`` (shipped with the package, the record ``grade``
trusts) and a copy in the exercise notebook's metadata (``metadata.rlcourse.checks``).

:func:`audit` compares a notebook with its manifest before anything runs, in the spirit of
nbgrader's checksums: a check cell that is missing, edited (commented out, wrapped in
``try``/``except``, given other arguments) or moved before another is reported, and so is a cell
that binds a ``check_*`` name to anything but that check, assigns into ``rlcourse`` (patching the
grader) or uses the grader's private code (``rlcourse.grading.llm.lesson10._reference_update``, the
reference step a check compares with). What a name is bound to is read by
:mod:`rlcourse.tools.bindings`: ``from rlcourse.grading import check_gae`` binds the check,
``from mine import check_gae`` does not, however either is spelt.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

MANIFESTS = Path(__file__).resolve().parents[1] / "grading" / "manifests"
_CHECK_NAME = re.compile(r"check_\w+")


def normalise(source: str) -> str:
    """Cell text as it is hashed: trailing spaces and blank edges do not count as edits."""
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def checksum(source: str) -> str:
    return hashlib.sha256(normalise(source).encode()).hexdigest()


def parse_check_call(source: str) -> dict | None:
    """``{"check", "args", "kwargs"}`` if the cell is a check cell, else ``None``.

    A check cell holds exactly one statement, a call ``check_<name>(<arg>, ...)``; its arguments
    are kept as source text (the first is the learner's function) and are evaluated in the
    learner's kernel at grading time.
    """
    try:
        tree = ast.parse(normalise(source))
    except SyntaxError:
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and _CHECK_NAME.fullmatch(node.func.id)]
    if not calls:
        return None
    call = calls[0]
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr) or tree.body[0].value is not call:
        raise ValueError(f"a check cell must hold one call and nothing else, got:\n{source}")
    if not call.args or not isinstance(call.args[0], ast.Name):
        raise ValueError(f"a check's first argument must be the learner's function, by name:\n{source}")
    return {"check": call.func.id, "args": [ast.unparse(a) for a in call.args],
            "kwargs": {k.arg: ast.unparse(k.value) for k in call.keywords}}


def manifest_of(nb) -> list[dict]:
    """The check cells of a (solution or exercise) notebook, in order, with their checksums."""
    entries = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            call = parse_check_call(cell.source)
            if call is not None:
                entries.append({**call, "function": call["args"][0], "sha256": checksum(cell.source)})
    return entries


def shipped_manifest(notebook_name: str, folder: Path = MANIFESTS) -> list[dict] | None:
    path = folder / (Path(notebook_name).stem + ".json")
    return json.loads(path.read_text())["checks"] if path.exists() else None


def render_manifest(notebook_name: str, entries: list[dict]) -> str:
    return json.dumps({"notebook": notebook_name, "checks": entries}, indent=1, ensure_ascii=False) + "\n"


@dataclass
class Audit:
    """Where each manifest entry's check cell is (``cells[i]``, ``None`` if not found) and what is wrong."""

    cells: list[int | None]
    problems: dict[int, str] = field(default_factory=dict)   # manifest index -> why its check cell cannot be run
    notebook_problems: list[str] = field(default_factory=list)  # redefined checks, patching: the checks still run


def _allowed_check(name: str, origins: frozenset) -> bool:
    """Whether a binding of the name ``check_*`` binds it to that very check of ``rlcourse.grading``."""
    lesson_module = rf"rlcourse\.grading\.(classic|llm)\.lesson\w+\.{name}"
    return bool(origins) and all(o == f"rlcourse.grading.{name}" or re.fullmatch(lesson_module, o) for o in origins)


def _in_rlcourse(origin: str) -> bool:
    return origin == "rlcourse" or origin.startswith("rlcourse.")


def grader_internals(origin: str) -> bool:
    """Whether ``origin`` is private code of the grader (``rlcourse.grading._core``, ``rlcourse.grading.llm.lesson10._x``):
    what an answer has no reason to touch, the reference steps the checks compare with among it."""
    parts = origin.split(".")
    return parts[:2] == ["rlcourse", "grading"] and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[2:])


def notebook_problems(sources: list[str], skip: set[int] = frozenset()) -> list[str]:
    """What the cells of a notebook (``sources``, in order; those in ``skip``, the intact check cells, are read but
    not judged) do to the grader: rebind a ``check_*`` name to anything but that check, patch ``rlcourse`` (an
    attribute or item written into it, ``setattr``, a module of it replaced in ``sys.modules``), or reach into the
    grader's private code. Judged by what each name is bound to (:mod:`rlcourse.tools.bindings`), not by its spelling."""
    from rlcourse.tools.bindings import Reader

    reader, problems = Reader(), []
    for i, source in enumerate(sources):
        events = reader.read(source)
        if i in skip:
            continue
        private = set()
        for event in events:
            if event.kind == "bind" and _CHECK_NAME.fullmatch(event.name) and not _allowed_check(event.name, event.origins):
                problems.append(f"a cell redefines {event.name}")
            elif event.kind == "store" and (any(_in_rlcourse(o) for o in event.origins) or _CHECK_NAME.fullmatch(event.name)
                                            or ("sys.modules" in event.origins and _in_rlcourse(event.name))):
                problems.append(f"a cell patches the grader ({ast.unparse(event.node)[:60]})")
            elif event.kind in ("load", "import", "bind"):
                private |= {o for o in event.origins if grader_internals(o)}
        for origin in sorted(private):
            if not any(other.startswith(origin + ".") for other in private):
                problems.append(f"a cell uses the grader's private code ({origin})")
    return list(dict.fromkeys(problems))


def audit(nb, manifest: list[dict]) -> Audit:
    """Compare a notebook's code cells with its manifest (see the module docstring)."""
    code = [(i, cell.source) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    hashes = {i: checksum(src) for i, src in code}
    used: set[int] = set()
    result = Audit(cells=[])
    for k, entry in enumerate(manifest):
        match = next((i for i, _ in code if i not in used and hashes[i] == entry["sha256"]), None)
        result.cells.append(match)
        if match is None:
            mentions = any(re.search(rf"\b{entry['check']}\s*\(", src) for i, src in code if i not in used)
            result.problems[k] = ("its check cell was edited (the text differs from the one handed out)"
                                  if mentions else "its check cell is missing")
        else:
            used.add(match)
    found = [(c, k) for k, c in enumerate(result.cells) if c is not None]
    for (c1, k1), (c2, k2) in zip(found, found[1:]):
        if c2 < c1:
            result.problems.setdefault(k2, f"its check cell was moved above {manifest[k1]['check']}'s")
    result.notebook_problems += notebook_problems([src for _, src in code],
                                                  skip={k for k, (i, _) in enumerate(code) if i in used})
    return result
