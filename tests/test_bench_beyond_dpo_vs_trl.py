"""beyond-dpo-vs-trl runs our SimPO, ORPO and KTO steps and TRL's trainers end to end (speed is never asserted)."""
import re

from rlcourse.bench import beyond_dpo_vs_trl


def test_beyond_dpo_vs_trl_reports_both_trainers_for_each_loss(capsys):
    assert beyond_dpo_vs_trl.main(["--pairs", "16", "--steps", "2", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    for loss, trl in (("simpo", "TRL CPOTrainer \\(simpo\\)"), ("orpo", "TRL ORPOTrainer"), ("kto", "TRL KTOTrainer")):
        for name in ("rlcourse train_dpo", trl):
            assert re.search(rf"{loss}\s+{name}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+", out), out
        assert re.search(rf"{loss} speed ratio rlcourse / TRL: [\d.]+x", out), out
