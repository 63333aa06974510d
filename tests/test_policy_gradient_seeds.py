"""Seed-batched training: S runs in one stacked model equal S separate runs, and never mix.

Oracles: each seed's own ``GPT2LMHeadModel`` run alone (forward, sampler, single-seed trainer) and
``torch.optim.Adam`` / ``clip_grad_norm_`` applied to each seed separately.
"""
import copy

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from rlcourse.tasks import AdditionTask
from rlcourse.trainers import exact_match
from rlcourse.lm import load_checkpoint, sample
from rlcourse.lm.logprobs import completion_logits
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer, _Batch
from rlcourse.lm.seed_stack import SeedAdam, clip_grad_norm_per_seed, seed_model, stack_models
from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer
from rlcourse.losses import GRPO_LOSS_TYPES
from seed_helpers import perturbed_copies, relative_error, update_cosine


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _prompts(task, seeds, n=3, k=4):
    blocks = [[p for p in task.prompts(n, np.random.default_rng(s)) for _ in range(k)] for s in seeds]
    blocks[1][:k] = blocks[1][k:2 * k]          # seed 1 has fewer distinct prompts than the others
    return blocks


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_stacked_forward_and_gradients_equal_each_seeds_own_model(checkpoint, dtype, tol):
    model, tok = checkpoint
    task, seeds = AdditionTask(), [0, 1, 2]
    models = perturbed_copies(model, seeds, dtype)
    stack = stack_models(models)
    blocks = _prompts(task, seeds)
    roll = sample(models[0], tok, [p for b in blocks for p in b], task.max_new_tokens,
                  generator=torch.Generator().manual_seed(0))
    holes = roll.completion_mask.clone()
    holes[::5, 0] = 0                                 # completions with holes and ragged ends
    args = (roll.prompt_ids, roll.completion_ids, roll.prompt_mask, holes)
    weight = torch.randn(*roll.completion_ids.shape, len(tok), generator=torch.Generator().manual_seed(1), dtype=dtype)
    logits = completion_logits(stack, *args)
    (logits * weight).sum().backward()
    size = len(blocks[0])
    for s, m in enumerate(models):
        rows = slice(s * size, (s + 1) * size)
        alone = completion_logits(m, *(a[rows] for a in args))
        assert relative_error(logits[rows].detach(), alone.detach()) < tol
        (alone * weight[rows]).sum().backward()
        stacked = dict(stack.named_parameters())
        for name, p in m.named_parameters():
            assert relative_error(stacked[name].grad[s], p.grad) < tol, (s, name)


@pytest.mark.parametrize("engine", ["lean", "static"])
def test_stacked_sampler_draws_what_each_seed_draws_alone(checkpoint, engine):
    model, tok = checkpoint
    task, seeds = AdditionTask(), [0, 1, 2]
    models = perturbed_copies(model, seeds)
    blocks = _prompts(task, seeds)
    together = sample(stack_models(models), tok, [p for b in blocks for p in b], task.max_new_tokens,
                      generator=[torch.Generator().manual_seed(10 + s) for s in seeds], engine=engine)
    size = len(blocks[0])
    for s, (m, block) in enumerate(zip(models, blocks)):
        alone = sample(m, tok, block, task.max_new_tokens, generator=torch.Generator().manual_seed(10 + s))
        mine = together.select(slice(s * size, (s + 1) * size))
        n = alone.completion_ids.shape[1]
        assert torch.equal(mine.completion_ids[:, :n], alone.completion_ids)
        assert not mine.completion_mask[:, n:].any()
        assert float((mine.logprobs[:, :n] - alone.logprobs).abs().max()) < 1e-5
        assert mine.completions == alone.completions


