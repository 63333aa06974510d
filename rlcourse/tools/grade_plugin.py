"""A pytest plugin used by ``python -m rlcourse grade``: records each nbval cell's outcome.

A "check" is a code cell that calls one of ``rlcourse.grading``'s ``check_*`` functions.
The records are written as JSON to ``$RLCOURSE_GRADE_REPORT`` when the session ends.
"""
import json
import os
import re

_CHECK_CALL = re.compile(r"\b(check_\w+)\s*\(")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_cells: dict[str, dict] = {}


def pytest_collection_modifyitems(items):
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is not None:
            check = _CHECK_CALL.search(cell.source)
            _cells[item.nodeid] = {"file": str(item.fspath), "cell": item.cell_num,
                                   "is_check": bool(check),
                                   "label": check.group(1) if check else f"cell {item.cell_num}",
                                   "outcome": "not run", "error": ""}


def pytest_runtest_logreport(report):
    record = _cells.get(report.nodeid)
    if record is None or (report.when != "call" and report.passed):
        return
    record["outcome"] = report.outcome
    if report.failed:
        text = _ANSI.sub("", str(report.longrepr))
        errors = re.findall(r"^\s*(\w+(?:Error|Exception|Implemented\w*)\b.*)$", text, flags=re.M)
        record["error"] = (errors[-1] if errors else text.strip().splitlines()[-1]).strip()[:200]


def pytest_sessionfinish(session):
    path = os.environ.get("RLCOURSE_GRADE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(list(_cells.values()), f)
