"""Online DPO: DPO on pairs the current policy samples, labelled as they are drawn, with TRL's names.

Offline DPO (:mod:`rlcourse.trainers.dpo`) learns from a fixed set of comparisons of answers that some
other policy wrote. Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI
Feedback", arXiv 2402.04792; TRL's ``OnlineDPOTrainer``) samples the pairs from the policy being
trained, so the comparisons follow it wherever it goes:

    for step in 1 .. max_steps:
        x     <- prompt_fn(per_device_train_batch_size, seed * 100_003 + step), each num_generations times
        y     <- sample(pi_theta, x)                            # the current policy: on-policy answers
        s     <- reward_funcs(x, y)      (a function, or a scalar-head reward model; minus
                                          missing_eos_penalty where no <eos> was written)
        pairs <- online_dpo_pairs(s, prompt of each y)          # each prompt's best against its worst
        loss  <- preference_objective(log pi_theta and log pi_ref of the pairs' answers)
        one AdamW step (gradient clipped), learning rate decayed linearly to 0 (and held at 0)

Every formula lives elsewhere (:func:`rlcourse.losses.beyond_dpo.online_dpo_pairs`,
:func:`rlcourse.trainers.dpo.batch_loss`); this module samples, scores and logs what TRL's
``OnlineDPOTrainer`` logs, under its names (``objective/scores``, ``objective/scores_margin``,
``objective/kl``, ``val/contain_eos_token``, ``rewards/*``, ``logps/*``, ``loss``) plus ``pairs`` (the
pairs formed: a prompt whose answers all score alike gives none). Reference-free losses (SimPO, ORPO)
log no ``objective/kl``: without a reference there is none to measure.

Several seeds train as one stacked model when ``seeds`` is given (:mod:`rlcourse.lm.seed_stack`):
seed ``s`` is the run ``seeds=[seeds[s]]`` would make, its own prompts, samples, copy of the reward
function, weights and AdamW state; a seed without a pair in a step does not move in that step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from rlcourse.losses.beyond_dpo import online_dpo_pairs
from rlcourse.trainers.dpo import DPOConfig, batch_loss, dpo_metrics, lr_factor, reference_free, uses_kto
from rlcourse.lm.fast_gpt2 import supports
from rlcourse.lm.logprobs import sequence_logprobs
from rlcourse.lm.model import frozen_copy
from rlcourse.lm.scalar_head import score_completions
from rlcourse.lm.sampling import sample
from rlcourse.lm.seed_stack import SeedAdam, seed_model, stack_models
from rlcourse.lm.seed_stack import score_by_seed, seed_copies

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer", "BradleyTerryRater", "rollout_scores"]


@torch.no_grad()
def rollout_scores(seed_rewards: list, roll, missing_eos_penalty: float | None = None) -> torch.Tensor:
    """The reward of every answer of a rollout (B,), float32, minus ``missing_eos_penalty`` where it has no ``<eos>``.

    ``seed_rewards``: one reward per seed-major block of the rollout's rows (one block for a single
    run), each ``f(prompts, completions) -> scores`` or the same scalar-head reward model (which scores
    every row at once, from the rollout's tokens).
    """
    if isinstance(seed_rewards[0], torch.nn.Module):
        s = score_completions(seed_rewards[0], roll.prompt_ids, roll.prompt_mask, roll.completion_ids,
                              roll.completion_mask)
    else:
        s = score_by_seed(seed_rewards)(roll.prompts, roll.completions)   # each run's rows by its own copy
    s = s.to(roll.completion_ids.device, torch.float32).flatten()
    if s.shape[0] != len(roll.completions):
        raise ValueError(f"reward_funcs must return one score per completion ({len(roll.completions)}), got {s.shape[0]}")
    if missing_eos_penalty is not None:
        s = s - missing_eos_penalty * (~roll.finished).float()
    return s


class BradleyTerryRater:
    """A noisy rater as a reward function: ``score(x, y) = u(x, y) + G / beta``, ``G`` a standard Gumbel draw.

    Comparing two answers by these scores prefers ``a`` to ``b`` with probability
    ``sigmoid(beta (u(a) - u(b)))``, exactly Bradley-Terry (the difference of two independent
    standard Gumbel variables is standard logistic); among more answers the highest score follows
    Luce's choice rule, ``P(a best) = exp(beta u(a)) / sum_y exp(beta u(y))``. So online DPO asks the
    same raters as :meth:`rlcourse.tasks.PreferenceTask.preference_pairs` ask for offline data:
    ``BradleyTerryRater(task.rater_utility, task.beta)``. ``seed`` fixes the noise.
    """

    def __init__(self, utility, beta: float, seed: int = 0):
        if not callable(utility) or not beta > 0:
            raise ValueError(f"utility must be a function (prompt, completion) -> float and beta > 0, got beta={beta!r}")
        self.utility, self.beta = utility, float(beta)
        self.rng = np.random.default_rng(seed)

    def __call__(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        u = np.array([self.utility(p, c) for p, c in zip(prompts, completions)], dtype=np.float64)
        return torch.tensor(u + self.rng.gumbel(size=len(u)) / self.beta, dtype=torch.float32)


@dataclass
class OnlineDPOConfig(DPOConfig):
    """:class:`~rlcourse.trainers.dpo.DPOConfig`'s loss settings (``beta``, ``loss_type``, ``learning_rate``,
    ``max_grad_norm``, ``lr_scheduler_type``, ``seed``...) and TRL's ``OnlineDPOConfig`` sampling names:

    * ``per_device_train_batch_size`` (8): prompts per step (TRL's meaning); each is sampled
      ``num_generations`` times.
    * ``num_generations`` (2): answers per prompt. Not a TRL setting: its ``OnlineDPOTrainer`` always
      samples two. With more, a prompt's pair is its best answer against its worst.
    * ``max_steps`` (**100** here; there are no epochs of a fixed data set to count).
    * ``max_new_tokens`` (None: ``prompt_fn``'s task decides, TRL's default is 64).
    * ``temperature`` (**1.0** here, TRL's default is 0.9): the sampling temperature; log-probs are
      taken at temperature 1, as TRL does.
    * ``missing_eos_penalty`` (None): subtracted from the score of an answer without ``<eos>``.

    ``loss_type`` may be any pairwise loss of :class:`~rlcourse.trainers.dpo.DPOConfig` (TRL's online trainer
    offers ``sigmoid`` and ``ipo``); ``kto`` is refused (its reference point needs another pass). ``ipo``
    is TRL's ``OnlineDPOTrainer``'s: ``(h - 1 / (2 beta))^2`` on whole-sequence log-ratios, where offline
    :func:`~rlcourse.trainers.dpo.train_dpo`, as TRL's ``DPOTrainer``, averages them per token.
    ``num_train_epochs`` and ``precompute_ref_log_probs`` are not read.
    """

    max_steps: int = 100
    num_generations: int = 2
    max_new_tokens: int | None = None
    temperature: float = 1.0
    missing_eos_penalty: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer (online DPO has no epochs), got {self.max_steps!r}")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"num_generations must be an integer >= 2 (a pair needs two answers), "
                             f"got {self.num_generations!r}")
        if uses_kto(self):
            raise ValueError("loss_type 'kto' is not an online loss here: use a pairwise loss (e.g. 'sigmoid')")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be None or a positive integer, got {self.max_new_tokens!r}")


class OnlineDPOTrainer:
    """``OnlineDPOTrainer(model, tokenizer, reward_funcs, prompt_fn, args).train()``.

    ``reward_funcs``: ``f(prompts, completions) -> scores`` (a rater, a verifier) or a scalar-head reward
    model (:class:`~rlcourse.lm.scalar_head.ScalarHeadModel`, lesson 08). ``prompt_fn(n, seed)`` makes
    ``n`` prompts (e.g. ``task.prompts``). ``max_new_tokens`` defaults to ``prompt_fn.__self__.max_new_tokens``
    when ``prompt_fn`` is a task's method. ``gold_fn(prompts, completions)``, if given, is logged as
    ``gold/scores``.

    Without ``seeds``: one run, ``model`` trained in place (any causal LM), seed ``args.seed``,
    reference a frozen copy of ``model`` (or ``ref_model``). With ``seeds``: one run per seed in one
    stacked model (plain GPT-2 only), ``model`` left as it is; ``model_of(s)`` copies seed ``s`` out.
    ``history[s]`` holds run ``s``'s metrics, one dict per step. A stacked run ``s`` calls its own deep
    copies of a reward function and ``gold_fn`` (``seed_rewards[s]``, ``seed_golds[s]``; a reward model
    is shared), so a rater with state draws for it what it draws in the run ``seeds=None, seed=seeds[s]``.
    """

    def __init__(self, model, tokenizer, reward_funcs, prompt_fn, args: OnlineDPOConfig | None = None,
                 ref_model=None, seeds=None, gold_fn=None):
        self.args = args = args or OnlineDPOConfig()
        if not isinstance(args, OnlineDPOConfig):
            raise ValueError(f"args must be an OnlineDPOConfig, got {type(args).__name__}")
        if not callable(reward_funcs):
            raise ValueError("reward_funcs must be a function f(prompts, completions) -> scores or a reward model")
        self.tokenizer, self.prompt_fn, self.gold_fn = tokenizer, prompt_fn, gold_fn
        self.reward_funcs = reward_funcs.eval() if isinstance(reward_funcs, torch.nn.Module) else reward_funcs
        self.max_new_tokens = args.max_new_tokens or getattr(getattr(prompt_fn, "__self__", None), "max_new_tokens", None)
        if self.max_new_tokens is None:
            raise ValueError("set args.max_new_tokens (prompt_fn is not a task's method that would give it)")
        self.stacked = seeds is not None
        self.seeds = [args.seed] if seeds is None else [int(s) for s in seeds]
        if not self.seeds:
            raise ValueError("seeds must hold at least one seed (or be None for one run)")
        no_reference = reference_free(args)
        if self.stacked:
            if not supports(model):
                raise ValueError("a seed-stacked run needs a plain GPT-2 model (rlcourse.lm.fast_gpt2.supports): "
                                 "leave seeds=None for any other model")
            self.model = stack_models([model] * len(self.seeds))
            start = model if ref_model is None else ref_model
            self.ref_model = None if no_reference else stack_models([start] * len(self.seeds)).eval().requires_grad_(False)
            self.optimizer = SeedAdam(self.model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
        else:
            self.model = model
            self.ref_model = None if no_reference else (ref_model if ref_model is not None else frozen_copy(model)).eval()
            self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                               weight_decay=args.weight_decay)
        self.model.eval()        # no dropout: the policy and its reference score tokens the same way
        self.device = next(self.model.parameters()).device
        self.generators = [torch.Generator(self.device).manual_seed(s) for s in self.seeds]
        S = len(self.seeds)
        self.seed_rewards = seed_copies(self.reward_funcs, S, "reward_funcs") if self.stacked else [self.reward_funcs]
        self.seed_golds = seed_copies(gold_fn, S, "gold_fn") if self.stacked else [gold_fn]
        self.step_count = 0
        self.history: list[list[dict]] = [[] for _ in self.seeds]
        self.seconds = 0.0

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def model_of(self, s: int):
        """Run ``s``'s current policy as an ordinary model (a copy when stacked, the model itself otherwise)."""
        return seed_model(self.model, s) if self.stacked else self.model

    def scores(self, roll) -> torch.Tensor:
        """The reward of every sampled answer, minus ``missing_eos_penalty`` where it has no ``<eos>``."""
        return rollout_scores(self.seed_rewards, roll, self.args.missing_eos_penalty)

    def step(self) -> list[dict]:
        """One online-DPO step of every run: sample, score, pair, one update; returns each run's metrics."""
        a, S = self.args, self.num_seeds
        P, G = a.per_device_train_batch_size, a.num_generations
        prompts = [p for seed in self.seeds for p in self.prompt_fn(P, seed * 100_003 + self.step_count)
                   for _ in range(G)]
        tic = time.perf_counter()
        roll = sample(self.model, self.tokenizer, prompts, self.max_new_tokens, temperature=a.temperature,
                      generator=self.generators if self.stacked else self.generators[0])
        scores = self.scores(roll)
        args = (roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
        logp = sequence_logprobs(self.model, *args)                      # every row: each run's rows are one block
        if self.ref_model is None:
            ref = torch.zeros(len(prompts), device=self.device)
        else:
            with torch.no_grad():
                ref = sequence_logprobs(self.ref_model, *args).sum(-1)
        groups = torch.arange(P).repeat_interleave(G)
        losses, metrics, active = {}, [], torch.zeros(S, dtype=torch.bool)
        for s in range(S):
            block = slice(s * P * G, (s + 1) * P * G)
            chosen, rejected = (i.to(self.device) + s * P * G for i in online_dpo_pairs(scores[block].cpu(), groups))
            m = {"objective/scores": float(scores[block].mean()),
                 "val/contain_eos_token": float(roll.finished[block].float().mean()),
                 "pairs": len(chosen)}
            if self.ref_model is not None:   # reference-free: ref is 0, and logp - 0 is no KL
                m["objective/kl"] = float((logp[block].detach().sum(-1) - ref[block]).mean())
            if self.gold_fn is not None:
                m["gold/scores"] = float(torch.as_tensor(self.seed_golds[s](roll.prompts[block], roll.completions[block])).float().mean())
            if len(chosen):
                both = torch.cat([chosen, rejected])
                loss, cl, rl = batch_loss(a, logp[chosen], logp[rejected], roll.completion_mask[both], ref[chosen],
                                          ref[rejected], ipo_per_token=False)   # TRL's OnlineDPOTrainer's IPO
                losses[s], active[s] = loss, True
                m.update(loss=float(loss.detach()), **{"objective/scores_margin": float((scores[chosen] - scores[rejected]).mean())},
                         **dpo_metrics(cl, rl, ref[chosen], ref[rejected], a.beta))
            metrics.append(m)
        self._update(losses, active)
        self.seconds += time.perf_counter() - tic
        for s, m in enumerate(metrics):
            m["learning_rate"] = a.learning_rate * lr_factor(a, self.step_count, a.max_steps)
            self.history[s].append(m)
        self.step_count += 1
        return metrics

    def _update(self, losses: dict, active: torch.Tensor) -> None:
        """One optimiser step of each run that formed a pair (a run without one does not move)."""
        if not losses:
            return
        a = self.args
        lr = a.learning_rate * lr_factor(a, self.step_count, a.max_steps)
        total = sum(losses.values())
        if not torch.isfinite(total):
            raise FloatingPointError(f"online DPO loss is {float(total)} at step {self.step_count}: lower learning_rate")
        if self.stacked:
            self.optimizer.zero_grad()
            self.optimizer.backward(total)
            if a.max_grad_norm and a.max_grad_norm > 0:
                self.optimizer.clip_grad_norm_(a.max_grad_norm)
            self.optimizer.step(active, lr=[lr] * self.num_seeds)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            total.backward()
            if a.max_grad_norm and a.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()

    def train(self, max_steps: int | None = None, progress: bool = True, callback=None) -> list[list[dict]]:
        """Run ``max_steps`` steps (default ``args.max_steps``) with a bar of the score and KL (if any) averaged over runs.

        ``callback(step, trainer)`` runs after each step. The learning-rate schedule counts ``args.max_steps``;
        steps past it (a second ``train()``) run at rate 0 under ``linear``, as TRL's schedule does.
        """
        steps = self.args.max_steps if max_steps is None else max_steps
        bar = tqdm(range(steps), disable=not progress, desc=f"online DPO x{self.num_seeds}" if self.stacked else "online DPO")
        for i in bar:
            rows = self.step()
            shown = {"score": f"{np.mean([r['objective/scores'] for r in rows]):.3f}"}
            if "objective/kl" in rows[0]:
                shown["kl"] = f"{np.mean([r['objective/kl'] for r in rows]):.2f}"
            bar.set_postfix(shown)
            if callback is not None:
                callback(i + 1, self)
        return self.history
