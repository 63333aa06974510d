"""returns.py against an independent oracle, on batches with holes, left padding and several episodes a row.

The oracle never runs a recursion: it lists each row's real steps, cuts them into episodes at the
flags, and computes every quantity from its definition as an explicit sum (the module docstring
of ``rlcourse.returns`` states the conventions it follows). Hypothesis draws the batches.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import returns

SETTINGS = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------------------------- the oracle
def episodes_of_row(mask_row, ends_row):
    """Lists of real column indices, one list per episode, in order."""
    episodes, current = [], []
    for t, real in enumerate(mask_row):
        if not real:
            continue
        current.append(t)
        if ends_row[t]:
            episodes.append(current)
            current = []
    if current:
        episodes.append(current)
    return episodes


def oracle(batch, gamma, lam, n=None):
    """Reward-to-go, TD residuals, GAE and n-step returns by their definitions, one episode at a time."""
    r, v, mask = batch["rewards"], batch["values"], batch["mask"]
    term, trunc, nv, lv = batch["terminated"], batch["truncated"], batch["next_values"], batch["last_value"]
    N, T = r.shape
    out = {k: np.zeros((N, T)) for k in ("rtg", "delta", "gae", "nstep")}
    for i in range(N):
        for ep in episodes_of_row(mask[i], term[i] | trunc[i]):
            last = ep[-1]
            # The value after each step of the episode: the next step's value inside it; after the
            # last step 0 for a termination, next_values for a truncation, else the row's end.
            after = []
            for j, t in enumerate(ep):
                if j + 1 < len(ep):
                    after.append(nv[i, t] if nv is not None else v[i, ep[j + 1]])
                elif term[i, last]:
                    after.append(0.0)
                elif trunc[i, last] or nv is not None:
                    after.append(nv[i, t])
                else:
                    after.append(lv[i])
            deltas = [r[i, t] + gamma * after[j] - v[i, t] for j, t in enumerate(ep)]
            for j, t in enumerate(ep):
                rest = range(j, len(ep))
                out["rtg"][i, t] = sum(gamma ** (k - j) * r[i, ep[k]] for k in rest)
                out["delta"][i, t] = deltas[j]
                out["gae"][i, t] = sum((gamma * lam) ** (k - j) * deltas[k] for k in rest)
                if n is not None:
                    steps = min(n, len(ep) - j)
                    out["nstep"][i, t] = (sum(gamma ** k * r[i, ep[j + k]] for k in range(steps))
                                          + gamma ** steps * after[j + steps - 1])
    return out


# ---------------------------------------------------------------------------------- random batches
@st.composite
def batches(draw, with_next_values=None):
    N = draw(st.integers(1, 4))
    T = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    layout = draw(st.sampled_from(["holes", "left", "right", "full"]))
    if layout == "holes":
        mask = rng.random((N, T)) < 0.7
    elif layout in ("left", "right"):
        lengths = rng.integers(0, T + 1, size=N)
        cols = np.arange(T)[None, :]
        mask = cols >= T - lengths[:, None] if layout == "left" else cols < lengths[:, None]
    else:
        mask = np.ones((N, T), dtype=bool)
    terminated = (rng.random((N, T)) < 0.2) & mask
    truncated = (rng.random((N, T)) < 0.15) & mask & ~terminated
    use_nv = draw(st.booleans()) if with_next_values is None else with_next_values
    if not use_nv:
        truncated[:] = False  # a truncation needs next_values (tested separately)
    return {"rewards": rng.normal(size=(N, T)), "values": rng.normal(size=(N, T)), "mask": mask,
            "terminated": terminated, "truncated": truncated,
            "next_values": rng.normal(size=(N, T)) if use_nv else None,
            "last_value": np.zeros(N) if use_nv else rng.normal(size=N)}


def critic_kwargs(b):
    kw = dict(mask=b["mask"], terminated=b["terminated"], truncated=b["truncated"])
    if b["next_values"] is not None:
        kw["next_values"] = b["next_values"]
    else:
        kw["last_value"] = b["last_value"]
    return kw


gammas = st.sampled_from([0.0, 0.5, 0.9, 1.0])
lambdas = st.sampled_from([0.0, 0.3, 0.95, 1.0])


# ---------------------------------------------------------------------------------- against the oracle
@SETTINGS
@given(batches(), gammas, lambdas, st.integers(1, 9))
def test_every_estimator_matches_the_per_episode_oracle(b, gamma, lam, n):
    want = oracle(b, gamma, lam, n)
    kw = critic_kwargs(b)
    r, v = b["rewards"], b["values"]
    np.testing.assert_allclose(returns.gae(r, v, gamma, lam, **kw), want["gae"], atol=1e-10)
    if b["next_values"] is None:  # the n-step identity needs next_values that agree with values
        np.testing.assert_allclose(returns.gae_from_n_step(r, v, gamma, lam, **kw), want["gae"], atol=1e-10)
    np.testing.assert_allclose(returns.td_residuals(r, v, gamma, **kw), want["delta"], atol=1e-10)
    np.testing.assert_allclose(returns.n_step_returns(r, v, gamma, n, **kw), want["nstep"], atol=1e-10)
    ends = b["terminated"] | b["truncated"]
    np.testing.assert_allclose(returns.reward_to_go(r, gamma, dones=ends, mask=b["mask"]), want["rtg"], atol=1e-10)


@SETTINGS
@given(batches(), gammas, lambdas)
def test_masked_steps_hold_anything_and_change_nothing(b, gamma, lam):
    kw = critic_kwargs(b)
    clean = returns.gae(b["rewards"], b["values"], gamma, lam, **kw)
    dirty = {k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in b.items()}
    hole = ~b["mask"]
    for key, junk in (("rewards", np.nan), ("values", np.inf), ("next_values", -np.inf)):
        if dirty[key] is not None:
            dirty[key][hole] = junk
    # flags set on masked steps must not matter either
    dirty["terminated"] = b["terminated"] | hole
    got = returns.gae(dirty["rewards"], dirty["values"], gamma, lam, **critic_kwargs(dirty))
    assert np.array_equal(got, clean)
    assert (got[hole] == 0).all()
    rtg = returns.reward_to_go(dirty["rewards"], gamma, dones=dirty["terminated"], mask=b["mask"])
    assert np.array_equal(rtg, returns.reward_to_go(b["rewards"], gamma, dones=b["terminated"], mask=b["mask"]))


@SETTINGS
@given(batches(with_next_values=False), gammas)
def test_dones_alone_mean_terminations_for_every_function(b, gamma):
    """The issue: gae(dones=...) bootstrapped across episode ends while reward_to_go cut them."""
    r, dones, mask = b["rewards"], b["terminated"], b["mask"]
    zeros = np.zeros_like(r)
    adv = returns.gae(r, zeros, gamma, 1.0, dones=dones, mask=mask)  # V = 0: A = G exactly
    np.testing.assert_allclose(adv, returns.reward_to_go(r, gamma, dones=dones, mask=mask), atol=1e-12)
    np.testing.assert_allclose(returns.n_step_returns(r, zeros, gamma, r.shape[1] + 1, dones=dones, mask=mask),
                               adv, atol=1e-12)


@SETTINGS
@given(batches(with_next_values=True), gammas, lambdas)
def test_dones_with_terminated_make_the_rest_truncations(b, gamma, lam):
    """gymnasium's done = terminated | truncated: the done steps that are not terminated bootstrap."""
    kw = critic_kwargs(b)
    want = returns.gae(b["rewards"], b["values"], gamma, lam, **kw)
    dones = b["terminated"] | b["truncated"]
    got = returns.gae(b["rewards"], b["values"], gamma, lam, mask=b["mask"], next_values=b["next_values"],
                      terminated=b["terminated"], dones=dones)
    np.testing.assert_allclose(got, want, atol=1e-12)


