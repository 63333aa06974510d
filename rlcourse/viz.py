"""Matplotlib helpers shared by the lessons."""
from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np

from rlcourse.envs.gridworld import ACTION_ARROWS

# One look for every lesson, readable when projected at 1024 px: JupyterLab's output column is
# then about 850 px wide, so figures are at most 10 inches at 80 dpi and fonts are 12-13 pt.
COURSE_STYLE = {
    "figure.dpi": 80,
    "savefig.dpi": 80,
    "figure.figsize": (8.0, 3.8),
    "figure.facecolor": "white",
    "font.size": 12,
    "axes.titlesize": 13,
    "axes.labelsize": 12,
    "legend.fontsize": 10.5,
    "xtick.labelsize": 11,
    "ytick.labelsize": 11,
    "lines.linewidth": 2.0,
    "lines.markersize": 5,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.framealpha": 0.85,
}
MAX_FIGURE_WIDTH = 10.0  # inches: 800 px at 80 dpi, inside JupyterLab's output column at 1024 px


def use_course_style() -> None:
    """Apply :data:`COURSE_STYLE` to matplotlib: larger fonts and widths that fit the output column.

    Every lesson calls it in its first cell, after ``import matplotlib.pyplot``: the inline backend
    sets its own defaults when pyplot is imported, and this must come after them.
    """
    plt.rcParams.update(COURSE_STYLE)


PRINT_WIDTH = 100  # JupyterLab at 1280 px with the file browser open wraps longer lines, inside numbers


def wrap(text: str, width: int = PRINT_WIDTH) -> str:
    """A long printed line cut at spaces into lines of at most ``width`` characters, the next ones
    indented; an interval ``a +- b`` (or ``a ± b``) is never split."""
    for sign in ("+-", "±"):
        text = text.replace(f" {sign} ", f"\0{sign}\0")
    return textwrap.fill(text, width, subsequent_indent="    ", break_on_hyphens=False,
                         break_long_words=False).replace("\0", " ")


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

    Walls are grey. The goal is outlined in green and labelled "goal", a trap is hatched, outlined
    in red and labelled "trap", so the two never look alike.
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
            color = "#1a7f37" if kind == "G" else "#b3261e"
            ax.add_patch(plt.Rectangle((c - 0.46, r - 0.46), 0.92, 0.92, fill=False, edgecolor=color,
                                       linewidth=3, hatch=None if kind == "G" else "xx"))
            ax.text(c, r, f"{'goal' if kind == 'G' else 'trap'}\n{V[s]:.2f}", ha="center", va="center",
                    fontsize=11, weight="bold", color=color,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", alpha=0.8, linewidth=0))
            continue
        arrow = ACTION_ARROWS[int(np.argmax(policy[s]))] if policy is not None else ""
        ax.text(c, r, f"{arrow}\n{V[s]:.2f}", ha="center", va="center", fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    return ax


# ---------------------------------------------------------------------------------- PPO and GAE (lessons 04-06)
def plot_clip_objective(clip_coef: float = 0.2, advantage: float = 1.0, ax=None, clip_coef_high: float | None = None,
                        r_max: float = 2.0):
    """PPO's per-sample objective ``min(rho A, clip(rho, 1-eps, 1+eps) A)`` against the ratio ``rho``.

    Draws the unclipped ``rho A`` (dashed), the clipped objective (solid) and shades the ratios
    where its gradient is 0 (the clipped branch is selected), for one advantage value.
    """
    import torch

    from rlcourse.losses import ppo_clip_objective

    ax = ax or plt.gca()
    r = torch.linspace(0.0, r_max, 401, dtype=torch.float64)
    A = torch.full_like(r, float(advantage))
    obj = ppo_clip_objective(r, A, clip_coef, clip_coef_high).numpy()
    high = clip_coef if clip_coef_high is None else clip_coef_high
    ax.plot(r, (r * A).numpy(), "--", color="grey", label="unclipped  ρ·A")
    ax.plot(r, obj, color="C0" if advantage >= 0 else "C3", linewidth=2.5, label="L^CLIP = min(ρ·A, clip(ρ)·A)")
    if advantage > 0:
        ax.axvspan(1 + high, r_max, color="0.85", label="gradient = 0")
    elif advantage < 0:
        ax.axvspan(0, 1 - clip_coef, color="0.85", label="gradient = 0")
    for x in (1 - clip_coef, 1 + high):
        ax.axvline(x, color="k", linewidth=0.6, linestyle=":")
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_xlabel("probability ratio  ρ = π_θ(a|s) / π_old(a|s)")
    ax.set_ylabel("objective (maximised)")
    ax.set_title(f"A = {advantage:+g},  ε = {clip_coef:g}" + (f", ε_high = {high:g}" if clip_coef_high else ""))
    ax.legend(loc="upper left" if advantage >= 0 else "lower left", fontsize=9)
    return ax


DIAGNOSTIC_UNITS = {"clip_fraction": "share of samples", "approx_kl": "nats", "update_kl": "nats",
                    "entropy": "nats", "value_loss": "squared return", "policy_loss": "loss",
                    "explained_variance": "1 = perfect critic", "learning_rate": "step size"}


def plot_training_diagnostics(updates: dict, keys=("clip_fraction", "approx_kl", "entropy", "value_loss"),
                              x: str = "step", axes=None, ncols: int = 2):
    """One panel per diagnostic of a trainer's per-update history against env steps, ``ncols`` a row."""
    if axes is None:
        nrows = -(-len(keys) // ncols)
        _, axes = plt.subplots(nrows, ncols, figsize=(MAX_FIGURE_WIDTH, 2.9 * nrows), squeeze=False)
    axes = np.ravel(axes)
    for ax, key in zip(axes, keys):
        ax.plot(updates[x], updates[key], linewidth=1.2)
        ax.set_title(key.replace("_", " "))
        ax.set_ylabel(DIAGNOSTIC_UNITS.get(key, key))
        ax.set_xlabel("env steps")
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    plt.tight_layout()
    return axes


def plot_band(x, mean, half_width, ax=None, label: str | None = None, xlabel: str = "samples drawn",
              ylabel: str = "validity", **line_kwargs):
    """A mean curve with a shaded band ``mean +/- half_width`` (e.g. a 95% interval over seeds)."""
    ax = ax or plt.gca()
    x, mean, half_width = (np.asarray(v, dtype=float) for v in (x, mean, half_width))
    line, = ax.plot(x, mean, marker="o", label=label, **line_kwargs)
    ax.fill_between(x, mean - half_width, mean + half_width, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return ax
