"""Grading cannot be fooled: tampered check cells, redefined or patched checks, and reference answers.

The static cases (a check cell deleted, commented out, wrapped in try/except, edited, moved, a
check redefined, the grader patched) are found by comparing the notebook with its manifest,
without running anything. The dynamic cases run ``grade`` on a tiny class of synthetic learners.
"""
import contextlib
import csv
import io
import re

import nbformat
import pytest
from nbclient import NotebookClient

from rlcourse.tools import checkcells, grade
from rlcourse.tools.make_exercises import make_exercise

IMPORTS = ("import rlcourse\n"
           "from rlcourse.grading import check_discounted_return, check_reward_to_go\n"
           "import numpy as np")
RETURN_OK = ("def discounted_return(rewards, gamma):\n"
             "    ### BEGIN SOLUTION\n"
             "    return float(sum(gamma ** t * float(r) for t, r in enumerate(rewards)))\n"
             "    ### END SOLUTION")
RTG_OK = ("def reward_to_go(rewards, gamma):\n"
          "    ### BEGIN SOLUTION\n"
          "    G, running = np.zeros(len(rewards)), 0.0\n"
          "    for t in reversed(range(len(rewards))):\n"
          "        running = float(rewards[t]) + gamma * running\n"
          "        G[t] = running\n"
          "    return G\n"
          "    ### END SOLUTION")
RTG_MINE = ("def reward_to_go(rewards, gamma):\n"       # right, written otherwise than the solution
            "    out = []\n"
            "    for r in reversed(list(rewards)):\n"
            "        out.append(float(r) + gamma * (out[-1] if out else 0.0))\n"
            "    return np.array(out[::-1])")
RTG_WRONG = ("def reward_to_go(rewards, gamma):\n"
             "    return np.cumsum(rewards)  # a prefix sum: wrong\n")
CHECK_1, CHECK_2 = "check_discounted_return(discounted_return)", "check_reward_to_go(reward_to_go)"


def notebook(*sources) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 99 · A tiny exercise")] +
                                    [nbformat.v4.new_code_cell(s) for s in sources])


SOLUTION = notebook(IMPORTS, RETURN_OK, CHECK_1, RTG_OK, CHECK_2)
MANIFEST = checkcells.manifest_of(SOLUTION)


def problems(nb):
    result = checkcells.audit(nb, MANIFEST)
    return {MANIFEST[k]["check"]: why for k, why in result.problems.items()}, result.notebook_problems


def test_the_manifest_records_each_check_cell_in_order():
    assert [e["check"] for e in MANIFEST] == ["check_discounted_return", "check_reward_to_go"]
    assert [e["function"] for e in MANIFEST] == ["discounted_return", "reward_to_go"]
    assert problems(SOLUTION) == ({}, [])
    exercise = make_exercise(SOLUTION, "99_tiny.ipynb")
    assert exercise.metadata.rlcourse.checks == MANIFEST
    assert problems(exercise) == ({}, []), "stubbing the answers must not touch the check cells"


@pytest.mark.parametrize("check_cell, why", [
    (None, "missing"),
    ("# " + CHECK_2, "edited"),
    ("try:\n    " + CHECK_2 + "\nexcept AssertionError:\n    pass", "edited"),
    ("check_reward_to_go(lambda rewards, gamma: rewards)", "edited"),
])
def test_a_deleted_commented_wrapped_or_edited_check_cell_is_tampered(check_cell, why):
    cells = [IMPORTS, RETURN_OK, CHECK_1, RTG_WRONG] + ([check_cell] if check_cell else [])
    found, _ = problems(notebook(*cells))
    assert list(found) == ["check_reward_to_go"] and why in found["check_reward_to_go"]


def test_whitespace_around_a_check_cell_is_not_an_edit():
    assert problems(notebook(IMPORTS, RETURN_OK, "\n" + CHECK_1 + "   \n", RTG_OK, CHECK_2)) == ({}, [])


def test_a_moved_check_cell_is_tampered():
    found, _ = problems(notebook(IMPORTS, RETURN_OK, CHECK_2, RTG_OK, CHECK_1))
    assert len(found) == 1 and "moved" in next(iter(found.values()))


