"""Generate ``exercises/NN_*.ipynb`` from ``solutions/NN_*.ipynb``.

Every region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's markers) is
replaced by a stub that raises ``NotImplementedError`` naming the function to write, and all
outputs are stripped. The check cells (``check_<name>(<name>)``) are recorded with their checksums in
the exercise's metadata and in ``rlcourse/grading/manifests/NN_*.json``, the record that
``python -m rlcourse grade`` compares notebooks with (see :mod:`rlcourse.tools.checkcells`).
``exercises/`` is generated: never edit it by hand; run
``python -m rlcourse.tools.make_exercises`` (or ``make exercises``) after changing a solution.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

from rlcourse.tools import checkcells

from rlcourse.tools.execute import KERNELSPEC  # the kernel `make env` installs: opening a notebook rewrites nothing
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
ROOT = Path(__file__).resolve().parents[2]
_DEF = re.compile(r"^\s*def\s+(\w+)\s*\(")
# A lesson's file name: two digits, an optional letter for a lesson inserted after another
# (07b comes after 07 and before 08), an underscore, the topic.
LESSON_NAME = re.compile(r"\d\d[a-z]?_\w+\.ipynb")


def lesson_notebooks(folder: Path) -> list[Path]:
    """The lesson notebooks in ``folder``, in course order (``07_...`` < ``07b_...`` < ``08_...``)."""
    return sorted(p for p in Path(folder).glob("*.ipynb") if LESSON_NAME.fullmatch(p.name))


def stub_source(source: str, notebook_name: str) -> str:
    """Replace each solution region in one cell's source with a ``NotImplementedError`` stub."""
    out, inside, where = [], False, None
    lines = source.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"{notebook_name}: nested '{BEGIN}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            where = next((m.group(1) for m in map(_DEF.match, reversed(lines[:i])) if m), None)
            what = f"`{where}`" if where else "this exercise"
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f'{indent}raise NotImplementedError("Exercise: write {what} here '
                       f'(replace this line), then run the check cell below.")')
        elif stripped == END:
            if not inside:
                raise ValueError(f"{notebook_name}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{notebook_name}: '{BEGIN}' without '{END}'")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The exercise version of a solution notebook: stubs instead of answers, no outputs."""
    nb = nbformat.from_dict(solution)
    n_regions = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            n_regions += cell.source.count(BEGIN)
            cell.source = stub_source(cell.source, name)
            cell.outputs = []
            cell.execution_count = None
    if n_regions == 0:
        raise ValueError(f"{name}: no '{BEGIN}' regions: nothing for the learner to do")
    # Only stable metadata: executing the solution (kernel version, widget state) must not make
    # the exercise look stale.
    nb.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC, "language_info": {"name": "python"},
                                      "rlcourse": {"checks": checkcells.manifest_of(nb)}})
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    """Notebook JSON exactly as it is written to disk (so staleness is a string comparison)."""
    return nbformat.writes(nb) + "\n"


def expected_exercises(root: Path = ROOT) -> dict[Path, str]:
    """Map each exercise path and each check manifest to the text it should have, from the solutions."""
    result = {}
    manifests = root / checkcells.MANIFESTS.relative_to(ROOT)
    for path in lesson_notebooks(root / "solutions"):
        nb = make_exercise(nbformat.read(path, as_version=4), path.name)
        result[root / "exercises" / path.name] = render(nb)
        result[manifests / (path.stem + ".json")] = checkcells.render_manifest(path.name, nb.metadata.rlcourse.checks)
    return result


def main(argv=None) -> int:
    root = Path(argv[0]).resolve() if argv else ROOT
    for path, text in expected_exercises(root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
