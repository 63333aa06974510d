"""Checks for lesson 10c (off-policy RL for language models).

* :func:`check_sampler_weights` - TRL's importance weight ``pi_old / mu`` in its four modes with both
  bounds (mistakes caught: the ratio inverted, the bounds applied to the log-ratio before
  exponentiating, tokens masked instead of sequences, the sequence ratio as a mean of log-ratios,
  truncation where masking is asked and the reverse, the lower bound ignored, the padding's junk
  let in, a NaN sampler log-prob let through, the wrong shape, a weight that carries a gradient);
* :func:`check_off_policy_mask` - DeepSeek-V3.2's off-policy sequence mask (mistakes caught: the
  advantage's sign ignored, ``A = 0`` dropped, the divergence taken the other way, a sum or a mean
  over the padded width instead of the mean over real tokens, a strict inequality at the
  threshold, a mask per token, the padding's junk let in);
* :func:`check_mismatch_run` - an experiment: the learner's GRPO runs under a 3-bit sampler hand back
  their trained policies, which the check measures on held-out prompts: the mismatch must cost
  accuracy, and a correction known to work must win some of it back;
* :func:`check_mismatch_correction` - the correction the learner chose, measured with the course's
  own run of that experiment: it must win back at least 3.5 points;
* :func:`check_off_policy_step` - one GRPO update on a 3-bit sampler's completions with TRL's weight, checked
  as lesson 10's step is (each call's gradient against the course trainer's, then a short run that must
  learn); a gradient equal to a known wrong update's is named (uncorrected, corrected twice, PPO against
  the sampler, the weight inverted, the weight with a gradient);
* :func:`check_off_policy_update` - find the bug: an update of several clipped steps on one sampled batch,
  fixed; measured by the ratio before any update and every step's gradient.

The weights and the mask are compared with :mod:`rlcourse.losses.off_policy`, which
``tests/test_trl_parity_off_policy.py`` holds to TRL 1.16's ``GRPOTrainer`` on fixed inputs.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references, to_numpy
from rlcourse.grading._routes import OFF_POLICY_CORRECTIONS, POLICY_GRADIENT_TRAINER

__all__ = ["check_sampler_weights", "check_off_policy_mask", "check_mismatch_run", "check_mismatch_correction",
           "check_off_policy_step", "check_off_policy_update"]

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# (clip_min, clip_max): TRL's default, both bounds, a lower bound alone, a tight upper bound.
BOUNDS = [(None, 3.0), (0.5, 2.0), (0.8, None), (None, 1.5)]


def _batches(seed: int):
    """(case, old, sampler, mask): lesson 10's ragged loss cases (padding holding nan, inf and 7, log-prob
    gaps of about 0.4 nats per token, so sequence ratios reach past 3), read as pi_old and mu, and one
    of them again with a NaN sampler log-prob on a real token."""
    from rlcourse.grading.llm.lesson10 import _loss_cases

    out = [(case, old, sampler, mask) for case, old, sampler, _, _, mask in _loss_cases(seed)]
    case, old, sampler, mask = out[-1]
    sampler = sampler.clone()
    sampler[0, 2] = float("nan")
    out.append((case + ", with a NaN sampler log-prob on a real token (row 0, column 2)", old, sampler, mask))
    return out


def _outside(values: torch.Tensor, lo, hi) -> torch.Tensor:
    """Where ``values`` leave ``[lo, hi]`` (a bound of None is no bound)."""
    return (values < (-math.inf if lo is None else lo)) | (values > (math.inf if hi is None else hi))


def _bounded(ratio: torch.Tensor, lo, hi, truncation: bool) -> torch.Tensor:
    """``ratio`` clamped into ``[lo, hi]`` (truncation), or set to 0 outside it (masking)."""
    if truncation:
        return ratio if (lo, hi) == (None, None) else ratio.clamp(min=lo, max=hi)
    return ratio.masked_fill(_outside(ratio, lo, hi), 0.0)


def _shown_bounds(clip_min, clip_max) -> str:
    return f"clip_min={clip_min}, clip_max={clip_max}"


@references("rlcourse.losses.off_policy:sampler_importance_weights",
            "rlcourse.trainers.policy_gradient:attach_sampler_logprobs")
def check_sampler_weights(fn) -> None:
    """``fn(old_logprobs, sampler_logprobs, mask, mode, clip_min, clip_max)``: TRL's ``importance_sampling_ratio``,
    ``(B, T)`` for the ``token_*`` modes and ``(B, 1)`` for the ``sequence_*`` modes, a constant."""
    __tracebackhide__ = True
    from rlcourse.losses.off_policy import sampler_importance_weights as reference

    name = "check_sampler_weights"
    n = 0
    for case, old, sampler, mask in _batches(1010):
        real = mask.bool()
        zero = torch.zeros_like(old)
        d = torch.nan_to_num(torch.where(real, old - sampler, zero), nan=0.0)    # TRL's log-ratio, 0 off the mask
        for mode in MODES:
            for clip_min, clip_max in BOUNDS:
                label = f"{case}, mode={mode!r}, {_shown_bounds(clip_min, clip_max)}"
                sequence = mode.startswith("sequence")
                truncate = mode.endswith("truncate")
                mine = old.clone().requires_grad_()
                got = call_unmutated(name, label, fn, mine, sampler, mask, "".join(mode), clip_min, clip_max)
                expected = reference(old, sampler, mask, mode, clip_min, clip_max)
                if isinstance(got, torch.Tensor) and got.requires_grad:
                    fail(name, label, "a weight without a gradient (a constant)", "a tensor that requires grad",
                         "the weight multiplies the loss as a constant: compute it from detached log-probs")
                level = (lambda x: x.sum(1, keepdim=True)) if sequence else (lambda x: x)
                lengths = mask.sum(1, keepdim=True).to(old.dtype)
                mistakes = [
                    (_bounded(level(-d).exp(), clip_min, clip_max, truncate),
                     "the weight corrects samples drawn from mu toward pi_old: it is pi_old / mu, "
                     "exp(old_logprobs - sampler_logprobs), not mu / pi_old"),
                    (level(d).clamp(min=clip_min, max=clip_max).exp() if truncate else
                     level(d).exp().masked_fill(_outside(level(d), clip_min, clip_max), 0.0),
                     "the bounds apply to the ratio, after exponentiating: min(exp(d), clip_max), not exp(min(d, clip_max))"),
                    (_bounded(level(d).exp(), clip_min, clip_max, not truncate),
                     "truncate clamps the ratio into [clip_min, clip_max]; mask sets a ratio outside it to 0 and "
                     "leaves the others as they are"),
                ]
                if clip_min is not None:
                    mistakes.append((_bounded(level(d).exp(), None, clip_max, truncate),
                                     "clip_min bounds the ratio from below (truncate: raise it to clip_min; mask: "
                                     "set it to 0)"))
                if sequence:
                    mistakes.append((_bounded((level(d) / lengths).exp(), clip_min, clip_max, truncate),
                                     "the sequence ratio is pi_old(y) / mu(y), the product of the token ratios: "
                                     "exp of the sum of the log-ratios, not of their mean"))
                    token_w = torch.where(real, _bounded(d.exp(), clip_min, clip_max, truncate), zero)
                    mistakes.append((token_w.sum(1, keepdim=True) / lengths,
                                     "one weight per sequence, from the sequence's ratio; not an average of token weights"))
                for value, hint in mistakes:
                    fail_if_mistake(name, label, expected, got, value, hint)
                if got is not None and sequence and tuple(np.shape(to_numpy(got))) == tuple(mask.shape):
                    fail(name, label, f"shape {tuple(expected.shape)}", f"shape {tuple(mask.shape)}",
                         "a sequence_* mode gives one weight per completion, (B, 1): the sequence is kept, truncated "
                         "or masked as a whole, not token by token")
                if got is not None and not sequence and tuple(np.shape(to_numpy(got))) == (mask.shape[0], 1):
                    fail(name, label, f"shape {tuple(expected.shape)}", f"shape {(mask.shape[0], 1)}",
                         "a token_* mode gives one weight per token, (B, T)")
                if got is not None and not np.isfinite(to_numpy(got)).all():
                    fail(name, label, expected, got, "padding holds nan and inf: take the log-ratio on real tokens "
                         "only (torch.where(mask.bool(), ..., 0), so a padded position gets weight 1), and a NaN "
                         "sampler log-prob on a real token counts as a log-ratio of 0 (TRL's convention: no correction)")
                assert_close(name, label, expected, got, atol=1e-7, rtol=1e-6,
                             hint="d = old - sampler on real tokens (0 elsewhere, and where NaN); token: exp(d); "
                                  "sequence: exp(sum_t d); truncate: clamp into [clip_min, clip_max]; mask: 0 outside")
                n += 1
    passed(name, n)


def _mask_cases():
    """(case, advantages, logprobs, sampler, mask, threshold)."""
    gen = torch.Generator().manual_seed(1011)
    cases = []
    B, T = 8, 5
    lengths = torch.tensor([5, 1, 3, 5, 2, 4, 5, 3])
    mask = (torch.arange(T) < lengths[:, None]).long()
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 0.1
    gaps = torch.tensor([[0.9, 0.6, 0.2, 0.8, 1.0], [0.7, 0, 0, 0, 0], [0.2, 0.1, 0.0, 0, 0], [0.5, 0.5, 0.5, 0.5, 0.5],
                         [-0.3, 1.5, 0, 0, 0], [0.6, 0.6, 0.6, 0.6, 0], [0.1, 0.1, 0.1, 0.1, 2.0], [1.0, 1.0, 1.0, 0, 0]],
                        dtype=torch.float64)
    sampler = logp + gaps
    junk = torch.tensor([float("nan"), 9.0, -float("inf"), float("inf")], dtype=torch.float64)
    fill = junk.repeat(B * T // 4 + 1)[:B * T].view(B, T)
    logp, sampler = torch.where(mask.bool(), logp, fill), torch.where(mask.bool(), sampler, fill.flip(1))
    adv = torch.tensor([-1.0, -0.5, -2.0, -1.0, -0.7, 0.0, -0.2, 1.3], dtype=torch.float64)
    for threshold in (0.5, 0.45, 0.0):
        cases.append((f"8 completions of lengths {lengths.tolist()} (padding holds nan, inf and 9), threshold "
                      f"{threshold}; row 3's mean gap is exactly 0.5, row 5 has A = 0", adv, logp, sampler, mask,
                      threshold))
    B, T = 6, 7
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths[:, None]).long()
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    sampler = logp + 0.6 * torch.randn(B, T, generator=gen, dtype=torch.float64).abs()
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    cases.append((f"6 random completions of lengths {lengths.tolist()}, advantages of shape (B, 1), threshold 0.3",
                  adv[:, None], logp, sampler, mask, 0.3))
    return cases


@references("rlcourse.losses.off_policy:off_policy_sequence_mask", "rlcourse.trainers.policy_gradient:loss_and_stats")
def check_off_policy_mask(fn) -> None:
    """``fn(advantages, logprobs, sampler_logprobs, mask, threshold) -> (B, 1)`` of 0 (drop) and 1 (keep)."""
    __tracebackhide__ = True
    from rlcourse.losses.off_policy import off_policy_sequence_mask as reference

    name = "check_off_policy_mask"
    n = 0
    cases = _mask_cases()
    case, adv, logp, sampler, mask, threshold = cases[-1]      # again, with the trainer's log-probs: they carry a graph
    cases.append((case.replace("6 random completions", "the same 6 completions, logprobs requiring grad as a "
                                                        "trainer's do,"), adv, logp.clone().requires_grad_(True),
                  sampler, mask, threshold))
    for case, adv, logp, sampler, mask, threshold in cases:
        try:
            got = call_unmutated(name, case, fn, adv, logp, sampler, mask, threshold)
        except RuntimeError as error:
            if not logp.requires_grad:
                raise
            fail(name, case, "a mask", f"RuntimeError: {error}",
                 "a trainer's log-probs carry the policy's graph and the mask is not differentiated: work on "
                 "logprobs.detach()")
        if isinstance(got, torch.Tensor) and got.requires_grad:
            fail(name, case, "a mask without a gradient (a constant)", "a tensor that requires grad",
                 "the mask selects sequences, it is not differentiated: compute it from detached log-probs")
        logp = logp.detach()
        expected = reference(adv, logp, sampler, mask, threshold).double()
        real = mask.bool()
        a = adv.reshape(-1, 1)
        gap = torch.where(real, sampler - logp, torch.zeros_like(logp))
        lengths = mask.sum(1, keepdim=True).double()
        mean_gap = gap.sum(1, keepdim=True) / lengths

        def keep(pushed_down, divergence, strict=False):
            far = divergence > threshold if not strict else divergence >= threshold
            return (~(pushed_down & far)).double()

        mistakes = [
            (keep(torch.ones_like(a, dtype=torch.bool), mean_gap),
             "only sequences pushed down (A < 0) are dropped: a sequence with A >= 0 is always kept"),
            (keep(a <= 0, mean_gap), "A = 0 is not negative: such a sequence is kept"),
            (keep(a < 0, -mean_gap), "the divergence is of the policy from the sampler, measured on the sampler's "
                                     "tokens: the mean of log mu - log pi, sampler_logprobs - logprobs"),
            (keep(a < 0, gap.sum(1, keepdim=True)), "the threshold is in nats per token: average the gap over the "
                                                    "sequence's real tokens, do not sum it"),
            (keep(a < 0, gap.sum(1, keepdim=True) / mask.shape[1]),
             "average over the sequence's real tokens (mask.sum(1)), not over the padded width"),
            (keep(a < 0, mean_gap, strict=True), "a sequence whose mean gap equals the threshold is kept: drop only "
                                                 "when it is strictly above"),
        ]
        for value, hint in mistakes:
            fail_if_mistake(name, case, expected, got, value, hint)
        if got is not None and tuple(np.shape(to_numpy(got))) == tuple(mask.shape):
            fail(name, case, f"shape {tuple(expected.shape)}", f"shape {tuple(mask.shape)}",
                 "the mask keeps or drops whole sequences: one value per completion, (B, 1)")
        if got is not None and not np.isfinite(to_numpy(got)).all():
            fail(name, case, expected, got, "padding holds nan and inf: leave it out of the sums")
        assert_close(name, case, expected, got, atol=0, rtol=0,
                     hint="keep (1) unless A < 0 and mean over real tokens of (sampler_logprobs - logprobs) > "
                          "threshold; shape (B, 1)")
        n += 1
    passed(name, n)


# The experiment of exercises 3 and 4: sizes stated in the exercise texts.
MISMATCH = {"seeds": list(range(8)), "steps": 50, "bits": 3, "learning_rate": 1e-4, "held_out": 200}
SETTINGS_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "off_policy_mask_threshold")
# A correction that works (token-level truncated IS at TRL's cap): what check_mismatch_run hands the learner's run.
WORKING = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
           "vllm_importance_sampling_clip_max": 3.0}


@functools.lru_cache(maxsize=8)
def _reference_run(settings: tuple | None) -> tuple:
    """The experiment of the exercises, run by the course's code: each seed's held-out exact match.

    ``settings`` is ``None`` (on-policy) or the sorted items of the off-policy settings (the 3-bit
    sampler); the runs are deterministic, so a repeated call returns the first one's result.
    """
    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers import exact_match
    from rlcourse.lm import load_checkpoint
    from rlcourse.lm.off_policy_samplers import CopySampler, quantised_copy
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer

    task = AdditionTask()
    start, tokenizer = load_checkpoint("addition-partial", device="cpu")
    config = PolicyGradientConfig(learning_rate=MISMATCH["learning_rate"], per_device_train_batch_size=64,
                                  num_generations=8, max_steps=MISMATCH["steps"], **dict(settings or ()))
    sampler = None if settings is None else CopySampler(lambda m: quantised_copy(m, MISMATCH["bits"]))
    trainer = SeedBatchedPolicyGradientTrainer(start, tokenizer, task, config, seeds=MISMATCH["seeds"], sampler=sampler)
    trainer.train(progress=False)
    prompts = task.test_prompts(MISMATCH["held_out"])
    return tuple(exact_match(trainer.model_of(s), tokenizer, task, prompts) for s in range(len(MISMATCH["seeds"])))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu().float() for p in model.parameters()])


def _policies(name: str, case: str, got, n: int, handed: torch.Tensor, checkpoint: torch.Tensor) -> list:
    """The ``n`` trained policies a run returned, or a failure saying what came back instead: each a causal LM
    trained from the policy handed over (``handed``, its weights flat), not from the checkpoint loaded again."""
    __tracebackhide__ = True
    models = list(got) if isinstance(got, (list, tuple)) else None
    if models is None or len(models) != n or not all(
            isinstance(m, torch.nn.Module) and hasattr(m, "get_input_embeddings") for m in models):
        shown = (f"{len(models)} items of types {sorted({type(m).__name__ for m in models})}" if models is not None
                 else f"{type(got).__name__} {got!r:.60}")
        fail(name, case, f"a list of {n} trained policies (causal LMs), one per seed", shown,
             "return the policies the trainer trained, [trainer.model_of(s) for s in range(8)]: the check measures "
             "each on held-out prompts itself")
    weights = [_flat(m) for m in models]
    if any(w.shape != handed.shape for w in weights):
        fail(name, case, f"{n} policies of the shape of the policy handed over", "policies of another shape",
             "train from start, the policy you are given")
    untrained = [s for s, w in enumerate(weights) if torch.equal(w, handed)]
    if untrained:
        fail(name, case, f"{n} policies trained from start", f"seed(s) {untrained} still at the start",
             "return each seed's policy after trainer.train()")
    elsewhere = [s for s, w in enumerate(weights) if not (w - handed).norm() < (w - checkpoint).norm()]
    if elsewhere:
        fail(name, case, f"{n} policies trained from the policy handed over",
             f"seed(s) {elsewhere} nearer the addition-partial checkpoint than that policy",
             "train from start, the policy you are given (the check moves it a little), not a checkpoint loaded again")
    probe = torch.randn(handed.shape, generator=torch.Generator().manual_seed(0))
    sums = [float(w.double() @ probe.double()) for w in weights]
    if len(set(sums)) < n:
        fail(name, case, f"{n} different policies, one per seed", f"{len(set(sums))} different one(s)",
             "each seed trains its own policy (seeds=list(range(8))); return trainer.model_of(s) for every s")
    return models


def _measured(models, tokenizer, held_out: int) -> np.ndarray:
    """Greedy exact match of each policy on the first ``held_out`` test prompts, measured here."""
    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers import exact_match

    task = AdditionTask()
    prompts = task.test_prompts(held_out)
    return np.array([exact_match(m.cpu().eval(), tokenizer, task, prompts) for m in models])


@references()
def check_mismatch_run(fn) -> None:
    """``fn(start, tokenizer, settings) -> [the trained policy of each of the 8 seeds]``: ``fn(start, tokenizer,
    None)`` trains on-policy from ``start``, ``fn(start, tokenizer, {})`` with the 3-bit sampler and no
    correction, ``fn(start, tokenizer, s)`` with the 3-bit sampler and the off-policy settings ``s``.
    ``start`` is ``addition-partial`` moved a little by seeded noise (a run that loads the checkpoint again is
    seen); it must come back unchanged. The check measures every policy itself (greedy exact match on 200
    held-out test prompts; a reported number could be anything). Paired over the seeds: the uncorrected run
    must lose at least 3 points to the on-policy one, and a correction known to work must win at least 3 of
    them back."""
    __tracebackhide__ = True
    import copy

    from rlcourse.grading._steps import moved_copy
    from rlcourse.lm import load_checkpoint

    name = "check_mismatch_run"
    n, held_out = len(MISMATCH["seeds"]), MISMATCH["held_out"]
    partial, tokenizer = load_checkpoint("addition-partial", device="cpu")
    start = moved_copy(partial, seed=3, scale=0.003)   # the same start for every run: the comparisons stay paired
    checkpoint, handed = _flat(partial), _flat(start)

    def accuracies(case: str, settings):
        policy = copy.deepcopy(start)
        got = fn(policy, tokenizer, settings)
        if not torch.equal(_flat(policy), handed):
            fail(name, case, "start left unchanged", "its weights were changed",
                 "the trainer trains copies of start (one per seed): the check hands the same start to every run")
        return _measured(_policies(name, case, got, n, handed, checkpoint), tokenizer, held_out)

    on = accuracies("fn(start, tokenizer, None), on-policy", None)
    uncorrected = accuracies("fn(start, tokenizer, {}), the 3-bit sampler, uncorrected", {})
    cost = 100 * (on - uncorrected)
    if not cost.mean() >= 3:
        fail(name, "fn(..., None) minus fn(..., {}), paired over the 8 seeds (held-out exact match of the policies "
                   "returned)", "at least 3 points lost to the 3-bit sampler",
             f"{cost.mean():+.1f} points (per seed: {np.round(cost, 1).tolist()})",
             "the mismatch did not reach training: fn(..., {}) must sample with the 3-bit copy "
             "(sampler=CopySampler(...)) and fn(..., None) without a sampler")
    fixed = accuracies(f"fn(start, tokenizer, {WORKING})", dict(WORKING))
    gain = 100 * (fixed - uncorrected)
    if not gain.mean() >= 3:
        fail(name, f"fn(..., {WORKING}) minus fn(..., {{}}), paired over the 8 seeds",
             "at least 3 points won back by token-level truncated importance sampling",
             f"{gain.mean():+.1f} points (per seed: {np.round(gain, 1).tolist()})",
             "the settings must reach the trainer: PolicyGradientConfig(..., **settings)")
    print(f"✔ {name}: measured on {held_out} held-out prompts, the 3-bit sampler cost {cost.mean():.1f} points "
          f"({100 * on.mean():.1f}% -> {100 * uncorrected.mean():.1f}%); a working correction won back "
          f"{gain.mean():.1f} (paired over {n} seeds)")


@references()
def check_mismatch_correction(fn) -> None:
    """``fn() -> settings``: off-policy settings under TRL's names. Measured with the course's own run of
    the experiment (8 seeds, the 3-bit sampler): the settings must raise held-out exact match by at
    least 3.5 points over the uncorrected run, paired over the seeds."""
    __tracebackhide__ = True
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig

    name = "check_mismatch_correction"
    settings = fn()
    if not isinstance(settings, dict) or not set(settings) <= set(SETTINGS_KEYS):
        fail(name, "the settings chosen", f"a dict whose keys are among {list(SETTINGS_KEYS)}", settings,
             "TRL's names for the off-policy settings (a misspelt key would be ignored by TRL, and refused by "
             "PolicyGradientConfig)")
    try:
        PolicyGradientConfig(**settings)
    except (TypeError, ValueError) as error:
        fail(name, "the settings chosen", "settings PolicyGradientConfig accepts", settings, str(error))
    if not settings.get("vllm_importance_sampling_correction") and settings.get("off_policy_mask_threshold") is None:
        fail(name, "the settings chosen", "a correction switched on", settings,
             "vllm_importance_sampling_correction=True applies the mode and its bounds (or set "
             "off_policy_mask_threshold); without either, the run is the uncorrected one")
    uncorrected = np.array(_reference_run(()))
    fixed = np.array(_reference_run(tuple(sorted(settings.items()))))
    gain = 100 * (fixed - uncorrected)
    if not gain.mean() >= 3.5:
        fail(name, f"the experiment with {settings} minus without a correction, paired over the 8 seeds",
             "at least 3.5 points of held-out exact match won back", f"{gain.mean():+.1f} points (per seed: "
             f"{np.round(gain, 1).tolist()})",
             "a bound so tight that most tokens or completions are masked, or a threshold so loose that none are, "
             "leaves the run close to the uncorrected one")
    print(f"✔ {name}: your settings won back {gain.mean():.1f} points over the uncorrected run (paired over "
          f"{len(MISMATCH['seeds'])} seeds)")


# ------------------------------------------------------------------ exercises 5 and 6: the off-policy update
# The sampler of both checks: a 3-bit copy of the trainer's current weights, far enough off that every
# token's weight pi_old / mu differs from 1 and each mode and bound gives another gradient.
STEP_BITS = 3
STEP_BATCH = (8, 8)    # prompts x completions per call: at lesson 10's 6 x 4 this sampler drew no right answer, no gradient
# (mode, clip_min, clip_max, sampler bits, completions per prompt): the last setting hands over another
# sampler (a 4-bit copy, whose draws have a right answer in groups of 4) and another group size.
STEP_SETTINGS = [("token_truncate", None, 3.0, STEP_BITS, 8), ("sequence_mask", None, 3.0, STEP_BITS, 8),
                 ("token_mask", 0.5, 2.0, STEP_BITS, 8), ("sequence_truncate", 0.5, 2.0, 4, 4)]
# 40 steps under the 3-bit sampler at token_truncate, cap 3: the reference step gains 5 to 18 points of
# held-out exact match over seeds 0-7 (10 at seed 0, which the check uses); the uncorrected step -3 to +6.
STEP_LEARNING = {"steps": 40, "lr": 1e-4, "groups": 8, "num_generations": 8, "held_out": 300, "margin": 0.04}
# (mode, clip_max, num_iterations, epsilon, num_generations, sampler bits)
BUG_SETTINGS = [("sequence_mask", 3.0, 2, 0.2, 8, STEP_BITS), ("token_truncate", 2.0, 3, 0.1, 4, 4)]

# What a gradient equal to one of these updates' shows (see _variant_gradients), named by its symptom.
SYMPTOMS = {
    "uncorrected": ("the gradient of the uncorrected update",
                    "the completions were drawn by the sampler, yet every token's loss counts as if the trainer had "
                    "drawn it: the weight pi_old / mu never reaches the gradient"),
    "twice": ("the gradient of an update that corrects for the sampler twice",
              "the clipped ratio is measured against the sampler's log-probs, so before any update it is already "
              "pi_old / mu rather than 1, and the weight pi_old / mu multiplies it once more"),
    "against_sampler": ("the gradient of PPO with its ratio against the sampler, pi_theta / mu, and no weight",
                        "the clip acts on the gap between the sampler and the trainer before any update; the ratio "
                        "of the clipped loss is against the trainer's own pi_old, and the sampler enters as a "
                        "bounded weight"),
    "with_grad": ("the gradient of an update whose weight pi_old / mu is a function of the parameters",
                  "the gradient also flows through the weight, as if it were pi_theta / mu: the weight corrects "
                  "for where the batch came from and is a constant of the update"),
    "inverted": ("the gradient of an update weighted by mu / pi_old",
                 "the tokens the sampler draws more often than the trainer would are weighted up, not down"),
}


def _sampler(bits: int = STEP_BITS):
    """The checks' sampler: :class:`~rlcourse.lm.off_policy_samplers.CopySampler` of a ``bits``-bit copy."""
    from rlcourse.lm.off_policy_samplers import CopySampler, quantised_copy

    return CopySampler(functools.partial(quantised_copy, bits=bits))


