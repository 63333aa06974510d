"""Benchmark workers: one measurement per fresh process (a private module: not a benchmark itself).

A benchmark that compares two trainers runs each in its own process, so that neither inherits the
other's memory, threads or warm caches. The worker prints its result as JSON on its last line.
"""
from __future__ import annotations

import json
import subprocess


def start_worker(cmd: list[str], env: dict) -> subprocess.Popen:
    """Start a benchmark worker that prints its result as JSON on its last line of output."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_result(proc: subprocess.Popen) -> dict:
    """Wait for a worker; its JSON result, or ``RuntimeError`` with the end of its error output."""
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {' '.join(proc.args[-6:])} failed "
                           f"(exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_worker(cmd: list[str], env: dict) -> dict:
    """Run one worker to its end: :func:`start_worker` then :func:`worker_result`."""
    return worker_result(start_worker(cmd, env))
