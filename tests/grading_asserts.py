"""The two assertions every ``tests/test_grading_lessonNN.py`` makes about its checks.

A check must pass a right answer quietly (one line naming the check) and refuse a wrong one with
a ``CheckFailed`` whose message helps (it names what went wrong: the ``hint``).
"""
import re

import pytest

from rlcourse.grading import CheckFailed


def assert_passes(check, answer, capsys, **kwargs) -> None:
    """``check(answer)`` passes and prints one line, ``✔ <check name>: all N cases passed``, followed by what a
    training part measured (``; ...``) where the check trains."""
    check(answer, **kwargs)
    out = capsys.readouterr().out
    assert re.fullmatch(rf"✔ {check.__name__}: all \d+ cases passed(; [^\n]+)?\n", out), out


def assert_fails(check, answer, hint: str | None = None, **kwargs) -> str:
    """``check(answer)`` raises ``CheckFailed``, whose message contains ``hint``; returns the message."""
    with pytest.raises(CheckFailed) as info:
        check(answer, **kwargs)
    message = str(info.value)
    if hint is not None:
        assert hint in message, message
    return message


def grading_tests(right, wrong):
    """The two parametrised tests of a lesson whose answers sit in tables.

    ``right``: ``[(check, answer), ...]``; ``wrong``: ``[(check, answer, hint), ...]``. Use as
    ``test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)``.
    """
    @pytest.mark.parametrize("check, answer", right, ids=[a.__name__ for _, a in right])
    def test_right_answers_pass(check, answer, capsys):
        assert_passes(check, answer, capsys)

    @pytest.mark.parametrize("check, answer, hint", wrong, ids=[a.__name__ for _, a, _ in wrong])
    def test_wrong_answers_fail_with_a_hint(check, answer, hint):
        assert_fails(check, answer, hint)

    return test_right_answers_pass, test_wrong_answers_fail_with_a_hint


def mistake_tests(check, right, mistakes, printed: str):
    """The two tests of a check whose wrong answers are one right answer with a slip switched on.

    ``right(*args, mistake=None)`` answers correctly and, given ``mistake=name``, makes that slip;
    ``mistakes`` lists the names. The check must pass ``right`` (printing a line that contains
    ``printed``) and refuse every slip with a ``CheckFailed``. Use as
    ``test_x_check, test_x_check_catches = mistake_tests(check_x, x_ok, X_MISTAKES, "passed")``.
    """
    import functools

    def test_passes(capsys):
        check(right)
        assert printed in capsys.readouterr().out

    @pytest.mark.parametrize("mistake", mistakes)
    def test_catches(mistake):
        with pytest.raises(CheckFailed):
            check(functools.partial(right, mistake=mistake))

    return test_passes, test_catches
