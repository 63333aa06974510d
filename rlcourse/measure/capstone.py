"""The capstone: every language-model algorithm of the course on one task, one model, one sample budget.

Task: :class:`~rlcourse.tasks.arithmetic.DigitSumTask` ("S=07:" -> four digits summing to 7) from the
``digitsum-sft`` checkpoint, a model that imitated demonstrations of which half were wrong. Many
answers are right, so besides how often an algorithm answers validly we can ask how *varied* its
valid answers stay. Every algorithm gets the same number of sampled completions (``budget``):

* the critic-free family through :class:`~rlcourse.trainers.policy_gradient.PolicyGradientTrainer`:
  REINFORCE (moving-average baseline), RLOO, GRPO, Dr. GRPO, DAPO (clip-higher + token mean +
  dynamic sampling, whose extra generation batches count against the budget) and GSPO
  (sequence-level ratio);
* PPO with a learned critic (:class:`~rlcourse.trainers.ppo_rlhf.PPORLHFTrainer`), scored by the same
  verifier instead of a learned reward model: the RLHF machinery with a perfect reward;
* DPO (+ an NLL term, RPO) on pairs built from the SFT model's own samples (valid = chosen, invalid
  = rejected): offline, so the whole budget is spent up front;
* online DPO (:class:`~rlcourse.trainers.online_dpo.OnlineDPOTrainer`, the same loss): each step samples
  two answers to each of 32 prompts from the current policy (TRL's ``OnlineDPOTrainer`` samples
  two), pairs the valid answer with the invalid one where exactly one is valid, and takes one step
  on those pairs;
* RFT, rejection-sampling fine-tuning (best-of-n as a training method, a.k.a. expert iteration):
  sample, keep the valid answers, fine-tune on them, repeat.

Every method with a clipped importance ratio (the critic-free family and PPO) takes the same number of
optimiser updates per batch, ``updates_per_batch`` (``num_iterations``; PPO's ``num_ppo_epochs``). At one
update the ratio is exactly 1 when the gradient is taken, so the clip (and DAPO's ``epsilon_high``,
GSPO's sequence clip) never acts: a comparison in which some clipped methods take two passes and
others one compares the number of passes as much as the methods.

:func:`run` trains one (algorithm, seed) and evaluates along the way; :func:`run_seeds` trains
several seeds of one method together (:mod:`rlcourse.trainers.policy_gradient_seeds`,
:mod:`rlcourse.trainers.ppo_rlhf_seeds`, :mod:`rlcourse.trainers.dpo_seeds`); :func:`compare`
runs them all and :func:`summary` gives the table: mean and a 95% t-interval over seeds for each
metric. :func:`paired_difference` compares two methods seed by seed, :func:`all_pairs` every pair
with and without Holm's correction for comparing many pairs at once, and :func:`start_results`
lets them compare a method with the checkpoint it started from.

Each evaluation samples every target of the task several times at temperature 1 and reports
validity (pass@1), the KL to the checkpoint, pass@k and the share of distinct answers among the
valid ones (:mod:`rlcourse.measure.coverage`). The evaluations before and after training draw more
samples per target (``final_samples_per_target``) than the ones along the way: the final numbers
are the ones compared, and their sampling noise is most of the spread between seeds.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from rlcourse.tasks import DigitSumTask
from rlcourse.lm import load_checkpoint, sample
from rlcourse.measure.coverage import coverage, pass_at_k_by_cell
from rlcourse.trainers.dpo import DPOConfig, reward_and_kl, train_dpo
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.trainers.sft import train_sft
from rlcourse.returns import check_integer
from rlcourse.runtime import seed_everything
from rlcourse.stats import t_interval

__all__ = ["ALGORITHMS", "CLIPPED", "MODELS_HELD", "SEED_BATCHED", "CapstoneConfig", "run", "run_seeds", "compare",
           "evaluate_start", "summary", "paired_difference", "all_pairs", "start_results", "curve_band"]

# name -> PolicyGradientConfig overrides (None: a trainer of its own)
_PG = {
    "REINFORCE": dict(advantage_estimator="moving_average", loss_type="dr_grpo", num_generations=1),
    "RLOO": dict(advantage_estimator="rloo", loss_type="dr_grpo"),
    "GRPO": dict(advantage_estimator="grpo", loss_type="grpo"),
    "Dr. GRPO": dict(advantage_estimator="grpo", loss_type="dr_grpo", scale_rewards="none"),
    "DAPO": dict(advantage_estimator="grpo", loss_type="dapo", epsilon_high=0.28, dynamic_sampling=True),
    "GSPO": dict(advantage_estimator="grpo", loss_type="grpo", importance_sampling_level="sequence",
                 epsilon=3e-4, epsilon_high=4e-4),
}
ALGORITHMS = (*_PG, "PPO", "DPO", "Online DPO", "RFT")
# Trained several seeds at a time by compare(): the critic-free methods but DAPO, whose dynamic sampling
# draws a different number of batches per seed, PPO and DPO. RFT runs one seed at a time: each seed
# keeps a different number of answers per step, so its fine-tuning batches are ragged across seeds.
SEED_BATCHED = (*(name for name, settings in _PG.items() if not settings.get("dynamic_sampling")), "PPO", "DPO",
                "Online DPO")
# Methods whose loss clips an importance ratio: they take cfg.updates_per_batch updates on each batch.
CLIPPED = (*_PG, "PPO")
# Models a run holds in memory while training (policy, reference, critic...).
MODELS_HELD = {**{name: 1 for name in _PG}, "PPO": 3, "DPO": 2, "Online DPO": 2, "RFT": 1}


@dataclass
class CapstoneConfig:
    """One budget for everyone. ``budget`` counts sampled completions; evaluation samples are extra."""

    budget: int = 8192
    batch: int = 64                 # completions per step (8 prompts x 8 generations)
    learning_rate: float = 6e-4
    updates_per_batch: int = 2      # optimiser updates on each batch for every method of CLIPPED
    eval_points: int = 4            # evaluations along the way (plus one before training)
    eval_samples_per_target: int = 4    # samples per target at the evaluations along the way
    final_samples_per_target: int = 4   # ... before training and after the budget (lesson 12: 16, ci 8)
    pass_k: tuple = (1, 4, 16)      # pass@k reported for each k <= the samples per target
    cell_samples_per_target: int = 0    # before and after training, a separate draw for pass@k by cell (0: none)
    cell_pass_k: tuple = (1, 4, 16, 64)  # pass@k by (target, first digit) for each k <= cell_samples_per_target
    checkpoint: str = "digitsum-sft"


def _evaluate(model, ref, tokenizer, task, cfg: CapstoneConfig, seed: int, final: bool = False) -> dict:
    """Sampled validity, KL(pi || pi_ref) along the samples, distinct valid answers per target, and the
    coverage of :func:`rlcourse.measure.coverage.coverage` (pass@k, distinct among valid) of the same samples.

    ``final`` (before training and after the budget) draws ``final_samples_per_target`` per target.
    """
    n = cfg.final_samples_per_target if final else cfg.eval_samples_per_target
    prompts = task.test_prompts() * n
    gen = torch.Generator(next(model.parameters()).device).manual_seed(10_000 + seed)
    validity, kl = reward_and_kl(model, ref, tokenizer, task, prompts, generator=gen)
    gen.manual_seed(10_000 + seed)       # the same completions again, to look at them
    roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=gen)
    valid = [task.is_valid(p, c) for p, c in zip(prompts, roll.completions)]
    cover = coverage(prompts, roll.completions, valid, ks=[k for k in cfg.pass_k if k <= n])
    cover.pop("valid_answers")
    if final and cfg.cell_samples_per_target:
        cover.update(_cell_coverage(model, tokenizer, task, cfg, seed))
    return {"validity": validity, "kl": kl, "distinct": task.distinct_valid(prompts, roll.completions),
            "samples_per_target": n, **cover}


def _cell_coverage(model, tokenizer, task, cfg: CapstoneConfig, seed: int) -> dict:
    """``cell_pass@k``: pass@k by (target, first digit) from ``cell_samples_per_target`` fresh samples per target.

    A (target, d) problem is solved by a sample that is valid and begins with d; every digit that can
    begin a right answer is a problem (:func:`rlcourse.measure.coverage.pass_at_k_by_cell`). Its own
    generator, so the other metrics' samples are those drawn without it.
    """
    n = cfg.cell_samples_per_target
    prompts = task.test_prompts() * n
    gen = torch.Generator(next(model.parameters()).device).manual_seed(20_000 + seed)
    roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=gen)
    valid = [task.is_valid(p, c) for p, c in zip(prompts, roll.completions)]
    cells = {p: task.first_digits(p) for p in set(prompts)}
    out = pass_at_k_by_cell(prompts, roll.completions, valid, cells, lambda c: c[:1],
                            ks=[k for k in cfg.cell_pass_k if k <= n])
    return {f"cell_{key}": value for key, value in out.items() if key != "cells"}


def _pg_config(name, cfg, seed) -> PolicyGradientConfig:
    settings = {"learning_rate": cfg.learning_rate, "per_device_train_batch_size": cfg.batch,
                "num_generations": 8, "seed": seed, "num_iterations": cfg.updates_per_batch, **_PG[name]}
    return PolicyGradientConfig(**settings)


def _pg_trainer(name, model, tokenizer, task, cfg, seed):
    trainer = PolicyGradientTrainer(model, tokenizer, task, _pg_config(name, cfg, seed))

    def step():  # dynamic sampling (DAPO) may draw several generation batches per step: count every one of them
        return cfg.batch * int(trainer.step()["num_gen_batches"])
    step.history = trainer.history
    return step


def _clip_fraction(history: list[dict]) -> float:
    """The share of tokens whose clipped branch was active at the last update of each step, averaged over the
    steps that trained (TRL's ``clip_ratio/low_mean + clip_ratio/high_mean``). Exactly 0 at one update per batch."""
    rows = [m for m in history if not m.get("skipped")]
    return float(np.mean([m["clip_ratio/low_mean"] + m["clip_ratio/high_mean"] for m in rows])) if rows else 0.0


def _ppo_config(cfg, task, seed):
    from rlcourse.trainers.ppo_rlhf import PPOConfig

    return PPOConfig(learning_rate=cfg.learning_rate, batch_size=cfg.batch, num_ppo_epochs=cfg.updates_per_batch,
                     response_length=task.max_new_tokens, kl_coef=0.0, seed=seed)


def _ppo_trainer(model, tokenizer, task, cfg, seed):
    from rlcourse.trainers.ppo_rlhf import PPORLHFTrainer
    from rlcourse.lm.value_model import make_value_model

    trainer = PPORLHFTrainer(_ppo_config(cfg, task, seed), model, tokenizer, task.reward,
                             make_value_model("policy", policy=model), prompt_fn=task.prompts)
    return lambda: trainer.train(1, progress=False) and cfg.batch


def _online_step(model, tokenizer, task, cfg, seed):
    trainer = _online_dpo_trainer(model, tokenizer, task, cfg, [seed], stacked=False)
    return lambda: trainer.step() and cfg.batch


def _rft_trainer(model, tokenizer, task, cfg, seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)

    def step():
        prompts = task.prompts(cfg.batch, rng)
        roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=gen)
        kept = [{"prompt": p, "completion": c} for p, c, r in
                zip(prompts, roll.completions, task.reward(prompts, roll.completions)) if r > 0]
        if kept:  # a few SFT steps on the model's own valid answers
            train_sft(model, tokenizer, kept, steps=1, lr=cfg.learning_rate, batch_size=len(kept),
                      warmup=0, weight_decay=0.0, seed=int(rng.integers(2**31)), progress=False)
        return cfg.batch
    return step