def test_a_redefined_check_and_a_patched_grader_are_tampered():
    found, notebook_wide = problems(notebook(
        IMPORTS, RETURN_OK, CHECK_1, RTG_WRONG, "def check_reward_to_go(fn):\n    print('✔ passed')", CHECK_2,
        "import rlcourse.grading._core as core\ncore.assert_close = lambda *a, **k: None"))
    assert found == {}, "the check cells themselves are intact: the real checks still run"
    assert "a cell redefines check_reward_to_go" in notebook_wide
    assert any("patches the grader" in p and "assert_close" in p for p in notebook_wide)


# ----------------------------------------------------------------------------- a tiny class, graded
LEARNERS = {
    "alice": [IMPORTS, RETURN_OK, CHECK_1, RTG_MINE, CHECK_2],                   # honest, right
    "bob": [IMPORTS, RETURN_OK, CHECK_1, RTG_WRONG, "try:\n    " + CHECK_2 + "\nexcept AssertionError:\n    pass"],
    "carol": [IMPORTS + "\nfrom rlcourse.returns import discounted_return", CHECK_1, RTG_WRONG,
              "import rlcourse.grading._core as core\ncore.assert_close = lambda *a, **k: None", CHECK_2],
    "dave": [IMPORTS, "from rlcourse import returns\ndef discounted_return(rewards, gamma):\n"
                      "    return returns.discounted_return(list(rewards), gamma)", CHECK_1, RTG_WRONG,
             "def check_reward_to_go(fn):\n    print('✔ check_reward_to_go: all 1 cases passed')", CHECK_2],
}


PASTED = ("def my_helper(r, g):\n"
          "    r = np.asarray(r, dtype=float)\n"
          "    if r.ndim != 1:\n"
          "        raise ValueError(f'bad shape {r.shape}')\n"
          "    _check_unit_interval('gamma', g)\n"
          "    if not np.isfinite(r).all():\n"
          "        raise ValueError('not finite')\n"
          "    return float(np.sum(g ** np.arange(len(r)) * r))")
CALLS_HELPER = "def discounted_return(rewards, gamma):\n    return my_helper(rewards, gamma)"
LEARNERS.update({
    # the reference's source pasted as a helper (renamed, no docstring, messages re-worded)
    "erin": [IMPORTS + "\nfrom rlcourse.returns import _check_unit_interval", PASTED, CALLS_HELPER, CHECK_1,
             RTG_MINE, CHECK_2],
    # the same source held in a string and exec'd
    "frank": [IMPORTS + "\nfrom rlcourse.returns import _check_unit_interval", f"exec({PASTED!r})", CALLS_HELPER,
              CHECK_1, RTG_MINE, CHECK_2],
    # a wrong answer that, when called, turns the grading helpers into no-ops where it runs
    "gina": [IMPORTS, "import sys\ndef discounted_return(rewards, gamma):\n"
                      "    for name, m in list(sys.modules.items()):\n"
                      "        if name.startswith('rlcourse.grading'):\n"
                      "            for h in ('fail', 'assert_close', 'fail_if_mistake'):\n"
                      "                if hasattr(m, h):\n"
                      "                    setattr(m, h, lambda *a, **k: None)\n"
                      "    return 0.0", CHECK_1, RTG_MINE, CHECK_2],
    # honest: `compile` is re's, and a module imported under another name is that module
    "hana": [IMPORTS + "\nimport re as regex\nfrom re import compile\nDIGITS = compile(r'-?[0-9]+')",
             "def discounted_return(rewards, gamma):\n"
             "    assert regex.fullmatch(DIGITS, str(len(rewards)))\n"
             "    return float(sum(gamma ** t * float(r) for t, r in enumerate(rewards)))", CHECK_1, RTG_MINE, CHECK_2],
    # the shipped solution's reward_to_go pasted, its variables renamed
    "ivan": [IMPORTS, RETURN_OK, CHECK_1, "def reward_to_go(r, g):\n"
                                          "    out, acc = np.zeros(len(r)), 0.0\n"
                                          "    for t in reversed(range(len(r))):\n"
                                          "        acc = float(r[t]) + g * acc\n"
                                          "        out[t] = acc\n"
                                          "    return out", CHECK_2],
    # the grader's private code reached into (statically: nothing of it has to run)
    "jack": [IMPORTS + "\nfrom rlcourse.grading.classic.lesson01 import _mdp", RETURN_OK, CHECK_1, RTG_MINE, CHECK_2],
})


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("grading")
    (root / "manifests").mkdir()
    (root / "manifests" / "99_tiny.json").write_text(checkcells.render_manifest("99_tiny.ipynb", MANIFEST))
    (root / "solutions").mkdir()
    nbformat.write(SOLUTION, root / "solutions" / "99_tiny.ipynb")
    for who, cells in LEARNERS.items():
        (root / "class" / who).mkdir(parents=True)
        nbformat.write(notebook(*cells), root / "class" / who / "99_tiny.ipynb")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = grade.main([str(root / "class"), "--csv", str(root / "grades.csv"), "--manifests",
                             str(root / "manifests"), "--solutions", str(root / "solutions")])
    with open(root / "grades.csv") as f:
        rows = {row["learner"]: row for row in csv.DictReader(f)}
    return status, rows, printed.getvalue()


