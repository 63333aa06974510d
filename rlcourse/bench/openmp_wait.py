"""openmp-wait: how torch's OpenMP threads should wait, measured on a GRPO step of the tiny GPT.

    python -m rlcourse.bench openmp-wait [--steps 40] [--threads 2] [--spins default,0,1000,3000]

Between two parallel operations, OpenMP's helper threads either spin (burn their core, ready at
once) or sleep (free the core, but the next operation waits for them to wake up). rlcourse sets
``OMP_WAIT_POLICY=PASSIVE`` with a short spin, ``GOMP_SPINCOUNT`` (see ``rlcourse/__init__.py``).
This benchmark times the same seeded GRPO step (64 completions, ``addition-partial``, 2 threads)
under each ``GOMP_SPINCOUNT`` in ``--spins`` (0 is PASSIVE alone; ``default`` is OpenMP's own
setting, neither variable set: a spin of about 3 ms), once with the machine to itself
and once with two copies running at the same time, the case that long spinning makes 10x slower.
Each setting runs in fresh processes: OpenMP reads these variables once, when torch loads.
Printed: the median milliseconds per warm step for each setting, alone and in pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import rlcourse
from rlcourse.bench._workers import start_worker, worker_result


def _worker(args) -> dict:
    if args.openmp_default:
        # rlcourse (imported to run this module) has filled in its defaults; take them out again
        # before torch loads OpenMP, which reads them once.
        assert "torch" not in sys.modules, "torch loaded before the OpenMP variables were chosen"
        for name in rlcourse.OPENMP_DEFAULTS:
            os.environ.pop(name, None)
    import torch

    from rlcourse.tasks import AdditionTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
    from rlcourse.runtime import seed_everything

    torch.set_num_threads(args.threads)
    seed_everything(0)
    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    config = PolicyGradientConfig(per_device_train_batch_size=64, num_generations=8, loss_type="dapo", seed=0)
    trainer = PolicyGradientTrainer(model, tokenizer, AdditionTask(), config)
    for _ in range(5):                      # warm-up: first calls allocate and pick kernels
        trainer.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.step()
        times.append(1000 * (time.perf_counter() - start))
    return {"ms_per_step": statistics.median(times)}


def _run(spins: int | None, copies: int, args) -> list[float]:
    """Start ``copies`` workers at once under ``GOMP_SPINCOUNT=spins`` (None: OpenMP's default); their ms per step."""
    env = dict(os.environ) if spins is None else dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT=str(spins))
    cmd = [sys.executable, "-m", "rlcourse.bench", "openmp-wait", "--worker",
           "--steps", str(args.steps), "--threads", str(args.threads)] + (["--openmp-default"] if spins is None else [])
    workers = [start_worker(cmd, env) for _ in range(copies)]      # all started before any is awaited
    return [worker_result(w)["ms_per_step"] for w in workers]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench openmp-wait", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per worker (after 5 warm-up steps)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spins", default="default,0,1000,3000",
                        help="GOMP_SPINCOUNT values, comma-separated ('default': OpenMP's own waiting)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--openmp-default", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    try:
        spins = [None if s.strip() == "default" else int(s) for s in args.spins.split(",")]
    except ValueError:
        parser.error(f"--spins must be comma-separated integers >= 0 or 'default', got {args.spins!r}")
    if any(s is not None and s < 0 for s in spins):
        parser.error(f"--spins must be comma-separated integers >= 0 or 'default', got {args.spins!r}")
    print(f"openmp-wait: GRPO step of 64 completions on addition-partial, {args.threads} threads, "
          f"median of {args.steps} warm steps; load average {os.getloadavg()[0]:.2f}")
    print(f"  {'GOMP_SPINCOUNT':>14} | {'alone (ms/step)':>15} | two copies at once (ms/step each)")
    for s in spins:
        alone = _run(s, 1, args)[0]
        pair = _run(s, 2, args)
        label = "default" if s is None else f"{s} (PASSIVE)" if s == 0 else str(s)
        print(f"  {label:>14} | {alone:15.1f} | " + " and ".join(f"{x:.1f}" for x in pair))
    return 0
