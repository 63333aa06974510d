"""A small GridWorld as a ``gymnasium.Env`` whose dynamics are also exposed as arrays.

Layouts are lists of strings, one character per cell::

    S  start cell (several S: a uniform start distribution)
    .  empty cell
    #  wall (never entered; moving into it leaves the agent in place)
    G  goal: terminal, pays ``goal_reward``
    T  trap: terminal, pays ``trap_reward``

Actions are 0=up, 1=right, 2=down, 3=left. With probability ``slip`` the move goes sideways
instead (``slip/2`` to each side, as in the 80/10/10 world of Russell & Norvig). Moving off the
grid or into a wall leaves the agent where it was.

Because the dynamics are known, the environment also exposes them as arrays
(``P[s, a, s']``, ``R[s, a]``, see :attr:`GridWorld.mdp`) so that lessons can compute exact values
and gradients and compare them with what sampling-based algorithms estimate.
"""
from __future__ import annotations

from typing import Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rlcourse.tabular import TabularMDP

LAYOUTS: dict[str, tuple[str, ...]] = {
    # A 2x3 maze: reach the goal (+10) without stepping into the trap (-10).
    "maze2x3": ("S.T",
                "..G"),
    # A 4x4 world where the only safe route to the goal runs past a trap.
    "4x4": ("S...",
            ".#..",
            "..#T",
            "T..G"),
}

ACTION_NAMES = ("up", "right", "down", "left")
ACTION_ARROWS = ("↑", "→", "↓", "←")
_MOVES = ((-1, 0), (0, 1), (1, 0), (0, -1))
_COLORS = {".": (238, 238, 238), "S": (200, 220, 250), "#": (70, 70, 70),
           "G": (120, 200, 120), "T": (230, 110, 110)}


