"""Lesson 10c's checks pass right answers written in other ways and catch plausible wrong ones.

The right answers are written from the exercise texts, independently of the solution notebook."""
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.grading.lesson10c import (check_mismatch_correction, check_mismatch_run, check_off_policy_mask,
                                        check_sampler_weights)
from grading_asserts import assert_fails, grading_tests


# ------------------------------------------------------------------ exercise 1: TRL's importance weights
def weights_loop(old, sampler, mask, mode, clip_min, clip_max):
    """Row by row, token by token, in Python floats."""
    rows = []
    for o_row, s_row, m_row in zip(old.tolist(), sampler.tolist(), mask.tolist()):
        logs = [o - s if m and not math.isnan(o - s) else 0.0 for o, s, m in zip(o_row, s_row, m_row)]
        ratios = [math.exp(sum(logs))] if mode.startswith("sequence") else [math.exp(x) for x in logs]
        out = []
        for r in ratios:
            if mode.endswith("truncate"):
                r = max(r, clip_min) if clip_min is not None else r
                r = min(r, clip_max) if clip_max is not None else r
            elif (clip_min is not None and r < clip_min) or (clip_max is not None and r > clip_max):
                r = 0.0
            out.append(r)
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float64)


def weights_float32(old, sampler, mask, mode, clip_min, clip_max):
    """Vectorised, in float32, the bounds as +-inf."""
    d = torch.where(mask.bool(), old.detach().float() - sampler.float(), torch.zeros(old.shape))
    d = torch.nan_to_num(d, nan=0.0)
    if mode in ("sequence_truncate", "sequence_mask"):
        d = d.sum(dim=1, keepdim=True)
    w = d.exp()
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode in ("token_truncate", "sequence_truncate"):
        return torch.minimum(torch.maximum(w, torch.tensor(lo)), torch.tensor(hi))
    return torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))


def _weights(old, sampler, mask, mode, clip_min, clip_max, *, inverted=False, log_bounds=False, swap=False,
             no_min=False, seq_mean=False, token_mask_for_sequence=False, multiply_mask=False, keep_nan=False,
             attached=False, flat=False):
    real = mask.bool()
    o = old if attached else old.detach()
    diff = (o - sampler) * mask if multiply_mask else torch.where(real, o - sampler, torch.zeros_like(o))
    if not keep_nan:
        diff = torch.nan_to_num(diff, nan=0.0)
    diff = -diff if inverted else diff
    sequence = mode.startswith("sequence") and not token_mask_for_sequence
    if sequence:
        diff = diff.sum(1, keepdim=True) / (mask.sum(1, keepdim=True) if seq_mean else 1)
    truncate = mode.endswith("truncate") != swap
    lo = None if no_min else clip_min
    if log_bounds:
        w = diff.clamp(min=lo, max=clip_max).exp()
    else:
        w = diff.exp()
        if truncate:
            w = w if (lo, clip_max) == (None, None) else w.clamp(min=lo, max=clip_max)
        else:
            w = w.masked_fill((w < (lo if lo is not None else -math.inf)) | (w > (clip_max or math.inf)), 0.0)
    return w.squeeze(1) if flat and sequence else w


def _slip(**flags):
    def answer(old, sampler, mask, mode, clip_min, clip_max):
        return _weights(old, sampler, mask, mode, clip_min, clip_max, **flags)
    answer.__name__ = "weights_" + "_".join(flags)
    return answer


# ------------------------------------------------------------------ exercise 2: the off-policy sequence mask
def mask_loop(advantages, logprobs, sampler_logprobs, mask, threshold):
    out = []
    for a, lp, sp, m in zip(advantages.reshape(-1).tolist(), logprobs.tolist(), sampler_logprobs.tolist(), mask.tolist()):
        gaps = [s - p for p, s, keep in zip(lp, sp, m) if keep]
        far = sum(gaps) / max(len(gaps), 1) > threshold
        out.append([0.0 if (a < 0 and far) else 1.0])
    return torch.tensor(out)


def _mask(advantages, logprobs, sampler_logprobs, mask, threshold, *, any_sign=False, zero_negative=False,
          reversed_gap=False, total=False, width=False, strict=False, per_token=False, multiply_mask=False):
    real = mask.bool()
    gap = sampler_logprobs - logprobs
    gap = -gap if reversed_gap else gap
    gap = gap * mask if multiply_mask else torch.where(real, gap, torch.zeros_like(gap))
    adv = advantages.reshape(-1, 1)
    pushed_down = torch.ones_like(adv, dtype=torch.bool) if any_sign else (adv <= 0 if zero_negative else adv < 0)
    if per_token:
        return (~(pushed_down & (gap > threshold))).float()
    norm = 1 if total else (mask.shape[1] if width else mask.sum(1, keepdim=True))
    mean = gap.sum(1, keepdim=True) / norm
    far = mean >= threshold if strict else mean > threshold
    return (~(pushed_down & far)).float()


def _mask_slip(flag):
    def answer(advantages, logprobs, sampler_logprobs, mask, threshold):
        return _mask(advantages, logprobs, sampler_logprobs, mask, threshold, **{flag: True})
    answer.__name__ = "mask_" + flag
    return answer


def weights_vectorised(old, sampler, mask, mode, clip_min, clip_max):
    return _weights(old, sampler, mask, mode, clip_min, clip_max)


def mask_vectorised(advantages, logprobs, sampler_logprobs, mask, threshold):
    return _mask(advantages, logprobs, sampler_logprobs, mask, threshold)


