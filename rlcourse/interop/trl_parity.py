"""One fixed batch through TRL's GRPO loss and through ours: the parity check of lesson 13 and of
``tests/test_trl_parity_grpo.py``.

TRL's code is run, not copied: :func:`trl_grpo_loss` hands the batch to ``GRPOTrainer.compute_loss``
(which recomputes the policy's log-probs with TRL's own forward) and differentiates what it returns;
:func:`rlcourse_grpo_loss` computes the same quantity with :func:`rlcourse.lm.sequence_logprobs`,
:func:`rlcourse.losses.per_token_loss` and :func:`rlcourse.losses.aggregate_loss`. Both return the
loss and the gradient of every parameter, flattened into one vector.

The batch (:func:`fixed_completion_batch`) is deterministic: fixed prompts, completions of fixed
lengths (some ending in ``<eos>``, some cut at the maximum), old and reference log-probs equal to
the current ones plus seeded noise (so ratios leave the clip range), and seeded advantages.
Run it in float64 (``trainer.model.double()``): the two forward passes round differently in
float32, by about 1e-6 relative. In float64 the difference left (about 1e-7) is TRL 1.16's fused
output layer, which returns its per-token log-probs in float32 even from a float64 model.
"""
from __future__ import annotations

import warnings

import torch

from rlcourse.lm.logprobs import sequence_logprobs
from rlcourse.losses import aggregate_loss, per_token_loss

__all__ = ["PARITY_LENGTHS", "build_trl_trainer", "fixed_completion_batch", "set_trl_grpo_loss",
           "trl_grpo_loss", "rlcourse_grpo_loss", "flat_grad"]

# Completion lengths of the 16 rows (1 to 5 tokens): ragged, so the aggregations differ.
PARITY_LENGTHS = (1, 2, 3, 4, 5, 3, 2, 5, 4, 1, 5, 2, 3, 4, 5, 2)


def build_trl_trainer(trainer_class, config_class, model_path, tokenizer, dataset, reward_funcs,
                      output_dir, num_generations: int, max_completion_length: int, beta: float = 0.04):
    """A TRL ``GRPOTrainer`` or ``RLOOTrainer`` on CPU, offline, fp64 and in train mode, one batch per step.

    ``per_device_train_batch_size`` is the dataset's length; ``current_gradient_accumulation_steps``
    is set to 1 (TRL sets it in ``train()``, which is never called here).
    """
    args = config_class(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
                        per_device_train_batch_size=len(dataset), num_generations=num_generations,
                        max_completion_length=max_completion_length, beta=beta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(model=str(model_path), reward_funcs=reward_funcs, train_dataset=dataset,
                                processing_class=tokenizer, args=args)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.double().train()
    return trainer


def fixed_completion_batch(model, tokenizer, rows, max_completion_length: int, lengths=PARITY_LENGTHS,
                           seed: int = 0) -> dict:
    """The deterministic batch: ``rows`` (one prompt string per completion, all of one length, so
    no left padding), digit completions of ``lengths`` tokens (``<eos>`` last when shorter than
    ``max_completion_length``), and, from ``torch.Generator().manual_seed(seed)``:
    ``old = current + 0.3 noise``, ``ref = current + 0.2 noise`` (both 0 on padding) and standard
    normal advantages. ``current`` is ``model``'s log-probs (its dtype sets the batch's)."""
    gen = torch.Generator().manual_seed(seed)
    enc = tokenizer(list(rows), return_tensors="pt")
    prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
    B = len(rows)
    lengths = torch.tensor(lengths)
    if lengths.shape != (B,) or lengths.min() < 1 or lengths.max() > max_completion_length:
        raise ValueError(f"lengths must hold {B} values in [1, {max_completion_length}], got {lengths.tolist()}")
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    completion_ids = torch.tensor(digits)[torch.randint(0, 10, (B, max_completion_length), generator=gen)]
    completion_mask = (torch.arange(max_completion_length)[None] < lengths[:, None]).long()
    ended = lengths < max_completion_length
    completion_ids[torch.arange(B)[ended], lengths[ended] - 1] = tokenizer.eos_token_id
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    with torch.no_grad():
        current = sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype)) * completion_mask
    ref = (current + 0.2 * torch.randn(current.shape, generator=gen, dtype=current.dtype)) * completion_mask
    advantages = torch.randn(B, generator=gen, dtype=current.dtype)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=advantages, old=old, ref=ref,
                max_completion_length=max_completion_length)


def set_trl_grpo_loss(trainer, loss_type: str, importance_sampling_level: str = "token", beta: float = 0.0,
                      epsilon: float = 0.2, epsilon_high: float = 0.28, use_bias_correction_kl: bool = True):
    """Set the attributes TRL 1.16's ``GRPOTrainer._compute_loss`` reads (they are copied from its config at init)."""
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, importance_sampling_level, beta
    trainer.epsilon_low, trainer.epsilon_high = epsilon, epsilon_high
    trainer.args.use_bias_correction_kl = use_bias_correction_kl


def flat_grad(model) -> torch.Tensor:
    """Every parameter's ``.grad``, flattened into one vector."""
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def trl_grpo_loss(trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's loss on ``batch`` (``GRPOTrainer.compute_loss``) and its gradient, as set by :func:`set_trl_grpo_loss`."""
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs["old_per_token_logps"] = batch["old"]
    inputs["ref_per_token_logps"] = batch["ref"]
    inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), flat_grad(trainer.model)


def rlcourse_grpo_loss(model, batch: dict, loss_type: str, importance_sampling_level: str = "token",
                       beta: float = 0.0, epsilon: float = 0.2, epsilon_high: float = 0.28,
                       use_bias_correction_kl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Our loss on ``batch`` with the same settings, and its gradient with respect to ``model``'s parameters."""
    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"],
                                 batch["prompt_mask"])
    per_token = per_token_loss(logprobs, batch["old"], batch["advantages"], batch["completion_mask"],
                               loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high,
                               importance_sampling_level=importance_sampling_level, beta=beta,
                               ref_logprobs=batch["ref"], use_bias_correction_kl=use_bias_correction_kl)
    loss = aggregate_loss(per_token, batch["completion_mask"], loss_type,
                          max_completion_length=batch["max_completion_length"])
    loss.backward()
    return loss.detach(), flat_grad(model)
