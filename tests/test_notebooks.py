"""Structural tests over every lesson, exercise and solution notebook.

nbval (in `make test`) runs the course and solution notebooks; these tests check what nbval does
not: exercises are regenerated, they fail cleanly, committed notebooks are executed and quiet.
"""
import re
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from rlcourse.tools.execute import KERNELSPEC
from rlcourse.tools.make_exercises import ROOT, expected_exercises, lesson_notebooks

COURSE = lesson_notebooks(ROOT / "course")
SOLUTIONS = lesson_notebooks(ROOT / "solutions")
EXERCISES = lesson_notebooks(ROOT / "exercises")
CHECK_CALL = re.compile(r"\bcheck_\w+\s*\(")


def ids(paths):
    return [f"{p.parent.name}/{p.name}" for p in paths]


def test_exercises_are_generated_from_the_current_solutions():
    expected = expected_exercises()
    stale = [p.name for p, text in expected.items() if not p.exists() or p.read_text() != text]
    orphans = [p.name for p in EXERCISES if p not in expected]
    assert not stale, f"exercises/ is stale for {stale}: run `make exercises`"
    assert not orphans, f"exercise notebooks without a solution: {orphans}"


def test_every_solution_and_exercise_belongs_to_a_lesson():
    lessons = {p.name for p in COURSE}
    assert {p.name for p in SOLUTIONS} <= lessons
    assert COURSE and COURSE[0].name == "00_start_here.ipynb"


def test_lessons_are_found_and_ordered_with_a_letter_after_the_number():
    names = [p.name[:p.name.index("_")] for p in COURSE]
    assert "07b" in names and names.index("07") + 1 == names.index("07b") == names.index("08") - 1, names
    every = sorted(p.name for p in (ROOT / "course").glob("*.ipynb") if not p.name.startswith("."))
    assert [p.name for p in COURSE] == every, "a notebook in course/ is not named like a lesson (NN_ or NNb_)"


@pytest.mark.parametrize("path", COURSE + SOLUTIONS, ids=ids(COURSE + SOLUTIONS))
def test_committed_notebooks_are_executed_without_errors_or_stderr(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code, "no code cells"
    assert all(c.execution_count is not None for c in code), \
        f"{path.name} is not fully executed: run `python -m rlcourse.tools.execute {path.relative_to(ROOT)}`"
    for cell in code:
        for out in cell.outputs:
            assert out.output_type != "error", f"{path.name}: a cell raised {out.get('ename')}"
            if out.output_type == "stream":
                assert out.name != "stderr", f"{path.name}: text on stderr: {out.text[:300]!r}"


@pytest.mark.parametrize("path", COURSE + SOLUTIONS + EXERCISES, ids=ids(COURSE + SOLUTIONS + EXERCISES))
def test_notebooks_carry_the_kernelspec_make_env_installs(path):
    # Any other kernelspec is rewritten by JupyterLab on opening, and the notebook shows as modified.
    assert nbformat.read(path, as_version=4).metadata.get("kernelspec") == KERNELSPEC, \
        f"{path.name}: kernelspec is not {KERNELSPEC}: run `python -m rlcourse.tools.execute {path.relative_to(ROOT)}`"


@pytest.mark.parametrize("path", COURSE[1:], ids=ids(COURSE[1:]))
def test_every_lesson_ends_with_an_asserted_promise(path):
    nb = nbformat.read(path, as_version=4)
    last_code = [c for c in nb.cells if c.cell_type == "code"][-1]
    assert re.search(r"^\s*assert\b", last_code.source, flags=re.M), \
        f"{path.name}: the last code cell should assert the lesson's promise"


@pytest.mark.parametrize("path", EXERCISES, ids=ids(EXERCISES))
def test_exercises_fail_cleanly_at_every_check(path):
    """Run the shipped exercise: every check cell stops with NotImplementedError, nothing else breaks."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    checks, unexpected = 0, []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        is_check = bool(CHECK_CALL.search(cell.source))
        checks += is_check
        if is_check and not errors:
            unexpected.append(f"check cell {i} passed on an unfinished exercise")
        for err in errors:
            if err.ename != "NotImplementedError" or "Exercise: write" not in err.evalue:
                unexpected.append(f"cell {i}: {err.ename}: {err.evalue[:200]}")
    assert checks >= 3, f"{path.name} has only {checks} check cells"
    assert not unexpected, "\n".join(unexpected)


def test_grade_command_scores_solutions_and_exercises():
    run = lambda target: subprocess.run([sys.executable, "-m", "rlcourse", "grade", target],
                                        capture_output=True, text=True, cwd=ROOT)
    solved = run("solutions/01_gridworld_mdp.ipynb")
    assert solved.returncode == 0, solved.stdout + solved.stderr
    assert re.search(r"total\s+6 / 6\s+100%", solved.stdout), solved.stdout
    fresh = run("exercises/01_gridworld_mdp.ipynb")
    assert fresh.returncode == 1
    assert re.search(r"total\s+0 / 6\s+0%", fresh.stdout), fresh.stdout
    assert re.search(r"check_discounted_return\(discounted_return\)\s+not implemented: NotImplementedError", fresh.stdout), \
        fresh.stdout
    assert re.search(r"check_discounted_return\(discounted_return\)\s+passed", solved.stdout), solved.stdout


def test_grade_command_rejects_a_missing_path():
    result = subprocess.run([sys.executable, "-m", "rlcourse", "grade", "no/such.ipynb"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "neither a folder nor an existing .ipynb" in result.stderr


@pytest.mark.parametrize("path", COURSE + SOLUTIONS + EXERCISES, ids=ids(COURSE + SOLUTIONS + EXERCISES))
def test_cell_sources_hold_no_control_characters(path):
    """A LaTeX macro written into JSON with one backslash (``\\beta`` as ``"\\beta"``) is read as a
    backspace plus ``eta``: the page then shows ``eta``. Only newlines belong in a cell, and tabs in
    code: in Markdown a tab is ``\\t`` gone wrong (``\\times`` shows as "imes", ``\\text`` as "ext")."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        allowed = "\n\t" if cell.cell_type == "code" else "\n"
        bad = sorted({repr(ch) for ch in cell.source if ord(ch) < 32 and ch not in allowed})
        assert not bad, f"{path.name}, cell {i}: control characters {bad} (a single backslash before b, f, n, r or t in the JSON?)"