def _dpo_config(cfg: CapstoneConfig, seed: int) -> DPOConfig:
    return DPOConfig(beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0], seed=seed,
                     learning_rate=cfg.learning_rate, per_device_train_batch_size=32,
                     num_train_epochs=2, lr_scheduler_type="constant", precompute_ref_log_probs=True)


def _online_dpo_trainer(model, tokenizer, task, cfg: CapstoneConfig, seeds: list[int], stacked: bool):
    """Online DPO with the offline DPO's loss (RPO) and rate: one batch of ``cfg.batch`` completions per step,
    2 per prompt, labelled by the verifier. ``stacked``: the runs of ``seeds`` in one seed-stacked model
    (``model`` left as it is); else one run of ``seeds[0]`` that trains ``model`` in place."""
    from rlcourse.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    dpo = _dpo_config(cfg, seeds[0])
    args = OnlineDPOConfig(beta=dpo.beta, loss_type=dpo.loss_type, loss_weights=dpo.loss_weights, seed=seeds[0],
                           learning_rate=cfg.learning_rate, lr_scheduler_type="constant", num_generations=2,
                           per_device_train_batch_size=cfg.batch // 2, max_steps=math.ceil(cfg.budget / cfg.batch))
    return OnlineDPOTrainer(model, tokenizer, task.reward, task.prompts, args, seeds=seeds if stacked else None)


def _dpo_pairs(model, tokenizer, task, n_samples: int, seed: int) -> list[dict]:
    """Sample ``n_samples`` completions from the SFT model, 8 per prompt; pair valid with invalid ones."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    prompts = [p for p in task.prompts(n_samples // 8, rng) for _ in range(8)]
    roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=gen)
    rewards = task.reward(prompts, roll.completions).tolist()
    pairs = []
    for g in range(0, len(prompts), 8):
        good = [roll.completions[i] for i in range(g, g + 8) if rewards[i] > 0]
        bad = [roll.completions[i] for i in range(g, g + 8) if rewards[i] <= 0]
        pairs += [{"prompt": prompts[g], "chosen": c, "rejected": r} for c, r in zip(good, bad)]
    return pairs


def _result(algorithm: str, seed: int, curve: list[dict], model, completions_per_second: float, **extra) -> dict:
    """One run's result as :func:`run` returns it."""
    return {"algorithm": algorithm, "seed": seed, "curve": curve, "models_held": MODELS_HELD[algorithm],
            "parameters": sum(p.numel() for p in model.parameters()),
            "completions_per_second": completions_per_second, **extra}


def _checked(algorithm: str, cfg: CapstoneConfig | None) -> CapstoneConfig:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    cfg = cfg or CapstoneConfig()
    if cfg.budget < cfg.batch:
        raise ValueError(f"budget ({cfg.budget}) must be at least one batch ({cfg.batch})")
    check_integer("updates_per_batch", cfg.updates_per_batch)
    return cfg


def _marks(cfg: CapstoneConfig) -> list[int]:
    """The sample counts after which a run evaluates: ``eval_points`` of them, evenly spaced, the last the budget."""
    return [round(cfg.budget * (k + 1) / cfg.eval_points) for k in range(cfg.eval_points)]


def _pop_passed(marks: list[int], samples: int) -> int:
    """Remove from ``marks`` every mark ``samples`` has reached; return how many (a step that draws several
    batches, DAPO's, or a budget of few batches per mark, passes more than one)."""
    passed = 0
    while marks and samples >= marks[0]:
        marks.pop(0)
        passed += 1
    return passed


def _start_row(model, ref, tokenizer, task, cfg, seed, start):
    """The curve's first row: the checkpoint's evaluation for ``seed`` (``start`` when already made)."""
    return {"samples": 0, "seconds": 0.0,
            **(start if start is not None else _evaluate(model, ref, tokenizer, task, cfg, seed, final=True))}


def evaluate_start(seed: int, cfg: CapstoneConfig | None = None, device=None) -> dict:
    """The checkpoint's evaluation for ``seed`` as every run of that seed begins with it (pass it as ``start``)."""
    cfg = cfg or CapstoneConfig()
    model, tokenizer = load_checkpoint(cfg.checkpoint, device=device)
    ref, _ = load_checkpoint(cfg.checkpoint, device=device)
    return _evaluate(model, ref, tokenizer, DigitSumTask(), cfg, seed, final=True)


def run(algorithm: str, seed: int, cfg: CapstoneConfig | None = None, device=None, start: dict | None = None) -> dict:
    """Train one algorithm from the checkpoint; return its learning curve and costs.

    ``curve`` rows: ``samples`` drawn so far, ``seconds`` of training so far (evaluation excluded),
    ``validity``, ``kl``, ``distinct`` (different valid answers per target), ``distinct_among_valid``,
    ``pass@k`` and ``samples_per_target``; the first and last rows are evaluated with
    ``cfg.final_samples_per_target``. One row per evaluation mark after the start (``eval_points``
    of them): a step that passes several marks is evaluated once, and that row fills each. Also
    ``models_held``, ``parameters`` (of one model), ``completions_per_second``, for the critic-free methods
    ``clip_fraction`` (the clipped share of tokens at each step's last update, averaged over steps) and, on
    CUDA, ``peak_memory_mb``. ``start``: the checkpoint's evaluation for this seed (:func:`evaluate_start`) when it
    is already made.
    """
    cfg = _checked(algorithm, cfg)
    seed_everything(seed)
    task = DigitSumTask()
    model, tokenizer = load_checkpoint(cfg.checkpoint, device=device)
    ref, _ = load_checkpoint(cfg.checkpoint, device=device)
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    curve = [_start_row(model, ref, tokenizer, task, cfg, seed, start)]
    marks = _marks(cfg)
    samples, seconds = 0, 0.0
    if algorithm == "DPO":  # offline: the whole budget is sampled first, then trained on
        tic = time.perf_counter()
        pairs = _dpo_pairs(model, tokenizer, task, cfg.budget, seed)
        train_dpo(model, tokenizer, pairs, _dpo_config(cfg, seed), ref_model=ref, progress=False)
        samples, seconds = cfg.budget, time.perf_counter() - tic
        curve.append({"samples": samples, "seconds": seconds,
                      **_evaluate(model, ref, tokenizer, task, cfg, seed, final=True)})
    else:
        step = (_pg_trainer(algorithm, model, tokenizer, task, cfg, seed) if algorithm in _PG else
                _ppo_trainer(model, tokenizer, task, cfg, seed) if algorithm == "PPO" else
                _online_step(model, tokenizer, task, cfg, seed) if algorithm == "Online DPO" else
                _rft_trainer(model, tokenizer, task, cfg, seed))
        while samples < cfg.budget:
            tic = time.perf_counter()
            samples += step()            # completions sampled by this step
            seconds += time.perf_counter() - tic
            passed = _pop_passed(marks, samples)
            if passed:                   # the last mark is the budget: the loop's last step evaluates finally
                row = {"samples": samples, "seconds": seconds,
                       **_evaluate(model, ref, tokenizer, task, cfg, seed, final=not marks)}
                curve += [dict(row) for _ in range(passed)]
    extra = {"clip_fraction": _clip_fraction(step.history)} if algorithm in _PG else {}
    out = _result(algorithm, seed, curve, model, samples / max(seconds, 1e-9), **extra)
    if dev.type == "cuda":
        out["peak_memory_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
    return out


def run_seeds(algorithm: str, seeds, cfg: CapstoneConfig | None = None, device=None,
              starts: dict | None = None) -> list[dict]:
    """:func:`run` for several seeds of one method of ``SEED_BATCHED``, trained together in one stacked model.

    Seed ``s`` is the run :func:`run` would make (the same prompts and sampling streams; its
    trajectory matches to float rounding). One result per seed, as :func:`run` returns it, with
    ``seeds_batched`` added; its ``seconds`` are the shared training time divided by the number of
    seeds (the cost of one seed when seeds are trained together). ``starts``: ``{seed: evaluate_start(seed)}``
    when already made.
    """
    from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer

    cfg = _checked(algorithm, cfg)
    if algorithm not in SEED_BATCHED:
        raise ValueError(f"run_seeds trains the methods of SEED_BATCHED {SEED_BATCHED}, got {algorithm!r}: use run()")
    seeds = [int(s) for s in seeds]
    starts = starts or {}
    task = DigitSumTask()
    model, tokenizer = load_checkpoint(cfg.checkpoint, device=device)
    ref, _ = load_checkpoint(cfg.checkpoint, device=device)
    if algorithm == "DPO":
        return _dpo_seeds(model, ref, tokenizer, task, seeds, cfg, starts)
    if algorithm == "Online DPO":
        trainer = _online_dpo_trainer(model, tokenizer, task, cfg, seeds, stacked=True)
    elif algorithm == "PPO":
        from rlcourse.trainers.ppo_rlhf_seeds import SeedBatchedPPORLHFTrainer
        from rlcourse.lm.value_model import make_value_model

        trainer = SeedBatchedPPORLHFTrainer(_ppo_config(cfg, task, seeds[0]), model, tokenizer, task.reward,
                                            make_value_model("policy", policy=model), task.prompts, seeds=seeds)
    else:
        trainer = SeedBatchedPolicyGradientTrainer(model, tokenizer, task, _pg_config(algorithm, cfg, seeds[0]),
                                                   seeds=seeds)
    curves = [[_start_row(model, ref, tokenizer, task, cfg, s, starts.get(s))] for s in seeds]
    marks = _marks(cfg)
    samples, seconds = 0, 0.0
    while samples < cfg.budget:
        start = time.perf_counter()
        trainer.step()
        samples += cfg.batch             # completions each seed drew in this step
        seconds += time.perf_counter() - start
        passed = _pop_passed(marks, samples)
        if passed:
            for i, s in enumerate(seeds):
                row = {"samples": samples, "seconds": seconds / len(seeds),
                       **_evaluate(trainer.model_of(i), ref, tokenizer, task, cfg, s, final=not marks)}
                curves[i] += [dict(row) for _ in range(passed)]
    clips = [_clip_fraction(h) for h in trainer.history] if algorithm in _PG else [None] * len(seeds)
    return [_result(algorithm, s, curve, model, samples * len(seeds) / max(seconds, 1e-9), seeds_batched=len(seeds),
                    **({} if clip is None else {"clip_fraction": clip}))
            for s, curve, clip in zip(seeds, curves, clips)]


def _dpo_seeds(model, ref, tokenizer, task, seeds: list[int], cfg: CapstoneConfig, starts: dict) -> list[dict]:
    """DPO's :func:`run_seeds`: each seed's offline pairs sampled as :func:`run` samples them, then one
    seed-batched training (:func:`rlcourse.trainers.dpo_seeds.train_dpo_seeds`)."""
    import copy

    from rlcourse.trainers.dpo_seeds import train_dpo_seeds

    firsts = [_start_row(model, ref, tokenizer, task, cfg, s, starts.get(s)) for s in seeds]
    start = time.perf_counter()
    pairs = [_dpo_pairs(model, tokenizer, task, cfg.budget, s) for s in seeds]
    models = [copy.deepcopy(model) for _ in seeds]
    train_dpo_seeds(models, tokenizer, pairs, _dpo_config(cfg, seeds[0]), seeds=seeds, ref_models=[ref] * len(seeds),
                    progress=False)
    seconds = (time.perf_counter() - start) / len(seeds)
    ends = [{"samples": cfg.budget, "seconds": seconds, **_evaluate(m, ref, tokenizer, task, cfg, s, final=True)}
            for s, m in zip(seeds, models)]
    return [_result("DPO", s, [first, end], model, cfg.budget / seconds, seeds_batched=len(seeds))
            for s, first, end in zip(seeds, firsts, ends)]


def compare(algorithms=ALGORITHMS, seeds=(0, 1, 2), cfg: CapstoneConfig | None = None, progress: bool = True,
            device=None, batch_seeds: bool = True) -> list[dict]:
    """Every (algorithm, seed): :func:`run_seeds` for ``SEED_BATCHED`` methods (with ``batch_seeds``),
    :func:`run` one seed at a time for the others. The checkpoint is evaluated once per seed and every
    run of that seed starts from that evaluation. A tqdm bar names the run in progress."""
    from tqdm.auto import tqdm

    starts = {int(s): evaluate_start(int(s), cfg, device=device) for s in seeds}
    results = []
    with tqdm(total=len(algorithms) * len(seeds), disable=not progress, desc="capstone") as bar:
        for algorithm in algorithms:
            if batch_seeds and algorithm in SEED_BATCHED and len(seeds) > 1:
                bar.set_postfix_str(f"{algorithm}, {len(seeds)} seeds together")
                results += run_seeds(algorithm, seeds, cfg, device=device, starts=starts)
                bar.update(len(seeds))
                continue
            for seed in seeds:
                bar.set_postfix_str(f"{algorithm}, seed {seed}")
                results.append(run(algorithm, seed, cfg, device=device, start=starts[int(seed)]))
                bar.update(1)
    return results


def paired_difference(results: list[dict], a: str, b: str, key: str = "validity") -> tuple[float, float]:
    """``a`` minus ``b`` seed by seed: the 95% t-interval of ``final_a(s) - final_b(s)`` over their shared seeds.

    Pairing removes what two runs of one seed share (here the seed's evaluation draws), so a
    difference can be resolved with fewer seeds than two separate intervals need. The difference
    is resolved when its interval excludes 0.
    """
    return t_interval(_paired_values(results, a, b, key))


def _paired_values(results: list[dict], a: str, b: str, key: str) -> list[float]:
    final = {(r["algorithm"], r["seed"]): r["curve"][-1][key] for r in results}
    shared = sorted({s for (alg, s) in final if alg == a} & {s for (alg, s) in final if alg == b})
    if len(shared) < 2:
        raise ValueError(f"{a!r} and {b!r} need at least 2 shared seeds in results, got {shared}")
    return [final[(a, s)] - final[(b, s)] for s in shared]


def all_pairs(results: list[dict], algorithms, key: str = "validity", alpha: float = 0.05) -> list[dict]:
    """Every pair ``(a, b)`` of ``algorithms`` (``a`` before ``b``) compared seed by seed, with and without Holm.

    One row per pair: ``mean`` and ``half`` (:func:`paired_difference`, ``a`` minus ``b``), the paired t-test's
    two-sided ``p``, ``resolved`` (the interval excludes 0, i.e. ``p < alpha`` one pair at a time), and
    ``p_holm`` / ``resolved_holm``: the same family of ``m`` pairs adjusted by :func:`rlcourse.stats.holm`, so that
    the chance of even one false separation among them is at most ``alpha``. Among 45 pairs that are all
    true ties, uncorrected tests at 95% would call about two resolved.
    """
    from rlcourse.stats import holm, t_test_p_value

    names = list(algorithms)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d = _paired_values(results, a, b, key)
            mean, half = t_interval(d)
            rows.append({"a": a, "b": b, "mean": mean, "half": half, "p": t_test_p_value(d),
                         "resolved": abs(mean) > half})
    adjusted, rejected = holm([r["p"] for r in rows], alpha=alpha)
    for row, p, reject in zip(rows, adjusted, rejected):
        row.update(p_holm=p, resolved_holm=bool(reject))
    return rows


def start_results(results: list[dict], name: str = "SFT") -> list[dict]:
    """The checkpoint as a pseudo-method: one result per seed whose curve is that seed's starting evaluation.

    Append them to ``results`` to compare a method with where it started, seed by seed:
    ``paired_difference(results + start_results(results), "GRPO", "SFT")``.
    """
    first = {r["seed"]: r["curve"][0] for r in results}
    return [{"algorithm": name, "seed": s, "curve": [point]} for s, point in first.items()]


def curve_band(results: list[dict], algorithm: str, x: str = "samples", y: str = "validity"):
    """One algorithm's learning curve over seeds: ``x`` (mean over seeds), ``y``'s mean and 95% half-width.

    Row ``k`` of every seed's curve is its ``k``-th evaluation mark (the same marks for every seed; DAPO's
    seeds pass them at slightly different sample counts, and wall-clock ``seconds`` differ a little), so the
    x of a point is the mean over seeds.
    """
    runs = [r for r in results if r["algorithm"] == algorithm]
    if len(runs) < 2:
        raise ValueError(f"algorithm {algorithm!r} needs at least 2 seeds in results, got {len(runs)}")
    points = list(zip(*(r["curve"] for r in runs)))  # one tuple of per-seed rows per evaluation point
    xs = np.array([np.mean([p[x] for p in point]) for point in points])
    bands = np.array([t_interval([p[y] for p in point]) for point in points])
    return xs, bands[:, 0], bands[:, 1]


def summary(results: list[dict]) -> list[dict]:
    """One row per algorithm: every final metric of the curve as (mean, 95% half-width) over seeds, costs.

    Works on :func:`start_results` too (the checkpoint's row, without costs)."""
    rows = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in results):
        runs = [r for r in results if r["algorithm"] == algorithm]
        final = [r["curve"][-1] for r in runs]
        row = {"algorithm": algorithm, "seeds": len(runs), "models_held": runs[0].get("models_held")}
        for key in final[0]:
            if key not in ("samples", "samples_per_target"):
                row[key] = t_interval([f[key] for f in final])
        if "completions_per_second" in runs[0]:
            row["completions_per_second"] = float(np.mean([r["completions_per_second"] for r in runs]))
        if "peak_memory_mb" in runs[0]:
            row["peak_memory_mb"] = float(np.max([r["peak_memory_mb"] for r in runs]))
        rows.append(row)
    return rows
