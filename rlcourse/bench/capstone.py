"""capstone: every LM algorithm of the course on DigitSumTask with one sample budget; the summary table.

    python -m rlcourse.bench capstone [--budget 8192] [--seeds 8] [--eval-points 4] [--threads 2]

Each algorithm runs all its seeds in a fresh worker process, so its peak memory is its own (the
methods of ``SEED_BATCHED`` train their seeds together, as the lesson does): on
CUDA ``max_memory_allocated``, on CPU the worker's resident set size (sampled every 2 ms) above its
level just before the first run started (models, optimiser state, activations). Every algorithm
starts from ``digitsum-sft`` and draws ``budget`` completions; the peer of every method is the SFT
start and RFT (rejection-sampling fine-tuning, the best-of-n baseline). Validity, KL and distinct
valid answers per target are final values, mean +/- 95% t half-width over seeds; pairs of methods
are also compared seed by seed (:func:`rlcourse.measure.capstone.paired_difference`).

DPO's peak is its offline sampling: ``budget`` completions drawn from the SFT model in one batch
before training, so its memory grows with the budget while the online methods' grows with ``batch``.
"""
from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.bench._memory import RSSWatcher
from rlcourse.measure.capstone import ALGORITHMS, CapstoneConfig, compare, paired_difference, summary
from rlcourse.runtime import describe, device
from rlcourse.stats import interval_above, t_interval


def _run_algorithm(algorithm: str, seeds: list[int], cfg: CapstoneConfig, threads: int) -> tuple[list[dict], float]:
    """All seeds of one algorithm in this (fresh) process: the runs and the peak memory in MB."""
    torch.set_num_threads(threads)
    dev = device()
    with RSSWatcher() as watcher:
        results = compare([algorithm], seeds, cfg, progress=False, device=dev)
    if dev.type == "cuda":
        return results, max(r["peak_memory_mb"] for r in results)
    return results, (watcher.peak - watcher.base) / 2**20


def _cell(pair, digits=3):
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench capstone", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=8192, help="sampled completions per run")
    parser.add_argument("--seeds", type=int, default=8, help="seeds per algorithm (at least 2)")
    parser.add_argument("--eval-points", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be at least 2 (an interval needs two values)")
    cfg = CapstoneConfig(budget=args.budget, eval_points=args.eval_points)
    seeds = list(range(args.seeds))
    torch.set_num_threads(args.threads)
    print(describe())
    print(f"capstone: {len(args.algorithms)} algorithms x {args.seeds} seeds, budget {args.budget}, "
          f"{args.threads} threads, one worker process per algorithm")
    results, peaks = [], {}
    spawn = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    for algorithm in args.algorithms:
        tic = time.perf_counter()
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            runs, peaks[algorithm] = pool.submit(_run_algorithm, algorithm, seeds, cfg, args.threads).result()
        results += runs
        print(f"  {algorithm:<10} done in {time.perf_counter() - tic:5.1f} s", flush=True)
    total = time.perf_counter() - start
    first = {r["seed"]: r["curve"][0] for r in results}.values()
    start_band = t_interval([p["validity"] for p in first])
    memory = "peak CUDA MB" if torch.cuda.is_available() else "peak RSS MB (above start)"
    params = results[0]["parameters"]
    print(f"\nSFT start validity {_cell(start_band)}; {params:,} parameters per model; total {total:.0f} s")
    print(f"{'algorithm':<10} {'validity':>15} {'KL':>13} {'distinct':>13} {'train s':>7} "
          f"{'compl/s':>7} {'models':>6} {'params held':>11} {memory:>26}  above start")
    rows = summary(results)
    for row in rows:
        a = row["algorithm"]
        print(f"{a:<10} {_cell(row['validity']):>15} {_cell(row['kl'], 2):>13} {_cell(row['distinct'], 2):>13} "
              f"{row['seconds'][0]:7.1f} {row['completions_per_second']:7.0f} {row['models_held']:6d} "
              f"{row['models_held'] * params:11,} {peaks[a]:26.0f}  {interval_above(row['validity'], start_band)}")
    validity = {row["algorithm"]: row["validity"] for row in rows}
    pairs = [f"{a} > {b}" for a in validity for b in validity if interval_above(validity[a], validity[b])]
    print("pairs whose 95% intervals separate:", ", ".join(pairs) or "none")
    paired = []
    for i, a in enumerate(validity):
        for b in list(validity)[i + 1:]:
            mean, half = paired_difference(results, a, b)
            if abs(mean) > half:
                paired.append(f"{a} > {b}" if mean > 0 else f"{b} > {a}")
    n_pairs = len(validity) * (len(validity) - 1) // 2
    print(f"pairs resolved seed by seed (paired 95% interval excludes 0), {len(paired)} of {n_pairs}:",
          ", ".join(paired) or "none")
    return 0
