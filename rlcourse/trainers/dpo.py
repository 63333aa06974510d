"""A thin DPO trainer for any ``transformers`` causal LM, with TRL's ``DPOConfig`` names.

Pseudocode (Rafailov et al. 2023, arXiv 2305.18290): no sampling, no reward model, no value
function, only the log-probs of fixed pairs under two models:

    for each batch of pairs (x, y_w, y_l):
        log pi(y|x)     = sum_t log pi_theta(y_t | x, y_<t)        for y in (y_w, y_l), one forward
        log pi_ref(y|x) = the same under the frozen reference      (or read from a precomputed table)
        loss = preference_objective(..., beta, loss_type, loss_weights, label_smoothing, ...)
        AdamW step (gradient clipped), learning rate decayed linearly to 0

Every formula lives in :mod:`rlcourse.losses.dpo` and :mod:`rlcourse.losses.beyond_dpo` (SimPO,
ORPO, KTO, R-DPO: lesson 11b); this module only encodes the pairs, runs the
forward passes and logs what TRL's ``DPOTrainer`` logs, under the same names: ``loss``,
``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
``logps/chosen``, ``logps/rejected``.

Encoding is the reward model's (:func:`rlcourse.tasks.reward_model.encode_preference_pairs`, lesson
08): ``<bos> prompt`` left-padded as the sampler does, each completion followed by ``<eos>`` and
right-padded, chosen rows then rejected rows; position ids come from the attention mask, so the
log-probs are the ones :func:`rlcourse.lm.sample` gives the same tokens.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from rlcourse.kl import exact_kl
from rlcourse.losses.beyond_dpo import ALL_PREFERENCE_LOSS_TYPES, REFERENCE_FREE_LOSS_TYPES, preference_objective
from rlcourse.losses.dpo import dpo_implicit_reward
from rlcourse.lm.logprobs import next_token_logprobs, sequence_logprobs
from rlcourse.lm.model import frozen_copy
from rlcourse.tasks.reward_model import encode_preference_pairs
from rlcourse.lm.sampling import sample
from rlcourse.lm.tokenizer import check_encodable

__all__ = ["DPOConfig", "check_preference_pairs", "select_pairs", "pair_token_logprobs", "batch_loss", "dpo_metrics",
           "train_dpo", "reward_and_kl", "kto_mismatched_pairs"]


@dataclass
class DPOConfig:
    """Settings named as TRL's ``DPOConfig``; defaults are TRL 1.16's except where noted.

    * ``beta`` (0.1): strength of the KL regularisation, the inverse temperature of the implicit reward
      (SimPO's ``beta``, ORPO's ``lambda``, KTO's ``beta``).
    * ``loss_type`` ("sigmoid"): one of ``sigmoid``, ``hinge``, ``ipo``, ``robust``, ``sft``, ``sigmoid_norm``
      (length-normalised DPO), ``simpo``, ``orpo``, ``kto`` (:mod:`rlcourse.losses.beyond_dpo`), or a list.
    * ``loss_weights`` (None = 1 each): one weight per loss type, e.g. ``["sigmoid", "sft"], [1, 1]``.
    * ``label_smoothing`` (0): the assumed label-flip rate of the ``robust`` loss.
    * ``learning_rate``: **1e-4** here, TRL's default is 1e-6 (for billion-parameter models; a
      100k-parameter GPT barely moves at 1e-6).
    * ``per_device_train_batch_size`` (8), ``num_train_epochs`` (3), ``max_steps`` (-1: use epochs),
      ``max_grad_norm`` (1.0), ``weight_decay`` (0.0), ``lr_scheduler_type`` ("linear" or "constant"),
      ``precompute_ref_log_probs`` (False), ``seed`` (42), ``logging_steps`` (bar refresh only:
      every step is recorded).
    * Lesson 11b (:func:`rlcourse.losses.beyond_dpo.preference_objective`): ``simpo_gamma`` (0.5, TRL's
      ``CPOConfig``; our ``simpo`` is SimPO alone, TRL's ``CPOConfig(loss_type="simpo")`` adds an NLL
      term unless ``cpo_alpha=0``), ``rdpo_alpha`` (0: R-DPO's length term on ``sigmoid``; not a TRL
      option), ``desirable_weight`` and ``undesirable_weight`` (1, TRL's ``KTOConfig``). ``orpo``'s NLL
      covers the chosen completion's tokens (TRL's ``ORPOTrainer`` counts the prompt's tokens too). Losses that never
      read the reference (``simpo``, ``orpo``, ``sft``) keep no reference copy and compute no reference
      log-probs. ``kto`` reads its reference point from mismatched pairs (:func:`kto_mismatched_pairs`):
      one more forward pass per step, without gradient, as TRL's ``KTOTrainer`` makes.
    """

    beta: float = 0.1
    loss_type: str | list[str] = "sigmoid"
    loss_weights: list[float] | None = None
    label_smoothing: float = 0.0
    learning_rate: float = 1e-4
    per_device_train_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    lr_scheduler_type: str = "linear"
    precompute_ref_log_probs: bool = False
    seed: int = 42
    logging_steps: int = 10
    # lesson 11b: SimPO's target margin, R-DPO's length penalty, KTO's weights
    simpo_gamma: float = 0.5
    rdpo_alpha: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_types: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.loss_types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        for t in self.loss_types:
            if t not in ALL_PREFERENCE_LOSS_TYPES:
                raise ValueError(f"loss_type must be one of {ALL_PREFERENCE_LOSS_TYPES} (or a list of them), got {t!r}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_types):
            raise ValueError(f"loss_weights must have one weight per loss type ({len(self.loss_types)}), "
                             f"got {self.loss_weights!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not isinstance(self.per_device_train_batch_size, int) or self.per_device_train_batch_size < 1:
            raise ValueError(f"per_device_train_batch_size must be a positive integer, "
                             f"got {self.per_device_train_batch_size!r}")
        if self.lr_scheduler_type not in ("linear", "constant"):
            raise ValueError(f"lr_scheduler_type must be 'linear' or 'constant', got {self.lr_scheduler_type!r}")
        if self.max_steps == 0 or (self.max_steps < 0 and not self.num_train_epochs > 0):
            raise ValueError("set max_steps > 0 or num_train_epochs > 0")


def check_preference_pairs(tokenizer, pairs: list[dict]) -> None:
    """Raise a ``ValueError`` naming the first malformed ``{"prompt", "chosen", "rejected"}`` row."""
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("pairs must be a non-empty list of {'prompt', 'chosen', 'rejected'} dicts")
    for i, row in enumerate(pairs):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise ValueError(f"pairs[{i}] must be a dict with string 'prompt', 'chosen' and 'rejected', got {row!r}")
    check_encodable(tokenizer, [r["prompt"] + r["chosen"] + r["rejected"] for r in pairs], "pairs")


def select_pairs(data: dict, idx: torch.Tensor) -> dict:
    """Pairs ``idx`` of :func:`rlcourse.tasks.reward_model.encode_preference_pairs`' layout (all chosen
    rows, then all rejected rows), in the same layout, with the columns that are all padding dropped."""
    n = data["prompt_ids"].shape[0] // 2
    both = torch.cat([idx, idx + n])
    batch = {k: v[both] for k, v in data.items()}
    keep_prompt, keep_completion = batch["prompt_mask"].any(0), batch["completion_mask"].any(0)
    for k, keep in (("prompt_ids", keep_prompt), ("prompt_mask", keep_prompt),
                    ("completion_ids", keep_completion), ("completion_mask", keep_completion)):
        batch[k] = batch[k][:, keep]
    return batch


def pair_token_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (B, T) of the chosen and of the rejected completions, 0 on padding.

    One forward over the stacked ``[chosen; rejected]`` rows (as TRL does).
    """
    logp = sequence_logprobs(model, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"],
                             batch["prompt_mask"])
    return logp.chunk(2, dim=0)