class GridWorld(gym.Env):
    """A tabular GridWorld. States are the non-wall cells, numbered row by row.

    Args:
        layout: a name from :data:`LAYOUTS` or a list of equal-length strings.
        slip: probability that a move goes to one of the two perpendicular directions.
        goal_reward, trap_reward: reward on entering a goal or trap cell (both end the episode).
        step_reward: reward added to every step (e.g. -1 to reward short paths when gamma=1).
        render_mode: ``None``, ``"ansi"`` (text) or ``"rgb_array"`` (an image).
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, layout: str | Sequence[str] = "4x4", slip: float = 0.0,
                 goal_reward: float = 10.0, trap_reward: float = -10.0, step_reward: float = 0.0,
                 render_mode: str | None = None):
        self.grid = _parse_layout(layout)
        if not 0.0 <= float(slip) <= 1.0:
            raise ValueError(f"slip must be a probability in [0, 1], got {slip!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']} or None, "
                             f"got {render_mode!r}")
        self.layout_name = layout if isinstance(layout, str) else "custom"
        self.slip = float(slip)
        self.goal_reward, self.trap_reward = float(goal_reward), float(trap_reward)
        self.step_reward = float(step_reward)
        self.render_mode = render_mode
        self.n_rows, self.n_cols = len(self.grid), len(self.grid[0])

        self.cells = [(r, c) for r in range(self.n_rows) for c in range(self.n_cols)
                      if self.grid[r][c] != "#"]
        self._index = {cell: s for s, cell in enumerate(self.cells)}
        self.observation_space = spaces.Discrete(len(self.cells))
        self.action_space = spaces.Discrete(len(ACTION_NAMES))
        self.P, self.reward_table = self._build_dynamics()
        # R[s, a] = E[r | s, a] = sum_s' P[s, a, s'] r(s, a, s')
        self.R = np.einsum("sat,sat->sa", self.P, self.reward_table)
        self.terminal = np.array([self.grid[r][c] in "GT" for r, c in self.cells])
        starts = np.array([self.grid[r][c] == "S" for r, c in self.cells], dtype=float)
        self.start_distribution = starts / starts.sum()
        self.state: int | None = None

    # ----------------------------------------------------------------- the model, as arrays
    @property
    def mdp(self) -> TabularMDP:
        """The exact model: transitions ``P[s,a,s']``, expected rewards ``R[s,a]``, terminal mask, start."""
        return TabularMDP(P=self.P, R=self.R, terminal=self.terminal, start=self.start_distribution)

    def state_of(self, row: int, col: int) -> int:
        """The state index of a (non-wall) cell."""
        if (row, col) not in self._index:
            raise ValueError(f"cell ({row}, {col}) is a wall or outside the {self.n_rows}x{self.n_cols} grid")
        return self._index[(row, col)]

    def _move(self, cell, action):
        r, c = cell[0] + _MOVES[action][0], cell[1] + _MOVES[action][1]
        if 0 <= r < self.n_rows and 0 <= c < self.n_cols and self.grid[r][c] != "#":
            return (r, c)
        return cell  # bumped into the edge or a wall: stay put

    def _build_dynamics(self):
        n_s, n_a = len(self.cells), len(ACTION_NAMES)
        P = np.zeros((n_s, n_a, n_s))
        rewards = np.zeros((n_s, n_a, n_s))
        for s, cell in enumerate(self.cells):
            if self.grid[cell[0]][cell[1]] in "GT":
                P[s, :, s] = 1.0  # terminal states absorb, with no further reward
                continue
            for a in range(n_a):
                sideways = ((a + 1) % 4, (a + 3) % 4)
                for direction, prob in ((a, 1 - self.slip), (sideways[0], self.slip / 2),
                                        (sideways[1], self.slip / 2)):
                    if prob == 0:
                        continue
                    nxt = self._index[self._move(cell, direction)]
                    P[s, a, nxt] += prob
                    kind = self.grid[self.cells[nxt][0]][self.cells[nxt][1]]
                    rewards[s, a, nxt] = (self.step_reward + self.goal_reward * (kind == "G")
                                          + self.trap_reward * (kind == "T"))
        return P, rewards

    # ----------------------------------------------------------------- the gymnasium interface
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode. ``options={"state": s}`` starts in state ``s`` (exploring starts)."""
        super().reset(seed=seed)
        start = (options or {}).get("state")
        if start is None:
            start = int(self.np_random.choice(len(self.cells), p=self.start_distribution))
        elif not (0 <= int(start) < len(self.cells)):
            raise ValueError(f"options['state'] must be a state in [0, {len(self.cells)}), got {start!r}")
        self.state = int(start)
        return self.state, {"cell": self.cells[self.state]}

    def step(self, action):
        if self.state is None:
            raise RuntimeError("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action must be an int in [0, 4) (0=up, 1=right, 2=down, 3=left), got {action!r}")
        s, a = self.state, int(action)
        if self.terminal[s]:
            raise RuntimeError("the episode has ended (terminal state); call reset()")
        # Sample s' ~ P[s, a, :] from the env's own seeded generator.
        nxt = int(np.searchsorted(np.cumsum(self.P[s, a]), self.np_random.random(), side="right"))
        nxt = min(nxt, len(self.cells) - 1)
        self.state = nxt
        reward = float(self.reward_table[s, a, nxt])
        return nxt, reward, bool(self.terminal[nxt]), False, {"cell": self.cells[nxt]}

    def render(self):
        if self.render_mode == "ansi":
            return self.to_text()
        if self.render_mode == "rgb_array":
            return self.to_rgb()
        return None

    def to_text(self) -> str:
        """The grid as text, with the agent drawn as ``A``."""
        rows = [list(row) for row in self.grid]
        if self.state is not None:
            r, c = self.cells[self.state]
            rows[r][c] = "A"
        return "\n".join("".join(row) for row in rows) + "\n"

    def to_rgb(self, cell_px: int = 48) -> np.ndarray:
        """The grid as an ``(H, W, 3)`` uint8 image, with the agent as a dark disc."""
        img = np.zeros((self.n_rows * cell_px, self.n_cols * cell_px, 3), dtype=np.uint8)
        for r in range(self.n_rows):
            for c in range(self.n_cols):
                img[r * cell_px:(r + 1) * cell_px, c * cell_px:(c + 1) * cell_px] = _COLORS[self.grid[r][c]]
        img[::cell_px, :] = img[:, ::cell_px] = 255  # grid lines
        if self.state is not None:
            r, c = self.cells[self.state]
            yy, xx = np.mgrid[:cell_px, :cell_px]
            disc = (yy - cell_px / 2) ** 2 + (xx - cell_px / 2) ** 2 <= (cell_px / 3.2) ** 2
            img[r * cell_px:(r + 1) * cell_px, c * cell_px:(c + 1) * cell_px][disc] = (40, 40, 90)
        return img


def _parse_layout(layout) -> tuple[str, ...]:
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)} or a list of strings, got {layout!r}")
        return LAYOUTS[layout]
    grid = tuple(layout)
    if not grid or any(len(row) != len(grid[0]) for row in grid) or not grid[0]:
        raise ValueError("layout must be a non-empty list of equal-length strings")
    bad = set("".join(grid)) - set(_COLORS)
    if bad:
        raise ValueError(f"layout has unknown cell characters {sorted(bad)}; use one of 'S.#GT'")
    text = "".join(grid)
    if "S" not in text or not ({"G", "T"} & set(text)):
        raise ValueError("layout needs at least one start 'S' and one terminal cell ('G' or 'T')")
    return grid
