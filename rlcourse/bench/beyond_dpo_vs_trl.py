"""beyond-dpo-vs-trl: rlcourse's SimPO, ORPO and KTO training steps against TRL's trainers on the same job.

    python -m rlcourse.bench beyond-dpo-vs-trl [--pairs 512] [--steps 40] [--batch 32] [--lr 1e-3]
                                               [--threads 2] [--losses simpo orpo kto] [--checkpoint preference-sft]

For each loss, ours is :func:`rlcourse.trainers.dpo.train_dpo` with ``loss_type`` set, TRL's is its own trainer:

    simpo   CPOTrainer(CPOConfig(loss_type="simpo", cpo_alpha=0))    beta 2.0, simpo_gamma 0.5
    orpo    ORPOTrainer(ORPOConfig)                                  beta (the paper's lambda) 1.0
    kto     KTOTrainer(KTOConfig), the pairs split into singles      beta 0.3, weights 1 and 1

Both train the same saved checkpoint on the same ``PreferenceTask`` comparisons, with the same
learning rate (linear decay to 0, no warm-up), number of steps, gradient clipping at 1.0 and dropout
off. A batch is ``--batch`` pairs: for KTO, TRL's batch holds the ``2 x --batch`` singles they split
into (our trainer splits each pair itself). KTO's reference is evaluated at every step on both sides
(no precomputed log-probs). Each run is its own subprocess, one after the other, so that peak memory
is its own. Reported: steps per second of the training loop (set-up excluded), the first loss and
the mean of the last five, and the process's peak resident memory. Shuffles differ, so the losses
agree only roughly; ORPO's differ by more, since TRL's NLL term also counts the prompt's tokens
(ours, as the paper's equation, the chosen completion's only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from rlcourse.bench._memory import process_peak_mb
from rlcourse.bench._workers import run_worker

SETTINGS = {"simpo": dict(beta=2.0, simpo_gamma=0.5), "orpo": dict(beta=1.0), "kto": dict(beta=0.3)}


def _trl_trainer(loss: str, args, path: str, tok, pairs: list[dict], out: str):
    """TRL's trainer for ``loss`` on the job of ``args`` (imports inside: TRL loads only in its worker)."""
    import datasets
    import torch

    common = dict(output_dir=out, use_cpu=not torch.cuda.is_available(), bf16=False, report_to=[],
                  learning_rate=args.lr, max_steps=args.steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                  warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0, seed=0,
                  dataloader_num_workers=0, **SETTINGS[loss])
    if loss == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        config = CPOConfig(loss_type="simpo", cpo_alpha=0.0, per_device_train_batch_size=args.batch, **common)
        return CPOTrainer(model=path, args=config, processing_class=tok, train_dataset=datasets.Dataset.from_list(pairs))
    if loss == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        config = ORPOConfig(per_device_train_batch_size=args.batch, **common)
        return ORPOTrainer(model=path, args=config, processing_class=tok, train_dataset=datasets.Dataset.from_list(pairs))
    from trl import KTOConfig, KTOTrainer
    singles = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
               for p in pairs for side in ("chosen", "rejected")]
    config = KTOConfig(per_device_train_batch_size=2 * args.batch, **common)
    return KTOTrainer(model=path, args=config, processing_class=tok, train_dataset=datasets.Dataset.from_list(singles))


def _worker(args) -> dict:
    import rlcourse  # noqa: F401  (before torch)
    import warnings

    import torch

    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint

    torch.set_num_threads(args.threads)
    pairs = PreferenceTask().preference_pairs(args.pairs, rng=0)
    loss = args.worker_loss
    if args.worker == "ours":
        from rlcourse.trainers.dpo import DPOConfig, train_dpo

        model, tok = load_checkpoint(args.checkpoint)
        config = DPOConfig(loss_type=loss, learning_rate=args.lr, per_device_train_batch_size=args.batch,
                           max_steps=args.steps, **SETTINGS[loss])
        history = train_dpo(model, tok, pairs, config, progress=False)
        seconds, losses = history["seconds"], history["loss"]
    else:
        import datasets
        import transformers

        transformers.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        _, tok = load_checkpoint(args.checkpoint)
        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trl_trainer(loss, args, args.model_path, tok, pairs, out)
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
            losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    tail = losses[-5:]
    return {"steps_per_second": args.steps / seconds, "first_loss": losses[0], "last_loss": sum(tail) / len(tail),
            "peak_mb": process_peak_mb()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench beyond-dpo-vs-trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--losses", nargs="+", choices=sorted(SETTINGS), default=["simpo", "orpo", "kto"])
    parser.add_argument("--checkpoint", default="preference-sft")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-loss", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0

    import rlcourse  # noqa: F401
    from rlcourse.lm import load_checkpoint, save_checkpoint
    from rlcourse.runtime import describe

    print(describe())
    print(f"job: {args.checkpoint}, {args.pairs} PreferenceTask pairs, {args.steps} steps of {args.batch} pairs, "
          f"lr={args.lr} (linear decay), {args.threads} threads")
    print(f"{'loss':>6} {'trainer':>22} {'steps/s':>8} {'first loss':>11} {'last 5 loss':>11} {'peak RSS MB':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load_checkpoint(args.checkpoint, device="cpu")
        path = save_checkpoint(model, tok, os.path.join(tmp, "model"))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_DATASETS_CACHE": os.path.join(tmp, "datasets"), "TRL_EXPERIMENTAL_SILENCE": "1"}
        trl_names = {"simpo": "TRL CPOTrainer (simpo)", "orpo": "TRL ORPOTrainer", "kto": "TRL KTOTrainer"}
        for loss in args.losses:
            results = {}
            for who in ("ours", "trl"):
                cmd = [sys.executable, "-m", "rlcourse.bench.beyond_dpo_vs_trl", *argv, "--worker", who,
                       "--worker-loss", loss, "--model-path", str(path)]
                results[who] = run_worker(cmd, env)
            for who, r in results.items():
                name = "rlcourse train_dpo" if who == "ours" else trl_names[loss]
                print(f"{loss:>6} {name:>22} {r['steps_per_second']:8.2f} {r['first_loss']:11.4f} {r['last_loss']:11.4f} "
                      f"{r['peak_mb']:12.0f}")
            print(f"{loss:>6} speed ratio rlcourse / TRL: "
                  f"{results['ours']['steps_per_second'] / results['trl']['steps_per_second']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
