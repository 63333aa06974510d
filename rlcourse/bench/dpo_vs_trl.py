"""dpo-vs-trl: rlcourse's DPO trainer against TRL's DPOTrainer on the same job.

    python -m rlcourse.bench dpo-vs-trl [--pairs 512] [--steps 40] [--batch 32] [--beta 0.1]
                                        [--lr 1e-3] [--threads 2] [--checkpoint preference-sft]

Both train the same saved checkpoint (a local path: TRL loads its own copy and its reference from
it) on the same ``PreferenceTask`` comparisons, with the same beta, learning rate (linear decay to
0, no warm-up), batch size, number of steps, gradient clipping at 1.0, dropout off and a frozen
reference model evaluated every step (no precomputed log-probs). Each runs in its own
subprocess, one after the other, so that peak memory is its own.

Reported for each: steps per second of the training loop (set-up excluded), the loss of the first
step and the mean loss of the last five, and the peak resident memory of the process (and its rise
during training). Shuffles differ between the two, so the later losses agree only roughly.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from rlcourse.bench._memory import process_peak_mb, rss_bytes
from rlcourse.bench._workers import run_worker


def _rss_mb() -> float:
    return rss_bytes() / 2**20


def _worker(args) -> dict:
    import rlcourse  # noqa: F401  (before torch)
    import torch

    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint

    torch.set_num_threads(args.threads)
    pairs = PreferenceTask().preference_pairs(args.pairs, rng=0)
    if args.worker == "ours":
        from rlcourse.trainers.dpo import DPOConfig, train_dpo

        model, tok = load_checkpoint(args.checkpoint)
        config = DPOConfig(beta=args.beta, learning_rate=args.lr, per_device_train_batch_size=args.batch,
                           max_steps=args.steps)
        before = _rss_mb()
        start = time.perf_counter()
        history = train_dpo(model, tok, pairs, config, progress=False)
        seconds = time.perf_counter() - start
        losses = history["loss"]
    else:
        import datasets
        import transformers
        from trl import DPOConfig, DPOTrainer

        transformers.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        _, tok = load_checkpoint(args.checkpoint)
        with tempfile.TemporaryDirectory() as out:
            config = DPOConfig(output_dir=out, use_cpu=not torch.cuda.is_available(), bf16=False, report_to=[],
                               beta=args.beta, learning_rate=args.lr, per_device_train_batch_size=args.batch,
                               max_steps=args.steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                               warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0,
                               seed=0, dataloader_num_workers=0)
            trainer = DPOTrainer(model=args.model_path, args=config, processing_class=tok,
                                 train_dataset=datasets.Dataset.from_list(pairs))
            before = _rss_mb()
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
            losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    tail = losses[-5:]   # one batch's loss is noisy: the mean of the last five steps
    return {"steps_per_second": args.steps / seconds, "seconds": seconds, "first_loss": losses[0],
            "last_loss": sum(tail) / len(tail), "peak_mb": process_peak_mb(), "rise_mb": process_peak_mb() - before}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench dpo-vs-trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint", default="preference-sft")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0

    import rlcourse  # noqa: F401
    from rlcourse.lm import load_checkpoint, save_checkpoint
    from rlcourse.runtime import describe

    print(describe())
    print(f"job: {args.checkpoint}, {args.pairs} PreferenceTask pairs, {args.steps} steps of batch {args.batch}, "
          f"beta={args.beta}, lr={args.lr} (linear decay), {args.threads} threads")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load_checkpoint(args.checkpoint, device="cpu")
        path = save_checkpoint(model, tok, os.path.join(tmp, "model"))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_DATASETS_CACHE": os.path.join(tmp, "datasets")}
        for who in ("ours", "trl"):
            cmd = [sys.executable, "-m", "rlcourse.bench.dpo_vs_trl", *argv, "--worker", who, "--model-path", str(path)]
            results[who] = run_worker(cmd, env)
    print(f"{'':>10} {'steps/s':>8} {'first loss':>11} {'last 5 loss':>11} {'peak RSS MB':>12} {'rise MB':>8}")
    for who, r in results.items():
        name = "rlcourse" if who == "ours" else "TRL 1.16"
        print(f"{name:>10} {r['steps_per_second']:8.2f} {r['first_loss']:11.4f} {r['last_loss']:11.4f} "
              f"{r['peak_mb']:12.0f} {r['rise_mb']:8.0f}")
    print(f"speed ratio rlcourse / TRL: {results['ours']['steps_per_second'] / results['trl']['steps_per_second']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
