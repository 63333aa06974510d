"""Parity with TRL 1.16: the sampler's importance weights (four modes, with bounds) and the off-policy
sequence mask, computed by TRL's own GRPOTrainer on fixed inputs, equal ours; so do the loss and the
gradient that our trainer's off-policy path (``sampler=``) makes from them.

TRL computes the weights inside ``_generate_and_score_completions`` when it samples with vLLM. Its
generation is replaced here by fixed completions and fixed "vLLM" log-probs (the trainer's own
log-probs plus seeded noise, so that ratios fall on both sides of every bound), and ``use_vllm`` is
switched on after construction: everything after generation is TRL's code, run as it is. The batch
and the trainer come from :mod:`rlcourse.interop.trl_parity` (float64; TRL's log-probs are float32).
"""
from __future__ import annotations

import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import Rollout
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.interop.trl_parity import flat_grad, set_trl_grpo_loss
from rlcourse.losses.off_policy import SAMPLER_IS_MODES, off_policy_sequence_mask, sampler_importance_weights

import trl  # noqa: E402  (a dependency of the project: these tests never skip)
# The fixed prompts, rewards and task of the GRPO parity tests: one batch for both files.
from test_trl_parity_grpo import K, MAX_LEN, REWARDS, _FixedTask, parity_setup  # noqa: E402

# (clip_min, clip_max): TRL's default, two-sided bounds that token ratios cross, a lower bound alone, none above.
BOUNDS = [(None, 3.0), (0.8, 1.25), (0.9, None), (None, 1.1)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    shared = parity_setup(tmp_path_factory)
    (trainer,), batch = shared.pop("trainers"), shared["batch"]
    # The "vLLM" log-probs: the trainer's own plus noise of 0.4 nats per token (batch["old"] holds 0.3).
    noise = torch.randn(batch["old"].shape, generator=torch.Generator().manual_seed(5), dtype=batch["old"].dtype)
    sampling = ((batch["old"] + 0.3 * noise) * batch["completion_mask"]).clamp(max=0.0)
    return dict(trainer=trainer, sampling=sampling, **shared)


def _switch_on(monkeypatch, trainer, mode, clip_min, clip_max, correction=True, threshold=None, beta=0.0):
    """The GRPOTrainer attributes TRL 1.16 reads, as GRPOConfig(use_vllm=True, ...) would set them."""
    for name, value in dict(use_vllm=True, vllm_importance_sampling_correction=correction,
                            vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                            vllm_importance_sampling_clip_max=clip_max, off_policy_mask_threshold=threshold,
                            scale_rewards="group").items():
        monkeypatch.setattr(trainer, name, value)
    set_trl_grpo_loss(trainer, "dapo", "token", beta=beta, epsilon=0.2, epsilon_high=0.28)


def _trl_batch(setup, sampling=None):
    """TRL's _generate_and_score_completions on the fixed completions and "vLLM" log-probs."""
    trainer, b, tok = setup["trainer"], setup["batch"], setup["tokenizer"]
    sampling = setup["sampling"] if sampling is None else sampling
    prompt_ids = [tok(r)["input_ids"] for r in setup["rows"]]
    real = b["completion_mask"].bool()
    completions = [ids[m].tolist() for ids, m in zip(b["completion_ids"], real)]
    logps = [[None if math.isnan(x) else x for x in lp[m].tolist()] for lp, m in zip(sampling, real)]
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completions, None, texts, logps, {}, None, None)
    return trainer._generate_and_score_completions([{"prompt": p, "reward": float(r)}
                                                    for p, r in zip(setup["rows"], REWARDS)])


@pytest.mark.parametrize("clip_min,clip_max", BOUNDS)
@pytest.mark.parametrize("mode", SAMPLER_IS_MODES)
def test_importance_weights_match_trl(setup, monkeypatch, mode, clip_min, clip_max):
    _switch_on(monkeypatch, setup["trainer"], mode, clip_min, clip_max)
    out = _trl_batch(setup)
    mask = out["completion_mask"]
    ours = sampler_importance_weights(out["old_per_token_logps"], out["sampling_per_token_logps"], mask, mode,
                                      clip_min, clip_max)
    theirs = out["importance_sampling_ratio"]
    assert ours.shape == theirs.shape == ((16, 1) if mode.startswith("sequence") else mask.shape)
    assert torch.allclose(ours.double(), theirs.double(), atol=1e-6, rtol=1e-6)
    raw = sampler_importance_weights(out["old_per_token_logps"], out["sampling_per_token_logps"], mask, mode, None, None)
    real = raw if mode.startswith("sequence") else raw[mask.bool()]
    low, high = (clip_min or 0.0), (clip_max or math.inf)
    assert bool(((real < low) | (real > high)).any()), "the bounds must act on this batch"
    assert bool(((real >= low) & (real <= high)).any())


