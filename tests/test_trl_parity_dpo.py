"""Parity with TRL 1.16: our DPO losses, gradients and implicit rewards equal TRL's DPOTrainer's.

TRL computes its loss inside ``DPOTrainer._compute_loss(model, inputs)``: the model returns
per-token log-probs (through TRL's fused LM head), the reference log-probs come from a reference
model or, with ``precompute_ref_log_probs``, from the batch. We run *that* code on fixed log-probs:
a stand-in model returns a leaf tensor of per-token log-probs, the reference sequence log-probs
ride in the batch, and TRL's loss, the gradient it sends back to the log-probs and its logged
``rewards/*`` and ``logps/*`` metrics are compared with :mod:`rlcourse.losses.dpo` on the same
numbers. One real DPOTrainer (on the tiny checkpoint, CPU) serves the whole module.
"""
import types

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import load_checkpoint, save_checkpoint
from rlcourse.trainers.dpo import dpo_metrics
from rlcourse.losses import dpo_implicit_reward, preference_loss


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    import datasets
    from trl import DPOConfig, DPOTrainer

    root = tmp_path_factory.mktemp("trl_dpo")
    model, tokenizer = load_checkpoint("preference-sft", device="cpu")
    path = save_checkpoint(model, tokenizer, root / "model")
    pairs = datasets.Dataset.from_list([{"prompt": "ab:", "chosen": "abba", "rejected": "hh"},
                                        {"prompt": "cd:", "chosen": "dc", "rejected": "hgfe"}])
    args = DPOConfig(output_dir=str(root / "out"), use_cpu=True, bf16=False, report_to=[], beta=0.1,
                     per_device_train_batch_size=2, disable_tqdm=True, save_strategy="no")
    trainer = DPOTrainer(model=str(path), args=args, train_dataset=pairs, processing_class=tokenizer)
    # The reference log-probs of these tests are fixed numbers carried in the batch, which is the
    # path TRL takes when it precomputes them (precompute_ref_log_probs=True).
    trainer.precompute_ref_logps = True
    return trainer


def _fixed_batch(seed: int, pairs: int = 5, width: int = 9, scale: float = 3.0):
    """Per-token log-probs (2B, width - 1) for [chosen; rejected] behind a prompt of varied length,
    completions of varied length, 0 on every position outside the completion."""
    gen = torch.Generator().manual_seed(seed)
    completion_mask = torch.zeros(2 * pairs, width, dtype=torch.long)
    for row in range(2 * pairs):
        start = int(torch.randint(1, 4, (1,), generator=gen))           # the prompt ends here
        end = int(torch.randint(start + 1, width + 1, (1,), generator=gen))
        completion_mask[row, start:end] = 1
    shift_mask = completion_mask[:, 1:]
    token_logps = -scale * torch.rand(2 * pairs, width - 1, generator=gen, dtype=torch.float64)
    token_logps = (token_logps * shift_mask).requires_grad_(True)
    ref = token_logps.detach().sum(-1) + torch.randn(2 * pairs, generator=gen, dtype=torch.float64)
    return token_logps, completion_mask, ref


def _run_trl(trainer, token_logps, completion_mask, ref, beta, loss_type, loss_weights, label_smoothing):
    """TRL's own ``_compute_loss`` on these numbers; returns (loss, grad, metrics)."""
    trainer.beta, trainer.label_smoothing = beta, label_smoothing
    trainer.loss_types = list(loss_type)
    trainer.loss_weights = loss_weights or [1.0] * len(loss_type)
    leaf = token_logps.detach().clone().requires_grad_(True)
    n, width = completion_mask.shape

    def stand_in_model(**kwargs):  # what TRL's fused LM head returns, for our fixed log-probs
        return types.SimpleNamespace(log_probs=leaf, entropy=torch.zeros(n, width - 1, dtype=leaf.dtype),
                                     mean_logits=torch.zeros(n, width - 1), is_top1=torch.zeros(n, width - 1, dtype=torch.bool))

    ref_chosen, ref_rejected = ref.chunk(2)
    inputs = {"input_ids": torch.zeros(n, width, dtype=torch.long), "attention_mask": torch.ones(n, width, dtype=torch.long),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode].clear()
    loss = trainer._compute_loss(stand_in_model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics[mode].items()}
    return loss.detach(), leaf.grad, metrics


def _run_ours(token_logps, completion_mask, ref, beta, loss_type, loss_weights, label_smoothing):
    leaf = token_logps.detach().clone().requires_grad_(True)
    shift_mask = completion_mask[:, 1:]
    chosen_tok, rejected_tok = leaf.chunk(2)
    chosen_mask, rejected_mask = shift_mask.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    loss = preference_loss(chosen_tok.sum(-1), rejected_tok.sum(-1), ref_chosen, ref_rejected, beta=beta,
                           loss_type=loss_type, loss_weights=loss_weights, label_smoothing=label_smoothing,
                           chosen_lengths=chosen_mask.sum(-1), rejected_lengths=rejected_mask.sum(-1),
                           chosen_token_logps=chosen_tok, chosen_mask=chosen_mask)
    loss.backward()
    metrics = dpo_metrics(chosen_tok.sum(-1), rejected_tok.sum(-1), ref_chosen, ref_rejected, beta)
    return loss.detach(), leaf.grad, metrics


