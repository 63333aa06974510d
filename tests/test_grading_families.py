"""Each family of mistakes the checks probe has wrong answers (tests/grading_catalogue.py) that
only that family's cases catch: each must fail its check, with a clean CheckFailed."""
import pytest

import rlcourse.grading as grading
from rlcourse.grading._core import CheckFailed

from grading_catalogue import CATALOGUE

FAMILIES = {"extreme magnitudes", "integer inputs", "float32 drift on long episodes", "one parameter value everywhere",
            "structural edge cases", "padding holding non-zero values", "gradients that do not flow",
            "inputs modified in place", "ratio regions beyond those sampled"}


def test_every_family_has_wrong_answers():
    assert {family for family, _, _ in CATALOGUE} == FAMILIES


@pytest.mark.parametrize("family, check, wrong", CATALOGUE, ids=[f"{c}-{w.__name__}" for _, c, w in CATALOGUE])
def test_the_family_catches_its_wrong_answer(family, check, wrong, capsys):
    with pytest.raises(CheckFailed):
        getattr(grading, check)(wrong)