def test_a_seed_copied_out_is_that_seeds_model(checkpoint):
    model, tok = checkpoint
    models = perturbed_copies(model, [0, 1])
    stack = stack_models(models)
    back = seed_model(stack, 1)
    assert type(back).__name__ == "GPT2LMHeadModel"
    assert back.lm_head.weight is back.transformer.wte.weight          # still tied
    for (name, p), q in zip(models[1].named_parameters(), back.parameters()):
        assert torch.equal(p, q), name
    with torch.no_grad():                                                # a copy: no memory shared
        next(stack.parameters()).add_(1.0)
    assert torch.equal(next(models[1].parameters()), next(back.parameters()))


def _concat(batches, pad_id):
    """Per-seed batches as one seed-major batch, completions padded to the longest."""
    width = max(b.completion_ids.shape[1] for b in batches)

    def pad(t, value):
        return None if t is None else F.pad(t, (0, width - t.shape[1]), value=value)

    fields = {}
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "loss_mask", "old_logprobs", "ref_logprobs",
                 "advantages", "rewards"):
        parts = [getattr(b, name) for b in batches]
        if parts[0] is None:
            fields[name] = None
        elif name in ("advantages", "rewards"):
            fields[name] = torch.cat(parts)
        elif name.startswith("prompt"):
            cols = max(p.shape[1] for p in parts)                # prompts are left-padded
            fields[name] = torch.cat([F.pad(p, (cols - p.shape[1], 0), value=pad_id if name == "prompt_ids" else 0)
                                      for p in parts])
        else:
            fields[name] = torch.cat([pad(p, pad_id if name == "completion_ids" else 0) for p in parts])
    return _Batch(**fields)


SETTINGS = [dict(loss_type=t, epsilon_high=5.0 if t == "cispo" else 0.28) for t in GRPO_LOSS_TYPES] + [
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="dapo", beta=0.04),
    dict(loss_type="rloo", advantage_estimator="rloo", beta=0.04, kl_in_reward=True),
    dict(loss_type="dr_grpo", advantage_estimator="moving_average", num_generations=1),
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_given_the_same_completions_each_seeds_loss_and_gradient_are_its_own_runs(checkpoint, settings, dtype, tol):
    model, tok = checkpoint
    seeds, task = [3, 4, 5], AdditionTask()
    config = {"per_device_train_batch_size": 12, "num_generations": 4, "num_iterations": 2, **settings}
    models = perturbed_copies(model, seeds, dtype)
    singles = [PolicyGradientTrainer(copy.deepcopy(m), tok, task, PolicyGradientConfig(seed=s, **config))
               for m, s in zip(models, seeds)]
    batches = [t.make_batch() for t in singles]
    batched = SeedBatchedPolicyGradientTrainer(models, tok, task, PolicyGradientConfig(**config), seeds=seeds)
    if settings.get("beta", 0) > 0:   # the single trainers' references are their own starting models
        for b, t in zip(batches, singles):
            assert b.ref_logprobs is not None and t.ref_model is not None
    with torch.no_grad():             # the same move of each seed on both sides, so that the ratios are not 1
        for s, t in enumerate(singles):
            g = torch.Generator().manual_seed(7 + s)
            for p, q in zip(t.model.parameters(), batched.model.parameters()):
                step = 0.02 * torch.randn(p.shape, generator=g, dtype=dtype)
                p.add_(step)
                q[s].add_(step)
    joint = _concat(batches, tok.pad_token_id)
    losses, _ = batched.losses(joint)
    batched.optimizer.zero_grad()
    batched.optimizer.backward(sum(losses))
    stacked = dict(batched.model.named_parameters())
    for s, (t, b) in enumerate(zip(singles, batches)):
        loss, _ = t._loss(b)
        loss.backward()
        mine, theirs = float(losses[s].detach()), float(loss.detach())
        assert abs(mine - theirs) <= tol * max(1.0, abs(theirs)), (s, mine, theirs)
        for name, p in t.model.named_parameters():
            assert relative_error(stacked[name].grad[s], p.grad) < tol, (s, name)


