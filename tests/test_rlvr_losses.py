"""rlcourse.losses.rlvr against closed forms and NumPy's quantile, and the trainer's entropy and length
knobs against direct computations (TRL parity is in tests/test_trl_parity_rlvr.py)."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.lm import Rollout, load_checkpoint
from rlcourse.trainers import policy_gradient
from rlcourse.trainers.policy_gradient import (PolicyGradientConfig, PolicyGradientTrainer, _Batch, logits_and_logprobs,
                                         loss_and_stats)
from rlcourse.interop.trl_parity import fixed_completion_batch
from rlcourse.losses.rlvr import high_entropy_mask, overlong_penalty


@pytest.mark.parametrize("L,C,expected", [
    (10, 4, {0: 0.0, 6: 0.0, 7: -0.25, 8: -0.5, 9: -0.75, 10: -1.0, 11: -1.0, 30: -1.0}),
    (8, 8, {0: 0.0, 1: -0.125, 4: -0.5, 8: -1.0, 9: -1.0}),
    (5, 0, {0: 0.0, 5: 0.0, 6: -1.0}),
    (3, 1, {2: 0.0, 3: -1.0, 4: -1.0}),
])
def test_overlong_penalty_is_daposs_piecewise_linear_ramp(L, C, expected):
    lengths = torch.tensor(list(expected))
    got = overlong_penalty(lengths, L, C)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(list(expected.values()), abs=1e-7)
    every = overlong_penalty(torch.arange(0, L + 3), L, C)
    assert bool((every.diff() <= 0).all()) and float(every.min()) == -1.0 and float(every.max()) == 0.0


@pytest.mark.parametrize("args,match", [
    ((torch.tensor([3]), 4, 5), r"overlong_buffer_len \(5\) must be <= max_completion_length \(4\)"),
    ((torch.tensor([3]), 0, 0), "max_completion_length"),
    ((torch.tensor([3]), 4, -1), "overlong_buffer_len"),
    ((torch.tensor([3.0]), 4, 2), "lengths must be a 1-D tensor of token counts"),
    ((torch.tensor([[3]]), 4, 2), "lengths must be a 1-D tensor of token counts"),
    ((torch.tensor([-1]), 4, 2), "lengths must be a 1-D tensor of token counts"),
])
def test_overlong_penalty_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(*args)


@pytest.mark.parametrize("rho", [0.0, 0.1, 0.2, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_high_entropy_mask_keeps_the_tokens_at_or_above_numpys_quantile(rho, dtype):
    gen = torch.Generator().manual_seed(int(rho * 100))
    for trial in range(5):
        B, T = 6, 7
        entropies = torch.rand(B, T, generator=gen, dtype=torch.float64).to(dtype) * 3
        entropies[:, 0] = entropies[0, 0]                     # one prompt's first token: ties across the batch
        mask = (torch.arange(T) < torch.randint(1, T + 1, (B, 1), generator=gen)).long()
        values = entropies[mask.bool()].double().numpy()
        threshold = np.quantile(values, 1 - rho, method="linear")
        expected = (entropies.double().numpy() >= threshold) & mask.bool().numpy()
        got = high_entropy_mask(entropies, mask, rho)
        assert got.dtype == torch.bool and not bool((got & ~mask.bool()).any())
        np.testing.assert_array_equal(got.numpy(), expected)
        if rho == 1.0:
            assert torch.equal(got, mask.bool())
        if rho == 0.0:
            assert torch.equal(got, (entropies == entropies[mask.bool()].max()) & mask.bool())


def test_high_entropy_mask_keeps_ties_at_the_threshold_in_float64():
    """Four completions of one prompt share their first token's entropy: all four are kept or none."""
    entropies = torch.tensor([[0.96536605530902, 0.1], [0.96536605530902, 0.2], [0.96536605530902, 2.0],
                              [0.96536605530902, 0.3]], dtype=torch.float64)
    got = high_entropy_mask(entropies, torch.ones(4, 2), 0.4)    # the 0.6-quantile falls between two tied values
    assert got[:, 0].all() and got[2, 1] and not got[[0, 1, 3], 1].any()


