"""The importance-weight explorer of lesson 03 builds and redraws without errors."""
import numpy as np

import rlcourse  # noqa: F401  (before torch)
from rlcourse import tabular, widgets
from rlcourse.classic import gradient_estimates as ge
from rlcourse.envs import GridWorld


def test_importance_weight_explorer_redraws(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: plt.close("all"))
    env = GridWorld("maze2x3", slip=0.1, step_reward=-1.0)
    theta = np.random.default_rng(0).normal(scale=0.5, size=(6, 4))
    batch = ge.sample_episodes(env.mdp, tabular.softmax_policy(theta), 500, np.random.default_rng(1),
                               reward_table=env.reward_table)
    w = widgets.importance_weight_explorer(env.mdp, theta, batch, 0.9)
    for alpha in (0.0, 2.5):
        w.children[0].value = alpha  # moving the slider re-runs the plot
    assert w.children[0].description == "α"


def test_gradient_estimate_explorer_redraws(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: plt.close("all"))
    rng = np.random.default_rng(0)
    exact = rng.normal(size=(3, 2))
    exact[0] = 0.0  # a terminal state's row: skipped in the bars
    g = exact[None] + rng.normal(size=(256, 3, 2))
    w = widgets.gradient_estimate_explorer(g, exact)
    assert w.children[0].max == 8 and w.children[0].value == 6
    for value in (0, 8):
        w.children[0].value = value
