"""The ``check_*`` functions that exercise notebooks call.

Each lesson's checks live in their own module (``lesson01.py``, ``lesson02.py``, ...). Every module
named ``lessonNN`` (or ``lessonNNb`` for a lesson inserted after ``NN``, such as ``lesson07b``) is found and re-exported here, so a notebook only needs
``from rlcourse.grading import check_discounted_return`` and a new lesson needs no edit of this file.
"""
import importlib as _importlib
import pkgutil as _pkgutil
import re as _re

from rlcourse.grading._core import CheckFailed

__all__ = ["CheckFailed"]
for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _re.fullmatch(r"lesson\d\d[a-z]?", _info.name):
        _module = _importlib.import_module(f"{__name__}.{_info.name}")
        _names = getattr(_module, "__all__", None) or [n for n in vars(_module) if n.startswith("check_")]
        for _name in _names:
            globals()[_name] = getattr(_module, _name)
        __all__ += list(_names)
