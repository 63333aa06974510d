"""seeds: completions/s of S seeds trained together against the same S seeds trained one after another.

    python -m rlcourse.bench seeds [--method grpo|ppo] [--size laptop|demo] [--seeds 1 4 8 16] [--steps 10] [--repeats 3]

Both sides train from the course's ``digitsum-sft`` checkpoint (``laptop``; 10M-parameter random
GPT-2 at ``demo``, for a GPU) on :class:`~rlcourse.tasks.arithmetic.DigitSumTask`, seeds 0..S-1, 64
completions per seed and step. ``--method grpo``: TRL's ``dapo`` loss, 8 completions per prompt.
``--method ppo``: PPO-RLHF as the capstone runs it (a critic from the policy, the verifier's
reward, 2 epochs, no KL), policy and critic stacked.

* **separate**: S runs of :class:`~rlcourse.trainers.policy_gradient.PolicyGradientTrainer` (or
  :class:`~rlcourse.trainers.ppo_rlhf.PPORLHFTrainer`), one per seed, one after another (what a loop
  over seeds costs);
* **batched**: one :class:`~rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer` (or
  :class:`~rlcourse.trainers.ppo_rlhf_seeds.SeedBatchedPPORLHFTrainer`) advancing all S seeds (the
  same runs: a seed draws the same prompts and, given the same weights, the same completions as
  alone; ``tests/test_policy_gradient_seeds.py``, ``tests/test_ppo_rlhf_seeds.py``).

Each side runs ``steps`` steps after one warm-up step; sides alternate ``repeats`` times and the
median time is reported as completions per second, with the ratio batched / separate. Targets: 8
seeds at least 4x on a CPU, 16 seeds at least 8x on a GPU at ``demo`` size.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import DigitSumTask
from rlcourse.lm import build_char_tokenizer, load_checkpoint, make_model
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer
from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer
from rlcourse.trainers.ppo_rlhf_seeds import SeedBatchedPPORLHFTrainer
from rlcourse.lm.value_model import make_value_model
from rlcourse.runtime import describe, device, synchronize


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("grpo", "ppo"), default="grpo")
    parser.add_argument("--size", choices=("laptop", "demo"), default="laptop")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two sides; the median is reported")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = device()
    task = DigitSumTask()
    if args.size == "laptop":
        model, tokenizer = load_checkpoint("digitsum-sft", device=dev)
    else:
        tokenizer = build_char_tokenizer()
        model = make_model("demo", tokenizer, seed=0).to(dev)
    model.eval()
    batch = 64
    if args.method == "grpo":
        settings = dict(learning_rate=1e-4, per_device_train_batch_size=batch, num_generations=8, loss_type="dapo")

        def one(seed):
            return PolicyGradientTrainer(copy.deepcopy(model), tokenizer, task, PolicyGradientConfig(seed=seed, **settings))

        def stacked(n_seeds):
            return SeedBatchedPolicyGradientTrainer(model, tokenizer, task, PolicyGradientConfig(**settings),
                                                    num_seeds=n_seeds)
    else:                                                  # the capstone's PPO (rlcourse.measure.capstone._ppo_trainer)
        settings = dict(learning_rate=6e-4, batch_size=batch, num_ppo_epochs=2, response_length=task.max_new_tokens,
                        kl_coef=0.0)

        def one(seed):
            policy = copy.deepcopy(model)
            return PPORLHFTrainer(PPOConfig(seed=seed, **settings), policy, tokenizer, task.reward,
                                  make_value_model("policy", policy=policy), prompt_fn=task.prompts)

        def stacked(n_seeds):
            return SeedBatchedPPORLHFTrainer(PPOConfig(**settings), model, tokenizer, task.reward,
                                             make_value_model("policy", policy=model), task.prompts, num_seeds=n_seeds)

    def separate(n_seeds):
        trainers = [one(s) for s in range(n_seeds)]
        for t in trainers:
            t.step()                                       # warm-up
        synchronize(dev)
        start = time.perf_counter()
        for t in trainers:
            t.train(args.steps, progress=False)
        synchronize(dev)
        return time.perf_counter() - start

    def batched(n_seeds):
        trainer = stacked(n_seeds)
        trainer.step()                                     # warm-up
        synchronize(dev)
        start = time.perf_counter()
        trainer.train(args.steps, progress=False)
        synchronize(dev)
        return time.perf_counter() - start

    load_before = os.getloadavg()[0]
    print(describe(), f"| {args.method}, {args.size}: {sum(p.numel() for p in model.parameters()):,} parameters | "
          f"{batch} completions per seed and step, {args.steps} steps, median of {args.repeats}")
    print(f"  {'seeds':>5s} {'separate (compl./s)':>20s} {'batched (compl./s)':>20s} {'ratio':>7s}")
    ratios = {}
    for n in args.seeds:
        apart, together = [], []
        for _ in range(args.repeats):
            apart.append(separate(n))
            together.append(batched(n))
        done = n * args.steps * batch
        rate_apart, rate_together = done / statistics.median(apart), done / statistics.median(together)
        ratios[n] = rate_together / rate_apart
        print(f"  {n:5d} {rate_apart:20,.0f} {rate_together:20,.0f} {ratios[n]:6.2f}x")
    print(f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    goal_seeds, goal = (16, 8.0) if dev.type == "cuda" else (8, 4.0)
    if goal_seeds in ratios:
        verdict = "PASS" if ratios[goal_seeds] >= goal else "FAIL"
        print(f"target ({goal_seeds} seeds >= {goal}x separate on {dev.type}): {verdict}")
        return 0 if verdict == "PASS" else 1
    return 0
