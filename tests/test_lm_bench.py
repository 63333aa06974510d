"""The LM benchmarks run end to end and report their numbers (speed itself is never asserted)."""
import rlcourse  # noqa: F401  (before torch)
import re

import pytest

from rlcourse.bench import rl_smoke, sampling


def test_sampling_benchmark_reports_three_rates_and_the_logprob_check(capsys):
    code = sampling.main(["--repeats", "1", "--batch", "8", "--new", "4", "--threads", "1"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert len(re.findall(r"tokens/s", out)) == 3
    diff = float(re.search(r"max \|diff\| ([0-9.e+-]+)", out).group(1))
    assert diff <= 1e-5


def test_rl_smoke_reports_before_after_and_time(capsys):
    code = rl_smoke.main(["--steps", "2", "--batch", "16", "--threads", "1"])
    out = capsys.readouterr().out
    before = float(re.search(r"before ([0-9.]+)%", out).group(1))
    assert 20 <= before <= 60                                 # the shipped partial checkpoint
    assert "REINFORCE: 2 steps x 16 samples" in out
    assert code == 1                                          # two steps cannot reach +20 points


def test_rl_smoke_digitsum_reports_validity_and_diversity(capsys):
    code = rl_smoke.main(["--task", "digitsum", "--steps", "1", "--batch", "16", "--threads", "1"])
    out = capsys.readouterr().out
    assert "valid, sampled at T=1" in out and "distinct valid / prompt" in out
    sampled_before = float(re.search(r"sampled at T=1\s+before ([0-9.]+)%", out).group(1))
    assert 10 <= sampled_before <= 55                         # imitation stays under its teachers
    assert code == 1


def test_openmp_wait_times_each_setting_alone_and_in_pairs(capsys):
    from rlcourse.bench import openmp_wait

    assert openmp_wait.main(["--spins", "0", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"0 \(PASSIVE\) \|\s+[\d.]+ \| [\d.]+ and [\d.]+", out), out


def test_openmp_wait_rejects_a_bad_spin_count(capsys):
    from rlcourse.bench import openmp_wait

    with pytest.raises(SystemExit):
        openmp_wait.main(["--spins", "fast"])
    assert "--spins must be comma-separated integers >= 0 or 'default'" in capsys.readouterr().err


def test_dpo_vs_trl_reports_both_trainers(capsys):
    from rlcourse.bench import dpo_vs_trl

    assert dpo_vs_trl.main(["--pairs", "32", "--steps", "2", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    for name in ("rlcourse", "TRL 1.16"):
        assert re.search(rf"{name}\s+[\d.]+\s+0\.6931\s+[\d.]+\s+\d+\s+-?\d+", out), out   # both start at log 2
    assert re.search(r"speed ratio rlcourse / TRL: [\d.]+x", out), out


def test_a_failing_worker_reports_its_error():
    import sys

    from rlcourse.bench._workers import run_worker

    with pytest.raises(RuntimeError, match="exit 3"):
        run_worker([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], {})
