"""The capstone engine: run()'s curve, the comparisons read from it, bad input."""
import math

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
from rlcourse.measure.capstone import (ALGORITHMS, MODELS_HELD, CapstoneConfig, curve_band, evaluate_start, paired_difference,
                               run, start_results, summary)
from rlcourse.stats import intervals_separate, t_interval


def test_run_returns_a_well_formed_curve_and_compare_helpers_read_it():
    cfg = CapstoneConfig(budget=192, eval_points=2, final_samples_per_target=8, pass_k=(1, 4, 8, 16))
    results = [run(a, s, cfg) for a in ("RLOO", "DPO") for s in (0, 1)]
    for r in results:
        curve = r["curve"]
        assert curve[0]["samples"] == 0 and curve[0]["seconds"] == 0.0 and curve[0]["kl"] == pytest.approx(0, abs=1e-6)
        assert curve[-1]["samples"] == cfg.budget
        assert all(b["samples"] > a["samples"] and b["seconds"] > a["seconds"] for a, b in zip(curve, curve[1:]))
        for point in curve:
            n = point["samples_per_target"]
            assert 0.0 <= point["validity"] <= 1.0 and 0.0 <= point["distinct"] <= n
            assert np.isfinite(point["kl"]) and 0.0 < point["distinct_among_valid"] <= 1.0
            # pass@1 is the validity of the same samples; pass@k grows with k, for every k <= n
            passes = [point[f"pass@{k}"] for k in cfg.pass_k if k <= n]
            assert passes[0] == pytest.approx(point["validity"]) and passes == sorted(passes)
            assert [k for k in cfg.pass_k if f"pass@{k}" in point] == [k for k in cfg.pass_k if k <= n]
        # the first and last evaluations draw more samples per target than the ones along the way
        assert [p["samples_per_target"] for p in curve] == (
            [8, 4, 8] if r["algorithm"] == "RLOO" else [8, 8])
        assert r["models_held"] == MODELS_HELD[r["algorithm"]] and r["parameters"] > 0
        assert r["completions_per_second"] > 0
    assert [len(r["curve"]) for r in results] == [3, 3, 2, 2]  # DPO is offline: start and end only
    # the same seed evaluates the same starting model identically
    assert results[0]["curve"][0] == results[2]["curve"][0]
    x, mean, half = curve_band(results, "RLOO")
    assert list(x) == [0, 128, 192]  # 128: the first batch that reaches half the budget
    assert len(mean) == len(half) == 3 and (half >= 0).all()
    rows = summary(results)
    assert [row["algorithm"] for row in rows] == ["RLOO", "DPO"] and rows[0]["seeds"] == 2
    assert rows[0]["validity"] == pytest.approx(t_interval([r["curve"][-1]["validity"] for r in results[:2]]))
    assert rows[0]["pass@8"] == pytest.approx(t_interval([r["curve"][-1]["pass@8"] for r in results[:2]]))
    assert "pass@16" not in rows[0]            # more than the 8 samples per target: not reported
    # the checkpoint as a pseudo-method: one start per seed, compared seed by seed
    starts = start_results(results)
    assert [(r["algorithm"], r["seed"]) for r in starts] == [("SFT", 0), ("SFT", 1)]
    assert starts[1]["curve"] == [results[1]["curve"][0]]
    d = [results[i]["curve"][-1]["validity"] - results[i]["curve"][0]["validity"] for i in (0, 1)]
    assert paired_difference(results + starts, "RLOO", "SFT") == pytest.approx(t_interval(d))
    assert summary(starts)[0]["kl"] == pytest.approx((0.0, 0.0), abs=1e-6)
    # a start evaluated once and handed to run() is the start run() makes itself; training is unchanged
    shared = run("RLOO", 1, cfg, start=evaluate_start(1, cfg))
    assert shared["curve"][0] == {"samples": 0, "seconds": 0.0, **evaluate_start(1, cfg)} == results[1]["curve"][0]
    assert [p["validity"] for p in shared["curve"]] == [p["validity"] for p in results[1]["curve"]]


