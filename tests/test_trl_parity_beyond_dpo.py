"""Parity with TRL 1.16: SimPO, ORPO, KTO and online DPO in :mod:`rlcourse.losses.beyond_dpo` equal TRL's trainers.

TRL's own code runs on fixed log-probs, as in ``tests/test_trl_parity_dpo.py``: ``CPOTrainer.cpo_loss``
(``loss_type="simpo"``), ``ORPOTrainer.odds_ratio_loss``, ``KTOTrainer._compute_loss`` (a stand-in model
returns leaf log-probs) and ``OnlineDPOTrainer.training_step`` (generation, forward and reward replaced by
fixed completions, leaf log-probs and fixed scores). Losses and the gradients sent back to the
log-probs agree to 1e-6. One real trainer of each kind (the tiny checkpoint, CPU) serves the module.
"""
import types
import warnings

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import load_checkpoint, save_checkpoint
from rlcourse.losses import (average_logps, chosen_nll_loss, kto_loss, kto_reference_point,
                             online_dpo_pairs, orpo_loss, simpo_loss)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("trl_beyond_dpo")
    model, tokenizer = load_checkpoint("preference-sft", device="cpu")
    path = save_checkpoint(model, tokenizer, root / "model")
    pairs = datasets.Dataset.from_list([{"prompt": "ab:", "chosen": "abba", "rejected": "hh"},
                                        {"prompt": "cd:", "chosen": "dc", "rejected": "hgfe"}])
    return root, path, tokenizer, pairs


def _common(root, name):
    return dict(output_dir=str(root / name), use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
                save_strategy="no")


@pytest.fixture(scope="module")
def cpo_trainer(saved):
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    root, path, tokenizer, pairs = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CPOTrainer(model=str(path), args=CPOConfig(loss_type="simpo", cpo_alpha=0.0, per_device_train_batch_size=2,
                                                          **_common(root, "cpo")),
                          train_dataset=pairs, processing_class=tokenizer)


@pytest.fixture(scope="module")
def orpo_trainer(saved):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    root, path, tokenizer, pairs = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ORPOTrainer(model=str(path), args=ORPOConfig(per_device_train_batch_size=2, **_common(root, "orpo")),
                           train_dataset=pairs, processing_class=tokenizer)


@pytest.fixture(scope="module")
def kto_trainer(saved):
    import datasets
    from trl import KTOConfig, KTOTrainer
    root, path, tokenizer, _ = saved
    singles = datasets.Dataset.from_list([{"prompt": "ab:", "completion": "abba", "label": True},
                                          {"prompt": "cd:", "completion": "hgfe", "label": False},
                                          {"prompt": "ef:", "completion": "ef", "label": True},
                                          {"prompt": "gh:", "completion": "a", "label": False}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(model=str(path), args=KTOConfig(per_device_train_batch_size=4, **_common(root, "kto")),
                             train_dataset=singles, processing_class=tokenizer)
    trainer.precompute_ref_logps = True   # the reference log-probs ride in the batch, as fixed numbers
    return trainer


def _avg_logps(seed, n=6):
    """Per-token average log-probs of n chosen and n rejected completions (leaves, float64, all < 0)."""
    gen = torch.Generator().manual_seed(seed)
    w = (-3 * torch.rand(n, generator=gen, dtype=torch.float64) - 0.05).requires_grad_(True)
    l = (-3 * torch.rand(n, generator=gen, dtype=torch.float64) - 0.05).requires_grad_(True)
    return w, l


@pytest.mark.parametrize("beta,gamma,label_smoothing", [(0.1, 0.5, 0.0), (2.0, 1.0, 0.0), (2.5, 0.3, 0.1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_simpo_equals_trl_cpo_trainer(cpo_trainer, beta, gamma, label_smoothing, seed):
    cpo_trainer.beta, cpo_trainer.simpo_gamma, cpo_trainer.label_smoothing = beta, gamma, label_smoothing
    w, l = _avg_logps(seed)
    trl_losses, _, _ = cpo_trainer.cpo_loss(w, l)
    trl_grad = torch.autograd.grad(trl_losses.mean(), (w, l))
    ours = simpo_loss(w, l, beta, gamma, label_smoothing)
    our_grad = torch.autograd.grad(ours.mean(), (w, l))
    torch.testing.assert_close(ours, trl_losses, atol=1e-6, rtol=1e-6)
    for a, b in zip(our_grad, trl_grad):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_simpo_reads_averages_as_trl_does():
    """TRL's CPO takes per-token averages for SimPO (``average_log_prob=True``): so does average_logps."""
    from trl.experimental.cpo import CPOTrainer
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (4, 6), generator=gen)
    labels[0, :2] = -100
    labels[1, 4:] = -100
    trl = CPOTrainer.get_batch_logps(logits, labels.clone(), average_log_prob=True)
    token = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(average_logps(token, (labels[:, 1:] != -100).long()), trl, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orpo_equals_trl_orpo_trainer(orpo_trainer, beta, seed):
    orpo_trainer.beta = beta
    w, l = _avg_logps(seed)
    trl_losses, _, _, _, _ = orpo_trainer.odds_ratio_loss(w, l)
    nll = torch.tensor(1.7, dtype=torch.float64)
    trl_total = nll - trl_losses.mean()                     # ORPOTrainer.get_batch_loss_metrics
    trl_grad = torch.autograd.grad(trl_total, (w, l))
    ours = nll + orpo_loss(w, l, beta).mean()
    our_grad = torch.autograd.grad(ours, (w, l))
    torch.testing.assert_close(ours, trl_total.to(ours.dtype), atol=1e-6, rtol=1e-6)
    for a, b in zip(our_grad, trl_grad):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-6, rtol=1e-6)


def test_orpo_nll_is_the_mean_over_chosen_tokens():
    """ORPO's NLL term is cross-entropy over every chosen completion token of the batch: our chosen_nll_loss.
    (TRL 1.16's ORPOTrainer also counts the prompt's tokens; the paper's eq. 2 and this course do not.)"""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 9, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 9, (3, 5), generator=gen)
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[0, 3:] = 0
    trl_style = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 9),
                                                  labels[:, 1:].masked_fill(mask == 0, -100).reshape(-1))
    token = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:, None])[..., 0]
    torch.testing.assert_close(chosen_nll_loss(token * mask, mask), trl_style, atol=1e-12, rtol=1e-12)


