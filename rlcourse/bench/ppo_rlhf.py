"""ppo-rlhf: PPO-RLHF against best-of-n sampling with the same reward model, in one run.

    python -m rlcourse.bench ppo-rlhf [--iterations 24] [--batch 64] [--rm-steps 100] [--threads 2]

Both start from the ``preference-sft`` checkpoint and use one reward model trained here on
``PreferenceTask`` pairs (Bradley-Terry, a few seconds). For each method the benchmark reports the
gold-score gain over the SFT policy on the 64 held-out prompts, the KL to the reference (PPO:
``objective/kl`` of its last batch; best-of-n: ``log n - (n - 1) / n``), the wall time and the peak
memory (CUDA: ``max_memory_allocated``; CPU: the peak resident set size above the level before
the method started, sampled every 5 ms). Best-of-n is run at the n whose KL is closest to PPO's
final KL, and at the n's around it. Samples per answer: PPO 1, best-of-n n.
"""
from __future__ import annotations

import argparse
import copy
import os
import threading
import time

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import PreferenceTask, load_checkpoint, sample
from rlcourse.lm.best_of_n import best_of_n, best_of_n_kl
from rlcourse.lm.ppo_rlhf import PPOConfig, PPORLHFTrainer
from rlcourse.lm.reward_model import ScalarHeadModel, train_reward_model
from rlcourse.lm.value_model import make_value_model
from rlcourse.runtime import describe, device


class PeakMemory:
    """Peak memory of a block: CUDA allocations, or the process's resident set size on CPU."""

    def __init__(self, dev):
        self.dev, self.peak, self._stop = dev, 0, threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.base)
            time.sleep(0.005)

    def __enter__(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self._rss()
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
        return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench ppo-rlhf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rm-steps", type=int, default=100)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = device()
    print(describe())

    task = PreferenceTask()
    policy, tokenizer = load_checkpoint("preference-sft", device=dev)
    torch.manual_seed(0)
    reward_model = ScalarHeadModel(policy)
    t0 = time.perf_counter()
    rm = train_reward_model(reward_model, tokenizer, task.preference_pairs(2000, rng=1), steps=args.rm_steps,
                            lr=3e-3, eval_pairs=task.preference_pairs(2000, rng=2), progress=False)
    print(f"reward model: {time.perf_counter() - t0:.1f} s, held-out accuracy {rm['eval']['eval_accuracy']:.3f}")
    prompts = task.test_prompts(64)
    gen = torch.Generator(dev).manual_seed(0)

    def gold_of(model, repeats=4):
        texts = []
        for _ in range(repeats):
            texts += sample(model, tokenizer, prompts, task.max_new_tokens, generator=gen).completions
        return float(task.gold(prompts * repeats, texts).mean())

    sft_gold = gold_of(policy)
    rows = []
    torch.manual_seed(0)
    student = copy.deepcopy(policy)
    critic = make_value_model("reward", reward_model=reward_model)
    config = PPOConfig(batch_size=args.batch, response_length=task.max_new_tokens, kl_coef=args.kl_coef)
    with PeakMemory(dev) as mem:
        t0 = time.perf_counter()
        trainer = PPORLHFTrainer(config, student, tokenizer, reward_model, critic, task.prompts)
        trainer.train(args.iterations, progress=False)
        seconds = time.perf_counter() - t0
    ppo_kl = trainer.history[-1]["objective/kl"]
    rows.append(("PPO-RLHF", gold_of(student) - sft_gold, ppo_kl, seconds, mem.peak, 1))

    ns = [2 ** k for k in range(0, 9)]
    closest = min(range(len(ns)), key=lambda i: abs(best_of_n_kl(ns[i]) - ppo_kl))
    for n in ns[max(0, closest - 1):closest + 2]:
        with PeakMemory(dev) as mem:
            t0 = time.perf_counter()
            out = best_of_n(policy, tokenizer, reward_model, prompts, n, task.max_new_tokens, generator=gen)
            seconds = time.perf_counter() - t0
        gain = float(task.gold(prompts, out["completions"]).mean()) - sft_gold
        rows.append((f"best-of-{n}", gain, best_of_n_kl(n), seconds, mem.peak, n))

    print(f"SFT gold score {sft_gold:+.3f} on {len(prompts)} held-out prompts; PPO: {args.iterations} iterations "
          f"x {args.batch} rollouts, kl_coef={args.kl_coef}")
    print(f"{'method':<12}{'gold gain':>10}{'KL (nats)':>11}{'wall s':>9}{'peak MiB':>10}{'samples/answer':>16}")
    for name, gain, kl_value, seconds, peak, per_answer in rows:
        print(f"{name:<12}{gain:>+10.3f}{kl_value:>11.2f}{seconds:>9.2f}{peak / 2**20:>10.1f}{per_answer:>16}")
    print("best-of-n's wall time is for 64 answers; PPO's is training, after which an answer costs one sample.")
    return 0
