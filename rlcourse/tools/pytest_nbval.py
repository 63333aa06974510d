"""A pytest plugin for running the course's notebooks under nbval; pyproject's ``addopts`` loads it.

nbval waits a fixed 5 seconds for a kernel's output after a cell has finished running
(``IPyNbCell.output_timeout``; no option sets it). When ``make test`` runs two workers on two
cores, a kernel that has just finished a long cell can take longer than that to be scheduled and
send its output. nbval then fails that cell and marks every later cell of the notebook xfail, so
the notebook's promises would not run. A generous wait costs nothing when the output comes at
once; how long a cell may *run* is still ``--nbval-cell-timeout``.
"""
from __future__ import annotations

OUTPUT_WAIT_S = 120


def pytest_collection_modifyitems(items) -> None:
    from nbval.plugin import IPyNbCell

    for item in items:
        if isinstance(item, IPyNbCell):
            item.output_timeout = max(item.output_timeout, OUTPUT_WAIT_S)
