"""grpo-vs-trl: our PolicyGradientTrainer against TRL's GRPOTrainer, same job, same run.

    python -m rlcourse.bench grpo-vs-trl [--size ci|laptop|demo] [--steps N] [--threads 2]

Both start from the ``addition-partial`` checkpoint and train on the same training prompts with the
same settings (``num_generations``, completions per step, learning rate at a constant schedule,
``beta``, ``loss_type``, ``max_completion_length``, ``max_grad_norm`` 1.0, temperature 1). Each
trainer runs in its own subprocess so that peak memory (max RSS on CPU, peak allocated on CUDA) is
its own; each runs ``--repeats`` times per seed (alternated) and the median speed is reported. Printed:
completions per second of the training loop (generation, scoring and updates;
model loading excluded), their ratio (goal: ours >= 3x TRL's), held-out greedy exact match after
the same number of steps (goal: ours within 3 points of TRL's or better; with ``--seeds N`` the mean
over N seeds and the standard error of the paired gap) and peak memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

from rlcourse.bench._memory import process_peak_mb
from rlcourse.bench._workers import run_worker

SIZES = {"ci": dict(steps=20, batch=64), "laptop": dict(steps=60, batch=64), "demo": dict(steps=200, batch=256)}


def _run_one(which: str, args) -> dict:
    import rlcourse  # noqa: F401  (before torch)
    import torch

    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers import exact_match
    from rlcourse.lm import load_checkpoint, save_checkpoint
    from rlcourse.runtime import device as best_device
    from rlcourse.runtime import seed_everything

    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    dev = best_device()
    task = AdditionTask()
    test = task.test_prompts(500)
    model, tokenizer = load_checkpoint("addition-partial", device=dev)
    before = exact_match(model, tokenizer, task, test)
    n_prompts = args.steps * args.batch // args.num_generations
    if which == "ours":
        from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer

        config = PolicyGradientConfig(learning_rate=args.lr, per_device_train_batch_size=args.batch,
                                      num_generations=args.num_generations, beta=args.beta,
                                      loss_type=args.loss_type, max_steps=args.steps, seed=args.seed)
        trainer = PolicyGradientTrainer(model, tokenizer, task, config)
        start = time.perf_counter()
        trainer.train(progress=False)
        seconds = time.perf_counter() - start
        trained = model
    else:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        path = tempfile.mkdtemp(prefix="grpo-vs-trl-")
        save_checkpoint(model, tokenizer, path)
        prompts = task.prompts(n_prompts, rng=args.seed)

        def exact_match_reward(prompts, completions, **kwargs):
            return task.reward(prompts, completions).tolist()

        config = GRPOConfig(output_dir=os.path.join(path, "out"), use_cpu=dev.type == "cpu", bf16=False,
                            report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=10**6,
                            learning_rate=args.lr, lr_scheduler_type="constant", per_device_train_batch_size=args.batch,
                            num_generations=args.num_generations, max_completion_length=task.max_new_tokens,
                            beta=args.beta, loss_type=args.loss_type, max_steps=args.steps, seed=args.seed,
                            temperature=1.0, max_grad_norm=1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = GRPOTrainer(model=path, reward_funcs=exact_match_reward, args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
        trained = trainer.model
    after = exact_match(trained, tokenizer, task, test)
    return {"trainer": which, "seconds": seconds, "completions_per_s": args.steps * args.batch / seconds,
            "before": before, "after": after, "peak_mb": process_peak_mb(dev), "device": str(dev)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench grpo-vs-trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(SIZES), default="laptop")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="train with seeds --seed, --seed + 1, ...: accuracy "
                                                           "is averaged over them, with the paired gap's standard error")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each trainer, alternated; the median is reported")
    parser.add_argument("--only", choices=("ours", "trl"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or SIZES[args.size]["steps"]
    args.batch = args.batch or SIZES[args.size]["batch"]
    if args.only:
        print(json.dumps(_run_one(args.only, args)))
        return 0
    runs = {"ours": [], "trl": []}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the OpenMP settings: from rlcourse
    seeds = range(args.seed, args.seed + args.seeds)
    # Alternate ours, TRL, ours, TRL...: a burst of load from other processes then hits both alike.
    for seed in seeds:
        for which in ("ours", "trl") * args.repeats:
            cmd = [sys.executable, "-m", "rlcourse.bench", "grpo-vs-trl", *argv, "--only", which, "--seed", str(seed)]
            runs[which].append(dict(run_worker(cmd, env), seed=seed))
    # The run of median speed stands for each trainer's speed. Training is seeded, so a seed's
    # accuracy is the same in every repeat: accuracy is averaged over seeds, not over repeats.
    ours, trl = (sorted(r, key=lambda x: x["completions_per_s"])[len(r) // 2] for r in (runs["ours"], runs["trl"]))
    if len(runs["ours"]) > 1:
        for which, r in runs.items():
            print(f"  {which} runs: " + ", ".join(f"{x['completions_per_s']:.0f}" for x in r) + " completions/s")
    print(f"grpo-vs-trl: addition-partial, {args.steps} steps x {args.batch} completions "
          f"(num_generations={args.num_generations}, lr={args.lr}, beta={args.beta}, loss_type={args.loss_type}), "
          f"{args.threads} threads, device {ours['device']}, seeds {seeds.start}-{seeds.stop - 1}")
    after = {which: [next(x["after"] for x in r if x["seed"] == s) for s in seeds] for which, r in runs.items()}
    for r in (ours, trl):
        acc = after[r["trainer"]]
        spread = f" (mean of {len(acc)} seeds, std {100 * _std(acc):.1f} points)" if len(acc) > 1 else ""
        print(f"  {r['trainer']:<5} {r['completions_per_s']:8.1f} completions/s ({r['seconds']:.1f} s) | held-out exact "
              f"match {r['before']:.1%} -> {sum(acc) / len(acc):.1%}{spread} | peak memory {r['peak_mb']:.0f} MB")
    ratio = ours["completions_per_s"] / trl["completions_per_s"]
    gaps = [100 * (a - b) for a, b in zip(after["ours"], after["trl"])]
    gap = sum(gaps) / len(gaps)
    error = f" +/- {_std(gaps) / len(gaps) ** 0.5:.1f} (standard error over {len(gaps)} seeds)" if len(gaps) > 1 else ""
    print(f"  speed ratio ours/TRL: {ratio:.2f}x (goal >= 3x); accuracy ours - TRL: {gap:+.1f}{error} points (goal >= -3)")
    return 0


def _std(xs: list[float]) -> float:
    """Sample standard deviation (n - 1)."""
    mean = sum(xs) / len(xs)
    return (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
