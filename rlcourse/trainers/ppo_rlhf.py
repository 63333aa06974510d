"""PPO for language models with a learned reward (RLHF), as in Ziegler et al. 2019 (arXiv
1909.08593), Stiennon et al. 2020 (2009.01325), InstructGPT (Ouyang et al. 2022, 2203.02155) and
TRL's ``PPOTrainer`` (removed from TRL in 1.13; its ``PPOConfig`` names are kept here).

One iteration:

1. **Roll out**: sample a completion per prompt from the policy and keep the sampler's per-token
   log-probs ``log pi_old(y_t)``; score each with the frozen reward model at its last real token
   (less ``reward_bias``; :func:`eos_rule` then treats a completion that never emitted ``<eos>``:
   TRL's ``missing_eos_penalty`` or Huang et al.'s ``non_eos_score``); read the reference
   model's log-probs and the critic's values ``V(s_t)``, all without gradient.
2. **Shape the reward per token** (:func:`kl_shaped_rewards`):
   ``r~_t = -kl_coef * KL_t + [t = last real token] * score``, with ``KL_t`` estimated by k1 (or k3)
   from the *stored* log-probs, so it is a number, not something to differentiate.
3. **Advantages** (:func:`advantages_and_returns`): GAE(gamma=1, lam) over the real tokens of
   each row, the critic's targets ``returns = A + V``, then the advantages whitened over the batch.
4. **Update**: ``num_ppo_epochs`` passes over the batch in ``num_mini_batches`` minibatches of
   :func:`ppo_rlhf_loss` = clipped policy loss + ``vf_coef`` * clipped value loss.
5. **KL controller** (only with ``adap_kl_ctrl=True``): :func:`adaptive_kl_coef` moves ``kl_coef``
   towards the value that keeps the batch's KL at ``target`` (Ziegler et al. 2019).

Each step is a method of :class:`PPORLHFTrainer`, so a lesson can override one to show a bug.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rlcourse.kl import KL_ESTIMATORS
from rlcourse.lm.logprobs import sequence_logprobs
from rlcourse.lm.model import frozen_copy
from rlcourse.lm.scalar_head import last_real_index, score_completions
from rlcourse.lm.sampling import sample
from rlcourse.lm.value_model import token_values
from rlcourse.losses import ppo_clip_loss, ppo_diagnostics, value_loss, masked_mean
from rlcourse.returns import gae, whiten
from rlcourse.trainers.sft import encode_examples, sft_loss

__all__ = ["PPOConfig", "PPORLHFTrainer", "eos_rule", "kl_shaped_rewards", "advantages_and_returns", "ppo_rlhf_loss",
           "minibatch_loss", "iteration_metrics", "disable_dropout", "adaptive_kl_coef", "ptx_loss"]


@dataclass
class PPOConfig:
    """Settings under the names of TRL's last ``PPOConfig``; where our default differs, it says why.

    ``batch_size`` is the number of rollouts per iteration (TRL: ``per_device_train_batch_size *
    gradient_accumulation_steps * num_mini_batches``). ``temperature``: TRL samples at 0.7; we
    sample at 1 so the policy is exactly the model and the KL is to the reference model itself.
    ``learning_rate``: TRL's 3e-6 suits billion-parameter models; the tiny GPT needs more.
    ``whiten_advantages`` is not a TRL setting (TRL always whitens); it is here for the ablation.

    Two rules for a completion that never emitted ``<eos>`` (it was cut at ``response_length``):
    ``missing_eos_penalty`` (TRL's) *subtracts* a penalty from its score; ``non_eos_score`` (Huang
    et al. 2024, "The N+ Implementation Details of RLHF with PPO", arXiv 2403.17031, who use -1)
    *replaces* its score by a constant. The first keeps what the reward model thought of the text,
    the second does not. At most one may be set.

    ``reward_bias`` is subtracted from every reward-model score first: InstructGPT normalises its
    reward model so that the SFT policy's completions score 0 on average
    (:func:`rlcourse.tasks.reward_model.reward_model_bias` measures it). A Bradley-Terry model fixes
    only score *differences*, so its level is arbitrary, and with a penalty for a missing
    ``<eos>`` or a constant for it the level is not harmless: it decides whether that penalty is
    large or small next to a typical score.

    ``kl_estimator`` is TRL's option: ``"k1"`` (the default, ``log pi_old - log pi_ref``) or ``"k3"``.
    ``"k3"`` warns: in a reward the penalty only weighs ``grad log pi``, and the expected gradient
    of ``k3 * grad log pi`` is ``grad KL(pi || ref) - grad KL(ref || pi)``, not ``grad KL(pi || ref)``
    (k1's): near the reference the two nearly cancel, far from it the penalty can push the policy
    away from the reference. Lesson 07b measures both ("In the reward, the penalty is a number").

    ``whiten_rewards`` here divides the shaped rewards by their standard deviation over the real
    tokens (:func:`advantages_and_returns`); TRL's option of that name (``trl.experimental.ppo`` up
    to v1.9) also kept their mean, ``(r - mean) / std + mean``.

    ``adap_kl_ctrl``, ``target`` and ``horizon`` are the adaptive KL controller of Ziegler et al.
    2019 under the names of TRL's ``PPOConfig`` up to v0.11 (where ``kl_coef`` was ``init_kl_coef``
    and the controller was on by default, ``target=6``, ``horizon=10000``): after each iteration
    :func:`adaptive_kl_coef` moves the coefficient towards the value that holds ``objective/kl`` at
    ``target``. Off by default here: ``kl_coef`` stays fixed, as in TRL's later ``PPOConfig``.

    ``ptx_coef`` is InstructGPT's PPO-ptx (Ouyang et al. 2022, arXiv 2203.02155, eq. 2: the objective
    gains ``gamma E_{x ~ D_pretrain}[log pi(x)]``) under OpenRLHF's name: every minibatch's loss adds
    ``ptx_coef`` times the mean negative log-likelihood of a batch of old-task text, drawn by the
    trainer's ``ptx_fn`` (:func:`ptx_loss`). 0 (the default) is plain PPO, as in TRL, which has no such
    setting. OpenRLHF adds it the same way; its earlier versions weighted the PPO loss by
    ``1 - ptx_coef`` as well.
    """

    learning_rate: float = 1e-3
    batch_size: int = 64
    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    response_length: int = 8
    temperature: float = 1.0
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None
    non_eos_score: float | None = None
    reward_bias: float = 0.0
    disable_dropout: bool = True
    seed: int = 0
    adap_kl_ctrl: bool = False
    target: float = 6.0
    horizon: float = 10000.0
    ptx_coef: float = 0.0

    def __post_init__(self):
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")
        if self.kl_estimator == "k3":
            warnings.warn("kl_estimator='k3' puts k3 in the reward, where its expected gradient is "
                          "grad KL(pi || ref) - grad KL(ref || pi), not the gradient of the KL: near the reference "
                          "the penalty barely regularises, far from it it can push the policy away. k1 (the default) "
                          "is the estimator for a KL in the reward; lesson 07b measures both.",
                          UserWarning, stacklevel=3)
        if self.batch_size < 1 or self.num_mini_batches < 1 or self.batch_size % self.num_mini_batches:
            raise ValueError(f"batch_size ({self.batch_size}) must be a positive multiple of "
                             f"num_mini_batches ({self.num_mini_batches})")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma!r}, {self.lam!r}")
        if not self.kl_coef >= 0 or self.num_ppo_epochs < 1:   # `not >=` also refuses NaN
            raise ValueError(f"kl_coef must be >= 0 and num_ppo_epochs >= 1, got {self.kl_coef!r}, "
                             f"{self.num_ppo_epochs!r}")
        if not (0 < self.temperature < math.inf):
            # The trainer samples *and* recomputes log-probs at this temperature: greedy (0) has no
            # log-prob to recompute, so unlike sample() it is refused here.
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if self.missing_eos_penalty is not None and self.non_eos_score is not None:
            raise ValueError("set missing_eos_penalty (TRL: subtract a penalty) or non_eos_score (Huang et al.: "
                             "replace the score), not both")
        if not (self.target > 0 and self.horizon > 0 and math.isfinite(self.target) and math.isfinite(self.horizon)):
            raise ValueError(f"target and horizon must be finite numbers > 0, got {self.target!r}, {self.horizon!r}")
        if self.adap_kl_ctrl and not self.kl_coef > 0:
            raise ValueError("adap_kl_ctrl multiplies kl_coef: it needs an initial kl_coef > 0")
        if not (self.ptx_coef >= 0 and math.isfinite(self.ptx_coef)):
            raise ValueError(f"ptx_coef must be a finite number >= 0 (0: no pretraining term), got {self.ptx_coef!r}")
        for name in ("missing_eos_penalty", "non_eos_score", "reward_bias"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")


def adaptive_kl_coef(kl_coef: float, kl: float, *, target: float, n_steps: int, horizon: float,
                     k_beta: float = 1.0) -> float:
    """One update of Ziegler et al.'s adaptive KL controller (2019, arXiv 1909.08593, section 2.2):

        e        = clip(KL / target - 1, -0.2, 0.2)
        kl_coef <- kl_coef * (1 + k_beta * e * n_steps / horizon)

    ``kl`` is the batch's mean KL per completion (``objective/kl``, nats), ``target`` the KL to
    hold, ``n_steps`` the completions in the batch. The paper writes ``K_beta = 0.1`` per update;
    its code, and TRL's ``AdaptiveKLController`` up to v0.11, set ``k_beta = 1`` and let
    ``n_steps / horizon`` give the rate. Above the target the coefficient grows, below it shrinks,
    by at most ``0.2 * k_beta * n_steps / horizon`` of itself per update: a proportional
    controller on ``log kl_coef`` whose error is clipped so one odd batch cannot swing it.
    """
    if not (kl_coef > 0 and target > 0 and horizon > 0 and n_steps > 0 and k_beta >= 0):
        raise ValueError(f"kl_coef, target, horizon and n_steps must be > 0 and k_beta >= 0, got "
                         f"{kl_coef!r}, {target!r}, {horizon!r}, {n_steps!r}, {k_beta!r}")
    if not math.isfinite(kl):
        raise ValueError(f"kl must be finite, got {kl!r}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + k_beta * error * n_steps / horizon)


def eos_rule(scores: torch.Tensor, finished: torch.Tensor, missing_eos_penalty: float | None = None,
             non_eos_score: float | None = None) -> torch.Tensor:
    """The score of each completion after the rule for those that never emitted ``<eos>``.

    ``missing_eos_penalty`` (TRL): ``score - penalty`` where ``finished`` is False;
    ``non_eos_score`` (Huang et al. 2024): ``non_eos_score`` there instead of the score.
    Finished completions keep their score; with neither set, nothing changes.
    """
    unfinished = ~finished.bool()
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * unfinished.to(scores.dtype)
    if non_eos_score is not None:
        scores = torch.where(unfinished, torch.full_like(scores, non_eos_score), scores)
    return scores


def kl_shaped_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                      mask: torch.Tensor, kl_coef: float, kl_estimator: str = "k1"):
    """Per-token rewards ``r~_t = -kl_coef * KL_t + 1[t = T_b] * score_b`` and the ``KL_t``, both ``(B, T)``.

    ``T_b`` is row ``b``'s last real token. ``KL_t`` is ``k1 = log pi_old - log pi_ref`` (or k3)
    of the sampled token, 0 on padding, and detached: the penalty is part of the *reward*, a
    number the policy-gradient weighs log-probs by, never a term to differentiate. Summed over a
    row, ``sum_t r~_t = score - kl_coef * sum_t KL_t``: the sequence-level KL-regularised reward.
    """
    if scores.ndim != 1 or scores.shape[0] != logprobs.shape[0]:
        raise ValueError(f"scores must have shape (B,) = ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite (a NaN or inf reward would poison every advantage)")
    m = mask.to(logprobs.dtype)
    kl = KL_ESTIMATORS[kl_estimator](logprobs.detach(), ref_logprobs.detach()) * m
    rewards = -kl_coef * kl
    last = last_real_index(mask)
    rewards = rewards.scatter_add(1, last[:, None], scores.detach().to(rewards.dtype)[:, None])
    return rewards, kl


def advantages_and_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                           lam: float, whiten_rewards: bool = False, whiten_advantages: bool = True):
    """GAE advantages and the critic's targets ``returns = A + V`` (both ``(B, T)``, 0 on padding).

    The recursion runs over each row's real tokens and stops at its last one (the state after it
    is terminal, value 0). ``whiten_rewards`` rescales the shaped rewards (no shift, so a good
    score stays positive) before GAE; the advantages are whitened *after* the returns are taken.
    """
    if whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False)
    adv = gae(rewards, values, gamma, lam, mask=mask)
    returns = adv + values.detach() * mask.to(values.dtype)
    if whiten_advantages:
        adv = whiten(adv, mask)
    return adv, returns


def ppo_rlhf_loss(logprobs, old_logprobs, advantages, values, old_values, returns, mask,
                  cliprange: float = 0.2, cliprange_value: float = 0.2, vf_coef: float = 0.1):
    """``loss = pg_loss + vf_coef * vf_loss`` and its two parts, token means over the real tokens.

    ``pg_loss = -mean_t min(rho_t A_t, clip(rho_t, 1 -/+ cliprange) A_t)``,
    ``vf_loss = 1/2 mean_t max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, +/- cliprange_value) - R_t)^2)``.
    """
    pg = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_coef=cliprange)
    vf = value_loss(values, returns, old_values, clip_coef=cliprange_value, mask=mask)
    return pg + vf_coef * vf, pg, vf


def ptx_loss(model, tokenizer, examples: list[dict]) -> torch.Tensor:
    """PPO-ptx's pretraining term: ``-mean_t log pi(x_t | x_<t)`` over the completions of ``examples``.

    ``examples`` are ``{"prompt", "completion"}`` rows of the old task (what the model was trained
    on before RL); the mean runs over every completion token and its ``<eos>``, as SFT's does
    (:func:`rlcourse.trainers.sft.sft_loss`, the same number).
    """
    device = next(model.parameters()).device
    input_ids, attention, loss_mask = (t.to(device) for t in encode_examples(tokenizer, examples))
    return sft_loss(model, input_ids, attention, loss_mask)


def minibatch_loss(config: PPOConfig, logprobs, values, mb: dict):
    """:func:`ppo_rlhf_loss` of one minibatch from the policy's ``logprobs`` and the critic's ``values``
    (both ``(B, T)``, with grad) and the rollout's stored tensors in ``mb``; returns the loss and its stats."""
    c = config
    loss, pg, vf = ppo_rlhf_loss(logprobs, mb["logprobs"], mb["advantages"], values, mb["values"],
                                 mb["returns"], mb["completion_mask"], c.cliprange, c.cliprange_value, c.vf_coef)
    vclip = ((values - mb["values"]).abs() > c.cliprange_value).float()
    stats = {**ppo_diagnostics(logprobs, mb["logprobs"], mb["advantages"], mb["completion_mask"], c.cliprange),
             "loss/policy": pg.item(), "loss/value": vf.item(),
             "val/clipfrac": float(masked_mean(vclip, mb["completion_mask"])),
             "val/ratio": float(masked_mean((logprobs - mb["logprobs"]).detach().exp(), mb["completion_mask"]))}
    return loss, stats