@SETTINGS
@given(batches(), gammas, lambdas)
def test_torch_float32_agrees_with_numpy_and_is_detached(b, gamma, lam):
    kw = critic_kwargs(b)
    want = returns.gae(b["rewards"], b["values"], gamma, lam, **kw)
    tkw = {k: (torch.tensor(x, dtype=torch.float32) if isinstance(x, np.ndarray) else x) for k, x in kw.items()}
    r = torch.tensor(b["rewards"], dtype=torch.float32, requires_grad=True)
    got = returns.gae(r, torch.tensor(b["values"], dtype=torch.float32), gamma, lam, **tkw)
    assert got.dtype == torch.float32 and not got.requires_grad
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4)


def test_the_cases_from_the_issue():
    # A masked prefix used to receive advantages: [1.5, 1.5, 1.5, 0.5] for mask [0, 0, 1, 1].
    r = np.array([[0.0, 0.0, 1.0, 0.5]])
    got = returns.gae(r, np.zeros_like(r), 1.0, 1.0, mask=[[0, 0, 1, 1]])
    np.testing.assert_array_equal(got, [[0.0, 0.0, 1.5, 0.5]])
    # A hole in the middle of a row is skipped: the return flows across it.
    got = returns.reward_to_go([[1.0, 99.0, 1.0]], 0.5, mask=[[1, 0, 1]])
    np.testing.assert_array_equal(got, [[1.5, 0.0, 1.0]])
    # nan and inf in masked slots
    got = returns.reward_to_go(np.array([[1.0, 2.0, np.inf]]), 1.0, mask=[[1, 1, 0]])
    np.testing.assert_array_equal(got, [[3.0, 2.0, 0.0]])
    assert returns.episode_returns(np.array([[np.nan, 1.0, 2.0]]), 1.0, mask=[[0, 1, 1]])[0] == 3.0


