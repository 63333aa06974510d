"""Matplotlib helpers shared by the lessons."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from rlcourse.envs.gridworld import ACTION_ARROWS


def moving_average(values, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each point (shorter at the start)."""
    values = np.asarray(values, dtype=float)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def plot_learning_curve(values, window: int = 20, ax=None, label: str | None = None,
                        xlabel: str = "episode", ylabel: str = "return"):
    """Raw values (faint) and their moving average (solid) on one axis."""
    ax = ax or plt.gca()
    line, = ax.plot(moving_average(values, window), label=label)
    ax.plot(values, alpha=0.2, color=line.get_color(), linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return ax


def plot_gridworld_values(env, V, policy=None, ax=None, title: str | None = None, cmap: str = "RdYlGn",
                          vmin: float | None = None, vmax: float | None = None):
    """Heatmap of state values on the grid, with an arrow for each state's most likely action.

    Walls are grey, goals and traps are labelled ``G`` and ``T``.
    """
    env = env.unwrapped
    ax = ax or plt.gca()
    grid = np.full((env.n_rows, env.n_cols), np.nan)
    for s, (r, c) in enumerate(env.cells):
        grid[r, c] = V[s]
    bound = np.nanmax(np.abs(grid)) or 1.0
    cm = plt.get_cmap(cmap).copy()
    cm.set_bad("#555555")
    ax.imshow(grid, cmap=cm, vmin=-bound if vmin is None else vmin, vmax=bound if vmax is None else vmax)
    for s, (r, c) in enumerate(env.cells):
        kind = env.grid[r][c]
        if kind in "GT":
            ax.text(c, r, f"{kind}\n{V[s]:.2f}", ha="center", va="center", fontsize=10, weight="bold")
            continue
        arrow = ACTION_ARROWS[int(np.argmax(policy[s]))] if policy is not None else ""
        ax.text(c, r, f"{arrow}\n{V[s]:.2f}", ha="center", va="center", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    return ax
