"""Seed-batched PPO-RLHF: S runs with stacked policies and critics equal S single-seed trainers, and never mix.

Oracles: each seed's own :class:`~rlcourse.trainers.ppo_rlhf.PPORLHFTrainer` (its critic through the
``transformers`` forward of :class:`~rlcourse.lm.scalar_head.ScalarHeadModel`) on the same rollout.
"""
import copy

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.lm import load_checkpoint, sample
from rlcourse.lm.fast_gpt2 import completion_window_values
from rlcourse.lm.logprobs import sequence_logprobs
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer
from rlcourse.lm.scalar_head import ScalarHeadModel
from rlcourse.lm.seed_stack import stack_models
from rlcourse.trainers.ppo_rlhf_seeds import SeedBatchedPPORLHFTrainer
from rlcourse.lm.value_model import token_values
from seed_helpers import perturbed_copies, relative_error, update_cosine

SEEDS = [3, 4, 5]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _critics(policies, dtype=torch.float32):
    """One critic per seed, each with its own non-zero head (a zero head would hide a head mix-up)."""
    out = []
    for i, p in enumerate(policies):
        torch.manual_seed(50 + i)
        out.append(ScalarHeadModel(p, head_std=0.3).to(dtype).eval())
    return out


def _config(**overrides):
    settings = dict(learning_rate=1e-3, batch_size=8, num_ppo_epochs=2, num_mini_batches=2, response_length=6,
                    kl_coef=0.05, seed=SEEDS[0])
    return PPOConfig(**{**settings, **overrides})


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_stacked_critic_values_and_gradients_equal_each_seeds_own_critic(checkpoint, dtype, tol):
    model, tok = checkpoint
    task = AdditionTask()
    critics = _critics(perturbed_copies(model, SEEDS, dtype), dtype)
    stack = stack_models(critics)
    prompts = [p for s in SEEDS for p in task.prompts(4, rng=s)]
    roll = sample(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(0))
    ragged = roll.completion_mask.clone()
    ragged[::3, -2:] = 0                                   # completions of several lengths
    args = (roll.prompt_ids, roll.prompt_mask, roll.completion_ids, ragged)
    weight = torch.randn(ragged.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    values = token_values(stack, *args)
    (values * weight).sum().backward()
    size = len(prompts) // len(SEEDS)
    stacked = dict(stack.named_parameters())
    for s, critic in enumerate(critics):
        rows = slice(s * size, (s + 1) * size)
        alone = token_values(critic, *(a[rows] for a in args))            # the transformers forward
        assert relative_error(values[rows].detach(), alone.detach()) < tol
        assert not values[rows][ragged[rows] == 0].any()
        (alone * weight[rows]).sum().backward()
        for name, p in critic.named_parameters():
            assert relative_error(stacked[name].grad[s], p.grad) < tol, (s, name)
    # One plain critic through the lean forward reads the same columns as its transformers forward.
    lean = completion_window_values(critics[0], roll.prompt_ids[:size], roll.prompt_mask[:size],
                                    roll.completion_ids[:size], ragged[:size])[:, :ragged.shape[1]] * ragged[:size]
    assert relative_error(lean.detach(), token_values(critics[0], *(a[:size] for a in args)).detach()) < tol


def _rows(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


@pytest.mark.filterwarnings("ignore:kl_estimator='k3':UserWarning")   # k3 on purpose: both trainers must agree on it
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("settings", [dict(), dict(kl_estimator="k3", whiten_rewards=True, missing_eos_penalty=1.0),
                                      dict(whiten_advantages=False, lam=1.0, cliprange=0.05)],
                         ids=["defaults", "k3-whitened-rewards-eos-penalty", "no-whitening-lam1-tight-clip"])
def test_given_the_same_rollout_each_seeds_loss_and_gradients_are_its_own_trainers(checkpoint, settings, dtype, tol):
    model, tok = checkpoint
    task, config = AdditionTask(), _config(**settings)
    policies = perturbed_copies(model, SEEDS, dtype)
    critics = _critics(policies, dtype)
    singles = [PPORLHFTrainer(_config(seed=s, **settings), copy.deepcopy(p), tok, task.reward, copy.deepcopy(v),
                              task.prompts) for s, p, v in zip(SEEDS, policies, critics)]
    batched = SeedBatchedPPORLHFTrainer(config, policies, tok, task.reward, critics, task.prompts, seeds=SEEDS)
    B = config.batch_size
    batch = batched.rollout([p for s in SEEDS for p in task.prompts(B, s * 100_003)])
    batch["rewards"], batch["kl"] = batched.token_rewards(batch)
    batch["advantages"], batch["returns"] = batched.advantages(batch)
    with torch.no_grad():             # the same move of each seed on both sides, so that the ratios are not 1
        for s, t in enumerate(singles):
            g = torch.Generator().manual_seed(7 + s)
            for module, stack in ((t.policy, batched.policy), (t.value_model, batched.value_model)):
                for p, q in zip(module.parameters(), stack.parameters()):
                    step = 0.02 * torch.randn(p.shape, generator=g, dtype=dtype)
                    p.add_(step)
                    q[s].add_(step)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    minibatch = torch.cat([torch.arange(s * B, s * B + B // 2) for s in range(len(SEEDS))])   # half of each seed's rows
    losses, stats = batched.losses(_rows(tensors, minibatch))
    batched.optimizer.zero_grad()
    batched.optimizer.backward(sum(losses))
    for s, t in enumerate(singles):
        part = _rows(tensors, slice(s * B, (s + 1) * B))
        with torch.no_grad():         # the rollout's values: the stacked critic's = this seed's own critic's
            own = token_values(critics[s], part["prompt_ids"], part["prompt_mask"], part["completion_ids"],
                               part["completion_mask"])
        assert relative_error(part["values"], own) < tol
        rewards, kl = t.token_rewards(part)
        assert relative_error(part["rewards"], rewards) < tol
        part["rewards"] = rewards
        advantages, returns = t.advantages(part)   # whitened within this seed's rows only
        assert relative_error(part["advantages"], advantages) < 10 * tol
        assert relative_error(part["returns"], returns) < tol
        loss, own_stats = t.loss(_rows(part, slice(0, B // 2)))
        loss.backward()
        mine, theirs = float(losses[s].detach()), float(loss.detach())
        assert abs(mine - theirs) <= 10 * tol * max(1.0, abs(theirs)), (s, mine, theirs)
        assert stats[s]["clip_fraction"] == pytest.approx(own_stats["clip_fraction"], abs=1e-9)
        for stack, module in ((batched.policy, t.policy), (batched.value_model, t.value_model)):
            stacked = dict(stack.named_parameters())
            for name, p in module.named_parameters():
                assert relative_error(stacked[name].grad[s], p.grad) < 100 * tol, (s, name)


def test_a_batched_seed_follows_the_single_seed_run(checkpoint):
    model, tok = checkpoint
    task, config = AdditionTask(), _config(batch_size=16, num_mini_batches=2)
    critic = ScalarHeadModel(model, head_std=0.0)
    batched = SeedBatchedPPORLHFTrainer(config, model, tok, task.reward, critic, task.prompts, seeds=SEEDS)
    batched.train(2, progress=False)
    for s, seed in enumerate(SEEDS):
        alone = PPORLHFTrainer(_config(batch_size=16, num_mini_batches=2, seed=seed), copy.deepcopy(model), tok,
                               task.reward, copy.deepcopy(critic), task.prompts)
        alone.train(2, progress=False)
        # The same draws before any update; the same statistics of the first iteration to rounding.
        assert alone.history[0]["objective/scores"] == batched.history[s][0]["objective/scores"]
        for key in ("objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg"):
            assert batched.history[s][0][key] == pytest.approx(alone.history[0][key], rel=1e-4, abs=1e-6), key
        cosine = update_cosine(model, alone.policy, batched.model_of(s))
        print(f"seed {seed}: cosine of the two policies' updates over 2 iterations {cosine:.6f}")
        assert cosine > 0.999


def test_seeds_never_mix(checkpoint):
    """A change to seed 0's policy leaves every other seed's next iteration as it was."""
    model, tok = checkpoint
    task, config = AdditionTask(), _config()
    critic = ScalarHeadModel(model, head_std=0.1)
    plain = SeedBatchedPPORLHFTrainer(config, model, tok, task.reward, critic, task.prompts, num_seeds=3)
    nudged = SeedBatchedPPORLHFTrainer(config, model, tok, task.reward, critic, task.prompts, num_seeds=3)
    with torch.no_grad():
        for p in nudged.policy.parameters():
            p[0].add_(0.3 * torch.randn_like(p[0]))
    a, b = plain.step(), nudged.step()
    assert a[0] != b[0]
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), key   # rounding: the pads differ
    # Judged by what the models compute: the key part of an attention bias gets a gradient that is 0 up
    # to rounding (softmax ignores a shift shared by all keys), and Adam turns that rounding into steps.
    roll = sample(model, tok, [p for s in range(3) for p in task.prompts(4, rng=s)], task.max_new_tokens,
                  generator=torch.Generator().manual_seed(0))
    args = (roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    with torch.no_grad():
        logp = [sequence_logprobs(t.policy, *args).view(3, 4, -1) for t in (plain, nudged)]
        values = [token_values(t.value_model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids,
                               roll.completion_mask).view(3, 4, -1) for t in (plain, nudged)]
    for x, y in (logp, values):
        assert relative_error(x[1:], y[1:]) < 1e-5         # rounding: the two batches' pads differ
    assert float((logp[0][0] - logp[1][0]).abs().max()) > 1e-2


def test_seed_copies_and_what_is_refused(checkpoint):
    model, tok = checkpoint
    task = AdditionTask()
    critic = ScalarHeadModel(model, head_std=0.1)
    trainer = SeedBatchedPPORLHFTrainer(_config(), model, tok, task.reward, critic, task.prompts, num_seeds=2)
    assert type(trainer.model_of(1)).__name__ == "GPT2LMHeadModel"
    assert isinstance(trainer.critic_of(1), ScalarHeadModel)
    assert torch.equal(trainer.critic_of(1).head.weight, critic.head.weight)
    with pytest.raises(ValueError, match="disable_dropout"):
        SeedBatchedPPORLHFTrainer(_config(disable_dropout=False), model, tok, task.reward, critic, task.prompts,
                                  num_seeds=2)
    with pytest.raises(ValueError, match="ScalarHeadModel"):
        SeedBatchedPPORLHFTrainer(_config(), model, tok, task.reward, model, task.prompts, num_seeds=2)
    with pytest.raises(ValueError, match="num_seeds"):
        SeedBatchedPPORLHFTrainer(_config(), model, tok, task.reward, critic, task.prompts, num_seeds=0)
    with pytest.raises(NotImplementedError, match="losses"):
        trainer.loss({})