def iteration_metrics(config: PPOConfig, batch: dict, stats: list[dict], iteration: int,
                      kl_coef: float | None = None) -> dict:
    """One iteration's log row under TRL's PPO names, from its batch and its minibatches' ``stats``.

    ``kl_coef`` is the coefficient the batch's rewards were shaped with (default ``config.kl_coef``);
    with ``adap_kl_ctrl`` it is logged as ``objective/kl_coef`` (TRL's name up to v0.11)."""
    c = config
    coef = c.kl_coef if kl_coef is None else kl_coef
    mean = lambda key: sum(s[key] for s in stats) / len(stats)  # noqa: E731
    kl_sum = batch["kl"].sum(1)
    non_score = (-coef * batch["kl"]).sum(1)
    row = {"objective/kl": float(kl_sum.mean()), "objective/entropy": float(-batch["logprobs"].sum(1).mean()),
           "objective/non_score_reward": float(non_score.mean()),
           "objective/rlhf_reward": float((batch["scores"] + non_score).mean()),
           "objective/scores": float(batch["scores"].mean()),
           "policy/approxkl_avg": mean("approx_kl"), "policy/clipfrac_avg": mean("clip_fraction"),
           "loss/policy_avg": mean("loss/policy"), "loss/value_avg": mean("loss/value"),
           "val/clipfrac_avg": mean("val/clipfrac"), "val/ratio": mean("val/ratio"),
           "val/num_eos_tokens": int(batch["finished"].sum()), "lr": c.learning_rate,
           "episode": (iteration + 1) * c.batch_size}
    if c.adap_kl_ctrl:
        row["objective/kl_coef"] = float(coef)
    return row


