import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import rlcourse  # noqa: F401  (registers the env id)
from rlcourse.envs import GRIDWORLD_ID, LAYOUTS, GridWorld


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
def test_check_env_passes_without_warnings(layout, render_mode):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any gymnasium warning fails the test
        env = gymnasium.make(GRIDWORLD_ID, layout=layout, slip=0.2, render_mode=render_mode)
        check_env(env.unwrapped)


def test_maze_layout_has_goal_trap_and_rewards():
    env = GridWorld("maze2x3")
    assert (env.n_rows, env.n_cols) == (2, 3)
    goal, trap = env.state_of(1, 2), env.state_of(0, 2)
    # +10 for entering the goal, -10 for entering the trap, 0 otherwise
    assert env.reward_table[env.state_of(0, 2 - 1), 1, trap] == -10
    assert env.reward_table[env.state_of(1, 1), 1, goal] == 10
    assert set(np.unique(env.R)) == {-10.0, 0.0, 10.0}
    assert env.terminal[[goal, trap]].all() and env.terminal.sum() == 2


@pytest.mark.parametrize("slip", [0.0, 0.2])
def test_transition_arrays_match_sampled_steps(slip):
    """The exposed P[s, a, :] is what env.step actually samples (chi-by-eye: 4 standard errors)."""
    env = gymnasium.make(GRIDWORLD_ID, layout="4x4", slip=slip).unwrapped
    n = 400
    for s in np.flatnonzero(~env.terminal)[:6]:
        for a in range(4):
            counts = np.zeros(env.observation_space.n)
            for i in range(n):
                env.reset(seed=i, options={"state": int(s)})
                s_next, reward, *_ = env.step(a)
                counts[s_next] += 1
                assert reward == env.reward_table[s, a, s_next]
            p = env.P[s, a]
            assert np.all(np.abs(counts / n - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_slip_is_80_10_10_and_walls_block():
    env = GridWorld("4x4", slip=0.2)
    s = env.state_of(0, 1)  # wall (1,1) is below
    # down: 0.8 into the wall (stay), 0.1 left, 0.1 right
    assert env.P[s, 2, s] == pytest.approx(0.8)
    assert env.P[s, 2, env.state_of(0, 0)] == pytest.approx(0.1)
    assert env.P[s, 2, env.state_of(0, 2)] == pytest.approx(0.1)
    assert np.allclose(env.P.sum(-1), 1)


def test_time_limit_and_terminal_behaviour():
    env = gymnasium.make(GRIDWORLD_ID, layout="maze2x3")
    env.reset(seed=0)
    for t in range(100):
        _, _, terminated, truncated, _ = env.step(0)  # bump into the top wall forever
        if truncated:
            break
    assert t == 99 and not terminated
    raw = GridWorld("maze2x3")
    raw.reset(seed=0)
    raw.step(1)
    _, r, terminated, _, _ = raw.step(1)
    assert terminated and r == -10
    with pytest.raises(RuntimeError, match="reset"):
        raw.step(0)


def test_rendering():
    env = GridWorld("maze2x3", render_mode="ansi")
    env.reset(seed=0)
    assert env.render() == "A.T\n..G\n"
    img = GridWorld("4x4", render_mode="rgb_array")
    img.reset(seed=0)
    frame = img.render()
    assert frame.shape == (4 * 48, 4 * 48, 3) and frame.dtype == np.uint8


@pytest.mark.parametrize("kwargs, message", [
    ({"layout": "nope"}, "layout must be one of"),
    ({"layout": ["S.", "..."]}, "equal-length"),
    ({"layout": ["S.X", "..G"]}, "unknown cell"),
    ({"layout": ["...", "..G"]}, "start"),
    ({"slip": 1.5}, "slip must be"),
    ({"render_mode": "human"}, "render_mode must be"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GridWorld(**kwargs)


def test_bad_action_and_start_state():
    env = GridWorld("maze2x3")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action must be"):
        env.step(7)
    with pytest.raises(ValueError, match="options"):
        env.reset(options={"state": 99})


def test_custom_layout_with_several_starts():
    env = GridWorld(["S.S", "#.G"])
    assert env.start_distribution.tolist() == [0.5, 0, 0.5, 0, 0]
    assert len(env.cells) == 5 and (1, 0) not in env.cells  # the wall is not a state
