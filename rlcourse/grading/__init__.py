"""The ``check_*`` functions that exercise notebooks call.

Each lesson's checks live in their own module (``lesson01.py``, ...) and are re-exported here, so
a notebook only needs ``from rlcourse.grading import check_discounted_return``.
"""
from rlcourse.grading._core import CheckFailed
from rlcourse.grading.lesson01 import *  # noqa: F401,F403
from rlcourse.grading.lesson02 import *  # noqa: F401,F403
from rlcourse.grading.lesson03 import *  # noqa: F401,F403
from rlcourse.grading.lesson04 import *  # noqa: F401,F403
from rlcourse.grading.lesson05 import *  # noqa: F401,F403
from rlcourse.grading.lesson06 import *  # noqa: F401,F403
from rlcourse.grading.lesson07 import *  # noqa: F401,F403