def _run_trl_kto(trainer, logps, kl_logps, labels, ref, ref_kl, beta, dw, uw):
    trainer.beta, trainer.desirable_weight, trainer.undesirable_weight = beta, dw, uw
    n, width = len(labels), 5
    leaf = logps.detach().clone().requires_grad_(True)
    kl_leaf = kl_logps.detach().clone()
    main_ids, kl_ids = torch.zeros(n, width, dtype=torch.long), torch.ones(n, width, dtype=torch.long)

    def per_token(total):   # the sequence log-prob on the last column, 0 elsewhere
        return torch.cat([torch.zeros(n, width - 2, dtype=total.dtype), total[:, None]], 1)

    def stand_in_model(input_ids, **kwargs):
        values = per_token(kl_leaf if input_ids is kl_ids else leaf)
        return types.SimpleNamespace(log_probs=values, entropy=torch.zeros(n, width - 1, dtype=values.dtype),
                                     mean_logits=torch.zeros(n, width - 1), aux_loss=None)

    mask = torch.ones(n, width, dtype=torch.long)
    inputs = {"input_ids": main_ids, "attention_mask": mask, "completion_mask": mask, "KL_input_ids": kl_ids,
              "KL_attention_mask": mask, "KL_completion_mask": mask, "label": labels, "ref_logps": ref,
              "ref_KL_logps": ref_kl}
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode].clear()
    loss = trainer._compute_loss(stand_in_model, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), leaf.grad, {k: v[-1] for k, v in trainer._metrics[mode].items()}