RIGHT = [(check_sampler_weights, weights_loop), (check_sampler_weights, weights_float32),
         (check_sampler_weights, weights_vectorised), (check_off_policy_mask, mask_loop),
         (check_off_policy_mask, mask_vectorised)]
WRONG = [
    (check_sampler_weights, _slip(inverted=True), "not mu / pi_old"),
    (check_sampler_weights, _slip(log_bounds=True), "after exponentiating"),
    (check_sampler_weights, _slip(swap=True), "mask sets a ratio outside it to 0"),
    (check_sampler_weights, _slip(no_min=True), "clip_min bounds the ratio from below"),
    (check_sampler_weights, _slip(seq_mean=True), "not of their mean"),
    (check_sampler_weights, _slip(token_mask_for_sequence=True), "not token by token"),
    (check_sampler_weights, _slip(multiply_mask=True, keep_nan=True), "padding holds nan and inf"),
    (check_sampler_weights, _slip(keep_nan=True), "counts as a log-ratio of 0"),
    (check_sampler_weights, _slip(attached=True), "a constant"),
    (check_sampler_weights, _slip(flat=True), "shape (4, 1)"),
    (check_off_policy_mask, _mask_slip("any_sign"), "A >= 0 is always kept"),
    (check_off_policy_mask, _mask_slip("zero_negative"), "A = 0 is not negative"),
    (check_off_policy_mask, _mask_slip("reversed_gap"), "sampler_logprobs - logprobs"),
    (check_off_policy_mask, _mask_slip("total"), "do not sum it"),
    (check_off_policy_mask, _mask_slip("width"), "not over the padded width"),
    (check_off_policy_mask, _mask_slip("strict"), "strictly above"),
    (check_off_policy_mask, _mask_slip("per_token"), "one value per completion"),
    (check_off_policy_mask, _mask_slip("multiply_mask"), None),
]
test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


# ------------------------------------------------------------------ exercises 3 and 4: the experiment
def mismatch_run(settings, *, bits=3, use_sampler=True, pass_settings=True, train=True):
    """The experiment as exercise 3 states it (seed-batched: the 8 seeds train together)."""
    from rlcourse.lm import AdditionTask, exact_match, load_checkpoint
    from rlcourse.lm.off_policy import CopySampler, quantised_copy
    from rlcourse.lm.policy_gradient import PolicyGradientConfig
    from rlcourse.lm.seed_batched import SeedBatchedPolicyGradientTrainer

    task = AdditionTask()
    start, tokenizer = load_checkpoint("addition-partial", device="cpu")
    extra = dict(settings or {}) if pass_settings else {}
    config = PolicyGradientConfig(learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8,
                                  max_steps=50, **extra)
    sampler = CopySampler(lambda m: quantised_copy(m, bits)) if settings is not None and use_sampler else None
    trainer = SeedBatchedPolicyGradientTrainer(start, tokenizer, task, config, seeds=list(range(8)), sampler=sampler)
    if train:
        trainer.train(progress=False)
    prompts = task.test_prompts(200)
    return [exact_match(trainer.model_of(s), tokenizer, task, prompts) for s in range(8)]


def test_the_experiment_check_passes_a_run_wired_as_stated(capsys):
    check_mismatch_run(mismatch_run)
    out = capsys.readouterr().out
    assert out.startswith("✔ check_mismatch_run: the 3-bit sampler cost") and out.count("\n") == 1


@pytest.mark.parametrize("run, hint", [
    (lambda s: 0.4, "8 accuracies in [0, 1]"),
    (lambda s: mismatch_run(s, use_sampler=False), "the mismatch did not reach training"),
    (lambda s: mismatch_run(s, train=False), "the mismatch did not reach training"),
    (lambda s: mismatch_run(s, bits=8), "the mismatch did not reach training"),
    (lambda s: mismatch_run(s, pass_settings=False), "the settings must reach the trainer"),
], ids=["one-number", "no-sampler", "untrained", "8-bit-sampler", "settings-ignored"])
def test_the_experiment_check_catches(run, hint):
    assert_fails(check_mismatch_run, run, hint)


TIS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
       "vllm_importance_sampling_clip_max": 3.0}
TRL_DEFAULT = {"vllm_importance_sampling_correction": True}           # sequence_mask, clip_max 3


@pytest.mark.parametrize("settings", [TIS, TRL_DEFAULT], ids=["token-truncate", "trl-default"])
def test_the_correction_check_passes_corrections_that_work(settings, capsys):
    check_mismatch_correction(lambda: dict(settings))
    assert capsys.readouterr().out.startswith("✔ check_mismatch_correction: your settings won back")


@pytest.mark.parametrize("settings, hint", [
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 3.0},
     "a correction switched on"),
    ({**TIS, "vllm_importance_sampling_cap": 3.0}, "keys are among"),
    ({**TIS, "vllm_importance_sampling_mode": "token"}, "vllm_importance_sampling_mode must be one of"),
    (None, "keys are among"),
    ({"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_mask",
      "vllm_importance_sampling_clip_min": 0.9, "vllm_importance_sampling_clip_max": 1.1}, "won back"),
    ({"off_policy_mask_threshold": 5.0}, "won back"),
], ids=["correction-off", "misspelt-key", "bad-mode", "none", "bounds-too-tight", "threshold-too-loose"])
def test_the_correction_check_catches(settings, hint):
    assert_fails(check_mismatch_correction, lambda: settings, hint)