def test_the_class_csv_has_one_row_per_learner_and_one_column_per_check(graded_class):
    status, rows, _ = graded_class
    assert status == 1
    assert set(rows) == set(LEARNERS)
    assert list(rows["alice"])[:3] == ["learner", "99_tiny:check_discounted_return", "99_tiny:check_reward_to_go"]
    assert rows["alice"]["99_tiny:check_discounted_return"] == rows["alice"]["99_tiny:check_reward_to_go"] == "passed"
    assert rows["alice"]["passed"] == "2" and rows["alice"]["notes"] == ""


def test_a_check_wrapped_in_try_except_is_tampered(graded_class):
    _, rows, _ = graded_class
    assert rows["bob"]["99_tiny:check_reward_to_go"] == "tampered"
    assert "edited" in rows["bob"]["notes"]


def test_the_reference_as_the_answer_is_flagged(graded_class):
    _, rows, _ = graded_class
    assert rows["carol"]["99_tiny:check_discounted_return"] == "reference"
    assert "rlcourse.returns:discounted_return itself" in rows["carol"]["notes"]


def test_a_wrapper_that_calls_the_reference_is_flagged_and_a_redefined_check_runs_the_real_one(graded_class):
    _, rows, _ = graded_class
    assert rows["dave"]["99_tiny:check_discounted_return"] == "reference"
    assert "calls the reference rlcourse.returns:discounted_return" in rows["dave"]["notes"]
    assert rows["dave"]["99_tiny:check_reward_to_go"] == "failed"        # the real check ran on the wrong answer
    assert "tampered: a cell redefines check_reward_to_go" in rows["dave"]["notes"]


def test_a_patched_helper_changes_nothing(graded_class):
    _, rows, _ = graded_class
    assert rows["carol"]["99_tiny:check_reward_to_go"] == "failed"       # the real check ran, in a clean process
    assert "patches the grader (core.assert_close)" in rows["carol"]["notes"]


def test_a_pasted_reference_is_found_in_the_notebooks_text(graded_class):
    _, rows, _ = graded_class
    assert rows["erin"]["99_tiny:check_discounted_return"] == "reference"
    assert "copy of the reference implementation rlcourse.returns:discounted_return" in rows["erin"]["notes"]
    assert rows["erin"]["99_tiny:check_reward_to_go"] == "passed"


def test_source_run_from_a_string_is_found_and_flagged(graded_class):
    _, rows, _ = graded_class
    assert rows["frank"]["99_tiny:check_discounted_return"] == "reference"
    assert "runs code the grader cannot read (exec)" in rows["frank"]["notes"]


def test_an_answer_that_disarms_the_grader_where_it_runs_still_fails(graded_class):
    _, rows, _ = graded_class
    assert rows["gina"]["99_tiny:check_discounted_return"] == "failed"
    assert rows["gina"]["99_tiny:check_reward_to_go"] == "passed"


def test_an_import_is_judged_by_what_it_binds_not_its_spelling(graded_class):
    _, rows, _ = graded_class
    assert rows["hana"]["99_tiny:check_discounted_return"] == rows["hana"]["99_tiny:check_reward_to_go"] == "passed"
    assert rows["hana"]["notes"] == "", "re's compile is not code run from a string"


