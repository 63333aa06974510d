"""The ``check_*`` functions that exercise notebooks call.

Each lesson's checks live in a module of their own: lessons 01-06 in :mod:`rlcourse.grading.classic`
(``lesson01.py`` ... ``lesson06.py``), lessons 07 on in :mod:`rlcourse.grading.llm` (``lesson07.py``,
``lesson07b.py`` ...). Every module named ``lessonNN`` (or ``lessonNNb`` for a lesson inserted after
``NN``) in either is found and re-exported here, so a notebook only needs
``from rlcourse.grading import check_discounted_return`` and a new lesson needs no edit of this file.
What the checks share: :mod:`~rlcourse.grading._core` (comparing, failing with a hint),
:mod:`~rlcourse.grading._steps` (training steps on the GPT) and :mod:`~rlcourse.grading._routes`
(the library functions that compute each answer, which the grader flags).
"""
import importlib as _importlib
import pkgutil as _pkgutil
import re as _re

from rlcourse.grading._core import CheckFailed

__all__ = ["CheckFailed"]
for _part in ("classic", "llm"):
    _package = _importlib.import_module(f"{__name__}.{_part}")
    for _info in sorted(_pkgutil.iter_modules(_package.__path__), key=lambda m: m.name):
        if _re.fullmatch(r"lesson\d\d[a-z]?", _info.name):
            _module = _importlib.import_module(f"{_package.__name__}.{_info.name}")
            _names = getattr(_module, "__all__", None) or [n for n in vars(_module) if n.startswith("check_")]
            for _name in _names:
                globals()[_name] = getattr(_module, _name)
            __all__ += list(_names)