@pytest.mark.parametrize("beta,dw,uw", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (1.0, 0.7, 1.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kto_equals_trl_kto_trainer(kto_trainer, beta, dw, uw, seed):
    gen = torch.Generator().manual_seed(seed)
    n = 8
    labels = torch.tensor([True, False, True, True, False, False, True, False])
    logps = -8 * torch.rand(n, generator=gen, dtype=torch.float64)
    ref = logps + 2 * torch.randn(n, generator=gen, dtype=torch.float64)
    kl_logps = -8 * torch.rand(n, generator=gen, dtype=torch.float64)
    ref_kl = kl_logps - 0.5 + torch.randn(n, generator=gen, dtype=torch.float64)
    trl_loss, trl_grad, metrics = _run_trl_kto(kto_trainer, logps, kl_logps, labels, ref, ref_kl, beta, dw, uw)

    leaf = logps.clone().requires_grad_(True)
    z0 = kto_reference_point(kl_logps, ref_kl)
    ours = kto_loss(leaf[labels], leaf[~labels], ref[labels], ref[~labels], z0, beta, dw, uw).mean()
    ours.backward()
    torch.testing.assert_close(ours.detach(), trl_loss.to(ours.dtype), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(leaf.grad, trl_grad, atol=1e-6, rtol=1e-6)
    assert float(z0) == pytest.approx(metrics["kl"], abs=1e-6)


def test_kto_reference_point_is_clipped_at_zero_and_detached():
    kl = torch.tensor([-3.0, -2.0], requires_grad=True)
    assert float(kto_reference_point(kl, torch.tensor([-1.0, -1.0]))) == 0.0       # mean log-ratio -1.5 -> 0
    z0 = kto_reference_point(kl, torch.tensor([-4.0, -4.0]))
    assert float(z0) == pytest.approx(1.5) and not z0.requires_grad


@pytest.fixture(scope="module")
def online_trainer(saved):
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    import datasets
    root, path, tokenizer, _ = saved
    prompts = datasets.Dataset.from_list([{"prompt": p} for p in ("ab:", "cd:", "ef:", "gh:", "ba:")])
    scores = {}

    def fixed_scores(prompts, completions, **kwargs):   # the test sets scores["now"] before each step
        return list(scores["now"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OnlineDPOTrainer(model=str(path), reward_funcs=[fixed_scores],
                                   args=OnlineDPOConfig(per_device_train_batch_size=5, beta=0.1, **_common(root, "online")),
                                   train_dataset=prompts, processing_class=tokenizer)
    trainer.model.double()
    return trainer, scores, tokenizer


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_online_dpo_pairs_and_loss_equal_trl_online_dpo_trainer(online_trainer, seed, loss_type):
    """With two completions per prompt and no ties, our pairs and the loss our OnlineDPOTrainer computes
    (``batch_loss`` with whole-sequence IPO, as the trainer calls it) are OnlineDPOTrainer's, for both of its
    losses; completions of different lengths, whose padding holds log-probs that must not count."""
    from rlcourse.trainers.dpo import batch_loss
    from rlcourse.trainers.online_dpo import OnlineDPOConfig

    trainer, scores, tokenizer = online_trainer
    gen = torch.Generator().manual_seed(seed)
    B, T = 5, 4
    prompt_ids = tokenizer(["ab:", "cd:", "ef:", "gh:", "ba:"], return_tensors="pt")["input_ids"].repeat(2, 1)
    completion_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("abcdefgh")))[torch.randint(0, 8, (2 * B, T), generator=gen)]
    lengths = torch.randint(1, T + 1, (2 * B,), generator=gen)
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    completion_ids[torch.arange(2 * B), lengths - 1] = tokenizer.eos_token_id
    completion_ids[completion_mask == 0] = tokenizer.pad_token_id
    policy = (-3 * torch.rand(2 * B, T, generator=gen, dtype=torch.float64)).requires_grad_(True)
    reference = -3 * torch.rand(2 * B, T, generator=gen, dtype=torch.float64)
    score = torch.randperm(2 * B, generator=gen).double()       # distinct: no ties
    scores["now"] = score.tolist()
    trainer._generate = lambda model, prompts, images=None: (prompt_ids, torch.ones_like(prompt_ids), completion_ids,
                                                             completion_mask, None)
    trainer._forward = lambda model, *args, **kwargs: policy if model is not trainer.ref_model else reference
    trainer.args.gradient_accumulation_steps = 1
    trainer.args.loss_type = loss_type
    try:
        loss = trainer.training_step(trainer.model, {"prompt": ["ab:", "cd:", "ef:", "gh:", "ba:"]})
    finally:
        trainer.args.loss_type = "sigmoid"
    trl_grad = policy.grad.clone()

    chosen, rejected = online_dpo_pairs(score, torch.arange(B).repeat(2))
    both = torch.cat([chosen, rejected])
    leaf = policy.detach().clone().requires_grad_(True)
    ref_seq = (reference * completion_mask).sum(-1)
    ours, _, _ = batch_loss(OnlineDPOConfig(beta=0.1, loss_type=loss_type), leaf[chosen], leaf[rejected],
                            completion_mask[both], ref_seq[chosen], ref_seq[rejected], ipo_per_token=False)
    ours.backward()
    torch.testing.assert_close(ours.detach(), loss.to(ours.dtype), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(leaf.grad, trl_grad, atol=1e-6, rtol=1e-6)
