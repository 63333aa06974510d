"""Grade exercise notebooks: ``python -m rlcourse grade [PATH ...]``.

Each notebook is run with nbval (``pytest --nbval-lax``) in a fresh kernel, exactly as
``pytest --nbval-lax exercises/01_gridworld_mdp.ipynb`` would. The score of a notebook is the
number of check cells (cells calling a ``check_*`` function) that passed, out of all of them.

Grading reads the notebook *file*: save it in JupyterLab (Ctrl-S) before you grade.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def notebooks_in(paths: list[str]) -> list[Path]:
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))
        elif path.suffix == ".ipynb" and path.exists():
            found.append(path)
        else:
            raise SystemExit(f"grade: {name!r} is neither a folder nor an existing .ipynb file")
    if not found:
        raise SystemExit(f"grade: no notebooks found in {paths}")
    return found


def grade_notebook(path: Path) -> list[dict]:
    """Run nbval on one notebook; return one record per cell (see ``grade_plugin``)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, RLCOURSE_GRADE_REPORT=str(report))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
                        "-p", "rlcourse.tools.grade_plugin", "-p", "no:cacheprovider", "-q",
                        "--no-header", "-o", "addopts=", str(path)],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if not report.exists():
            return [{"file": str(path), "cell": -1, "label": "notebook", "is_check": True, "outcome": "failed",
                     "error": "pytest/nbval could not run this notebook (is it valid JSON?)"}]
        return json.loads(report.read_text())


def main(argv: list[str]) -> int:
    paths = notebooks_in(argv or ["exercises"])
    rows, all_passed = [], True
    for path in paths:
        records = grade_notebook(path)
        checks = [r for r in records if r["is_check"]]
        passed = sum(r["outcome"] == "passed" for r in checks)
        other_failures = [r for r in records if not r["is_check"] and r["outcome"] == "failed"]
        all_passed &= passed == len(checks) and not other_failures
        rows.append((path, passed, len(checks), checks, other_failures))

    width = max(len(str(p)) for p, *_ in rows)
    print(f"{'notebook':<{width}}  checks   score")
    total_passed = total = 0
    for path, passed, n, checks, other in rows:
        score = 100 * passed / n if n else 100.0
        print(f"{str(path):<{width}}  {passed:>2} / {n:<2}  {score:5.0f}%")
        for r in checks + other:
            if r["outcome"] != "passed":
                print(f"{'':<{width}}    {r['label']}: {r['error'] or r['outcome']}")
        total_passed, total = total_passed + passed, total + n
    print(f"{'total':<{width}}  {total_passed:>2} / {total:<2}  {100 * total_passed / max(total, 1):5.0f}%")
    return 0 if all_passed else 1