def test_seed_adam_and_clipping_are_each_seeds_own(checkpoint):
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 3)]
    singles = [[torch.randn(sh, requires_grad=True) for sh in shapes] for _ in range(3)]
    stacked = [torch.nn.Parameter(torch.stack([ps[i].detach() for ps in singles]).clone()) for i in range(len(shapes))]
    adams = [torch.optim.Adam(ps, lr=0.01) for ps in singles]
    seed_adam = SeedAdam(stacked, lr=0.01)
    for step in range(6):
        grads = [[3 * torch.randn(sh) for sh in shapes] for _ in range(3)]
        active = torch.tensor([True, step % 2 == 0, True])          # seed 1 skips every other step
        seed_adam.zero_grad()
        for i in range(len(shapes)):
            stacked[i].grad += torch.stack([g[i] for g in grads])
        norms = clip_grad_norm_per_seed(stacked, 1.0) if step % 2 else seed_adam.clip_grad_norm_(1.0)
        seed_adam.step(active)
        for s in range(3):
            for p, g in zip(singles[s], grads[s]):
                p.grad = g.clone()
            norm = torch.nn.utils.clip_grad_norm_(singles[s], 1.0)
            assert abs(float(norm) - float(norms[s])) < 1e-5 * float(norm)
            if active[s]:
                adams[s].step()
    for i in range(len(shapes)):
        for s in range(3):
            assert relative_error(stacked[i].detach()[s], singles[s][i].detach()) < 1e-6, (i, s)


def test_a_batched_seed_follows_the_single_seed_run_step_by_step(checkpoint):
    model, tok = checkpoint
    config = dict(per_device_train_batch_size=16, num_generations=4, loss_type="grpo", learning_rate=3e-4)
    batched = SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), PolicyGradientConfig(**config), num_seeds=3)
    batched.train(3, progress=False)
    for s in range(3):
        alone = PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(), PolicyGradientConfig(seed=s, **config))
        alone.train(3, progress=False)
        assert [m["reward"] for m in alone.history] == [m["reward"] for m in batched.history[s]]   # the same draws
        cosine = update_cosine(model, alone.model, batched.model_of(s))     # the same updates, up to rounding
        print(f"seed {s}: cosine of the two updates {cosine:.6f}")
        assert cosine > 0.999


def test_gdpo_and_the_entropy_controller_are_each_seeds_own(checkpoint):
    """Lesson 10b's settings: normalise-then-sum over two reward functions and the adaptive entropy controller,
    batched, follow each seed's single-seed run: the same draws, the same coefficients, the same updates."""
    from rlcourse.tasks.verifiers import RewardedTask
    model, tok = checkpoint
    task = AdditionTask()

    def exact(prompts, completions, **kwargs):
        return task.reward(prompts, completions, kind="exact").tolist()

    def partial(prompts, completions, **kwargs):
        return task.reward(prompts, completions, kind="partial").tolist()

    config = dict(per_device_train_batch_size=16, num_generations=4, num_iterations=2, learning_rate=3e-4,
                  multi_objective_aggregation="normalize_then_sum", use_adaptive_entropy=True, entropy_target=5.0,
                  entropy_coef_delta=0.02)
    rewarded = RewardedTask(task, [exact, partial], [1.0, 0.5])
    batched = SeedBatchedPolicyGradientTrainer(model, tok, rewarded, PolicyGradientConfig(**config), num_seeds=3)
    batched.train(3, progress=False)
    for s in range(3):
        alone = PolicyGradientTrainer(copy.deepcopy(model), tok, copy.deepcopy(rewarded), PolicyGradientConfig(seed=s, **config))
        alone.train(3, progress=False)
        assert [m["reward"] for m in alone.history] == [m["reward"] for m in batched.history[s]]
        assert [m["entropy_coef"] for m in alone.history] == pytest.approx([m["entropy_coef"] for m in batched.history[s]])
        assert batched.history[s][-1]["entropy_coef"] == pytest.approx(0.12)     # 6 optimiser steps of 0.02
        assert update_cosine(model, alone.model, batched.model_of(s)) > 0.999