def test_high_entropy_mask_with_an_empty_mask_keeps_nothing_and_refuses_bad_input():
    assert not high_entropy_mask(torch.rand(2, 3), torch.zeros(2, 3), 0.2).any()
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        high_entropy_mask(torch.rand(2, 3), torch.ones(2, 3), 1.5)
    with pytest.raises(ValueError, match="entropies must be a"):
        high_entropy_mask(torch.rand(6), torch.ones(6), 0.2)
    with pytest.raises(ValueError, match="mask must have shape"):
        high_entropy_mask(torch.rand(2, 3), torch.ones(3, 2), 0.2)


@pytest.fixture(scope="module")
def fixed():
    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    model = model.double()
    rows = [p for p in ["12+34=", "56+78=", "90+12=", "33+44="] for _ in range(4)]
    b = fixed_completion_batch(model, tokenizer, rows, 5, seed=3)
    batch = _Batch(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"],
                   advantages=b["advantages"], old_logprobs=b["old"], ref_logprobs=b["ref"])
    return model, tokenizer, rows, b, batch


def _loss(model, batch, **settings):
    config = PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4, max_completion_length=5, **settings)
    logits, logp = logits_and_logprobs(model, batch, config.temperature)
    return loss_and_stats(config, logits, logp, batch, 5)[0], logits


@pytest.mark.parametrize("loss_type,temperature", [("dapo", 1.0), ("grpo", 0.7)])
def test_entropy_coef_subtracts_coef_times_the_mean_token_entropy(fixed, loss_type, temperature):
    model, _, _, _, batch = fixed
    plain, logits = _loss(model, batch, loss_type=loss_type, temperature=temperature)
    with_bonus, _ = _loss(model, batch, loss_type=loss_type, temperature=temperature, entropy_coef=0.3)
    z = logits.detach().numpy() / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    token_entropy = -(p * np.log(p)).sum(-1)
    m = batch.loss_mask.numpy().astype(bool)
    assert float((plain - with_bonus).detach()) == pytest.approx(0.3 * token_entropy[m].mean(), abs=1e-10)


def test_top_entropy_quantile_leaves_only_the_kl_on_the_other_tokens(fixed):
    """d loss / d logp is the policy term's on the kept tokens and beta's k3 term's alone on the others."""
    model, _, _, b, batch = fixed
    config = PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4, max_completion_length=5,
                                  top_entropy_quantile=0.3, beta=0.1)
    logits, logp = logits_and_logprobs(model, batch, 1.0)
    logits = logits.detach()

    def grad_of(**settings):
        x = logp.detach().clone().requires_grad_()
        loss, _ = loss_and_stats(PolicyGradientConfig(**{**vars(config), **settings}), logits, x, batch, 5)
        loss.backward()
        return x.grad

    p = torch.softmax(logits, -1)
    keep = high_entropy_mask(-(p * p.log()).sum(-1), batch.loss_mask, 0.3)
    both, kl_only, policy_only = grad_of(), grad_of(top_entropy_quantile=0.0, beta=0.1), grad_of(beta=0.0)
    real = batch.loss_mask.bool()
    dropped = real & ~keep
    assert 0 < int(keep.sum()) < int(real.sum())
    full_kl = grad_of(top_entropy_quantile=1.0) - grad_of(top_entropy_quantile=1.0, beta=0.0)
    assert torch.allclose(both[dropped], full_kl[dropped], atol=1e-12)
    assert torch.allclose(both[keep], (policy_only + full_kl)[keep], atol=1e-12)
    assert bool((policy_only[dropped] == 0).all()) and policy_only[keep].abs().max() > 1e-4
    assert kl_only.abs().max() > 0


class _FixedTask:
    max_new_tokens = 5

    def __init__(self, rows, rewards):
        self.rows, self.rewards = rows, rewards

    def prompts(self, n, rng=None):
        return self.rows[::4][:n]

    def reward(self, prompts, completions):
        return self.rewards.clone()