CASES = [(["sigmoid"], None, 0.0, 0.1), (["sigmoid"], None, 0.0, 2.0), (["hinge"], None, 0.0, 0.1),
         (["hinge"], None, 0.0, 0.7), (["ipo"], None, 0.0, 0.1), (["ipo"], None, 0.0, 1.5),
         (["robust"], None, 0.1, 0.1), (["robust"], None, 0.3, 0.5), (["sft"], None, 0.0, 0.1),
         (["sigmoid", "sft"], [1.0, 1.0], 0.0, 0.1), (["ipo", "sft"], [0.5, 2.0], 0.0, 0.3),
         (["sigmoid", "hinge", "robust"], [0.8, 0.2, 1.0], 0.2, 0.4),
         (["sigmoid_norm"], None, 0.0, 0.1), (["sigmoid_norm"], None, 0.0, 5.0),      # length-normalised DPO (Tulu 3)
         (["sigmoid_norm", "sft"], [1.0, 0.5], 0.0, 2.0)]


@pytest.mark.parametrize("loss_type, loss_weights, label_smoothing, beta", CASES,
                         ids=[f"{'+'.join(c[0])}-beta{c[3]}-ls{c[2]}" for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradient_and_rewards_equal_trl(trl_trainer, loss_type, loss_weights, label_smoothing, beta, seed):
    scale = 3.0 if seed == 0 else 40.0        # seed 1: large log-ratios (saturated sigmoids, hinge at 0)
    token_logps, completion_mask, ref = _fixed_batch(seed, scale=scale)
    args = (token_logps, completion_mask, ref, beta, loss_type, loss_weights, label_smoothing)
    trl_loss, trl_grad, trl_metrics = _run_trl(trl_trainer, *args)
    our_loss, our_grad, our_metrics = _run_ours(*args)
    torch.testing.assert_close(our_loss, trl_loss.to(our_loss.dtype), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, atol=1e-6, rtol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        assert our_metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6), name


@pytest.mark.parametrize("seed", [0, 1])
def test_train_dpos_batch_loss_keeps_trls_per_token_ipo(trl_trainer, seed):
    """Offline DPO's IPO, through the trainer's own batch_loss, is TRL's DPOTrainer's: log-ratios averaged per
    token (online DPO's is not: see tests/test_trl_parity_beyond_dpo.py)."""
    from rlcourse.trainers.dpo import DPOConfig, batch_loss

    token_logps, completion_mask, ref = _fixed_batch(seed)
    trl_loss, trl_grad, _ = _run_trl(trl_trainer, token_logps, completion_mask, ref, 0.3, ["ipo"], None, 0.0)
    leaf = token_logps.detach().clone().requires_grad_(True)
    loss, _, _ = batch_loss(DPOConfig(loss_type="ipo", beta=0.3), *leaf.chunk(2), completion_mask[:, 1:], *ref.chunk(2))
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.to(loss.dtype), atol=1e-6, rtol=1e-6)
    real = completion_mask[:, 1:].bool()   # TRL sums every column (its padding holds 0); ours selects the real ones
    torch.testing.assert_close(leaf.grad[real], trl_grad[real], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("ipo_per_token", [True, False])
def test_train_dpos_batch_loss_keeps_trls_length_normalised_dpo(trl_trainer, ipo_per_token):
    """Length-normalised DPO through the trainer's own batch_loss is TRL's ``sigmoid_norm``: each log-ratio divided by
    its completion's length, whichever IPO convention the trainer keeps (online DPO passes ipo_per_token=False)."""
    from rlcourse.trainers.dpo import DPOConfig, batch_loss

    token_logps, completion_mask, ref = _fixed_batch(2)
    trl_loss, trl_grad, _ = _run_trl(trl_trainer, token_logps, completion_mask, ref, 3.0, ["sigmoid_norm"], None, 0.0)
    leaf = token_logps.detach().clone().requires_grad_(True)
    loss, _, _ = batch_loss(DPOConfig(loss_type="sigmoid_norm", beta=3.0), *leaf.chunk(2), completion_mask[:, 1:],
                            *ref.chunk(2), ipo_per_token=ipo_per_token)
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.to(loss.dtype), atol=1e-6, rtol=1e-6)
    real = completion_mask[:, 1:].bool()
    torch.testing.assert_close(leaf.grad[real], trl_grad[real], atol=1e-6, rtol=1e-6)


def test_the_gradient_is_not_trivially_zero(trl_trainer):
    """Guard against a vacuous comparison: the fixed batch gives TRL a real, non-zero gradient."""
    token_logps, completion_mask, ref = _fixed_batch(0)
    _, grad, _ = _run_trl(trl_trainer, token_logps, completion_mask, ref, 0.1, ["sigmoid"], None, 0.0)
    assert grad.abs().sum() > 1e-3


def test_implicit_reward_equals_trls_logged_rewards(trl_trainer):
    token_logps, completion_mask, ref = _fixed_batch(3)
    _, _, metrics = _run_trl(trl_trainer, token_logps, completion_mask, ref, 0.25, ["sigmoid"], None, 0.0)
    chosen, rejected = token_logps.detach().sum(-1).chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    assert dpo_implicit_reward(chosen, ref_chosen, 0.25).mean().item() == pytest.approx(metrics["rewards/chosen"], abs=1e-6)
    assert dpo_implicit_reward(rejected, ref_rejected, 0.25).mean().item() == pytest.approx(metrics["rewards/rejected"], abs=1e-6)


def test_trainer_attributes_are_the_config_names(tmp_path, trl_trainer):
    """The attributes set in these tests are the ones TRL's DPOTrainer fills from DPOConfig."""
    from trl import DPOConfig

    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], beta=0.3,
                     loss_type=["ipo", "sft"], loss_weights=[0.5, 2.0], label_smoothing=0.2)
    assert args.loss_type == ["ipo", "sft"]
    for attribute in ("beta", "loss_types", "loss_weights", "label_smoothing", "precompute_ref_logps"):
        assert hasattr(trl_trainer, attribute), attribute
