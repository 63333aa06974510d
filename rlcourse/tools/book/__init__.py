"""The course as a static website: :mod:`~rlcourse.tools.book.build` stages and builds it,
:mod:`~rlcourse.tools.book.check` checks the built site, ``python -m rlcourse.tools.book`` (``make book``)
does both."""
