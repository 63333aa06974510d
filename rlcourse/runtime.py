"""Where and how code runs: device, seeds, threads and the size profile.

Profiles set how big every experiment in the course is:

* ``ci``     - smallest sizes that still show each lesson's promise (the test suite uses it);
* ``laptop`` - the default: every lesson runs in about a minute on 2 CPU threads;
* ``demo``   - larger models and runs for an instructor with a GPU.

Choose one with the environment variable ``RLCOURSE_PROFILE`` before starting Jupyter, or call
:func:`set_profile` at the top of a notebook.
"""
from __future__ import annotations

import os
import random
from contextlib import contextmanager

# rlcourse/__init__.py has already set OMP_WAIT_POLICY: a package runs before its modules.
import numpy as np
import torch

PROFILES = ("ci", "laptop", "demo")
_profile_override: str | None = None


def profile() -> str:
    """The active profile: :func:`set_profile`'s choice, else ``$RLCOURSE_PROFILE``, else ``laptop``."""
    name = _profile_override or os.environ.get("RLCOURSE_PROFILE", "").strip().lower() or "laptop"
    if name not in PROFILES:
        raise ValueError(f"RLCOURSE_PROFILE={name!r} is not a profile; expected one of {PROFILES}")
    return name


def set_profile(name: str) -> None:
    """Override the profile for this Python process (``None`` goes back to the environment)."""
    global _profile_override
    if name is not None and name not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {name!r}")
    _profile_override = name


def by_profile(*, ci, laptop, demo=None):
    """Pick a value for the active profile: ``by_profile(ci=200, laptop=1000, demo=20000)``.

    ``demo`` falls back to ``laptop`` when not given.
    """
    return {"ci": ci, "laptop": laptop, "demo": laptop if demo is None else demo}[profile()]


def device(prefer: str | None = None) -> torch.device:
    """The best available device: CUDA, then Apple's MPS, then the CPU.

    ``prefer`` (or ``$RLCOURSE_DEVICE``) forces a choice, e.g. ``"cpu"`` to compare speeds.
    """
    choice = prefer or os.environ.get("RLCOURSE_DEVICE")
    if choice:
        return torch.device(choice)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def synchronize(dev: torch.device) -> None:
    """Wait for ``dev``'s queued work (a no-op off CUDA): a timer must not stop before the GPU has."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def seed_everything(seed: int) -> np.random.Generator:
    """Seed Python, NumPy and torch (all devices); return a fresh NumPy ``Generator`` for ``seed``."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads to ``n`` (default ``$RLCOURSE_THREADS`` or all cores); return it.

    Small models gain nothing from more threads than cores, and oversubscription on a 2-core
    laptop is the most common cause of a 10x slowdown.
    """
    if n is None:
        n = int(os.environ.get("RLCOURSE_THREADS", 0)) or (os.cpu_count() or 1)
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


@contextmanager
def intra_op_threads(n: int):
    """Run the block with torch's intra-op thread count at ``n``; the count before comes back after.

    For work whose every operation is too small to split: waking another thread for each of many
    tiny kernels can cost more than the thread saves (see :func:`rlcourse.lm.sampling.decode_threads`).
    The count is process-wide: two Python threads inside this block at once would change each
    other's.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer (threads), got {n!r}")
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def describe() -> str:
    """One line saying where the course runs: device, threads and profile."""
    dev = device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return (f"device={name} threads={torch.get_num_threads()} profile={profile()} "
            f"torch={torch.__version__}")


def close_progress(bar, note: str = "stopped early: target reached") -> None:
    """Close a tqdm bar; a run that stopped before its budget closes as finished, not as failed.

    In JupyterLab, tqdm paints a bar closed short of its total red, which reads as an error. A
    trainer that stops because it solved the task sets the total to what was done, says why in
    the description, and the bar ends green and full.
    """
    if not getattr(bar, "disable", False) and bar.total and bar.n < bar.total:
        bar.total = bar.n
        bar.set_description_str(f"{bar.desc} ({note})", refresh=False)
        bar.refresh()
    bar.close()
