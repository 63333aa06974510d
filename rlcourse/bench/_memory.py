"""Memory measurements shared by the benchmarks (a private module: not a benchmark itself)."""
from __future__ import annotations

import os
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
