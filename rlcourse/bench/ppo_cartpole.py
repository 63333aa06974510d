"""PPO on CartPole-v1: env steps and wall time until the last 20 episodes average >= 475, over seeds.

    python -m rlcourse.bench ppo-cartpole [--seeds 0 1 2] [--budget 150000] [--threads 1]
                                          [--no-peer | --peer-budget 500000] [--no-ours] [--penalty]

Runs :func:`rlcourse.classic.ppo.train_ppo` with its defaults (rl-baselines3-zoo's CartPole
settings) and, as the peer in the same run, the same trainer with CleanRL's reference
configuration for ``ppo.py`` (4 envs x 128 steps, 4 epochs of 4 minibatches, lr 2.5e-4, gamma
0.99, lambda 0.95, ent_coef 0.01), whose own budget is 500k steps; by default both get ``--budget``.
"""
from __future__ import annotations

import argparse
import os
import platform

import numpy as np

CLEANRL_REFERENCE = dict(num_envs=4, num_steps=128, learning_rate=2.5e-4, gamma=0.99, gae_lambda=0.95,
                         num_minibatches=4, update_epochs=4, ent_coef=0.01, clip_vloss=True)


def run(label: str, seeds, budget: int, **config) -> list[tuple]:
    from rlcourse.classic.ppo import train_ppo

    rows = []
    for seed in seeds:
        r = train_ppo(seed=seed, total_timesteps=budget, progress=False, **config)
        rows.append((r.solved_at_step, r.seconds, r.episodes.last_mean_return(20)))
        steps = "not reached" if r.solved_at_step is None else f"{r.solved_at_step:>7,d}"
        print(f"{label:<22} seed {seed}: steps to 475 {steps:>11}   wall {r.seconds:6.1f} s   "
              f"last-20 mean return {rows[-1][2]:6.1f}", flush=True)
    return rows


def summary(label: str, rows) -> None:
    steps = [s for s, _, _ in rows if s is not None]
    secs = [t for _, t, _ in rows]
    solved = f"{len(steps)}/{len(rows)} seeds solved"
    med = f"median steps {int(np.median(steps)):,d} (max {max(steps):,d})" if steps else "median steps -"
    print(f"{label:<22} {solved}; {med}; median wall {np.median(secs):.1f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench ppo-cartpole", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=150_000, help="env steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a 64-unit MLP)")
    parser.add_argument("--no-peer", action="store_true", help="skip the CleanRL-reference configuration")
    parser.add_argument("--peer-budget", type=int, default=None,
                        help="env steps for the peer (default: --budget; CleanRL's own is 500000)")
    parser.add_argument("--no-ours", action="store_true", help="run only the peer")
    parser.add_argument("--penalty", action="store_true",
                        help="also run PPO-penalty (adaptive beta, kl_target 0.01) with the course's settings")
    args = parser.parse_args(argv)
    import torch

    import rlcourse  # noqa: F401
    from rlcourse.runtime import describe

    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {describe()}  cpu={platform.processor() or platform.machine()} cores={os.cpu_count()} "
          f"load(1 min)={load:.2f}")
    ours = None if args.no_ours else run("rlcourse defaults", args.seeds, args.budget)
    peer = None if args.no_peer else run("CleanRL reference cfg", args.seeds, args.peer_budget or args.budget,
                                         **CLEANRL_REFERENCE)
    penalty = run("PPO-penalty", args.seeds, args.budget, loss_type="penalty") if args.penalty else None
    if ours is not None:
        summary("rlcourse defaults", ours)
    if penalty is not None:
        summary("PPO-penalty", penalty)
    if peer is not None:
        summary("CleanRL reference cfg", peer)
    return 0