def test_whiten_equal_values_is_exactly_zero_in_every_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.full((16,), 0.3, dtype=dtype)
        assert (returns.whiten(x) == 0).all(), dtype
        # without centring there is no scale to remove: unchanged, never divided by eps (was ~5e8)
        assert torch.equal(returns.whiten(x, shift_mean=False), x), dtype
    x = torch.tensor([0.3] * 5 + [float("nan")])
    assert (returns.whiten(x, mask=torch.tensor([1] * 5 + [0])) == 0).all()


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_whiten_matches_a_loop_over_the_real_entries(seed, shift):
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 2.0, size=(3, 5))
    mask = rng.random((3, 5)) < 0.6
    mask[0, 0] = True
    real = [x[i, t] for i in range(3) for t in range(5) if mask[i, t]]
    mean = sum(real) / len(real)
    std = math.sqrt(sum((a - mean) ** 2 for a in real) / len(real))
    dirty = np.where(mask, x, np.nan)
    got = returns.whiten(dirty, mask=mask, shift_mean=shift)
    for i in range(3):
        for t in range(5):
            want = ((x[i, t] - (mean if shift else 0.0)) / (std + 1e-8) if std > 1e-8 else
                    x[i, t] - (mean if shift else 0.0)) if mask[i, t] else 0.0
            assert got[i, t] == pytest.approx(want, abs=1e-9)


def test_discount_weights_count_real_steps_since_the_episode_began():
    w = returns.discount_weights(np.array([[0, 0, 1, 1, 0, 1, 1]]), 0.5, dones=[[0, 0, 0, 1, 0, 0, 1]])
    np.testing.assert_allclose(w, [[0, 0, 1, 0.5, 0, 1, 0.5]])
    w = returns.discount_weights(torch.tensor([[1, 0, 1, 1]]), 0.5)
    assert w.dtype == torch.get_default_dtype()
    np.testing.assert_allclose(w.numpy(), [[1, 0, 0.5, 0.25]])


def test_empty_time_axis_is_a_clear_result():
    empty = np.zeros((2, 0))
    assert returns.reward_to_go(empty, 0.9).shape == (2, 0)
    assert returns.gae(empty, empty, 0.9, 0.95).shape == (2, 0)
    np.testing.assert_array_equal(returns.episode_returns(empty, 0.9), [0.0, 0.0])
