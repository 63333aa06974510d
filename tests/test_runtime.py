import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlcourse import runtime


def test_profile_from_environment_and_override(monkeypatch):
    monkeypatch.setenv("RLCOURSE_PROFILE", "demo")
    assert runtime.profile() == "demo"
    assert runtime.by_profile(ci=1, laptop=2, demo=3) == 3
    runtime.set_profile("ci")
    try:
        assert runtime.by_profile(ci=1, laptop=2) == 1
    finally:
        runtime.set_profile(None)
    monkeypatch.setenv("RLCOURSE_PROFILE", "")
    assert runtime.profile() == "laptop"
    monkeypatch.setenv("RLCOURSE_PROFILE", "demo")
    assert runtime.by_profile(ci=1, laptop=2) == 2  # demo falls back to laptop


def test_bad_profile_is_named(monkeypatch):
    monkeypatch.setenv("RLCOURSE_PROFILE", "huge")
    with pytest.raises(ValueError, match="RLCOURSE_PROFILE='huge'"):
        runtime.profile()
    with pytest.raises(ValueError, match="profile must be one of"):
        runtime.set_profile("huge")


def test_seeding_makes_numpy_and_torch_repeatable():
    runtime.seed_everything(7)
    a = (np.random.rand(3), torch.rand(3))
    rng = runtime.seed_everything(7)
    b = (np.random.rand(3), torch.rand(3))
    assert np.array_equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert isinstance(rng, np.random.Generator)
    with pytest.raises(ValueError, match="seed"):
        runtime.seed_everything(-1)


def test_device_and_threads(monkeypatch):
    monkeypatch.setenv("RLCOURSE_DEVICE", "cpu")
    assert runtime.device() == torch.device("cpu")
    before = torch.get_num_threads()
    try:
        assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        runtime.set_threads(0)


HF_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def test_importing_rlcourse_sets_the_openmp_wait_and_nothing_else():
    """The OpenMP waiting defaults are set before torch; the user's Hugging Face settings are left alone."""
    # gymnasium (imported to register the gridworld) sets PYGAME_HIDE_SUPPORT_PROMPT itself
    ignored = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PYGAME_HIDE_SUPPORT_PROMPT") + HF_VARIABLES
    env = {k: v for k, v in os.environ.items() if k not in ignored}
    code = ("import sys, os, json; before = dict(os.environ); import rlcourse; "
            "assert 'torch' not in sys.modules; "
            "print(json.dumps({k: os.environ[k] for k in os.environ if os.environ.get(k) != before.get(k) "
            "and k != 'PYGAME_HIDE_SUPPORT_PROMPT'}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}


def test_a_users_openmp_setting_wins():
    """A variable the user set before importing rlcourse is left as it is."""
    env = {**os.environ, "GOMP_SPINCOUNT": "0"}
    code = "import os, rlcourse; print(os.environ['GOMP_SPINCOUNT'], os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "PASSIVE"]


def test_checkpoints_load_without_offline_variables_or_network():
    """Without HF_HUB_OFFLINE and with an unreachable Hub, a shipped checkpoint still loads (no request)."""
    env = {k: v for k, v in os.environ.items() if k not in HF_VARIABLES}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"      # the discard port: any request would fail
    code = ("import rlcourse, os; from rlcourse.lm import load_checkpoint; "
            "m, t = load_checkpoint('addition', device='cpu'); "
            "print(type(m).__name__, len(t), os.environ.get('HF_HUB_OFFLINE'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.split() == ["GPT2LMHeadModel", "81", "None"]


def test_command_line_info():
    out = subprocess.run([sys.executable, "-m", "rlcourse", "info"], capture_output=True, text=True, check=True)
    assert "profile=" in out.stdout and "device=" in out.stdout
