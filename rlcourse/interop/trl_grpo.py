"""GRPO on one of our tasks with TRL's GRPOTrainer: the script lesson 13 launches, on 1 or N processes.

    python -m rlcourse.interop.trl_grpo --steps 20 --out /tmp/run.json                  # one process
    accelerate launch --multi_gpu --num_processes 2 -m rlcourse.interop.trl_grpo --cpu ...   # 2 on CPU (gloo)
    accelerate launch --num_processes 8 -m rlcourse.interop.trl_grpo ...                  # 8 GPUs

It exports the shipped checkpoint to a folder (TRL loads models from a path, offline), builds a
``datasets`` prompt dataset and a reward function from the task, trains, then measures held-out
exact match with rlcourse's own evaluator on the main process. Every process reports its rank, the
world size and a checksum of its weights (:func:`rlcourse.interop.trl_bridge.distributed_report`);
rank 0 writes them, with the training log, as JSON to ``--out``.

Batch arithmetic, as TRL counts it: each optimizer step consumes
``per_device_train_batch_size x num_processes x gradient_accumulation_steps`` completions, i.e.
that many / ``num_generations`` prompts. The script keeps the *global* batch fixed, so 1 and 2
processes run the same optimisation (2 processes each take half of every batch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import rlcourse  # noqa: F401  (before torch)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="addition-partial")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=32, help="completions per optimizer step, all processes")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (use_cpu=True): gloo between processes")
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers import exact_match
    from rlcourse.interop.trl_bridge import distributed_report, export_checkpoint, task_dataset, task_reward_func

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % (world * args.num_generations):
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of "
                         f"processes x num_generations = {world} x {args.num_generations}")
    task = AdditionTask()
    workdir = os.environ.get("RLCOURSE_TRL_WORKDIR") or tempfile.mkdtemp(prefix="rlcourse-trl-")
    model_dir = os.path.join(workdir, f"{args.checkpoint}-rank{os.environ.get('RANK', '0')}")
    export_checkpoint(args.checkpoint, model_dir)
    n_prompts = args.steps * args.global_batch // args.num_generations
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "out"), use_cpu=args.cpu, bf16=False, report_to=[], seed=args.seed,
        max_steps=args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        per_device_train_batch_size=args.global_batch // world, gradient_accumulation_steps=1,
        num_generations=args.num_generations, max_completion_length=task.max_new_tokens,
        temperature=1.0, beta=args.beta, loss_type=args.loss_type, logging_steps=1,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=task_reward_func(task), args=config,
                          train_dataset=task_dataset(task, n_prompts, seed=args.seed),
                          processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))
    # With its progress bar off, the Trainer prints every log dict; the report below carries the rewards.
    from transformers.trainer_callback import PrinterCallback
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    report = distributed_report(trainer.model)
    if report["rank"] == 0:
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        before_model = GPT2LMHeadModel.from_pretrained(model_dir).to(model.device)
        prompts = task.test_prompts(args.eval_prompts)
        report.update(
            seconds=seconds, steps=args.steps, global_batch=args.global_batch,
            exact_match_before=exact_match(before_model.eval(), tokenizer, task, prompts),
            exact_match_after=exact_match(model.eval(), tokenizer, task, prompts),
            rewards=[row["reward"] for row in trainer.state.log_history if "reward" in row],
            device=str(model.device), torch_threads=torch.get_num_threads(),
        )
        print(json.dumps({k: v for k, v in report.items() if k != "rewards"}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    # Every rank waits here for rank 0's evaluation, so that no rank exits while another still talks to
    # it: a rank that left early sometimes died in C++ at exit ("terminate called without an active
    # exception", SIGABRT), which failed the whole launch.
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    code = main()
    # After the barrier every rank's work is done and written. Its interpreter's own shutdown (the
    # destructors of gloo's threads) still aborted a rank now and then with the same "terminate called
    # without an active exception"; destroying the process group first instead left a rank hanging. So
    # a rank of a multi-process launch leaves without that shutdown, once its output is flushed.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
