"""Edit notebooks as plain Python files ("percent" format) and convert back.

    python -m rlcourse.tools.nbbuild to-py   course/01_gridworld_mdp.ipynb  /tmp/01.py
    python -m rlcourse.tools.nbbuild to-ipynb /tmp/01.py  course/01_gridworld_mdp.ipynb

In the ``.py`` form a line ``# %%`` starts a code cell and ``# %% [markdown]`` a markdown cell
whose lines are written as comments (``# text``). The ``.ipynb`` files are what the repository
keeps; after converting, execute the notebook (``python -m rlcourse.tools.execute``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

from rlcourse.tools.make_exercises import KERNELSPEC


def py_to_notebook(text: str) -> nbformat.NotebookNode:
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        else:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata.kernelspec = KERNELSPEC
    nb.metadata.language_info = {"name": "python"}
    return nb


def notebook_to_py(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            body = "\n".join(("# " + line) if line else "#" for line in cell.source.splitlines())
            parts.append("# %% [markdown]\n" + body)
        elif cell.cell_type == "code":
            parts.append("# %%\n" + cell.source)
    return "\n\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("to-py", "to-ipynb"):
        print(__doc__)
        return 2
    command, src, dst = argv
    if command == "to-py":
        Path(dst).write_text(notebook_to_py(nbformat.read(src, as_version=4)))
    else:
        nbformat.write(py_to_notebook(Path(src).read_text()), dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
