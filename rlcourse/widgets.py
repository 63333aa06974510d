"""ipywidgets explorers: turn a knob, watch the numbers move."""
from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

from rlcourse import tabular
from rlcourse.envs import GridWorld
from rlcourse.viz import plot_gridworld_values


def gridworld_explorer(layout: str = "4x4", gamma: float = 0.9, slip: float = 0.0):
    """Sliders for the discount and the slip probability; shows ``V*`` and the optimal policy.

    Watch how a small gamma makes the agent short-sighted (values near the goal only) and how slip
    makes states next to a trap worth less, until the optimal route changes.
    """

    def show(gamma: float, slip: float):
        env = GridWorld(layout, slip=slip)
        result = tabular.value_iteration(env.mdp, gamma)
        start = int(env.start_distribution.argmax())
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        plot_gridworld_values(env, result.V, result.policy, ax=ax,
                              title=f"V* and the optimal policy\nγ={gamma:.2f}, slip={slip:.2f}, "
                                    f"V*(start)={result.V[start]:.2f}")
        plt.show()

    return widgets.interactive(
        show,
        gamma=widgets.FloatSlider(value=gamma, min=0.0, max=0.99, step=0.01, description="γ"),
        slip=widgets.FloatSlider(value=slip, min=0.0, max=0.6, step=0.05, description="slip"))
