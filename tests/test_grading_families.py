"""Each family of mistakes the checks probe has wrong answers (the catalogues ``tests/grading_catalogue*.py``)
that only that family's cases catch: each must fail its check, with a clean CheckFailed.

A catalogue module holds ``CATALOGUE``, a list of ``(family, check name, wrong answer)``, and
``FAMILIES``, the families it promises (written out, so a family whose witnesses were all deleted
is noticed). ``grading_catalogue.py`` covers lessons 01-07 and ``grading_catalogue_llm.py``
lessons 07b-13.
"""
import importlib
from pathlib import Path

import pytest

import rlcourse.grading as grading
from rlcourse.grading._core import CheckFailed

MODULES = [importlib.import_module(p.stem) for p in sorted(Path(__file__).parent.glob("grading_catalogue*.py"))]
CATALOGUE = [entry for module in MODULES for entry in module.CATALOGUE]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_family_has_wrong_answers(module):
    assert {family for family, _, _ in module.CATALOGUE} == module.FAMILIES


@pytest.mark.parametrize("family, check, wrong", CATALOGUE, ids=[f"{c}-{w.__name__}" for _, c, w in CATALOGUE])
def test_the_family_catches_its_wrong_answer(family, check, wrong, capsys):
    with pytest.raises(CheckFailed):
        getattr(grading, check)(wrong)
