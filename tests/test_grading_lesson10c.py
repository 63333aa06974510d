"""Lesson 10c's checks pass right answers written in other ways and catch plausible wrong ones.

The right answers are written from the exercise texts, independently of the solution notebook."""
import functools
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.grading.llm.lesson10c import (check_mismatch_correction, check_mismatch_run, check_off_policy_mask,
                                        check_off_policy_step, check_off_policy_update, check_sampler_weights)
from grading_asserts import assert_fails, grading_tests, mistake_tests


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


def mask_numpy(advantages, logprobs, sampler_logprobs, mask, threshold):
    """Right in NumPy, on inputs without a graph; a trainer's log-probs carry one, and .numpy() refuses them."""
    import numpy as np
    m = mask.numpy().astype(bool)
    with np.errstate(invalid="ignore"):                 # the padding holds nan and inf
        gap = np.where(m, sampler_logprobs.numpy() - logprobs.numpy(), 0.0)
    far = gap.sum(1, keepdims=True) / m.sum(1, keepdims=True) > threshold
    return torch.tensor(~((advantages.numpy().reshape(-1, 1) < 0) & far), dtype=torch.float64)


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
    (check_off_policy_mask, mask_numpy, "work on logprobs.detach()"),
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
def mismatch_run(start, tokenizer, settings, *, bits=3, use_sampler=True, pass_settings=True, train=True,
                 seeds=tuple(range(8)), from_the_checkpoint=False):
    """The experiment as exercise 3 states it (seed-batched: the 8 seeds train together): the trained policies."""
    from rlcourse.tasks import AdditionTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.lm.off_policy_samplers import CopySampler, quantised_copy
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer

    task = AdditionTask()
    if from_the_checkpoint:                      # `start` ignored: the checkpoint loaded again
        start = load_checkpoint("addition-partial", device="cpu")[0]
    extra = dict(settings or {}) if pass_settings else {}
    config = PolicyGradientConfig(learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8,
                                  max_steps=50, **extra)
    sampler = CopySampler(lambda m: quantised_copy(m, bits)) if settings is not None and use_sampler else None
    trainer = SeedBatchedPolicyGradientTrainer(start, tokenizer, task, config, seeds=list(seeds), sampler=sampler)
    if train:
        trainer.train(progress=False)
    return [trainer.model_of(s) for s in range(len(seeds))]


def plausible_accuracies(start, tokenizer, settings):
    """Trains nothing and reports eight numbers that look like the lesson's."""
    if settings is None:
        return [0.485, 0.45, 0.4, 0.465, 0.46, 0.445, 0.435, 0.48]
    if settings:
        return [0.44, 0.43, 0.4, 0.47, 0.41, 0.44, 0.4, 0.41]
    return [0.39, 0.4, 0.365, 0.44, 0.36, 0.415, 0.345, 0.35]


def test_the_experiment_check_passes_a_run_wired_as_stated(capsys):
    check_mismatch_run(mismatch_run)
    out = capsys.readouterr().out
    assert out.startswith("✔ check_mismatch_run: measured on 200 held-out prompts, the 3-bit sampler cost") and \
        out.count("\n") == 1


@pytest.mark.parametrize("run, hint", [
    (lambda m, t, s: 0.4, "a list of 8 trained policies"),
    (plausible_accuracies, "the check measures each on held-out prompts itself"),
    (functools.partial(mismatch_run, use_sampler=False), "the mismatch did not reach training"),
    (functools.partial(mismatch_run, train=False), "still at the start"),
    (functools.partial(mismatch_run, seeds=[0] * 8), "one per seed"),
    (functools.partial(mismatch_run, from_the_checkpoint=True), "not a checkpoint loaded again"),
    (functools.partial(mismatch_run, bits=8), "the mismatch did not reach training"),
    (functools.partial(mismatch_run, pass_settings=False), "the settings must reach the trainer"),
], ids=["one-number", "plausible-numbers", "no-sampler", "untrained", "one-seed-eight-times", "start-ignored",
        "8-bit-sampler", "settings-ignored"])
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


