"""dynamic-sampling: DAPO's refill against no filter and against dropping only, on the addition task.

    python -m rlcourse.bench dynamic-sampling [--steps 80] [--seeds 0,1,2,3,4,5,6,7] [--threads 2]

Lesson 10's GRPO settings (``addition-partial``, 64 completions = 8 prompts x 8 per step, loss
``grpo``, ``num_iterations=4``, learning rate 5e-5). Three variants from the same start and seeds:
no filter; ``dynamic_sampling=True, max_num_gen_batches=1`` (all-equal groups dropped, the batch
shrinks); ``max_num_gen_batches=4`` (refilled with fresh prompts). Held-out exact match (greedy, 500
prompts) is read at the same number of training steps and at the same number of completions
sampled; mean +/- standard error over seeds.
"""
from __future__ import annotations

import argparse
import time

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.trainers import exact_match
from rlcourse.lm import load_checkpoint
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.runtime import describe

BATCH, EVERY = 64, 10
VARIANTS = {"no filter": {}, "drop only (cap 1)": dict(dynamic_sampling=True, max_num_gen_batches=1),
            "refill (cap 4)": dict(dynamic_sampling=True, max_num_gen_batches=4)}


def _run(settings: dict, seed: int, steps: int, task, tokenizer, test_prompts) -> dict:
    """One training run; held-out exact match every EVERY steps and every EVERY * BATCH completions."""
    model = load_checkpoint("addition-partial", device="cpu")[0]
    config = PolicyGradientConfig(learning_rate=5e-5, per_device_train_batch_size=BATCH, num_generations=8,
                                  loss_type="grpo", num_iterations=4, seed=seed, **settings)
    trainer = PolicyGradientTrainer(model, tokenizer, task, config)
    samples, mark, curve, start = 0, BATCH * EVERY, [], time.perf_counter()
    for step in range(1, steps + 1):
        samples += BATCH * int(trainer.step()["num_gen_batches"])
        crossed = samples >= mark
        while samples >= mark:
            mark += BATCH * EVERY
        if step % EVERY == 0 or crossed:
            curve.append({"step": step, "samples": samples, "acc": exact_match(model, tokenizer, task, test_prompts)})
    return {"curve": curve, "seconds": time.perf_counter() - start,
            "num_gen_batches": np.mean([h["num_gen_batches"] for h in trainer.history]),
            "frac_reward_zero_std": np.mean([h["frac_reward_zero_std"] for h in trainer.history])}


def _at(run: dict, key: str, value: int) -> dict:
    return next((c for c in run["curve"] if c[key] >= value), run["curve"][-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench dynamic-sampling", description=__doc__)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    task, tokenizer = AdditionTask(), load_checkpoint("addition-partial", device="cpu")[1]
    test_prompts = task.test_prompts(500)
    before = exact_match(load_checkpoint("addition-partial", device="cpu")[0], tokenizer, task, test_prompts)
    print(f"{describe()}\nheld-out exact match before training: {before:.3f}; {args.steps} steps of {BATCH}, "
          f"seeds {seeds}")
    budget = args.steps * BATCH
    for label, settings in VARIANTS.items():
        runs = [_run(settings, seed, args.steps, task, tokenizer, test_prompts) for seed in seeds]
        for what, key, value in (("same steps", "step", args.steps), ("same samples", "samples", budget)):
            points = [_at(r, key, value) for r in runs]
            acc = np.array([p["acc"] for p in points])
            sem = acc.std(ddof=1) / np.sqrt(len(acc)) if len(acc) > 1 else float("nan")
            print(f"{label:<18} {what:<12} exact match {acc.mean():.3f} +/- {sem:.3f}  at step "
                  f"{np.mean([p['step'] for p in points]):5.1f}, {np.mean([p['samples'] for p in points]):6.0f} samples")
        print(f"{label:<18} generation batches per step {np.mean([r['num_gen_batches'] for r in runs]):.2f}, "
              f"frac_reward_zero_std {np.mean([r['frac_reward_zero_std'] for r in runs]):.3f}, "
              f"{np.mean([r['seconds'] for r in runs]):.1f} s per run")
    return 0
