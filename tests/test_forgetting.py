"""Lesson 12b's measurements (rlcourse.measure.forgetting) against enumeration and brute force."""
import itertools

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import load_checkpoint
from rlcourse.grading._steps import moved_copy
from rlcourse.measure.forgetting import (base_completions, correlation_interval, forward_kl_on_prompts,
                                         forward_kl_per_token, pareto_front)


def test_per_token_kl_is_the_numpy_sum_over_the_vocabulary():
    gen = torch.Generator().manual_seed(0)
    base, logits = torch.randn(3, 4, 7, generator=gen), torch.randn(3, 4, 7, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    got = forward_kl_per_token(base, logits, mask).numpy()
    b, q = base.double().numpy(), logits.double().numpy()
    p0 = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    p = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    want = (p0 * (np.log(p0) - np.log(p))).sum(-1) * mask.numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert (got[mask.numpy() == 0] == 0).all()


def test_summed_per_token_kl_has_the_sequence_kl_as_expectation():
    """On a toy autoregressive model (V=3, T=3, tables of logits), the pi_0-weighted mean over all V^T sequences
    of sum_t KL_t equals the sequence-level KL(pi_0 || pi) by enumeration (the chain rule)."""
    V, T = 3, 3
    gen = torch.Generator().manual_seed(1)
    table0 = {h: torch.randn(V, generator=gen) for t in range(T) for h in itertools.product(range(V), repeat=t)}
    table1 = {h: torch.randn(V, generator=gen) for h in table0}
    seqs = list(itertools.product(range(V), repeat=T))
    base = torch.stack([torch.stack([table0[y[:t]] for t in range(T)]) for y in seqs])    # (V^T, T, V)
    logits = torch.stack([torch.stack([table1[y[:t]] for t in range(T)]) for y in seqs])
    ys = torch.tensor(seqs)
    logp0 = torch.log_softmax(base.double(), -1).gather(-1, ys[..., None]).squeeze(-1).sum(-1)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ys[..., None]).squeeze(-1).sum(-1)
    exact = float((logp0.exp() * (logp0 - logp)).sum())
    per_token = forward_kl_per_token(base, logits, torch.ones(len(seqs), T)).double().sum(-1)
    assert float((logp0.exp() * per_token).sum()) == pytest.approx(exact, rel=1e-5)


def test_forward_kl_on_prompts_is_zero_for_the_base_and_positive_otherwise():
    model, tokenizer = load_checkpoint("addition", device="cpu")
    roll = base_completions(model, tokenizer, ["S=03:", "S=11:"], 4, 3, seed=0)
    assert forward_kl_on_prompts(model, model, roll) == 0.0
    moved = moved_copy(model, seed=1, scale=0.05)
    kl = forward_kl_on_prompts(model, moved, roll)
    args = (roll.prompt_ids, roll.completion_ids, roll.prompt_mask, roll.completion_mask)
    from rlcourse.lm.logprobs import completion_logits
    with torch.no_grad():
        want = forward_kl_per_token(completion_logits(model, *args), completion_logits(moved, *args),
                                    roll.completion_mask).sum(-1).mean()
    assert kl > 0 and kl == pytest.approx(float(want), rel=1e-6)


def _front_brute(points):
    out = []
    for i, p in enumerate(points):
        out.append(not any(j != i and q[0] >= p[0] and q[1] >= p[1] and (q[0] > p[0] or q[1] > p[1])
                           for j, q in enumerate(points)))
    return np.array(out)


@pytest.mark.parametrize("seed", range(5))
def test_pareto_front_against_brute_force(seed):
    pts = np.round(np.random.default_rng(seed).random((25, 2)), 1)
    np.testing.assert_array_equal(pareto_front(pts), _front_brute(pts.tolist()))
    assert pareto_front([[0.5, 0.5], [0.5, 0.5]]).all()
    with pytest.raises(ValueError):
        pareto_front([[0.1, float("nan")]])


def test_correlation_interval_covers_the_truth():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        x = rng.normal(size=30)
        y = 0.5 * x + np.sqrt(1 - 0.25) * rng.normal(size=30)       # true r = 0.5
        r, lo, hi = correlation_interval(x, y)
        assert lo < r < hi
        hits += lo <= 0.5 <= hi
    assert 0.92 <= hits / 400 <= 0.98
