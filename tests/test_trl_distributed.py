"""The lesson-13 script on TRL's GRPOTrainer, launched with accelerate: 2 real processes, or 1 that looks like 2.

These runs are part of the suite on purpose (a few seconds of training each, bounded by a timeout):
a multi-process launch that silently degrades is exactly what lesson 13 teaches learners to catch.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlcourse  # noqa: F401

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
SCRIPT = ["-m", "rlcourse.interop.trl_grpo", "--cpu", "--steps", "3", "--eval-prompts", "20"]
# A port of its own: lesson 13 launches DDP on accelerate's default port, and `make test` may run it
# in the other worker at the same time.
COMMON = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517"]


def launch(tmp_path, *launcher_args):
    out = tmp_path / "report.json"
    env = {**os.environ, "RLCOURSE_TRL_WORKDIR": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONWARNINGS": "ignore",
           "CUDA_VISIBLE_DEVICES": ""}   # CPU ranks: with one GPU visible rank 1 would be sent to cuda:1
    done = subprocess.run([ACCELERATE, "launch", *launcher_args, *COMMON, *SCRIPT, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_processes_train_one_model_with_ddp(tmp_path):
    report = launch(tmp_path, "--multi_gpu", "--num_processes", "2")
    assert report["world_size"] == 2
    assert len(report["checksums"]) == 2 and report["replicas_identical"], report["checksums"]
    assert 0.0 <= report["exact_match_after"] <= 1.0


def test_the_cpu_flag_silently_starts_one_process(tmp_path):
    """`accelerate launch --cpu --num_processes 2` asks for two processes and gets one: count them."""
    report = launch(tmp_path, "--cpu", "--num_processes", "2")
    assert report["world_size"] == 1


def test_trl_reward_function_and_dataset_come_from_the_task():
    from rlcourse.tasks import AdditionTask
    from rlcourse.interop.trl_bridge import task_dataset, task_reward_func

    task = AdditionTask()
    data = task_dataset(task, 4, seed=0)
    assert data.column_names == ["prompt"] and data["prompt"] == task.prompts(4, rng=0)
    reward = task_reward_func(task)
    assert reward(["1+2=", "10+5="], ["3", "14"]) == [1.0, 0.0]


@pytest.mark.parametrize("name", ["addition-partial"])
def test_exported_checkpoint_loads_offline_and_matches(tmp_path, name):
    from transformers import GPT2LMHeadModel

    from rlcourse.lm import load_checkpoint
    from rlcourse.interop.trl_bridge import export_checkpoint, parameter_checksum

    path = export_checkpoint(name, tmp_path / "model")
    ours, _ = load_checkpoint(name, device="cpu")
    assert parameter_checksum(GPT2LMHeadModel.from_pretrained(path, local_files_only=True)) == parameter_checksum(ours)
