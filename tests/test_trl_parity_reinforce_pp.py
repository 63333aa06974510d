"""Parity with TRL 1.16: REINFORCE++ with baseline is TRL's RLOOTrainer with ``normalize_advantages=True``.

TRL normalises the leave-one-out advantages ``K/(K-1) (r_i - mean_g)`` over the batch and adds
``1e-4`` to their std; the ``K/(K-1)`` cancels, so our globally normalised group-centred rewards
with the floor ``1e-4 (K-1)/K`` are the same numbers. TRL's own ``_generate_and_score_completions``
is run on the fixed batch of ``test_trl_parity_grpo`` (its code is run, not copied).
"""
from __future__ import annotations

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.losses import group_advantages, reinforce_plus_plus_advantages

import trl  # noqa: E402  (a dependency of the project: these tests never skip)

from test_trl_parity_grpo import K, REWARDS, _trl_advantages, parity_setup  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    shared = parity_setup(tmp_path_factory, ((trl.RLOOTrainer, trl.RLOOConfig),))
    (trainer,) = shared.pop("trainers")
    return dict(rloo=trainer, **shared)


def test_reinforce_plus_plus_with_baseline_is_trls_normalised_rloo(setup):
    trainer, b = setup["rloo"], setup["batch"]
    trainer.beta, trainer.normalize_advantages = 0.0, True
    out = _trl_advantages(trainer, setup["rows"], b["completion_ids"], b["completion_mask"], setup["tokenizer"])
    ours = reinforce_plus_plus_advantages(REWARDS, K, std_floor=1e-4 * (K - 1) / K)
    assert torch.allclose(ours, out["advantages"].to(ours.dtype), atol=1e-6, rtol=0)
    assert ours.abs().max() > 0.5
    # GRPO's scale_rewards="batch" is another estimator: it divides by the raw rewards' batch std
    assert (group_advantages(REWARDS, K, scale_rewards="batch") - ours).abs().max() > 0.05