def disable_dropout(model) -> None:
    """Set every dropout probability to 0: with dropout the two forward passes of one policy differ,
    the ratio is not 1 before any update, and the KL to the reference is noisy."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class PPORLHFTrainer:
    """PPO-RLHF on a causal LM: ``trainer.train(iterations)``; logs go to ``trainer.history``.

    ``policy`` is trained in place; a frozen copy of it is the reference. ``reward_model`` is
    frozen. ``value_model`` comes from :func:`rlcourse.lm.value_model.make_value_model`.
    ``prompt_fn(n, rng)`` makes prompts (e.g. ``task.prompts``); ``gold_fn(prompts, completions)``,
    if given, is logged as ``gold/scores`` next to the proxy's ``objective/scores``.
    """

    def __init__(self, config: PPOConfig, policy, tokenizer, reward_model, value_model, prompt_fn,
                 gold_fn=None, ptx_fn=None):
        if config.ptx_coef > 0 and ptx_fn is None:
            raise ValueError("ptx_coef > 0 needs ptx_fn(n, rng) -> n {'prompt', 'completion'} examples of the "
                             "old task (PPO-ptx's pretraining data)")
        self.config, self.policy, self.tokenizer = config, policy, tokenizer
        self.ptx_fn, self.ptx_draws = ptx_fn, 0
        # A reward model (scored at the last real token), or any reward function
        # f(prompts, completions) -> tensor, e.g. a task's verifier (the capstone uses one).
        self.reward_model = reward_model.eval() if isinstance(reward_model, torch.nn.Module) else reward_model
        self.value_model = value_model
        self.prompt_fn, self.gold_fn = prompt_fn, gold_fn
        if config.disable_dropout:
            for model in (policy, value_model):
                disable_dropout(model)
        self.ref_policy = frozen_copy(policy)  # our own copy; the reward model is only used under no_grad
        self.device = next(policy.parameters()).device
        self.optimizer = torch.optim.AdamW([*policy.parameters(), *value_model.parameters()],
                                           lr=config.learning_rate, weight_decay=0.0)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.rng_seed, self.iteration, self.history = config.seed, 0, []
        self.kl_coef = config.kl_coef   # the coefficient in use: config.kl_coef, moved by the controller if on

    @torch.no_grad()
    def rollout(self, prompts: list[str]) -> dict:
        """Sample, score and evaluate one batch; every tensor here is a constant for the update."""
        c = self.config
        ro = sample(self.policy, self.tokenizer, prompts, c.response_length, temperature=c.temperature,
                    generator=self.generator)
        batch = {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask, "completion_ids": ro.completion_ids,
                 "completion_mask": ro.completion_mask, "logprobs": ro.logprobs}
        args = (ro.prompt_ids, ro.completion_ids, ro.completion_mask, ro.prompt_mask, c.temperature)
        batch["ref_logprobs"] = sequence_logprobs(self.ref_policy, *args)
        if isinstance(self.reward_model, torch.nn.Module):
            scores = score_completions(self.reward_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                       ro.completion_mask)
        else:
            scores = torch.as_tensor(self.reward_model(ro.prompts, ro.completions), dtype=torch.float32,
                                     device=self.device)
        finished = ro.finished
        scores = eos_rule(scores - c.reward_bias, finished, c.missing_eos_penalty, c.non_eos_score)
        self.value_model.eval()
        batch["values"] = token_values(self.value_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                       ro.completion_mask)
        batch.update(scores=scores, finished=finished, prompts=ro.prompts, completions=ro.completions)
        return batch

    def token_rewards(self, batch: dict):
        c = self.config
        return kl_shaped_rewards(batch["scores"], batch["logprobs"], batch["ref_logprobs"],
                                 batch["completion_mask"], self.kl_coef, c.kl_estimator)

    def advantages(self, batch: dict):
        c = self.config
        return advantages_and_returns(batch["rewards"], batch["values"], batch["completion_mask"], c.gamma,
                                      c.lam, c.whiten_rewards, c.whiten_advantages)

    def loss(self, mb: dict):
        """The loss of one minibatch and its parts; the forward passes run in train mode."""
        logprobs = sequence_logprobs(self.policy, mb["prompt_ids"], mb["completion_ids"], mb["completion_mask"],
                                     mb["prompt_mask"], self.config.temperature)
        values = token_values(self.value_model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                              mb["completion_mask"])
        loss, stats = minibatch_loss(self.config, logprobs, values, mb)
        if self.config.ptx_coef > 0:   # PPO-ptx: a fresh batch of old-task text for every minibatch
            examples = self.ptx_fn(len(mb["completion_ids"]), self.config.seed * 1_000_003 + self.ptx_draws)
            self.ptx_draws += 1
            ptx = ptx_loss(self.policy, self.tokenizer, examples)
            loss = loss + self.config.ptx_coef * ptx
            stats["loss/ptx"] = ptx.item()
        return loss, stats

    def step(self) -> dict:
        """One PPO-RLHF iteration (rollout, shaping, GAE, updates); returns and logs its metrics."""
        c = self.config
        prompts = self.prompt_fn(c.batch_size, self.rng_seed * 100_003 + self.iteration)
        batch = self.rollout(prompts)
        batch["rewards"], batch["kl"] = self.token_rewards(batch)
        batch["advantages"], batch["returns"] = self.advantages(batch)
        self.policy.train()
        self.value_model.train()
        size = c.batch_size // c.num_mini_batches
        gen = torch.Generator().manual_seed(c.seed * 7919 + self.iteration)
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        stats = []
        for _ in range(c.num_ppo_epochs):
            order = torch.randperm(c.batch_size, generator=gen).to(self.device)
            for start in range(0, c.batch_size, size):
                rows = order[start:start + size]
                loss, s = self.loss({k: v[rows] for k, v in tensors.items()})
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                stats.append(s)
        self.policy.eval()
        self.value_model.eval()
        return self._log(batch, stats)

    def next_kl_coef(self, kl_coef: float, kl: float) -> float:
        """The controller's next coefficient after an iteration of ``batch_size`` rollouts whose KL was ``kl``."""
        c = self.config
        return adaptive_kl_coef(kl_coef, kl, target=c.target, n_steps=c.batch_size, horizon=c.horizon)

    def _log(self, batch: dict, stats: list[dict]) -> dict:
        c = self.config
        row = iteration_metrics(c, batch, stats, self.iteration, self.kl_coef)
        if self.gold_fn is not None:
            row["gold/scores"] = float(torch.as_tensor(self.gold_fn(batch["prompts"], batch["completions"])).mean())
        if c.adap_kl_ctrl:   # the next batch is shaped with the updated coefficient
            self.kl_coef = self.next_kl_coef(self.kl_coef, row["objective/kl"])
        self.iteration += 1
        self.history.append(row)
        return row

    def train(self, iterations: int, progress: bool = True) -> list[dict]:
        """Run ``iterations`` PPO iterations with a progress bar showing the live score and KL."""
        bar = tqdm(range(iterations), desc="PPO-RLHF", disable=not progress)
        for _ in bar:
            row = self.step()
            shown = {"score": row["objective/scores"], "kl": row["objective/kl"]}
            if "gold/scores" in row:
                shown["gold"] = row["gold/scores"]
            bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items()})
        return self.history
