"""Reproduce the shipped checkpoints: ``python -m rlcourse.tools.train_checkpoints NAME [NAME ...] | all``.

Each recipe below is the whole story of a checkpoint: task, model size, data, optimiser settings.
Training is seeded; the numbers in ``recipe.json`` were measured at the end of training (on
2 CPU threads they vary slightly with the machine because float sums are not associative).

* ``addition``         - 2-digit addition, trained to near-perfect held-out exact match.
* ``addition-partial`` - the same recipe stopped as soon as exact match on a validation set
                         reaches 35%: the starting point of the RL lessons (room to improve).
* ``digitsum-sft``     - "S=07:" -> 4 digits summing to S, imitated from demonstrations of which
                         half are wrong. Its samples (T=1) are valid less often than the
                         demonstrations (~40% < 50%); greedy decoding picks the mode and does
                         better (~68%). RL with the verifier goes past both (lessons 09-12).
* ``preference-sft``   - the base policy of the preference task: random short words.
* ``filler-addition``  - "12+34=" -> "...46": 0-12 filler dots, then the sum; the task scores only
                         answers after at most 3 dots, so most demonstrations (and samples) run
                         over budget. Completions vary in length: lesson 10's length-bias runs.
* ``tool-sum-sft``     - "12+34+56=" -> the sum, directly, or (one demonstration in ten of the three-number
                         sums) through calculator calls "(12+34)=46;(46+56)=102;102", the calculator's
                         tokens left out of the loss; plus two-number sums. Greedy decoding never calls the
                         tool and adds three numbers poorly; sampling calls it about one time in ten
                         (lesson 10e's starting point: RL teaches when to call).
* ``judge``, ``judge-seed1``, ``judge-seed2`` - a generative judge: "12+34=47|46>" -> "y" or "n" (answer,
                         then the reference), trained on well-formed answers only (the right sum, and wrong
                         sums of the same number of digits); three seeds of one recipe, lesson 10d's judge
                         and its ensemble. Its exact match is the accuracy of its greedy verdict.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import rlcourse  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from rlcourse.lm.checkpoints import CHECKPOINT_DIR, save_checkpoint
from rlcourse.lm.model import count_parameters, make_model
from rlcourse.trainers.sft import exact_match, train_sft
from rlcourse.tasks import AdditionTask, DigitSumTask, FillerAdditionTask, PreferenceTask
from rlcourse.tasks.judge import JudgeTask
from rlcourse.tasks.tool_env import ToolSumTask
from rlcourse.lm.tokenizer import build_char_tokenizer

RECIPES = {
    "addition": dict(task="AdditionTask", task_kwargs=dict(n_digits=2), size="tiny",
                     n_examples=20000, steps=3000, lr=3e-3, batch_size=128, seed=0),
    "addition-partial": dict(task="AdditionTask", task_kwargs=dict(n_digits=2), size="tiny",
                             n_examples=20000, steps=1500, lr=3e-3, batch_size=128, seed=0,
                             stop_at=0.35, eval_every=10),
    "digitsum-sft": dict(task="DigitSumTask", task_kwargs=dict(n_digits=4, demo_accuracy=0.5),
                         size="tiny", n_examples=20000, steps=3000, lr=3e-3, batch_size=128, seed=0),
    "preference-sft": dict(task="PreferenceTask", task_kwargs=dict(), size="tiny",
                           n_examples=20000, steps=800, lr=3e-3, batch_size=128, seed=0),
    "filler-addition": dict(task="FillerAdditionTask", task_kwargs=dict(n_digits=2, max_filler=12, budget=3),
                            size="tiny", n_examples=20000, steps=1500, lr=3e-3, batch_size=128, seed=0),
    "judge": dict(task="JudgeTask", task_kwargs=dict(near_miss=0.5), size="tiny",
                  n_examples=20000, steps=1500, lr=3e-3, batch_size=128, seed=0),
    "judge-seed1": dict(task="JudgeTask", task_kwargs=dict(near_miss=0.5), size="tiny",
                        n_examples=20000, steps=1500, lr=3e-3, batch_size=128, seed=1),
    "judge-seed2": dict(task="JudgeTask", task_kwargs=dict(near_miss=0.5), size="tiny",
                        n_examples=20000, steps=1500, lr=3e-3, batch_size=128, seed=2),
    "tool-sum-sft": dict(task="ToolSumTask", task_kwargs=dict(n_operands=3, n_digits=2, tool_rate=0.1, pair_fraction=0.3),
                         size="tiny", n_examples=20000, steps=2000, lr=3e-3, batch_size=128, seed=0),
}
TASKS = {"AdditionTask": AdditionTask, "DigitSumTask": DigitSumTask, "FillerAdditionTask": FillerAdditionTask,
         "PreferenceTask": PreferenceTask, "ToolSumTask": ToolSumTask, "JudgeTask": JudgeTask}


def make_task(recipe: dict):
    return TASKS[recipe["task"]](**recipe["task_kwargs"])


def train_recipe(name: str, out_dir: Path, progress: bool = True) -> dict:
    """Train the checkpoint ``name`` from scratch, save it under ``out_dir / name``, return its record."""
    if name not in RECIPES:
        raise ValueError(f"name must be one of {sorted(RECIPES)}, got {name!r}")
    recipe = RECIPES[name]
    task = make_task(recipe)
    torch.manual_seed(recipe["seed"])
    tokenizer = build_char_tokenizer()
    model = make_model(recipe["size"], tokenizer, seed=recipe["seed"])
    examples = task.sft_dataset(recipe["n_examples"], rng=recipe["seed"])
    test_prompts = task.test_prompts(500)
    eval_kwargs = {}
    if "stop_at" in recipe:
        # Stop on *training-split* prompts so the held-out set stays untouched for measuring.
        eval_kwargs = dict(task=task, eval_prompts=task.prompts(300, rng=recipe["seed"] + 999),
                           eval_every=recipe["eval_every"], stop_at=recipe["stop_at"])
    start = time.perf_counter()
    history = train_sft(model, tokenizer, examples, steps=recipe["steps"], lr=recipe["lr"],
                        batch_size=recipe["batch_size"], seed=recipe["seed"], progress=progress,
                        **eval_kwargs)
    seconds = time.perf_counter() - start
    sampler = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    results = {"steps_run": len(history["step"]), "final_loss": history["loss"][-1],
               "train_seconds": round(seconds, 1), "parameters": count_parameters(model)}
    if not isinstance(task, PreferenceTask):
        results["test_exact_match_greedy"] = exact_match(model, tokenizer, task, test_prompts)
        results["test_exact_match_sampled_T1"] = exact_match(model, tokenizer, task, test_prompts,
                                                             greedy=False, generator=sampler)
    if isinstance(task, ToolSumTask):   # with the calculator: episodes of up to 4 turns (lesson 10e's rollout)
        results.update(tool_results(model, tokenizer, task, test_prompts))
    record = {"name": name, "recipe": recipe, "results": results,
              "command": f"python -m rlcourse.tools.train_checkpoints {name}",
              "trained_with": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                               "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}}
    save_checkpoint(model, tokenizer, out_dir / name, record)
    return record


def tool_results(model, tokenizer, task, prompts: list[str]) -> dict:
    """Held-out exact match and tool-call rate of multi-turn episodes, greedy and sampled (T=1, seed 0)."""
    from rlcourse.lm.multi_turn import rollout

    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled_T1", 1.0)):
        episodes = rollout(model, tokenizer, prompts, task.make_env, temperature=temperature,
                           generator=torch.Generator(device=next(model.parameters()).device).manual_seed(0))
        out[f"test_tool_exact_match_{name}"] = round(float(episodes.rewards.mean()), 3)
        out[f"test_tool_call_rate_{name}"] = round(float((episodes.tool_calls > 0).float().mean()), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.tools.train_checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help=f"checkpoint names ({', '.join(RECIPES)}) or 'all'")
    parser.add_argument("--out", type=Path, default=CHECKPOINT_DIR,
                        help="folder that receives one sub-folder per checkpoint (default: the package's)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    names = list(RECIPES) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown checkpoint(s) {unknown}; choose from {sorted(RECIPES)} or 'all'")
    torch.set_num_threads(args.threads)
    for name in names:
        record = train_recipe(name, args.out, progress=not args.quiet)
        print(f"{name}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in record["results"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
