"""verl's rollout-correction conventions (rlcourse.interop.verl_rollout) against element-by-element
arithmetic, and against TRL's weights (rlcourse.losses.off_policy) where the two conventions agree."""
from __future__ import annotations

import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.interop.verl_rollout import verl_rejection_mask, verl_rollout_weights
from rlcourse.losses.off_policy import sampler_importance_weights


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(7)[None] < torch.tensor([7, 4, 1, 6, 3])[:, None]).long()
    old = -torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3
    sampler = old + 1.2 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    sampler[0, 2] = old[0, 2] - 25.0                     # a token 25 nats less likely under the sampler
    sampler[3, :6] = old[3, :6] + 4.0                    # a completion the sampler finds e^24 times likelier
    sampler = sampler.masked_fill(mask == 0, float("nan"))  # padding may hold anything
    return old, sampler, mask


def _d(old, sampler, i, t):
    return float(old[i, t] - sampler[i, t])


def test_token_weights_elementwise():
    old, sampler, mask = _batch()
    for threshold, bound in ((2.0, 20.0), (3.0, None), (None, 20.0)):
        w, metrics = verl_rollout_weights(old, sampler, mask, threshold=threshold, log_ratio_bound=bound)
        raw = []
        for i in range(5):
            for t in range(7):
                if not mask[i, t]:
                    assert w[i, t] == 0.0
                    continue
                d = _d(old, sampler, i, t)
                r = math.exp(max(-bound, min(bound, d)) if bound is not None else d)
                raw.append(r)
                expected = r if threshold is None else min(r, threshold)
                assert math.isclose(float(w[i, t]), expected, rel_tol=1e-12)
        assert math.isclose(metrics["rollout_is_mean"], sum(raw) / len(raw), rel_tol=1e-12)
        cut = 0.0 if threshold is None else sum(r > threshold for r in raw) / len(raw)
        assert metrics["rollout_is_truncated"] == cut
    w20, _ = verl_rollout_weights(old, sampler, mask, threshold=None)
    assert math.isclose(float(w20[0, 2]), math.exp(20.0), rel_tol=1e-12)      # e^25 clamped to e^20


def test_sequence_weights_elementwise():
    old, sampler, mask = _batch()
    w, metrics = verl_rollout_weights(old, sampler, mask, level="sequence", threshold=None)
    raw = []
    for i in range(5):
        s = sum(_d(old, sampler, i, t) for t in range(7) if mask[i, t])
        r = math.exp(max(-20.0, min(20.0, s)))
        for t in range(7):
            assert math.isclose(float(w[i, t]), r if mask[i, t] else 0.0, rel_tol=1e-12)
            if mask[i, t]:
                raw.append(r)
    assert math.isclose(metrics["rollout_is_mean"], sum(raw) / len(raw), rel_tol=1e-12)
    assert math.isclose(float(w[3, 0]), math.exp(-20.0), rel_tol=1e-12)      # sum of -24 clamped to -20


def test_equals_trl_where_the_conventions_agree():
    old, sampler, mask = _batch()
    clean = torch.where(mask.bool(), sampler, old)
    real = mask.bool()
    for mode, level in (("token_truncate", "token"), ("sequence_truncate", "sequence")):
        trl_w = sampler_importance_weights(old, clean, mask, mode, None, 3.0)
        ours, _ = verl_rollout_weights(old, clean, mask, level=level, threshold=3.0, log_ratio_bound=None)
        assert torch.allclose(ours[real], trl_w.expand(mask.shape)[real], rtol=1e-12, atol=0)
        if level == "token":
            assert torch.all(trl_w[~real] == 1.0) and torch.all(ours[~real] == 0.0)   # padding: TRL 1, verl 0


def test_rejection_bounds_the_weight_on_both_sides_by_default():
    """verl's mask mode keeps 1/upper <= pi_old / mu <= upper; TRL's *_mask modes, with clip_min unset, drop only
    above clip_max, and agree with verl once verl's lower bound is taken away (a lower bound near 0)."""
    old, sampler, mask = _batch()
    clean = torch.where(mask.bool(), sampler, old)
    for level, mode in (("token", "token_mask"), ("sequence", "sequence_mask")):
        keep = verl_rejection_mask(old, clean, mask, level=level, upper=3.0)
        trl_keep = sampler_importance_weights(old, clean, mask, mode, None, 3.0) > 0
        ratio = torch.exp(torch.where(mask.bool(), old - clean, torch.zeros_like(old)))
        if level == "sequence":
            ratio = ratio.prod(-1, keepdim=True)
            assert torch.equal(keep.bool(), (ratio >= 1 / 3) & (ratio <= 3.0))
            assert not torch.equal(keep.bool(), trl_keep)      # verl also drops the lower tail
            assert torch.equal(verl_rejection_mask(old, clean, mask, level=level, upper=3.0, lower=1e-30).bool(), trl_keep)
        else:
            assert torch.equal(keep.bool(), (ratio >= 1 / 3) & (ratio <= 3.0) & mask.bool())
            assert torch.equal(verl_rejection_mask(old, clean, mask, level=level, upper=3.0, lower=1e-30).bool(),
                               trl_keep & mask.bool())
    both = verl_rejection_mask(old, clean, mask, level="token", lower=0.5, upper=2.0)
    ratio = torch.exp(old - clean)
    assert torch.equal(both.bool(), (ratio >= 0.5) & (ratio <= 2.0) & mask.bool())
    assert torch.equal(verl_rejection_mask(old, clean, mask).bool(), verl_rejection_mask(old, clean, mask, upper=2.0,
                                                                                        lower=0.5).bool())


@pytest.mark.parametrize("kwargs", [dict(threshold=0.0), dict(log_ratio_bound=-1.0), dict(level="tokens")])
def test_weights_refuse_bad_settings(kwargs):
    old, sampler, mask = _batch()
    with pytest.raises(ValueError):
        verl_rollout_weights(old, sampler, mask, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(lower=0.0), dict(upper=-2.0), dict(lower=3.0, upper=2.0), dict(upper=0.0)])
def test_rejection_refuses_bad_bounds(kwargs):
    old, sampler, mask = _batch()
    with pytest.raises(ValueError):
        verl_rejection_mask(old, sampler, mask, **kwargs)


def test_shapes_must_agree():
    old, sampler, mask = _batch()
    with pytest.raises(ValueError, match="one shape"):
        verl_rollout_weights(old, sampler[:, :3], mask)
