"""Argument checks shared by the task modules (clear errors that name the argument)."""
from __future__ import annotations

import numpy as np


def as_rng(rng) -> np.random.Generator:
    """``None`` or an int seed -> a fresh ``numpy.random.Generator``; a Generator passes through."""
    if rng is None or isinstance(rng, (int, np.integer)):
        return np.random.default_rng(rng)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be None, an int seed or a numpy Generator, got {type(rng).__name__}")
    return rng


def check_pairs(prompts, completions) -> None:
    if isinstance(prompts, str) or isinstance(completions, str):
        raise ValueError("prompts and completions must be lists of strings, not a single string")
    if len(prompts) != len(completions):
        raise ValueError(f"prompts and completions must have the same length, got "
                         f"{len(prompts)} and {len(completions)}")


def check_count(n) -> None:
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