def test_a_token_vllm_could_not_score_is_left_uncorrected_as_in_trl(setup, monkeypatch):
    """TRL reads a NaN log-prob as "no correction" (ratio 1); our pure function does the same (our
    trainer refuses the NaN instead: tests/test_off_policy_samplers.py)."""
    sampling = setup["sampling"].clone()
    sampling[1, 1] = sampling[3, 0] = float("nan")          # two real tokens (row 0 has one)
    for mode in SAMPLER_IS_MODES:
        _switch_on(monkeypatch, setup["trainer"], mode, None, 3.0)
        out = _trl_batch(setup, sampling)
        ours = sampler_importance_weights(out["old_per_token_logps"], out["sampling_per_token_logps"],
                                          out["completion_mask"], mode, None, 3.0)
        assert torch.isnan(out["sampling_per_token_logps"]).sum() == 2
        assert torch.allclose(ours.double(), out["importance_sampling_ratio"].double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.15])
def test_off_policy_sequence_mask_matches_trl(setup, threshold):
    b, sampling = setup["batch"], setup["sampling"]
    advantages = b["advantages"][:, None]
    current = b["old"]                                           # any log-probs of the policy: TRL detaches them
    theirs = trl.GRPOTrainer.get_off_policy_mask(advantages, current, sampling, b["completion_mask"], threshold)
    ours = off_policy_sequence_mask(b["advantages"], current, sampling, b["completion_mask"], threshold)
    assert torch.equal(ours, theirs)
    assert 0 < int((ours == 0).sum()) < int((advantages < 0).sum()), "some, not all, pushed-down sequences dropped"


CASES = [dict(mode=m, clip_min=lo, clip_max=hi) for m in SAMPLER_IS_MODES for lo, hi in BOUNDS[:2]]
CASES += [dict(mode="sequence_mask", clip_min=None, clip_max=3.0, threshold=0.1),
          dict(mode="token_truncate", clip_min=None, clip_max=2.0, threshold=0.05, beta=0.04),
          dict(mode="sequence_mask", clip_min=None, clip_max=3.0, correction=False, threshold=0.1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_our_trainers_off_policy_loss_and_gradient_match_trl(setup, monkeypatch, request, case):
    """Our trainer, handed the same completions by a sampler that reports the same log-probs, makes
    TRL's advantages, pi_old, weights, loss and gradient (TRL: GRPOTrainer.compute_loss)."""
    trainer, b, tok = setup["trainer"], setup["batch"], setup["tokenizer"]
    case = dict(case)
    correction, threshold, beta = case.pop("correction", True), case.pop("threshold", None), case.pop("beta", 0.0)
    ref = trainer.ref_model
    if beta > 0:           # a reference that differs from the policy (put back afterwards), as in test_trl_parity_grpo
        saved = {k: v.clone() for k, v in ref.state_dict().items()}
        request.addfinalizer(lambda: ref.load_state_dict(saved))
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in ref.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    _switch_on(monkeypatch, trainer, case["mode"], case["clip_min"], case["clip_max"], correction, threshold, beta)
    out = _trl_batch(setup)
    model = trainer.model
    model.zero_grad(set_to_none=True)
    expected = trainer.compute_loss(model, out)
    expected.backward()
    expected_grad = flat_grad(model)

    rollout = Rollout(prompt_ids=b["prompt_ids"], prompt_mask=b["prompt_mask"], completion_ids=b["completion_ids"],
                      completion_mask=b["completion_mask"], logprobs=setup["sampling"].clone(), prompts=setup["rows"],
                      completions=[""] * len(setup["rows"]), eos_token_id=tok.eos_token_id)
    config = PolicyGradientConfig(per_device_train_batch_size=len(setup["rows"]), num_generations=K,
                                  max_completion_length=MAX_LEN, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
                                  beta=beta, vllm_importance_sampling_correction=correction,
                                  vllm_importance_sampling_mode=case["mode"],
                                  vllm_importance_sampling_clip_min=case["clip_min"],
                                  vllm_importance_sampling_clip_max=case["clip_max"],
                                  off_policy_mask_threshold=threshold)
    ours = PolicyGradientTrainer(model, tok, _FixedTask(), config, ref_model=ref if beta > 0 else None,
                                 sampler=lambda *args, **kwargs: rollout)
    batch = ours.make_batch()
    assert torch.allclose(batch.advantages.double(), out["advantages"].double(), atol=1e-6, rtol=0)
    if correction:                    # (without it TRL leaves pi_old to the loss: the current log-probs, detached)
        assert torch.allclose(batch.old_logprobs.double(), out["old_per_token_logps"].double(), atol=1e-6, rtol=0)
        assert torch.allclose(batch.is_weights.double(), out["importance_sampling_ratio"].double(), atol=1e-6, rtol=1e-6)
    else:
        assert batch.is_weights is None and "importance_sampling_ratio" not in out
    model.zero_grad(set_to_none=True)
    loss, stats = ours._loss(batch)
    loss.backward()
    assert torch.allclose(loss.detach().double(), expected.detach().double(), atol=1e-6, rtol=0)
    assert torch.allclose(flat_grad(model), expected_grad, atol=1e-6, rtol=1e-5)
    assert expected_grad.abs().max() > 1e-4
    if correction:                    # TRL logs these metrics only with the correction on
        logged = trainer._metrics["train"]
        for name in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                     "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                     "sampling/importance_sampling_ratio/max"):
            assert abs(stats[name] - logged[name][-1]) <= 1e-6 * max(1.0, abs(logged[name][-1])), name
