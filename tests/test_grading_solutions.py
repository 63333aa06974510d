"""Every solution notebook, graded as a learner's submission is, scores 100%.

This runs the whole grader (`python -m rlcourse grade`): the kernel, the hand-over of each answer
to its worker process, the checks judged apart, the tripwires and the copy finder. A correct
answer must pass there as it does in the notebook itself, whatever it returns, changes or calls.
"""
from pathlib import Path

import pytest

from rlcourse.tools import grade

SOLUTIONS = sorted((Path(__file__).resolve().parents[1] / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_solution_passes_every_check_under_the_grader(path):
    result = grade.grade_notebook(path)
    failed = [f"{r.label} {r.outcome}: {r.message}" for r in result.rows if r.outcome != "passed"]
    assert result.rows and not failed and not result.problems, failed + result.problems
