"""Properties every check shares, tested once over all of them."""
import numpy as np
import pytest

import rlcourse.grading as grading
from rlcourse.grading._core import CheckFailed, fail_if_mistake

CHECKS = sorted(name for name in dir(grading) if name.startswith("check_"))


def test_every_lesson_exports_checks():
    assert len(CHECKS) >= 20


@pytest.mark.parametrize("name", CHECKS)
def test_unfinished_exercise_propagates_not_implemented(name):
    """An exercise still holding its stub must surface NotImplementedError, not a failed check."""
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise: write `f` here")

    with pytest.raises(NotImplementedError):
        getattr(grading, name)(stub)


def test_fail_if_mistake_names_the_mistake_only_when_it_is_recognisable():
    expected, mistake = np.array([1.0, 2.0]), np.array([1.0, 3.0])
    with pytest.raises(CheckFailed, match="the hint"):
        fail_if_mistake("check_x", "case", expected, mistake.copy(), mistake, "the hint")
    fail_if_mistake("check_x", "case", expected, expected.copy(), mistake, "the hint")  # right answer
    fail_if_mistake("check_x", "case", expected, None, mistake, "the hint")  # left to assert_close
    # On a case where the mistake gives the right answer, a right answer must not be failed.
    fail_if_mistake("check_x", "case", expected, expected.copy(), expected.copy(), "the hint")
    # A different shape is not the mistake: assert_close reports it.
    fail_if_mistake("check_x", "case", expected, np.ones(3), mistake, "the hint")


def test_an_untouched_argument_holding_nan_is_not_called_modified():
    import torch

    from rlcourse.grading._core import call_unmutated

    t = torch.tensor([float("nan"), 1.0, -float("inf")])
    a = np.array([np.nan, 2.0])
    assert call_unmutated("check_x", "nan left alone", lambda x, y: 0, t, a) == 0

    def writes(x, y):
        x[1] = 5.0
    with pytest.raises(CheckFailed, match="modified in place"):
        call_unmutated("check_x", "a value written next to a nan", writes, t, a)