def _flat_gradient(loss: torch.Tensor, params: list) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten().double() for g, p in zip(grads, params)])


def _variant_gradients(model, b, config, max_len: int) -> dict:
    """The gradients, at the batch's weights, of the updates :data:`SYMPTOMS` names, built from the course's loss."""
    from rlcourse.trainers.policy_gradient import logits_and_logprobs
    from rlcourse.losses.grpo import aggregate_loss, per_token_loss
    from rlcourse.losses.off_policy import sampler_importance_weights

    c = config
    logp = logits_and_logprobs(model, b, c.temperature)[1]
    old, mu, mask = b.old_logprobs, b.sampler_logprobs, b.loss_mask

    def loss(against, weight=None):
        per_token = per_token_loss(logp, against, b.advantages, mask, c.loss_type, c.epsilon, c.epsilon_high)
        return aggregate_loss(per_token if weight is None else per_token * weight, mask, c.loss_type, max_len)

    inverted = sampler_importance_weights(mu, old, mask, c.vllm_importance_sampling_mode,
                                          c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max)
    # The same weights computed from the policy's log-probs with their graph: where the weight is the ratio
    # itself (not cut to a bound), its gradient is the ratio's, w * grad(log pi - log mu).
    log_ratio = torch.where(mask.bool(), logp - mu, torch.zeros_like(logp))
    if c.vllm_importance_sampling_mode.startswith("sequence"):
        log_ratio = log_ratio.sum(1, keepdim=True)
    free = b.is_weights == log_ratio.detach().exp()
    with_grad = b.is_weights * torch.exp(torch.where(free, log_ratio - log_ratio.detach(), torch.zeros_like(log_ratio)))
    params = list(model.parameters())
    losses = {"uncorrected": loss(old), "twice": loss(mu, b.is_weights), "against_sampler": loss(mu),
              "inverted": loss(old, inverted), "with_grad": loss(old, with_grad)}
    return {key: _flat_gradient(value, params) for key, value in losses.items()}