def test_a_step_that_passes_two_marks_consumes_both():
    """budget 128 in 4 marks (32, 64, 96, 128) and 64 completions per step: each step passes two marks. Every
    mark gets its row (one evaluation per step, shared by the marks it passed), and the last row is the final
    evaluation, with final_samples_per_target; alone and seed-batched."""
    from rlcourse.measure.capstone import run_seeds

    cfg = CapstoneConfig(budget=128, eval_points=4, eval_samples_per_target=4, final_samples_per_target=8,
                         pass_k=(1, 4, 8))
    alone = run("RLOO", 0, cfg)["curve"]
    together = run_seeds("RLOO", [0, 1], cfg)
    for curve in (alone, *(r["curve"] for r in together)):
        assert [p["samples"] for p in curve] == [0, 64, 64, 128, 128]
        assert [p["samples_per_target"] for p in curve] == [8, 4, 4, 8, 8]
        assert curve[1] == curve[2] and curve[3] == curve[4] and "pass@8" in curve[-1]
    assert [p["validity"] for p in together[0]["curve"]] == pytest.approx([p["validity"] for p in alone], abs=0.02)


def test_bad_algorithm_or_budget_raises_naming_the_argument():
    with pytest.raises(ValueError, match="algorithm"):
        run("TRPO", 0, CapstoneConfig(budget=64))
    with pytest.raises(ValueError, match="budget"):
        run("RLOO", 0, CapstoneConfig(budget=32))
    with pytest.raises(ValueError, match="at least 2 seeds"):
        curve_band([], "RLOO")
    assert set(ALGORITHMS) == set(MODELS_HELD)


def test_run_seeds_gives_each_seed_the_run_of_that_seed_alone():
    """The seed-batched capstone run equals run() seed by seed (the same draws; evaluations agree)."""
    from rlcourse.measure.capstone import SEED_BATCHED, run_seeds

    assert "DAPO" not in SEED_BATCHED and "RFT" not in SEED_BATCHED
    assert {"REINFORCE", "GSPO", "PPO", "DPO", "Online DPO"} <= set(SEED_BATCHED)
    cfg = CapstoneConfig(budget=192, eval_points=2)
    for algorithm in ("REINFORCE", "GSPO", "PPO", "DPO", "Online DPO"):
        together = run_seeds(algorithm, [3, 1], cfg)
        for r, seed in zip(together, (3, 1)):
            alone = run(algorithm, seed, cfg)
            assert r["seed"] == seed and r["seeds_batched"] == 2 and r["algorithm"] == algorithm
            assert [p["samples"] for p in r["curve"]] == [p["samples"] for p in alone["curve"]]
            for a, b in zip(r["curve"], alone["curve"]):
                assert a["validity"] == pytest.approx(b["validity"], abs=0.02)
    with pytest.raises(ValueError, match="SEED_BATCHED"):
        run_seeds("RFT", [0, 1], cfg)


def test_paired_difference_is_the_t_interval_of_seedwise_differences():
    from rlcourse.measure.capstone import paired_difference

    def result(algorithm, seed, v):
        return {"algorithm": algorithm, "seed": seed, "curve": [{"validity": 0.0}, {"validity": v}]}

    a = [0.6, 0.7, 0.65, 0.8]
    b = [0.5, 0.66, 0.6, 0.7]
    results = [result("A", s, v) for s, v in enumerate(a)] + [result("B", s, v) for s, v in enumerate(b)]
    results.append(result("B", 9, 0.1))                         # a seed A never ran: not paired
    mean, half = paired_difference(results, "A", "B")
    d = np.subtract(a, b)
    assert mean == pytest.approx(d.mean())
    assert half == pytest.approx(3.182 * d.std(ddof=1) / 2)
    # the separate intervals overlap where the paired one excludes 0: the shared part of each seed cancels
    assert not intervals_separate(t_interval(a), t_interval(b)) and abs(mean) > half
    with pytest.raises(ValueError, match="shared seeds"):
        paired_difference(results[:1] + results[4:5], "A", "B")


