"""grpo-vs-trl runs both trainers end to end and reports their numbers (speed is never asserted)."""
import re

from rlcourse.bench import grpo_vs_trl


def test_grpo_vs_trl_reports_both_trainers(capsys):
    assert grpo_vs_trl.main(["--steps", "1", "--batch", "8", "--num-generations", "4", "--repeats", "1", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("ours", "trl"):
        assert re.search(rf"{name}\s+[\d.]+ completions/s .* held-out exact match [\d.]+% -> [\d.]+% "
                         rf"\(mean of 2 seeds, std [\d.]+ points\) \| peak memory \d+ MB",
                         out), out
    assert "speed ratio ours/TRL" in out
    assert "seeds 0-1" in out and "standard error over 2 seeds" in out, out
