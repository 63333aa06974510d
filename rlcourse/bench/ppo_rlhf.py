"""ppo-rlhf: PPO-RLHF against best-of-n sampling with the same reward model, in one run.

    python -m rlcourse.bench ppo-rlhf [--iterations 24] [--batch 64] [--rm-steps 100] [--threads 2]

Both start from the ``preference-sft`` checkpoint and use one reward model trained here on
``PreferenceTask`` pairs (Bradley-Terry, a few seconds). For each method the benchmark reports the
gold-score gain over the SFT policy on the 64 held-out prompts, the KL to the reference (PPO:
``objective/kl`` of its last batch; best-of-n: ``log n - (n - 1) / n``), the wall time and the peak
memory (each method runs in a fresh worker process; CUDA: ``max_memory_allocated``; CPU: the
worker's resident set size, sampled every 2 ms, above its level just before the method started).
Best-of-n runs at the n whose KL is closest to PPO's final KL and at the n's either side of it.
Samples per answer: PPO 1, best-of-n n.
"""
from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import PreferenceTask
from rlcourse.lm import load_checkpoint, sample
from rlcourse.measure.best_of_n import best_of_n, best_of_n_kl
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer
from rlcourse.lm.scalar_head import ScalarHeadModel
from rlcourse.tasks.reward_model import train_reward_model
from rlcourse.lm.value_model import make_value_model
from rlcourse.bench._memory import RSSWatcher
from rlcourse.runtime import describe, device


def _run_method(method: str, n: int, settings: dict, reward_model_path: str) -> dict:
    """One method in a fresh process, so its peak memory is its own: gold gain, KL, seconds, peak bytes."""
    torch.set_num_threads(settings["threads"])
    dev = device()
    task = PreferenceTask()
    policy, tokenizer = load_checkpoint("preference-sft", device=dev)
    torch.manual_seed(0)
    reward_model = ScalarHeadModel(policy)
    reward_model.load_state_dict(torch.load(reward_model_path, map_location=dev))
    reward_model.eval()
    prompts = task.test_prompts(64)
    gen = torch.Generator(dev).manual_seed(0)

    def gold_of(model, repeats=4):
        texts = []
        for _ in range(repeats):
            texts += sample(model, tokenizer, prompts, task.max_new_tokens, generator=gen).completions
        return float(task.gold(prompts * repeats, texts).mean())

    sft_gold = gold_of(policy)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    watcher = RSSWatcher().__enter__() if dev.type != "cuda" else None
    t0 = time.perf_counter()
    if method == "ppo":
        torch.manual_seed(0)
        student = copy.deepcopy(policy)
        critic = make_value_model("reward", reward_model=reward_model)
        config = PPOConfig(batch_size=settings["batch"], response_length=task.max_new_tokens,
                           kl_coef=settings["kl_coef"])
        trainer = PPORLHFTrainer(config, student, tokenizer, reward_model, critic, task.prompts)
        trainer.train(settings["iterations"], progress=False)
        seconds = time.perf_counter() - t0
        gain, kl_value = gold_of(student) - sft_gold, trainer.history[-1]["objective/kl"]
    else:
        out = best_of_n(policy, tokenizer, reward_model, prompts, n, task.max_new_tokens, generator=gen)
        seconds = time.perf_counter() - t0
        gain, kl_value = float(task.gold(prompts, out["completions"]).mean()) - sft_gold, best_of_n_kl(n)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        watcher.__exit__(None, None, None)
        peak = watcher.peak - watcher.base
    return {"gain": gain, "kl": kl_value, "seconds": seconds, "peak": peak, "sft_gold": sft_gold}


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
    settings = {"threads": args.threads, "batch": args.batch, "kl_coef": args.kl_coef, "iterations": args.iterations}
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        path = os.path.join(tmp, "reward_model.pt")   # handed to the workers, deleted at the end
        torch.save(reward_model.state_dict(), path)
        rows = [("PPO-RLHF", 1, pool.submit(_run_method, "ppo", 1, settings, path).result())]
        ns = [2 ** k for k in range(0, 9)]
        closest = min(range(len(ns)), key=lambda i: abs(best_of_n_kl(ns[i]) - rows[0][2]["kl"]))
        for n in ns[max(0, closest - 1):closest + 2]:
            rows.append((f"best-of-{n}", n, pool.submit(_run_method, "bon", n, settings, path).result()))

    print(f"SFT gold score {rows[0][2]['sft_gold']:+.3f} on 64 held-out prompts; PPO: {args.iterations} iterations "
          f"x {args.batch} rollouts, kl_coef={args.kl_coef}")
    print(f"{'method':<12}{'gold gain':>10}{'KL (nats)':>11}{'wall s':>9}{'peak MiB':>10}{'samples/answer':>16}")
    for name, per_answer, r in rows:
        print(f"{name:<12}{r['gain']:>+10.3f}{r['kl']:>11.2f}{r['seconds']:>9.2f}{r['peak'] / 2**20:>10.1f}"
              f"{per_answer:>16}")
    print("best-of-n's wall time is for 64 answers; PPO's is training, after which an answer costs one sample.")
    print("peak MiB: above the worker's level before the method (CPU: resident set; CUDA: allocated).")
    return 0