@pytest.mark.parametrize("buffer,factor", [(0, 1.0), (2, 1.0), (3, 0.5), (5, 2.0)])
def test_overlong_shaping_adds_factor_times_the_penalty_of_each_length(fixed, monkeypatch, buffer, factor):
    model, tokenizer, rows, b, _ = fixed
    rewards = torch.linspace(0.0, 1.0, 16)
    roll = Rollout(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"],
                   torch.zeros(b["completion_ids"].shape), [""] * 16, list(rows), tokenizer.eos_token_id)
    monkeypatch.setattr(policy_gradient, "sample", lambda *args, **kwargs: roll)
    trainer = PolicyGradientTrainer(model, tokenizer, _FixedTask(rows, rewards), PolicyGradientConfig(
        per_device_train_batch_size=16, num_generations=4, max_completion_length=5, overlong_buffer_len=buffer,
        overlong_penalty_factor=factor, scale_rewards="none"))
    batch = trainer.make_batch()
    lengths = b["completion_mask"].sum(1)
    start = 5 - buffer
    penalty = torch.tensor([0.0 if n <= start else (start - n) / buffer for n in lengths.tolist()])
    assert torch.allclose(batch.rewards, rewards + factor * penalty, atol=1e-6)
    assert (penalty != 0).any() == (buffer > 0)


def test_config_refuses_bad_entropy_and_length_settings():
    for settings, match in [(dict(top_entropy_quantile=1.2), "top_entropy_quantile must be in"),
                            (dict(top_entropy_quantile=0.2, loss_type="rloo"), "loss_type='rloo'"),
                            (dict(entropy_coef=0.1, loss_type="rloo"), "loss_type='rloo'"),
                            (dict(overlong_buffer_len=-2), "overlong_buffer_len must be an integer >= 0"),
                            (dict(overlong_buffer_len=2.5), "overlong_buffer_len must be an integer >= 0"),
                            (dict(overlong_penalty_factor=-1.0), "overlong_penalty_factor >= 0")]:
        with pytest.raises(ValueError, match=match):
            PolicyGradientConfig(**settings)


@pytest.mark.parametrize("trainer_class", ["single", "seed-batched"])
def test_a_buffer_longer_than_the_budget_is_refused_when_the_trainer_is_built(fixed, trainer_class):
    """A buffer C > L would charge every completion, however short: both trainers refuse it up front,
    whether L is the config's max_completion_length or the task's own max_new_tokens."""
    from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer

    model, tokenizer, rows, _, _ = fixed
    task = _FixedTask(rows, torch.zeros(16))
    build = (PolicyGradientTrainer if trainer_class == "single" else
             lambda *args: SeedBatchedPolicyGradientTrainer(*args, seeds=[0, 1]))
    for settings, match in [(dict(max_completion_length=5, overlong_buffer_len=6),
                             r"overlong_buffer_len \(6\) must be <= the completion budget max_completion_length \(5\)"),
                            (dict(overlong_buffer_len=6), r"max_completion_length \(5, the task default\)")]:
        with pytest.raises(ValueError, match=match):
            build(model, tokenizer, task, PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4,
                                                               **settings))
    build(model, tokenizer, task, PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4,
                                                       overlong_buffer_len=5))      # C = L: allowed