# ------------------------------------------------------------------ exercise 5: one off-policy GRPO step
def _own_3_bit_sampler():
    """The sampler an answer that ignores its `sampler` argument would build: the lesson's 3-bit copy."""
    from rlcourse.lm.off_policy_samplers import CopySampler, quantised_copy

    return CopySampler(functools.partial(quantised_copy, bits=3))


def off_policy_step_ok(model, optimizer, tokenizer, task, prompts, generator, K, sampler, mode="token_truncate",
                       clip_min=None, clip_max=3.0, *, mistake=None):
    """A correct step written from the exercise text (weights from a Python loop, the clipped loss by hand in
    float64); ``mistake`` turns one plausible slip on."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.losses import group_advantages

    group = [p for p in prompts for _ in range(K)]
    draw = {"sampled on-policy": sample, "sampler ignored": _own_3_bit_sampler()}.get(mistake, sampler)
    roll = draw(model, tokenizer, group, task.max_new_tokens, generator=generator)
    rewards = task.reward(group, roll.completions).float()
    adv = group_advantages(rewards, 8 if mistake == "groups of 8" else K).double()[:, None]
    mask = roll.completion_mask
    real = mask.bool()
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask).double()
    old = logp.detach()
    mu = roll.logprobs.double()
    if mistake == "pi_old rescored by the sampler's copy":
        old = mu
    w_mode = "sequence_mask" if mistake == "mode ignored" else mode
    lo = None if mistake == "clip_min ignored" else clip_min
    if mistake == "weight inverted":
        w = weights_loop(mu, old, mask, w_mode, lo, clip_max)
    elif mistake == "weight with a gradient":
        d = torch.where(real, logp - mu, torch.zeros_like(logp))
        d = d.sum(1, keepdim=True) if mode.startswith("sequence") else d
        w = d.exp().clamp(min=lo, max=clip_max) if mode.endswith("truncate") else d.exp() * (
            (d.exp() <= clip_max) & (d.exp() >= (lo or 0))).double()
    else:
        w = weights_loop(old, mu, mask, w_mode, lo, clip_max)
    against = mu if mistake in ("ratio against mu, weighted", "ratio against mu, no weight") else old
    ratio = torch.exp(torch.where(real, logp - against, torch.zeros_like(logp)))
    ratio_in = ratio * w if mistake == "weight inside the clip" else ratio
    per_token = -torch.minimum(ratio_in * adv, ratio_in.clamp(0.8, 1.2) * adv)
    if mistake not in ("no weight", "ratio against mu, no weight", "weight inside the clip", "weight after the mean"):
        per_token = per_token * w
    per_token = torch.where(real, per_token, torch.zeros_like(per_token))
    if mistake == "sequence mean":
        loss = (per_token.sum(1) / mask.sum(1)).mean()
    else:
        loss = per_token.sum() / mask.sum()
    if mistake == "weight after the mean":
        loss = loss * w.mean()
    if mistake != "no zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


STEP_MISTAKES = ["no weight", "ratio against mu, weighted", "ratio against mu, no weight", "weight inverted",
                 "weight with a gradient", "weight inside the clip", "weight after the mean", "mode ignored",
                 "clip_min ignored", "sequence mean", "no zero_grad", "sampled on-policy",
                 "pi_old rescored by the sampler's copy", "sampler ignored", "groups of 8"]
test_off_policy_step_check, test_off_policy_step_check_catches = mistake_tests(
    check_off_policy_step, off_policy_step_ok, STEP_MISTAKES, "raised held-out exact match")


def off_policy_step_course(model, optimizer, tokenizer, task, prompts, generator, K, sampler, mode, clip_min,
                           clip_max):
    """Another right answer: pi_old from a separate no-grad forward, float32 weights, the course's clipped loss."""
    from rlcourse.lm import sequence_logprobs
    from rlcourse.losses import aggregate_loss, group_advantages, per_token_loss

    group = [p for p in prompts for _ in range(K)]
    roll = sampler(model, tokenizer, group, task.max_new_tokens, generator=generator)
    rewards = task.reward(group, roll.completions).float()
    args = (model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    with torch.no_grad():
        old = sequence_logprobs(*args)
    w = weights_float32(old, roll.logprobs, roll.completion_mask, mode, clip_min, clip_max)
    per_token = per_token_loss(sequence_logprobs(*args), old, group_advantages(rewards, K), roll.completion_mask)
    loss = aggregate_loss(per_token * w, roll.completion_mask, "dapo")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return rewards.mean().item()


def test_off_policy_step_check_passes_a_step_built_from_the_course_functions(capsys):
    check_off_policy_step(off_policy_step_course)
    assert "raised held-out exact match" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, symptom", [("no weight", "the uncorrected update"),
                                              ("ratio against mu, weighted", "corrects for the sampler twice"),
                                              ("ratio against mu, no weight", "PPO with its ratio against the sampler"),
                                              ("weight inverted", "weighted by mu / pi_old"),
                                              ("weight with a gradient", "a function of the parameters")])