def dpo_metrics(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float) -> dict:
    """TRL's ``DPOTrainer`` metrics of one batch (means over its pairs), as floats."""
    with torch.no_grad():
        chosen = dpo_implicit_reward(chosen_logps.detach(), ref_chosen_logps, beta)
        rejected = dpo_implicit_reward(rejected_logps.detach(), ref_rejected_logps, beta)
        return {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
                "rewards/accuracies": (chosen > rejected).float().mean().item(),
                "rewards/margins": (chosen - rejected).mean().item(),
                "logps/chosen": chosen_logps.detach().mean().item(),
                "logps/rejected": rejected_logps.detach().mean().item()}


# What a DPO run records at every step (TRL's DPOTrainer names), besides "step".
HISTORY_KEYS = ("loss", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected")


def lr_factor(args: DPOConfig, step: int, steps: int) -> float:
    """The learning rate of ``step`` (0-based) of ``steps``, as a fraction of ``args.learning_rate``:
    ``max(0, 1 - step / steps)`` for the ``linear`` schedule (to 0 and then held there, as TRL's: a step past
    ``steps`` must not run at a negative rate, gradient ascent), 1 for ``constant``."""
    return max(0.0, 1.0 - step / steps) if args.lr_scheduler_type == "linear" else 1.0


def _summed_logps(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t m_t log pi(y_t | x, y_<t)``, shape (B,): padding selected away with ``torch.where`` (it may hold
    anything, NaN or inf included: the package's mask convention), not multiplied by 0."""
    return torch.where(mask.bool(), token_logps, 0.0).sum(-1)


def batch_loss(args: DPOConfig, chosen_tok: torch.Tensor, rejected_tok: torch.Tensor, completion_mask: torch.Tensor,
               ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, kl_logps: torch.Tensor | None = None,
               ref_kl_logps: torch.Tensor | None = None, *,
               ipo_per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch's loss (:func:`rlcourse.losses.beyond_dpo.preference_objective` with ``args``' settings), and the
    chosen and rejected sequence log-probs it used. ``completion_mask`` is the batch's, chosen rows first;
    ``kl_logps`` and ``ref_kl_logps``: KTO's mismatched pairs under the policy and the reference;
    ``ipo_per_token``: IPO's log-ratios averaged per token (TRL's ``DPOTrainer``) or whole (its ``OnlineDPOTrainer``).
    Token log-probs off the mask are not read (they may hold anything)."""
    chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
    chosen_logps, rejected_logps = _summed_logps(chosen_tok, chosen_mask), _summed_logps(rejected_tok, rejected_mask)
    loss = preference_objective(chosen_tok, rejected_tok, chosen_mask, rejected_mask, ref_chosen, ref_rejected,
                                beta=args.beta, loss_type=args.loss_types, loss_weights=args.loss_weights,
                                label_smoothing=args.label_smoothing, simpo_gamma=args.simpo_gamma,
                                rdpo_alpha=args.rdpo_alpha, desirable_weight=args.desirable_weight,
                                undesirable_weight=args.undesirable_weight, kl_logps=kl_logps,
                                ref_kl_logps=ref_kl_logps, ipo_per_token=ipo_per_token)
    return loss, chosen_logps, rejected_logps


def kto_mismatched_pairs(pairs: list[dict]) -> list[dict]:
    """KTO's pairs for its reference point: prompt ``i`` with the chosen and rejected completions of pair ``i - 1``.

    ``z0`` estimates ``KL(pi || pi_ref)`` from completions that answer *another* prompt, so that no
    example's own log-ratio sets the point it is compared with (Ethayarajh et al. 2024, section 4.1).
    TRL's ``KTOTrainer`` shifts the completions by one within each chunk of
    ``per_device_train_batch_size`` examples; here the shift runs over the whole list (the first prompt
    takes the last pair's completions): the same estimator, other partners.
    """
    return [{"prompt": row["prompt"], "chosen": pairs[i - 1]["chosen"], "rejected": pairs[i - 1]["rejected"]}
            for i, row in enumerate(pairs)]


def uses_kto(args: DPOConfig) -> bool:
    """Whether ``args`` trains with KTO (which needs the mismatched pairs' log-probs)."""
    return "kto" in args.loss_types


def reference_free(args: DPOConfig) -> bool:
    """Whether every loss of ``args`` ignores the reference model (SimPO, ORPO, SFT)."""
    return all(t in REFERENCE_FREE_LOSS_TYPES for t in args.loss_types)


@torch.no_grad()
def _reference_logps(ref_model, batch: dict, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs (B,) of chosen and rejected under the reference, in chunks."""
    chosen, rejected = [], []
    n = batch["prompt_ids"].shape[0] // 2
    for i in range(0, n, batch_size):
        rows = torch.arange(i, min(i + batch_size, n), device=batch["prompt_ids"].device)
        pair = select_pairs(batch, rows)
        c, r = pair_token_logprobs(ref_model, pair)
        chosen_mask, rejected_mask = pair["completion_mask"].chunk(2, dim=0)
        chosen.append(_summed_logps(c, chosen_mask))
        rejected.append(_summed_logps(r, rejected_mask))
    return torch.cat(chosen), torch.cat(rejected)


def train_dpo(model, tokenizer, pairs: list[dict], args: DPOConfig | None = None, ref_model=None,
              progress: bool = True) -> dict:
    """Train ``model`` in place by DPO on preference ``pairs``; return the per-step history.

    ``ref_model`` defaults to a frozen copy of ``model`` as it is now. With
    ``args.precompute_ref_log_probs`` the reference log-probs of every pair are computed once up
    front (and the copy is dropped). Dropout is off during training (TRL's ``disable_dropout``).
    History: ``{"step": [...], "loss": [...], "learning_rate": [...], "rewards/chosen": [...], ...,
    "seconds": float}``.
    """
    args = args or DPOConfig()
    dev = next(model.parameters()).device
    check_preference_pairs(tokenizer, pairs)
    data = encode_preference_pairs(tokenizer, pairs, dev)   # lesson 08's layout: chosen rows, then rejected
    n = len(pairs)
    bs = args.per_device_train_batch_size
    steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * math.ceil(n / bs))
    no_reference = reference_free(args)
    if no_reference:   # SimPO, ORPO: no reference copy, no reference forward; its log-probs enter no loss
        ref_model = None
        ref_table = tuple(torch.zeros(n, device=dev) for _ in range(2))
    elif ref_model is None:
        ref_model = frozen_copy(model)
    if ref_model is not None:
        ref_model.eval()  # its forwards run under no_grad
        ref_table = None
    kl_data = encode_preference_pairs(tokenizer, kto_mismatched_pairs(pairs), dev) if uses_kto(args) else None
    kl_table = None
    if args.precompute_ref_log_probs and not no_reference:
        ref_table = _reference_logps(ref_model, data, max(bs, 64))
        if kl_data is not None:
            kl_table = _reference_logps(ref_model, kl_data, max(bs, 64))
        ref_model = None  # not needed any more: free the copy

    model.eval()  # no dropout: the policy and its reference must score tokens the same way
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                            weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(args, s, steps))
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.empty(0, dtype=torch.long)
    history = {"step": [], **{k: [] for k in HISTORY_KEYS}}
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"DPO ({'+'.join(args.loss_types)}, beta={args.beta})", disable=not progress)
    for step in bar:
        if order.numel() == 0:  # a new epoch: a fresh shuffle of the pairs
            order = torch.randperm(n, generator=gen)
        idx, order = order[:bs].to(dev), order[bs:]
        batch = select_pairs(data, idx)   # padding-only columns dropped: a shorter forward, same numbers
        chosen_tok, rejected_tok = pair_token_logprobs(model, batch)
        if ref_table is not None:
            ref_chosen, ref_rejected = ref_table[0][idx], ref_table[1][idx]
        else:
            ref_chosen, ref_rejected = _reference_logps(ref_model, batch, bs)
        kl = ref_kl = None
        if kl_data is not None:   # KTO's reference point: mismatched pairs, no gradient (as TRL)
            kl_batch = select_pairs(kl_data, idx)
            with torch.no_grad():
                kl = _summed_logps(torch.cat(pair_token_logprobs(model, kl_batch)), kl_batch["completion_mask"])
            ref_kl = (torch.cat([kl_table[0][idx], kl_table[1][idx]]) if kl_table is not None
                      else torch.cat(_reference_logps(ref_model, kl_batch, bs)))
        loss, chosen_logps, rejected_logps = batch_loss(args, chosen_tok, rejected_tok, batch["completion_mask"],
                                                        ref_chosen, ref_rejected, kl, ref_kl)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"DPO loss is {loss.item()} at step {step}: lower learning_rate or check the data")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.max_grad_norm and args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        history["learning_rate"].append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()

        history["step"].append(step + 1)
        history["loss"].append(loss.item())
        for k, v in dpo_metrics(chosen_logps, rejected_logps, ref_chosen, ref_rejected, args.beta).items():
            history[k].append(v)
        if step % max(1, args.logging_steps) == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}", margin=f"{history['rewards/margins'][-1]:.2f}",
                            acc=f"{history['rewards/accuracies'][-1]:.2f}")
    history["seconds"] = time.perf_counter() - start
    return history


@torch.no_grad()
def reward_and_kl(model, ref_model, tokenizer, task, prompts: list[str], max_new_tokens: int | None = None,
                  generator: torch.Generator | None = None) -> tuple[float, float]:
    """Mean task reward of completions sampled from ``model`` (temperature 1) and ``KL(pi || pi_ref)``.

    The KL of whole completions is estimated without the noise of a log-ratio: along each sampled
    completion the exact next-token KL is summed over its real tokens,
    ``KL(pi || pi_ref) = E_{y~pi} [ sum_t KL(pi(.|x, y_<t) || pi_ref(.|x, y_<t)) ]`` (the chain rule
    of KL), then averaged over prompts.
    """
    roll = sample(model, tokenizer, prompts, max_new_tokens or task.max_new_tokens, generator=generator)
    reward = task.reward(roll.prompts or list(prompts), roll.completions).float().mean().item()
    logp = next_token_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.prompt_mask)
    logq = next_token_logprobs(ref_model, roll.prompt_ids, roll.completion_ids, roll.prompt_mask)
    per_token = exact_kl(logp, logq) * roll.completion_mask.to(logp.dtype)
    return reward, per_token.sum(-1).mean().item()
