"""Execute notebooks in place and save them with their outputs.

    python -m rlcourse.tools.execute course/01_gridworld_mdp.ipynb solutions/*.ipynb

Each notebook runs in a fresh kernel from its own folder, under the active profile
(``RLCOURSE_PROFILE``, default ``laptop``). The wall time of each is printed, so the "about a
minute" budget of a lesson is visible whenever notebooks are refreshed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

# The kernel `make env` installs into the virtualenv (Makefile: ipykernel install --name ...
# --display-name ...). Committed notebooks carry exactly this kernelspec, so opening one in
# JupyterLab neither marks it modified nor rewrites its metadata on autosave.
KERNEL_NAME = "python3"
KERNEL_DISPLAY_NAME = "Python 3 (rlcourse)"
KERNELSPEC = {"name": KERNEL_NAME, "display_name": KERNEL_DISPLAY_NAME, "language": "python"}


def execute(path: Path, timeout: int = 600) -> float:
    """Run one notebook top to bottom, write it back with outputs, return the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name=KERNEL_NAME,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # per-run timestamps would churn every diff
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nbformat.write(nb, path)
    with open(path, "a") as f:
        f.write("\n")
    return seconds


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    missing = [name for name in argv if not name.endswith(".ipynb") or not Path(name).is_file()]
    if missing:
        print(f"not a notebook file: {', '.join(missing)}", file=sys.stderr)
        return 2
    for name in argv:
        seconds = execute(Path(name))
        print(f"{seconds:6.1f} s  {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