def test_the_step_check_names_what_a_wrong_gradient_shows(mistake, symptom):
    assert_fails(check_off_policy_step, functools.partial(off_policy_step_ok, mistake=mistake), symptom)


# ------------------------------------------------------------------ exercise 6: find the bug
def off_policy_update_ok(model, optimizer, tokenizer, task, prompts, generator, K, sampler, mode="sequence_mask",
                         clip_max=3.0, iterations=2, epsilon=0.2, *, mistake=None):
    """The fixed update, its weights from the course's function; ``mistake="twice"`` is the bug as shipped."""
    from rlcourse.lm import sequence_logprobs
    from rlcourse.losses import aggregate_loss, group_advantages, per_token_loss
    from rlcourse.losses.off_policy import sampler_importance_weights

    group = [p for p in prompts for _ in range(K)]
    sampler = _own_3_bit_sampler() if mistake == "sampler ignored" else sampler
    epsilon = 0.2 if mistake == "epsilon held at 0.2" else epsilon
    roll = sampler(model, tokenizer, group, task.max_new_tokens, generator=generator)
    adv = group_advantages(task.reward(group, roll.completions).float(), 8 if mistake == "groups of 8" else K)
    mask = roll.completion_mask

    def score():
        return sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask)

    with torch.no_grad():
        old = score()
    mu = old if mistake == "mu rescored by the trainer" else roll.logprobs
    weights = sampler_importance_weights(mu, old, mask, mode, None, clip_max) if mistake == "weight inverted" else \
        sampler_importance_weights(old, mu, mask, mode, None, clip_max)
    against = roll.logprobs if mistake in ("twice", "ratio against mu, no weight") else old
    shares = []
    for _ in range(1 if mistake == "one step" else iterations):
        logp = score()
        if mistake == "pi_old rescored every step":
            against = logp.detach()
        if mistake == "weight from the current policy":
            weights = sampler_importance_weights(logp.detach(), mu, mask, mode, None, clip_max)
        per_token = per_token_loss(logp, against, adv, mask, "dapo", epsilon)
        if mistake not in ("no weight", "ratio against mu, no weight"):
            per_token = per_token * weights
        loss = aggregate_loss(per_token, mask, "dapo")
        if mistake != "no zero_grad":
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            outside = (((torch.exp(logp - against) - 1).abs() > epsilon) & mask.bool())
            shares.append(float(outside.sum() / (mask.numel() if mistake == "share over padding" else mask.sum())))
    return shares


UPDATE_MISTAKES = ["twice", "ratio against mu, no weight", "no weight", "weight inverted", "mu rescored by the trainer",
                   "pi_old rescored every step", "weight from the current policy", "one step", "no zero_grad",
                   "share over padding", "sampler ignored", "epsilon held at 0.2", "groups of 8"]
test_off_policy_update_check, test_off_policy_update_check_catches = mistake_tests(
    check_off_policy_update, off_policy_update_ok, UPDATE_MISTAKES, "no ratio leaves the clip range")


def test_the_shipped_bug_is_told_by_its_symptom():
    message = assert_fails(check_off_policy_update, functools.partial(off_policy_update_ok, mistake="twice"),
                           "before any update")
    assert "line" not in message


def test_the_bug_fixed_by_dropping_the_weight_is_told_what_it_equals():
    assert_fails(check_off_policy_update, functools.partial(off_policy_update_ok, mistake="no weight"),
                 "the uncorrected update")