def test_seeds_never_mix(checkpoint):
    """A change to seed 0's weights leaves every other seed's next step as it was."""
    model, tok = checkpoint
    config = PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4, loss_type="dapo", beta=0.04)
    plain = SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), config, num_seeds=3)
    nudged = SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), config, num_seeds=3)
    with torch.no_grad():
        for p in nudged.model.parameters():
            p[0].add_(0.3 * torch.randn_like(p[0]))
    a, b = plain.step(), nudged.step()
    assert a[0] != b[0]
    assert a[1:] == b[1:]
    for p, q in zip(plain.model.parameters(), nudged.model.parameters()):
        assert float((p[1:] - q[1:]).detach().abs().max()) < 1e-6
        assert float((p[0] - q[0]).detach().abs().max()) > 1e-3


def test_sixteen_batched_seeds_learn_as_sixteen_separate_runs(checkpoint):
    """Held-out accuracy after training, 16 seeds each way: a permutation test on the difference of means."""
    model, tok = checkpoint
    task = AdditionTask()
    config = dict(per_device_train_batch_size=32, num_generations=8, loss_type="dapo", learning_rate=1e-4)
    steps, seeds = 30, list(range(16))
    held_out = task.test_prompts(200)

    def accuracy(m, s):
        return exact_match(m, tok, task, held_out)          # greedy: the seed is in the weights only

    batched = SeedBatchedPolicyGradientTrainer(model, tok, task, PolicyGradientConfig(**config), num_seeds=16)
    batched.train(steps, progress=False)
    together = np.array([accuracy(batched.model_of(s), s) for s in seeds])
    apart = []
    for s in seeds:
        t = PolicyGradientTrainer(copy.deepcopy(model), tok, task, PolicyGradientConfig(seed=s, **config))
        t.train(steps, progress=False)
        apart.append(accuracy(t.model, s))
    apart = np.array(apart)
    start = accuracy(model, 0)
    observed = abs(together.mean() - apart.mean())
    pooled, rng = np.concatenate([together, apart]), np.random.default_rng(0)
    draws = [abs(np.subtract(*rng.permutation(pooled).reshape(2, -1).mean(1))) for _ in range(4000)]
    p_value = (1 + sum(d >= observed for d in draws)) / (1 + len(draws))
    print(f"held-out accuracy from {start:.3f}: batched {together.mean():.3f} +- {together.std(ddof=1):.3f}, "
          f"separate {apart.mean():.3f} +- {apart.std(ddof=1):.3f}; permutation p = {p_value:.3f}")
    assert p_value > 0.01
    assert together.mean() > start and apart.mean() > start


def test_what_is_not_batched_is_refused(checkpoint):
    model, tok = checkpoint
    with pytest.raises(ValueError, match="dynamic_sampling"):
        SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), PolicyGradientConfig(dynamic_sampling=True),
                                         num_seeds=2)


def test_bad_settings_are_named(checkpoint):
    model, tok = checkpoint
    for bad in (0, 2.0, None):
        with pytest.raises(ValueError, match="num_seeds"):
            SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), PolicyGradientConfig(), num_seeds=bad)
    with pytest.raises(ValueError, match="list of num_seeds=2 models"):
        SeedBatchedPolicyGradientTrainer([model] * 3, tok, AdditionTask(), PolicyGradientConfig(), num_seeds=2)
    with pytest.raises(ValueError, match="seeds must hold num_seeds=2"):
        SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), PolicyGradientConfig(), num_seeds=2, seeds=[1, 2, 3])
    stack = stack_models([model, model])
    prompts = AdditionTask().prompts(4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="list of 2 generators"):
        sample(stack, tok, prompts, 4, generator=torch.Generator())
    with pytest.raises(ValueError, match="2 equal blocks"):
        sample(stack, tok, prompts[:3], 4)
    with pytest.raises(ValueError, match="engine='hf'"):
        sample(stack, tok, prompts, 4, engine="hf")
    with pytest.raises(TypeError, match="no transformers forward"):
        stack(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="seed index"):
        seed_model(stack, 2)
    with pytest.raises(ValueError, match="not a plain GPT-2"):
        stack_models([stack])