def _reference_update(model, optimizer, tokenizer, task, prompts, generator, num_generations, sampler, mode,
                      clip_min, clip_max, epsilon=0.2, num_iterations=1, variants: dict | None = None):
    """The course trainer's off-policy update on one batch, as ``PolicyGradientTrainer.step`` runs it with
    ``sampler=`` and TRL's correction on (``loss_type="dapo"``, no gradient clipping): the completions and
    ``mu`` from ``sampler``, ``pi_old`` from the trainer's own forward, the weight in ``mode`` with its bounds
    on the clipped loss (:func:`~rlcourse.trainers.policy_gradient.attach_sampler_logprobs`,
    :func:`~rlcourse.trainers.policy_gradient.loss_and_stats`), ``num_iterations`` optimiser steps.

    Returns the mean reward and, per step, the share of real tokens whose ratio ``pi_theta / pi_old`` was
    outside ``[1 - epsilon, 1 + epsilon]``; ``variants``, when given, receives :func:`_variant_gradients`
    before the first step.
    """
    from rlcourse.trainers.policy_gradient import (PolicyGradientConfig, _Batch, advantages, attach_sampler_logprobs,
                                             logits_and_logprobs, loss_and_stats)

    group = [p for p in prompts for _ in range(num_generations)]
    config = PolicyGradientConfig(per_device_train_batch_size=len(group), num_generations=num_generations,
                                  epsilon=epsilon, loss_type="dapo", num_iterations=num_iterations, max_grad_norm=None,
                                  vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                                  vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)
    roll = sampler(model, tokenizer, group, task.max_new_tokens, generator=generator)
    b = _Batch(roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    with torch.no_grad():
        b.rewards = task.reward(group, roll.completions).float()
        b.advantages = advantages(config, b.rewards)[0]
        attach_sampler_logprobs(config, model, b, roll.logprobs)
    if variants is not None:
        variants.update(_variant_gradients(model, b, config, task.max_new_tokens))
    mask, outside = b.loss_mask, []
    for _ in range(num_iterations):
        logits, logp = logits_and_logprobs(model, b, config.temperature)
        loss, _ = loss_and_stats(config, logits, logp, b, task.max_new_tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ratio = torch.exp(logp.detach() - b.old_logprobs)
        outside.append(float((((ratio - 1).abs() > epsilon) & mask.bool()).sum() / mask.sum()))
    return float(b.rewards.mean()), outside


def _name_the_symptom(name: str, case: str, received: torch.Tensor, expected: torch.Tensor, variants: dict) -> None:
    """Fail, naming what the learner's gradient shows, when it equals one of the :data:`SYMPTOMS` updates'
    (and that update's differs from the reference's on this batch)."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import relative_gap

    for key, gradient in variants.items():
        if relative_gap(gradient, expected) > 1e-3 and relative_gap(received, gradient) <= 1e-4:
            shown, why = SYMPTOMS[key]
            fail(name, case, "the gradient of the corrected update (ratio against the trainer's pi_old, times the "
                 "sampler's weight pi_old / mu in the mode and bounds given)", shown, why)


def _drawn(name: str, case: str, reward, expected_reward: float) -> None:
    __tracebackhide__ = True
    if reward is None or abs(float(reward) - expected_reward) > 1e-6:
        fail(name, case, f"mean reward {expected_reward:.4f} of the completions drawn", reward,
             "draw the completions once per call with the sampler handed in, sampler(model, tokenizer, group_prompts, "
             "task.max_new_tokens, generator=generator), each prompt num_generations times in a row; return the "
             "mean of their rewards")


@references(*OFF_POLICY_CORRECTIONS, *POLICY_GRADIENT_TRAINER)
def check_off_policy_step(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, sampler, mode, clip_min, clip_max)
    -> mean reward``: one GRPO update on completions drawn by ``sampler``, corrected by TRL's weight.

    Checked as :func:`rlcourse.grading.llm.lesson10.check_grpo_step` is, with a 3-bit sampler (a 4-bit one and
    groups of 4 in the last setting): for each of four modes and bounds, the gradient each of two calls hands
    the optimiser equals the course trainer's (:func:`_reference_update`) on the same weights and generator;
    then 40 steps with Adam from
    ``addition-partial``, under the same sampler at ``token_truncate`` with a cap of 3, must raise greedy
    exact match on 300 held-out prompts by at least 4 points.
    """
    __tracebackhide__ = True
    from rlcourse.grading._steps import addition_start, check_sampling_step, twin_runs

    name = "check_off_policy_step"
    samplers = {bits: _sampler(bits) for bits in {b for *_, b, _ in STEP_SETTINGS}}
    settings = [(f"{bits}-bit sampler, mode={mode!r}, clip_min={lo}, clip_max={hi}",
                 (samplers[bits], "".join(mode), lo, hi), {"completions": K})
                for mode, lo, hi, bits, K in STEP_SETTINGS]
    task, start, tokenizer = addition_start()
    for case, extra, options in settings:      # first call of each setting: what a wrong gradient shows
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.05)
        groups, K = STEP_BATCH[0], options["completions"]
        prompts = task.prompts(groups, rng=30)            # check_sampling_step's first call
        label = f"{case}, {groups} prompts x {K} completions, call 1"
        reward = fn(mine, opt_mine, tokenizer, task, list(prompts), torch.Generator().manual_seed(5), K, *extra)
        variants: dict = {}
        expected_reward, _ = _reference_update(theirs, opt_theirs, tokenizer, task, prompts,
                                               torch.Generator().manual_seed(5), K, *extra, variants=variants)
        _drawn(name, label, reward, expected_reward)
        if len(opt_mine.seen) == 1:
            _name_the_symptom(name, label, opt_mine.seen[0], opt_theirs.seen[0], variants)
    learning = dict(STEP_LEARNING, extra=(samplers[STEP_BITS], "token_truncate", None, 3.0))
    check_sampling_step(name, fn, _reference_update, settings, learning,
                        "another direction: the ratio of the clipped loss is the model's log-probs (with grad) against "
                        "the trainer's pi_old; the sampler's weight, a constant in the mode and bounds given, "
                        "multiplies each token's clipped loss before the token mean over real tokens",
                        call_prompts=STEP_BATCH[0], call_completions=STEP_BATCH[1])


class _FirstSteps:
    """The first ``n`` records of a :class:`~rlcourse.grading._steps.RecordingSGD` (``seen``), so that
    :func:`~rlcourse.grading._steps.assert_call_gradient` can judge the steps of one call one by one."""

    def __init__(self, optimizer, n: int):
        self.seen = optimizer.seen[:n]


@references(*OFF_POLICY_CORRECTIONS, *POLICY_GRADIENT_TRAINER)
def check_off_policy_update(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, sampler, mode, clip_max,
    num_iterations, epsilon) -> [share of tokens outside the clip range at each step]``: the fixed
    find-the-bug update. Measured with a 3-bit sampler and with a 4-bit one (each with its own clip range,
    group size and number of steps): before any update no token's ratio leaves the clip
    range (the ratio is against the trainer's own pi_old), every step's gradient equals the course trainer's
    on the same samples (what a wrong one equals is named), and the shares match."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import addition_start, assert_call_gradient, twin_runs

    name = "check_off_policy_update"
    task, start, tokenizer = addition_start()
    n = 0
    for mode, clip_max, iterations, epsilon, K, bits in BUG_SETTINGS:
        case = (f"{bits}-bit sampler, mode={mode!r}, clip_max={clip_max}, num_iterations={iterations}, "
                f"epsilon={epsilon}, 6 prompts x {K}")
        sampler = _sampler(bits)
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.02)
        prompts = task.prompts(6, rng=40)
        shares = fn(mine, opt_mine, tokenizer, task, list(prompts), torch.Generator().manual_seed(6), K, sampler,
                    "".join(mode), clip_max, iterations, epsilon)
        variants: dict = {}
        _, expected_shares = _reference_update(theirs, opt_theirs, tokenizer, task, prompts,
                                               torch.Generator().manual_seed(6), K, sampler, mode, None, clip_max,
                                               epsilon, iterations, variants)
        if len(opt_mine.seen) != iterations:
            fail(name, case, f"{iterations} optimizer steps", f"{len(opt_mine.seen)}",
                 "one optimizer step per iteration on the batch")
        try:
            shares = [float(s) for s in shares]
        except TypeError:
            shares = None
        if shares is None or len(shares) != iterations:
            fail(name, case, f"a list of {iterations} shares", shares, "return the list the function builds")
        if shares[0] > 0:
            fail(name, case, "no token outside the clip range before any update (every ratio pi_theta / pi_old is 1)",
                 f"{shares[0]:.1%} of the tokens outside [{1 - epsilon:g}, {1 + epsilon:g}] at the first step",
                 "at the first step the policy is the one the trainer scored the batch with, so the ratio of the "
                 "clipped loss is exactly 1 on every token: this one is measured against another distribution")
        _name_the_symptom(name, f"{case}, step 1", opt_mine.seen[0], opt_theirs.seen[0], variants)
        for step in range(iterations):
            assert_call_gradient(name, f"{case}, step {step + 1}", step, _FirstSteps(opt_mine, step + 1),
                                 _FirstSteps(opt_theirs, step + 1),
                                 "another direction: every step weighs the same batch by the same weights against "
                                 "the same pi_old, from zeroed gradients")
            n += 1
        if abs(shares[-1] - expected_shares[-1]) > 0.01:       # a token of about 150 may round across
            fail(name, f"{case}, step {iterations}", f"{expected_shares[-1]:.4f} of the tokens outside the clip range",
                 shares[-1], "the share of real tokens whose ratio is outside [1 - epsilon, 1 + epsilon]")
    print(f"✔ {name}: no ratio leaves the clip range before the first update, and all {n} steps match the "
          f"reference's gradient")
