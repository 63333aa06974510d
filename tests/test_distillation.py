"""Distillation losses (rlcourse.losses.distillation) against a NumPy sum over the vocabulary and
against TRL 1.16's own code (DistillationTrainer's chunked loss, GKDTrainer.generalized_jsd_loss),
values and gradients; and the distillation trainer (rlcourse.trainers.distillation).
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.losses.distillation import (forward_kl_per_token, generalized_jsd, generalized_jsd_per_token,
                                          reverse_kl_per_token, sampled_reverse_kl_per_token)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

B, T, V, H = 3, 5, 16, 8
BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hs, ht = torch.randn(B, T, H, generator=g, dtype=dtype), torch.randn(B, T, H, generator=g, dtype=dtype)
    ws = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(True)
    wt = torch.randn(V, H, generator=g, dtype=dtype)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return hs, ht, ws, wt, mask


def _numpy_jsd(zs, zt, beta, temperature):
    """Eq. (1) of GKD (arXiv 2306.13649) by an explicit sum over the vocabulary, in float64 NumPy."""
    def softmax(z):
        z = z / temperature
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    ps, pt = softmax(zs), softmax(zt)
    kl = lambda p, q: (p * (np.log(p) - np.log(q))).sum(-1)   # noqa: E731
    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = beta * pt + (1 - beta) * ps
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_per_token_divergence_equals_the_numpy_sum_over_the_vocabulary(beta, temperature):
    hs, ht, ws, wt, mask = _inputs()
    zs, zt = hs @ ws.T, ht @ wt.T
    got = generalized_jsd_per_token(zs, zt, mask, beta=beta, temperature=temperature)
    want = _numpy_jsd(zs.detach().numpy(), zt.numpy(), beta, temperature) * mask.numpy()
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    assert (got[mask == 0] == 0).all()


def test_reverse_and_forward_kl_are_the_two_ends_and_zero_at_the_teacher():
    hs, ht, ws, wt, mask = _inputs()
    zs, zt = hs @ ws.T, ht @ wt.T
    torch.testing.assert_close(reverse_kl_per_token(zs, zt, mask), generalized_jsd_per_token(zs, zt, mask, beta=1.0))
    torch.testing.assert_close(forward_kl_per_token(zs, zt, mask), generalized_jsd_per_token(zs, zt, mask, beta=0.0))
    assert not torch.allclose(reverse_kl_per_token(zs, zt, mask), forward_kl_per_token(zs, zt, mask))
    for beta in BETAS:
        assert float(generalized_jsd_per_token(zt, zt, mask, beta=beta).abs().max()) < 1e-12


def test_teacher_is_under_stop_gradient_and_masked_junk_never_leaks():
    hs, ht, ws, wt, mask = _inputs()
    zs = (hs @ ws.T).detach().requires_grad_(True)
    zt = (ht @ wt.T).detach().requires_grad_(True)
    junk_s, junk_t = zs.detach().clone(), zt.detach().clone()
    junk_s[mask == 0], junk_t[mask == 0] = float("nan"), float("inf")
    junk_s.requires_grad_(True)
    loss = generalized_jsd(junk_s, junk_t.requires_grad_(True), mask, beta=0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(junk_s.grad).all()
    assert junk_t.grad is None                           # the teacher gets no gradient
    assert (junk_s.grad[mask == 0] == 0).all()
    clean = generalized_jsd(zs, zt, mask, beta=0.5)
    torch.testing.assert_close(loss, clean)


def test_reverse_kl_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(2, 3, V, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.autograd.gradcheck(lambda z: generalized_jsd(z, zt, mask, beta=1.0), (zs,))
    assert torch.autograd.gradcheck(lambda z: generalized_jsd(z, zt, mask, beta=0.3, temperature=0.8), (zs,))


def test_sampled_reverse_kl_is_k1_and_unbiased_for_the_exact_sum():
    g = torch.Generator().manual_seed(1)
    zs, zt = torch.randn(V, generator=g, dtype=torch.float64), torch.randn(V, generator=g, dtype=torch.float64)
    log_s, log_t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    per_token = sampled_reverse_kl_per_token(log_s, log_t)          # one value per possible sampled token
    expectation = (log_s.exp() * per_token).sum()                    # E_{y ~ pi_s}[k1], enumerated
    torch.testing.assert_close(expectation, reverse_kl_per_token(zs[None, None], zt[None, None])[0, 0])
    assert (per_token < 0).any()                                    # the one-sample estimate can be negative


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_matches_trl_distillation_trainer_and_gkd_loss_values_and_gradients(beta, temperature):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer
    hs, ht, ws, wt, mask = _inputs(seed=7)
    ours = generalized_jsd(hs @ ws.T, ht @ wt.T, mask, beta=beta, temperature=temperature)
    (g_ours,) = torch.autograd.grad(ours, ws)
    # TRL's DistillationTrainer: hidden states and lm_head weights, the vocabulary projected in chunks
    trl_loss, _, n_valid = _chunked_divergence_loss(hs, ht, ws, wt, mask, beta, temperature=temperature)
    (g_trl,) = torch.autograd.grad(trl_loss, ws)
    assert int(n_valid) == int(mask.sum())
    # TRL's GKDTrainer: full logits, -100 labels where the mask is 0
    labels = torch.where(mask.bool(), 0, -100)
    gkd = GKDTrainer.generalized_jsd_loss(hs @ ws.T, ht @ wt.T, labels=labels, beta=beta, temperature=temperature)
    (g_gkd,) = torch.autograd.grad(gkd, ws)
    # GKD's loss runs in the inputs' float64; TRL's chunked kernel accumulates in float32
    for other, grad, tol in ((gkd, g_gkd, 1e-10), (trl_loss, g_trl, 1e-6)):
        assert float(ours.detach()) == pytest.approx(float(other.detach()), rel=tol, abs=tol)
        torch.testing.assert_close(g_ours, grad, rtol=10 * tol, atol=tol)


def test_bad_inputs_are_refused_with_a_sentence():
    z = torch.zeros(1, 2, V)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(z, z, beta=1.5)
    with pytest.raises(ValueError, match="one shape"):
        generalized_jsd(z, torch.zeros(1, 2, V + 1))
    with pytest.raises(ValueError, match="temperature"):
        generalized_jsd(z, z, temperature=0.0)
    with pytest.raises(ValueError, match="mask"):
        generalized_jsd(z, z, torch.ones(1, 3))


# --------------------------------------------------------------------------- the trainer

@pytest.fixture(scope="module")
def models():
    from rlcourse.lm.checkpoints import load_checkpoint
    teacher, tok = load_checkpoint("addition", "cpu")
    student, _ = load_checkpoint("addition-partial", "cpu")
    return teacher, student, tok


def test_a_seed_of_the_stack_is_the_run_a_one_seed_trainer_makes(models):
    from rlcourse.tasks.arithmetic import AdditionTask
    from rlcourse.trainers.distillation import DistillationConfig, DistillationTrainer
    teacher, student, tok = models
    config = DistillationConfig(per_device_train_batch_size=8, lmbda=0.5, max_steps=3, seed=5)
    both = DistillationTrainer(student, teacher, tok, AdditionTask(2), config, num_seeds=2)
    both.train(progress=False)
    alone = DistillationTrainer(student, teacher, tok, AdditionTask(2), DistillationConfig(
        per_device_train_batch_size=8, lmbda=0.5, max_steps=3, seed=6))
    alone.train(progress=False)
    for key in ("loss", "reverse_kl", "on_policy", "generated_tokens"):
        assert [m[key] for m in both.history[1]] == pytest.approx([m[key] for m in alone.history[0]], rel=1e-4)
    assert {m["on_policy"] for m in both.history[0] + both.history[1]} == {0.0, 1.0}   # lmbda mixes the sources
    w_both, w_alone = both.model_of(1).state_dict(), alone.model_of(0).state_dict()
    for name in w_alone:
        torch.testing.assert_close(w_both[name], w_alone[name], rtol=1e-4, atol=1e-5)


def test_on_policy_distillation_lowers_the_reverse_kl_and_the_loss_is_the_library_function(models):
    from rlcourse.lm.logprobs import completion_logits
    from rlcourse.tasks.arithmetic import AdditionTask
    from rlcourse.trainers.distillation import DistillationConfig, DistillationTrainer
    teacher, student, tok = models
    trainer = DistillationTrainer(student, teacher, tok, AdditionTask(2), DistillationConfig(
        per_device_train_batch_size=64, learning_rate=1e-3), num_seeds=1)
    batch, on_policy = trainer.make_batch()
    assert on_policy == [True]
    losses, _ = trainer.losses(batch)
    args = (batch["prompt_ids"], batch["completion_ids"], batch["prompt_mask"], batch["completion_mask"])
    with torch.no_grad():
        want = generalized_jsd(completion_logits(trainer.model_of(0), *args), completion_logits(teacher, *args),
                               batch["completion_mask"], beta=1.0)
    assert float(losses[0]) == pytest.approx(float(want), rel=1e-5)
    trainer.train(30, progress=False)
    first = np.mean([m["reverse_kl"] for m in trainer.history[0][:5]])
    last = np.mean([m["reverse_kl"] for m in trainer.history[0][-5:]])
    assert last < 0.9 * first


def test_config_refuses_bad_settings():
    from rlcourse.trainers.distillation import DistillationConfig
    for bad in ({"beta": 1.2}, {"lmbda": -0.1}, {"loss_type": "kl"}, {"temperature": 0.0}, {"learning_rate": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DistillationConfig(**bad)