def test_the_shipped_solution_pasted_is_flagged(graded_class):
    _, rows, _ = graded_class
    assert rows["ivan"]["99_tiny:check_reward_to_go"] == "solution"
    assert "shipped solution's answer (solutions/99_tiny.ipynb)" in rows["ivan"]["notes"]
    assert rows["ivan"]["99_tiny:check_discounted_return"] == "passed", "a one-line answer is everyone's"
    assert rows["alice"]["99_tiny:check_reward_to_go"] == "passed", "an answer written otherwise is the learner's"


def test_the_graders_private_code_reached_into_is_tampering(graded_class):
    _, rows, _ = graded_class
    assert "uses the grader's private code (rlcourse.grading.classic.lesson01._mdp)" in rows["jack"]["notes"]


def test_the_table_names_each_check_passed_or_not(graded_class):
    _, _, printed = graded_class
    block = printed.split("alice/99_tiny.ipynb")[1].split("/99_tiny.ipynb")[0]
    assert re.search(r"check_discounted_return\(discounted_return\)\s+passed", block), printed
    assert re.search(r"check_reward_to_go\(reward_to_go\)\s+passed", block), printed
    block = printed.split("bob/99_tiny.ipynb")[1].split("/99_tiny.ipynb")[0]
    assert re.search(r"check_discounted_return\(discounted_return\)\s+passed", block), printed
    assert re.search(r"check_reward_to_go\(reward_to_go\)\s+tampered: its check cell was edited", block), printed
    assert "SOLUTION" in printed.split("ivan/99_tiny.ipynb")[1].splitlines()[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_grade_help_prints_its_usage(flag, capsys):
    from rlcourse.__main__ import main

    assert main(["grade", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m rlcourse grade") and "--csv" in out and "--solutions" in out


def test_grade_help_from_the_command_line_and_an_unknown_option():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlcourse", "grade", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    done = subprocess.run([sys.executable, "-m", "rlcourse", "grade", "--cvs", "x.csv"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "unknown option --cvs" in done.stderr


@pytest.mark.parametrize("cells, found", [
    (["from re import compile\nimport re as something\np = compile('a+')", "something.compile('b')"], []),
    (["from rlcourse.grading import check_reward_to_go as check_reward_to_go"], []),
    (["from rlcourse.grading.classic.lesson03 import check_reward_to_go"], []),
    (["from mine import check_reward_to_go"], ["a cell redefines check_reward_to_go"]),
    (["import rlcourse\nstep = rlcourse.grading.llm.lesson10._reference_update"],
     ["a cell uses the grader's private code (rlcourse.grading.llm.lesson10._reference_update)"]),
    (["import importlib\ng = importlib.import_module('rlcourse.grading.llm.lesson11')", "g._reference_dpo_step(1)"],
     ["a cell uses the grader's private code (rlcourse.grading.llm.lesson11._reference_dpo_step)"]),
    (["import sys\nsys.modules['rlcourse.grading'] = None"], ["a cell patches the grader (sys.modules['rlcourse.grading'])"]),
    (["from rlcourse.grading.classic.lesson06 import ppo_toy_batch"], []),          # a public helper a lesson hands out
])
def test_what_a_cell_does_to_the_grader_is_judged_by_binding(cells, found):
    _, notebook_wide = problems(notebook(IMPORTS, *cells, RETURN_OK, CHECK_1, RTG_OK, CHECK_2))
    assert notebook_wide == found


# ----------------------------------------------------------------------------- what the learner sees
def test_a_failing_check_shows_no_grader_frames_in_the_kernel(tmp_path):
    nb = notebook(IMPORTS, RTG_WRONG, CHECK_2,
                  "def discounted_return(rewards, gamma):\n    return rewards[99]", CHECK_1)
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    failed, = [o for o in nb.cells[3].outputs if o.output_type == "error"]
    text = ansi.sub("", "\n".join(failed.traceback))
    assert failed.ename == "CheckFailed"
    for part in ("check_reward_to_go failed on", "expected:", "received:", "hint:"):
        assert part in text
    assert "rlcourse/grading" not in text and "File " not in text and "reference" not in text.lower()
    crashed, = [o for o in nb.cells[5].outputs if o.output_type == "error"]   # the learner's own IndexError
    text = ansi.sub("", "\n".join(crashed.traceback))
    assert crashed.ename == "IndexError" and "rewards[99]" in text
    assert "rlcourse/grading" not in text, text