# ---------------------------------------------------------------- adaptive entropy control (Skywork-OR1, TRL 1.16)
def test_adaptive_entropy_coef_steps_towards_the_target_within_its_bounds():
    from rlcourse.losses.rlvr import adaptive_entropy_coef, applied_entropy_coef
    settings = dict(entropy_target=1.0, entropy_coef_delta=0.25, entropy_coef_min=0.1, entropy_coef_max=0.6)
    coef, seen = 0.1, []
    for entropy in (0.5, 0.5, 1.0, 0.9, 0.2, 1.5, 1.5, 1.5, 3.0):     # at the target counts as below
        coef = adaptive_entropy_coef(coef, entropy, **settings)
        seen.append(coef)
    assert seen == pytest.approx([0.35, 0.6, 0.6, 0.6, 0.6, 0.35, 0.1, 0.1, 0.1])
    assert adaptive_entropy_coef(0.0, 0.1) == 0.005 and adaptive_entropy_coef(0.0, 0.3) == 0.0   # TRL's defaults
    # applied only at or below the target; never before the first measurement
    assert applied_entropy_coef(0.4, 0.7, 0.7) == 0.4 and applied_entropy_coef(0.4, 0.71, 0.7) == 0.0
    assert applied_entropy_coef(0.4, float("inf"), 0.7) == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(entropy_coef_delta=-0.1), "entropy_coef_delta must be >= 0"),
    (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min <= entropy_coef_max"),
    (dict(entropy_target=float("nan")), "entropy_target must be a finite number"),
])
def test_adaptive_entropy_coef_refuses_bad_settings(kwargs, match):
    from rlcourse.losses.rlvr import adaptive_entropy_coef
    with pytest.raises(ValueError, match=match):
        adaptive_entropy_coef(0.1, 0.5, **kwargs)
    with pytest.raises(ValueError, match="entropy must be a finite number"):
        adaptive_entropy_coef(0.1, float("nan"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(use_adaptive_entropy=True, entropy_coef_delta=-1.0), "use_adaptive_entropy needs entropy_coef_delta >= 0"),
    (dict(use_adaptive_entropy=True, entropy_coef_min=1.0, entropy_coef_max=0.5), "entropy_coef_min <= entropy_coef_max"),
    (dict(use_adaptive_entropy=True, loss_type="rloo", advantage_estimator="rloo"), "no adaptive entropy"),
    (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation must be one of"),
    (dict(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo"), "advantage_estimator='grpo'"),
    (dict(multi_objective_aggregation="normalize_then_sum", overlong_buffer_len=2), "overlong_buffer_len"),
    (dict(multi_objective_aggregation="normalize_then_sum", beta=0.1, kl_in_reward=True), "kl_in_reward"),
])
def test_config_refuses_bad_lesson_10b_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyGradientConfig(**kwargs)


def test_the_trainer_runs_the_controller_on_the_entropy_its_loss_measured(monkeypatch):
    """Each optimiser step applies the coefficient gated on the previous step's entropy, then updates it from
    this step's: replayed from the trainer's own log, and the loss carries exactly that bonus."""
    from rlcourse.losses.rlvr import adaptive_entropy_coef, applied_entropy_coef
    from rlcourse.tasks import AdditionTask
    model, tokenizer = load_checkpoint("addition-partial", device="cpu")
    settings = dict(entropy_target=5.0, entropy_coef_delta=0.02, entropy_coef_max=0.05, entropy_coef=0.01)
    config = PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4, num_iterations=2,
                                  use_adaptive_entropy=True, **settings)
    trainer = PolicyGradientTrainer(model, tokenizer, AdditionTask(), config)
    applied, measured = [], []
    real = policy_gradient.loss_and_stats

    def spy(config, logits, logp, b, max_len, entropy_coef=None):
        loss, stats = real(config, logits, logp, b, max_len, entropy_coef=entropy_coef)
        plain, _ = real(config, logits, logp, b, max_len, entropy_coef=0.0)
        applied.append(entropy_coef)
        measured.append(stats["entropy_bonus/entropy"])
        assert float((plain - loss).detach()) == pytest.approx(entropy_coef * stats["entropy_bonus/entropy"], rel=1e-5, abs=1e-9)
        return loss, stats

    monkeypatch.setattr(policy_gradient, "loss_and_stats", spy)
    trainer.train(3, progress=False)
    coef, last, expected = 0.01, float("inf"), []
    for entropy in measured:
        expected.append(applied_entropy_coef(coef, last, 5.0))
        coef, last = adaptive_entropy_coef(coef, entropy, entropy_target=5.0, entropy_coef_delta=0.02,
                                           entropy_coef_max=0.05), entropy
    assert len(applied) == 6 and applied == pytest.approx(expected) and applied[0] == 0.0 and applied[-1] == 0.05
    assert [m["entropy_coef"] for m in trainer.history] == pytest.approx([0.05, 0.05, 0.05])
