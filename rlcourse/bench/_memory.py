"""Memory measurements shared by the benchmarks (a private module: not a benchmark itself).

Two ways to measure memory, each used consistently within one comparison:

* :func:`process_peak_mb` - the whole process's peak (``ru_maxrss``, or the CUDA peak): for a
  worker that does one job from start to end (``grpo-vs-trl``, ``dpo-vs-trl``);
* :class:`RSSWatcher` - the peak while one block runs, above where it started: for a worker that
  loads shared things first (``ppo-rlhf``, ``capstone``).
"""
from __future__ import annotations

import os
import resource
import threading
import time


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RSSWatcher:
    """Peak resident set size of this process while a block runs, sampled every 2 ms (CPU only).

    ``ru_maxrss`` cannot serve: a spawned worker inherits its parent's peak across fork and exec.
    """

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return False


def process_peak_mb(device=None) -> float:
    """Peak memory of this process so far in MiB: CUDA's peak allocated on a GPU, else the peak RSS.

    ``ru_maxrss`` counts from the parent's size at ``fork``: run workers from a small parent.
    """
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

