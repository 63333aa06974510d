"""The loop every seed-batched trainer runs: ``step()`` under a progress bar, a callback after each.

:class:`~rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer`,
:class:`~rlcourse.trainers.multi_turn.MultiTurnTrainer` and
:class:`~rlcourse.trainers.distillation.DistillationTrainer` share it: each ``step()`` returns one
metrics row per seed (or run) and appends it to ``trainer.history``.
"""
from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

__all__ = ["run_steps"]


def run_steps(trainer, steps: int, *, desc: str, metric: str, progress: bool = True, callback=None) -> list[list[dict]]:
    """Call ``trainer.step()`` ``steps`` times; the bar shows ``metric`` averaged over the step's rows.

    ``callback(i, trainer)`` runs after step ``i``. Returns ``trainer.history``.
    """
    bar = tqdm(range(steps), disable=not progress, desc=desc)
    for i in bar:
        rows = trainer.step()
        bar.set_postfix({metric: f"{np.mean([row[metric] for row in rows]):.3f}"})
        if callback is not None:
            callback(i, trainer)
    return trainer.history
