"""rl-smoke: does the tiny-GPT substrate carry RL? Plain REINFORCE from the partial checkpoint.

    python -m rlcourse.bench rl-smoke [--task addition|digitsum] [--steps N] [--budget SECONDS]

Starting from ``addition-partial`` (held-out greedy exact match ~35%), each step samples one
completion for each of ``batch`` training prompts at T=1, scores it with the exact-match verifier,
subtracts the batch-mean reward as a baseline and takes one Adam step on the REINFORCE loss

    L(theta) = -(1/B) sum_b sum_t m_bt (R_b - mean(R)) log pi_theta(y_bt | x_b, y_b,<t).

It prints held-out greedy exact match before and after, and the wall time of the RL loop. The bar
(recorded in BENCHMARKS.md): at least +20 points within 60 s on 2 CPU threads. Exit status 0 when
the bar is met, 1 otherwise.

``--task digitsum`` runs the same loop from ``digitsum-sft``, a model imitating demonstrations of
which half are wrong ("S=07:" -> four digits summing to S). There the bar is that RL goes past
imitation: sampled (T=1) validity above the demonstrators' 50% within 60 s. It also reports greedy
validity and the number of distinct valid answers among 10 samples per prompt (diversity).
"""
from __future__ import annotations

import argparse
import os
import time

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import torch

from rlcourse.tasks import AdditionTask, DigitSumTask
from rlcourse.trainers import exact_match
from rlcourse.lm import load_checkpoint, sample, sequence_logprobs
from rlcourse.losses import reinforce_loss
from rlcourse.runtime import by_profile, describe, seed_everything


def reinforce_step(model, tokenizer, task, optimizer, prompts, generator) -> float:
    """One REINFORCE update with a batch-mean baseline; returns the batch's mean reward."""
    roll = sample(model, tokenizer, prompts, task.max_new_tokens, temperature=1.0, generator=generator)
    rewards = task.reward(prompts, roll.completions).to(roll.logprobs.device)
    advantages = (rewards - rewards.mean()).unsqueeze(1)     # one weight per completion
    model.train()                                            # dropout is 0: same forward as sampling
    logprobs = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                 roll.prompt_mask)
    loss = reinforce_loss(logprobs, advantages, roll.completion_mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return rewards.mean().item()


def evaluate_digitsum(model, tokenizer, task) -> dict:
    """Greedy and sampled validity over every target S (10 prompts each), and answer diversity."""
    prompts = task.test_prompts(10 * (task.max_sum + 1))
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(1234)
    roll = sample(model, tokenizer, prompts, task.max_new_tokens, temperature=1.0, generator=gen)
    return {"greedy": exact_match(model, tokenizer, task, prompts),
            "sampled": task.reward(prompts, roll.completions).mean().item(),
            "distinct": task.distinct_valid(prompts, roll.completions)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench rl-smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("addition", "digitsum"), default="addition")
    parser.add_argument("--steps", type=int, default=by_profile(ci=150, laptop=250, demo=250))
    parser.add_argument("--budget", type=float, default=60.0, help="stop the RL loop after this many seconds")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = seed_everything(args.seed)

    digitsum = args.task == "digitsum"
    model, tokenizer = load_checkpoint("digitsum-sft" if digitsum else "addition-partial")
    task = DigitSumTask() if digitsum else AdditionTask()
    test = task.test_prompts(500)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    print(describe(), f"| load average {os.getloadavg()[0]:.2f}")
    before = evaluate_digitsum(model, tokenizer, task) if digitsum else exact_match(model, tokenizer, task, test)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    start, rewards, step = time.perf_counter(), [], 0
    while step < args.steps and time.perf_counter() - start < args.budget:
        rewards.append(reinforce_step(model, tokenizer, task, optimizer, task.prompts(args.batch, rng), gen))
        step += 1
    seconds = time.perf_counter() - start
    after = evaluate_digitsum(model, tokenizer, task) if digitsum else exact_match(model, tokenizer, task, test)

    if digitsum:
        ok = after["sampled"] > task.demo_accuracy and seconds <= 60
        for key, label in (("sampled", "valid, sampled at T=1"), ("greedy", "valid, greedy")):
            print(f"{label:24s} before {before[key]:.1%}  after {after[key]:.1%}")
        print(f"{'distinct valid / prompt':24s} before {before['distinct']:.1f}  after {after['distinct']:.1f}"
              f"  (of 10 samples per target)")
        bar = f"sampled validity above the demonstrations' {task.demo_accuracy:.0%} within 60 s"
    else:
        gain = 100 * (after - before)
        ok = gain >= 20 and seconds <= 60
        print(f"held-out exact match (greedy, {len(test)} prompts): before {before:.1%}  after {after:.1%}  "
              f"gain {gain:+.1f} points")
        bar = ">= +20 points within 60 s"
    print(f"REINFORCE: {step} steps x {args.batch} samples in {seconds:.1f} s; mean training reward "
          f"{np.mean(rewards[:10]):.2f} (first 10 steps) -> {np.mean(rewards[-10:]):.2f} (last 10); "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"bar ({bar}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