def test_every_clipped_method_takes_updates_per_batch_updates_and_the_clip_acts_only_from_the_second():
    """updates_per_batch reaches num_iterations of every critic-free method and PPO's epochs; at one update the
    ratio is 1 when the gradient is taken, so no token is ever clipped; at two, some are."""
    from rlcourse.measure.capstone import CLIPPED, _pg_config, _ppo_config, run_seeds
    from rlcourse.tasks import DigitSumTask

    assert set(CLIPPED) == {"REINFORCE", "RLOO", "GRPO", "Dr. GRPO", "DAPO", "GSPO", "PPO"}
    for k in (1, 3):
        cfg = CapstoneConfig(updates_per_batch=k)
        assert all(_pg_config(a, cfg, 0).num_iterations == k for a in CLIPPED if a != "PPO")
        assert _ppo_config(cfg, DigitSumTask(), 0).num_ppo_epochs == k
    assert CapstoneConfig().updates_per_batch == 2
    one = run("GRPO", 2, CapstoneConfig(budget=128, eval_points=1, updates_per_batch=1))
    assert one["clip_fraction"] == 0.0
    two = run_seeds("GSPO", [2, 0], CapstoneConfig(budget=128, eval_points=1, updates_per_batch=2))
    assert all(r["clip_fraction"] > 0 for r in two)      # GSPO's sequence clip (3e-4) acts at the second pass
    assert "clip_fraction" not in run("RFT", 0, CapstoneConfig(budget=64, eval_points=1))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="updates_per_batch"):
            run("GRPO", 0, CapstoneConfig(budget=64, updates_per_batch=bad))


def test_all_pairs_matches_paired_difference_and_holm_resolves_no_more():
    from rlcourse.measure.capstone import all_pairs
    from rlcourse.stats import holm, t_test_p_value

    rng = np.random.default_rng(4)
    shift = {"A": 0.0, "B": 0.02, "C": 0.3, "D": 0.31}
    seed_effect = rng.normal(0, 0.2, 6)          # what a seed's runs share: cancels in each pair
    results = [{"algorithm": a, "seed": s, "curve": [{"validity": 0.5 + mu + seed_effect[s] + rng.normal(0, 0.03)}]}
               for a, mu in shift.items() for s in range(6)]
    rows = all_pairs(results, list(shift))
    assert [(r["a"], r["b"]) for r in rows] == [("A", "B"), ("A", "C"), ("A", "D"), ("B", "C"), ("B", "D"), ("C", "D")]
    for r in rows:
        assert (r["mean"], r["half"]) == pytest.approx(paired_difference(results, r["a"], r["b"]))
        assert r["resolved"] == (abs(r["mean"]) > r["half"]) == (r["p"] < 0.05)
        assert r["p_holm"] >= r["p"] and (not r["resolved_holm"] or r["resolved"])
    final = {(r["algorithm"], r["seed"]): r["curve"][-1]["validity"] for r in results}
    p = [t_test_p_value([final[(r["a"], s)] - final[(r["b"], s)] for s in range(6)]) for r in rows]
    assert [r["p_holm"] for r in rows] == pytest.approx(holm(p)[0])
    # the four far pairs resolve with and without the correction; the two near ties do not after it
    assert {(r["a"], r["b"]) for r in rows if r["resolved_holm"]} == {("A", "C"), ("A", "D"), ("B", "C"), ("B", "D")}


def test_cell_coverage_is_measured_before_and_after_training_only():
    """pass@k by (target, first digit) from a separate draw: in the first and last rows, absent along the way,
    and it leaves the other metrics' samples alone."""
    cfg = CapstoneConfig(budget=128, eval_points=2, final_samples_per_target=4, pass_k=(1, 4),
                         cell_samples_per_target=16, cell_pass_k=(1, 4, 16, 64))
    curve = run("RLOO", 0, cfg)["curve"]
    plain = run("RLOO", 0, CapstoneConfig(budget=128, eval_points=2, final_samples_per_target=4, pass_k=(1, 4)))["curve"]
    for row in (curve[0], curve[-1]):
        cells = [row[f"cell_pass@{k}"] for k in (1, 4, 16)]
        assert "cell_pass@64" not in row and cells == sorted(cells) and 0.0 < cells[0] < cells[-1] <= 1.0
    assert not any(key.startswith("cell_") for key in curve[1])
    for row, other in zip(curve, plain):
        assert {k: v for k, v in row.items() if not k.startswith("cell_") and k != "seconds"} == \
               {k: v for k, v in other.items() if k != "seconds"}
