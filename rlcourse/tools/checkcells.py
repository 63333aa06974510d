"""Check cells and their manifest: what makes grading tamper-evident.

A *check cell* is a code cell that calls one of ``rlcourse.grading``'s ``check_*`` functions on
the learner's function, e.g. ``check_gae(gae)``. When exercises are generated, each notebook's
check cells are recorded, in order, with a checksum of their text, in a *manifest*: one JSON file
per notebook in ``rlcourse/grading/manifests/`` (shipped with the package, the record ``grade``
trusts) and a copy in the exercise notebook's metadata (``metadata.rlcourse.checks``).

:func:`audit` compares a notebook with its manifest before anything runs, in the spirit of
nbgrader's checksums: a check cell that is missing, edited (commented out, wrapped in
``try``/``except``, given other arguments) or moved before another is reported, and so is a cell
that redefines a ``check_*`` name or assigns into ``rlcourse`` (patching the grader).
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


def _parse(source: str):
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _rlcourse_aliases(sources) -> set[str]:
    """Names the notebook binds to rlcourse modules or objects (``import rlcourse.grading._core as core``)."""
    aliases = {"rlcourse"}
    for tree in filter(None, map(_parse, sources)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("rlcourse")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlcourse"):
                aliases |= {a.asname or a.name for a in node.names}
    return aliases


def _root_name(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _redefinitions(source: str, aliases: set[str]) -> tuple[list[str], list[str]]:
    """Names ``check_*`` bound by a cell, and what it assigns into ``rlcourse`` (patching)."""
    tree = _parse(source)
    if tree is None:
        return [], []
    bound, patched = [], []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name) and isinstance(leaf.ctx, ast.Store):
                        names.append(leaf.id)
                    elif isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store) \
                            and (_root_name(leaf) in aliases or _CHECK_NAME.search(leaf.attr)):
                        patched.append(ast.unparse(leaf))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.asname for a in node.names if a.asname]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and _root_name(node.args[0]) in aliases:
            patched.append(ast.unparse(node)[:60])
        bound += [n for n in names if _CHECK_NAME.fullmatch(n)]
    return bound, patched


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
    aliases = _rlcourse_aliases(src for _, src in code)
    for i, src in code:
        if i in used:
            continue
        bound, patched = _redefinitions(src, aliases)
        result.notebook_problems += [f"a cell redefines {name}" for name in bound]
        result.notebook_problems += [f"a cell patches the grader ({p})" for p in patched]
    return result
