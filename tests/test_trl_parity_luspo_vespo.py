"""Parity with TRL 1.16 for its two sequence-level loss types, ``loss_type="luspo"`` and ``"vespo"``:
:func:`rlcourse.losses.luspo_aggregate` and :func:`rlcourse.losses.vespo_per_token_loss` give the loss and
the gradient that TRL's own ``GRPOTrainer.compute_loss`` gives on the fixed batch of
``test_trl_parity_grpo`` (TRL's code is run, not copied), plus unit checks against closed forms.
"""
from __future__ import annotations

import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import sequence_logprobs
from rlcourse.interop.trl_parity import flat_grad, set_trl_grpo_loss, trl_grpo_loss
from rlcourse.losses import aggregate_loss, luspo_aggregate, per_token_loss, vespo_per_token_loss, vespo_weights
from rlcourse.losses.off_policy import sampler_importance_weights

import trl  # noqa: E402,F401  (a dependency of the project: these tests never skip)
from test_trl_parity_grpo import parity_setup  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    shared = parity_setup(tmp_path_factory)
    (trainer,) = shared.pop("trainers")
    return dict(trainer=trainer, **shared)


def _ours(model, b, loss_fn):
    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, b["prompt_ids"], b["completion_ids"], b["completion_mask"], b["prompt_mask"])
    loss = loss_fn(logprobs)
    loss.backward()
    return loss.detach(), flat_grad(model)


def _close(ours, theirs):
    (loss, grad), (expected_loss, expected_grad) = ours, theirs
    assert torch.allclose(loss, expected_loss.to(loss.dtype), atol=1e-6, rtol=0), (loss.item(), expected_loss.item())
    assert torch.allclose(grad, expected_grad, atol=1e-6, rtol=1e-5)
    assert expected_grad.abs().max() > 1e-4          # a real gradient, not two zeros


@pytest.mark.parametrize("level,beta", [("sequence", 0.0), ("sequence", 0.04), ("token", 0.0)])
def test_luspo_matches_trl(setup, level, beta):
    trainer, b = setup["trainer"], setup["batch"]
    settings = dict(importance_sampling_level=level, beta=beta, epsilon=0.2, epsilon_high=0.28)
    set_trl_grpo_loss(trainer, "luspo", **settings)
    theirs = trl_grpo_loss(trainer, b)

    def luspo(logprobs):
        per_token = per_token_loss(logprobs, b["old"], b["advantages"], b["completion_mask"], loss_type="grpo",
                                   ref_logprobs=b["ref"], **settings)
        return luspo_aggregate(per_token, b["completion_mask"])

    _close(_ours(trainer.model, b, luspo), theirs)


GATES = [dict(), dict(k_pos=1.0, lambda_pos=0.5, k_neg=4.0, lambda_neg=5.0)]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("with_sampler", [False, True])
def test_vespo_matches_trl(setup, monkeypatch, gate, with_sampler):
    trainer, b = setup["trainer"], setup["batch"]
    set_trl_grpo_loss(trainer, "vespo", "token", beta=0.0)
    for name, value in gate.items():
        monkeypatch.setattr(trainer.args, f"vespo_{name}", value)
    mask = b["completion_mask"]
    weights = None
    if with_sampler:      # token_truncate weights pi_old / mu from a "sampler" 0.4 nats per token away
        noise = torch.randn(b["old"].shape, generator=torch.Generator().manual_seed(7), dtype=b["old"].dtype)
        sampler = ((b["old"] + 0.4 * noise) * mask).clamp(max=0.0)
        weights = sampler_importance_weights(b["old"], sampler, mask, "token_truncate", None, 3.0)
        moved = vespo_weights(b["old"], b["old"], b["advantages"], mask, sampler_weights=weights, **gate)
        assert (moved - 1).abs().max() > 0.05         # the sampler's weights move phi off phi(1) = 1
    inputs = {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs.update(old_per_token_logps=b["old"], ref_per_token_logps=b["ref"], num_items_in_batch=mask.sum())
    if weights is not None:
        inputs["importance_sampling_ratio"] = weights     # read by get_gamma_weights even without vLLM
    trainer.model.zero_grad(set_to_none=True)
    expected = trainer.compute_loss(trainer.model, inputs)
    expected.backward()
    theirs = (expected.detach(), flat_grad(trainer.model))

    def vespo(logprobs):
        per_token = vespo_per_token_loss(logprobs, b["old"], b["advantages"], mask, sampler_weights=weights, **gate)
        return aggregate_loss(per_token, mask, "dapo")

    _close(_ours(trainer.model, b, vespo), theirs)


def test_luspo_is_dr_grpo_times_max_length_and_ignores_padding():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(6)[None] < torch.tensor([6, 3, 1, 0, 4])[:, None]).long()
    per_token = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    poisoned = per_token.masked_fill(mask == 0, float("nan"))
    expected = sum(float(per_token[i, :int(mask[i].sum())].sum()) for i in range(5)) / 5
    assert math.isclose(luspo_aggregate(poisoned, mask).item(), expected, rel_tol=1e-12)
    dr = aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=6)
    assert math.isclose(luspo_aggregate(per_token, mask).item(), 6 * dr.item(), rel_tol=1e-12)
    per_sequence = torch.randn(5, 1, generator=gen, dtype=torch.float64)     # GSPO: one loss per completion
    lengths = mask.sum(1).double()
    assert math.isclose(luspo_aggregate(per_sequence, mask).item(), float((lengths * per_sequence[:, 0]).mean()),
                        rel_tol=1e-12)
    with pytest.raises(ValueError, match="per_token must be"):
        luspo_aggregate(per_token[:, :3], mask)


def test_vespo_gate_closed_form():
    # One token per completion, log w = log-ratio: phi(w) = w^k exp(lambda (1 - w)).
    log_w = torch.tensor([[-1.0], [0.0], [0.5], [1.2], [-0.3], [30.0], [-30.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones_like(log_w)
    phi = vespo_weights(log_w, torch.zeros_like(log_w), adv, mask)[:, 0]
    for i in range(5):
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        w = math.exp(float(log_w[i]))
        assert math.isclose(float(phi[i]), w ** k * math.exp(lam * (1 - w)), rel_tol=1e-12)
    assert float(phi[1]) == 1.0
    # beyond the clamps: log w = 20 gives exp(3 + 40 - 3 e^20) = 0; log w = log 1e-8 gives (1e-8)^3 e^(2 (1 - 1e-8))
    assert float(phi[5]) == 0.0
    assert math.isclose(float(phi[6]), 1e-24 * math.exp(2 * (1 - 1e-8)), rel_tol=1e-9)


def test_vespo_gradient_is_phi_times_reinforce_and_padding_is_inert():
    gen = torch.Generator().manual_seed(1)
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 3])[:, None]).long()
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    logp = (old + 0.2 * torch.randn(3, 4, generator=gen, dtype=torch.float64)).masked_fill(mask == 0, float("nan"))
    adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    logp = logp.requires_grad_()
    loss = vespo_per_token_loss(logp, old, adv, mask).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    phi = vespo_weights(logp.detach(), old, adv, mask)
    assert torch.isfinite(grad).all() and torch.equal(grad[mask == 0], torch.zeros(int((mask == 0).sum()),
                                                                                   dtype=grad.dtype))
    assert torch.allclose(grad, (-phi * adv[:, None]).expand_as(grad) * mask, atol=1e-14)
    assert not phi.requires_grad
