"""Samplers that are not the trained policy (rlcourse.lm.off_policy_samplers) and the trainers' sampler= path.

Oracles: the copies' weights checked element by element (dtype, rounding grid, what is left alone),
the rollouts against sampling the same copy directly, the trainer's off-policy loss against the
on-policy loss when the sampler is exact, against the GRPO loss written out with the sampler's
log-probs as pi_old, and a seed-batched run against single-seed runs."""
import copy

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.lm import load_checkpoint, sample, sequence_logprobs
from rlcourse.lm.off_policy_samplers import CopySampler, StaleSampler, cast_copy, quantised_copy
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.lm.seed_stack import seed_model, stack_models
from rlcourse.trainers.policy_gradient_seeds import SeedBatchedPolicyGradientTrainer
from rlcourse.losses import aggregate_loss, per_token_loss
from rlcourse.losses.off_policy import SAMPLER_IS_MODES
from seed_helpers import perturbed_copies, update_cosine


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _exact_copy(model):
    return copy.deepcopy(model).eval().requires_grad_(False)


def test_cast_copy_changes_the_copy_only(checkpoint):
    model, _ = checkpoint
    before = {k: v.clone() for k, v in model.state_dict().items()}
    low = cast_copy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in low.parameters())
    assert low.lm_head.weight is low.transformer.wte.weight               # GPT-2's tied head stays tied
    assert all(torch.equal(v, model.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())
    assert torch.equal(low.transformer.wte.weight, model.transformer.wte.weight.to(torch.bfloat16))


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_quantised_copy_rounds_each_row_of_each_matrix_to_its_grid(checkpoint, bits):
    model, _ = checkpoint
    rounded = quantised_copy(model, bits)
    levels = 2 ** (bits - 1) - 1
    changed = 0
    for (name, p), q in zip(model.named_parameters(), rounded.parameters()):
        if p.dim() < 2:                                                   # biases and layer norms are left alone
            assert torch.equal(p, q), name
            continue
        scale = p.detach().abs().amax(-1, keepdim=True) / levels
        steps = q / scale
        assert torch.allclose(steps, steps.round(), atol=1e-3), name       # on the grid s * integer
        assert steps.abs().max() <= levels + 1e-3
        assert ((q - p).abs() <= scale / 2 + 1e-6).all(), name             # round to nearest
        changed += int((q != p).sum())
    assert changed > 0 and not rounded.training


def test_quantising_a_seed_stack_rounds_each_seed_as_its_own_model(checkpoint):
    model, _ = checkpoint
    models = perturbed_copies(model, [0, 1])
    stacked = quantised_copy(stack_models(models), 3)
    for s, m in enumerate(models):
        alone, out = quantised_copy(m, 3), seed_model(stacked, s)
        for (name, p), q in zip(alone.named_parameters(), out.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (s, name)
    with pytest.raises(ValueError, match="bits must be an integer >= 2"):
        quantised_copy(model, 1)
    with pytest.raises(ValueError, match="bits must be an integer >= 2"):
        quantised_copy(model, 4.0)


def test_copy_sampler_reports_the_copys_log_probs(checkpoint):
    model, tok = checkpoint
    task = AdditionTask()
    prompts = task.prompts(16, rng=1)
    exact = CopySampler(_exact_copy)(model, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine = sequence_logprobs(model, exact.prompt_ids, exact.completion_ids, exact.completion_mask, exact.prompt_mask)
    assert float((mine - exact.logprobs).abs().max()) < 1e-5                # an exact copy: no gap
    rounded = CopySampler(lambda m: quantised_copy(m, 3))(model, tok, prompts, task.max_new_tokens,
                                                           generator=torch.Generator().manual_seed(2))
    direct = sample(quantised_copy(model, 3), tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(2))
    assert torch.equal(rounded.completion_ids, direct.completion_ids) and torch.allclose(rounded.logprobs, direct.logprobs)
    with torch.no_grad():
        trainer_view = sequence_logprobs(model, rounded.prompt_ids, rounded.completion_ids, rounded.completion_mask,
                                         rounded.prompt_mask)
    assert float((trainer_view - rounded.logprobs)[rounded.completion_mask.bool()].abs().mean()) > 0.05
    low = CopySampler(lambda m: cast_copy(m, torch.bfloat16))(model, tok, prompts, task.max_new_tokens,
                                                              generator=torch.Generator().manual_seed(2))
    assert low.logprobs.dtype == torch.float32


def test_stale_sampler_samples_the_model_of_k_calls_ago(checkpoint):
    model, tok = checkpoint
    task = AdditionTask()
    prompts = task.prompts(8, rng=3)
    live = copy.deepcopy(model)
    stale = StaleSampler(2)
    history = []
    for step in range(4):
        history.append(_exact_copy(live))
        roll = stale(live, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(step))
        expected = history[max(0, step - 2)]                              # the start until two updates have passed
        direct = sample(expected, tok, prompts, task.max_new_tokens, generator=torch.Generator().manual_seed(step))
        assert torch.equal(roll.completion_ids, direct.completion_ids) and torch.allclose(roll.logprobs, direct.logprobs)
        with torch.no_grad():                                             # an "update" of the live model
            for p in live.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + step)))
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="k must be an integer >= 0"):
            StaleSampler(bad)


def _config(**kwargs):
    return PolicyGradientConfig(per_device_train_batch_size=16, num_generations=4, max_steps=3, **kwargs)


class _Corrupt:
    """A sampler whose log-probs are broken by ``how``."""

    def __init__(self, how):
        self.how = how

    def __call__(self, model, tokenizer, prompts, max_new_tokens, **kwargs):
        roll = sample(model, tokenizer, prompts, max_new_tokens, **kwargs)
        if self.how == "shape":
            roll.logprobs = roll.logprobs[:, :-1]
        elif self.how == "nan":
            roll.logprobs = roll.logprobs.clone()
            roll.logprobs[0, 0] = float("nan")
        return roll


@pytest.mark.parametrize("how, message", [("shape", "sampler_logprobs must have the completions' shape"),
                                          ("nan", "sampler_logprobs holds 1 NaN")])
def test_a_sampler_with_broken_log_probs_is_named(checkpoint, how, message):
    model, tok = checkpoint
    for trainer in (PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(), _config(), sampler=_Corrupt(how)),
                    SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), _config(), num_seeds=2,
                                                     sampler=_Corrupt(how))):
        with pytest.raises(ValueError, match=message):
            trainer.step()


@pytest.mark.parametrize("mode", SAMPLER_IS_MODES)
def test_with_an_exact_sampler_the_corrected_loss_is_the_on_policy_loss(checkpoint, mode):
    model, tok = checkpoint
    settings = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                    vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0, beta=0.04)
    on = PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(), _config(**settings))
    off = PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(), _config(**settings),
                                sampler=CopySampler(_exact_copy))
    b_on, b_off = on.make_batch(), off.make_batch()
    assert torch.equal(b_on.completion_ids, b_off.completion_ids)       # the same draws
    assert float((b_off.is_weights - 1).abs().max()) < 1e-5
    grads = []
    for trainer, batch in ((on, b_on), (off, b_off)):
        loss, stats = trainer._loss(batch)
        trainer.model.zero_grad()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4) and grads[0].abs().max() > 1e-4
    assert stats["sampling/sampling_logp_difference/max"] < 1e-5 and stats["sampling/sequence_ess"] > 0.999999


def test_ratio_against_the_sampler_is_the_grpo_loss_with_the_samplers_log_probs_as_pi_old(checkpoint):
    model, tok = checkpoint
    sizes = dict(per_device_train_batch_size=64, num_generations=8, loss_type="grpo", epsilon_high=0.28)
    trainer = PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(),
                                    PolicyGradientConfig(ratio_against_sampler=True, **sizes),
                                    sampler=CopySampler(lambda m: quantised_copy(m, 3)))
    batch = trainer.make_batch()
    assert (batch.advantages != 0).sum() > 8
    loss, stats = trainer._loss(batch)
    logp = sequence_logprobs(trainer.model, batch.prompt_ids, batch.completion_ids, batch.loss_mask, batch.prompt_mask)
    expected = aggregate_loss(per_token_loss(logp, batch.sampler_logprobs, batch.advantages, batch.loss_mask, "grpo",
                                             0.2, 0.28), batch.loss_mask, "grpo", trainer.max_len)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert stats["clip_ratio/low_mean"] + stats["clip_ratio/high_mean"] > 0.01   # the 3-bit gap is clipped at once
    plain = PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(), PolicyGradientConfig(**sizes),
                                  sampler=CopySampler(lambda m: quantised_copy(m, 3)))
    assert sum(v for k, v in plain._loss(plain.make_batch())[1].items() if k.startswith("clip_ratio")) == 0


def test_off_policy_settings_are_checked():
    with pytest.raises(ValueError, match="ratio_against_sampler=True takes the sampler's log-probs as pi_old"):
        PolicyGradientConfig(ratio_against_sampler=True, vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min .* must not exceed"):
        PolicyGradientConfig(vllm_importance_sampling_clip_min=4.0)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        PolicyGradientConfig(vllm_importance_sampling_mode="token")
    with pytest.raises(ValueError, match="off_policy_mask_threshold must be None or >= 0"):
        PolicyGradientConfig(off_policy_mask_threshold=-0.5)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_settings_trls_grpo_config_refuses_are_refused(mode):
    """TRL 1.16's GRPOConfig refuses a *_truncate mode with no bound and clip_min >= clip_max: so do we."""
    with pytest.raises(ValueError, match=f"vllm_importance_sampling_mode='{mode}' truncates the ratio: set "
                                         "vllm_importance_sampling_clip_max"):
        PolicyGradientConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                             vllm_importance_sampling_clip_max=None)
    PolicyGradientConfig(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=None)   # correction off
    PolicyGradientConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                         vllm_importance_sampling_clip_max=None, vllm_importance_sampling_clip_min=0.5)   # one bound
    for correction in (True, False):
        with pytest.raises(ValueError, match=r"vllm_importance_sampling_clip_min \(2.0\) must be below "
                                             r"vllm_importance_sampling_clip_max \(2.0\)"):
            PolicyGradientConfig(vllm_importance_sampling_correction=correction, vllm_importance_sampling_mode=mode,
                                 vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=2.0)


def test_a_batched_seed_with_a_sampler_follows_its_single_seed_run(checkpoint):
    model, tok = checkpoint
    settings = dict(learning_rate=3e-4, vllm_importance_sampling_correction=True,
                    vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
                    off_policy_mask_threshold=0.3)
    make = lambda: CopySampler(lambda m: quantised_copy(m, 4))             # noqa: E731
    batched = SeedBatchedPolicyGradientTrainer(model, tok, AdditionTask(), _config(**settings), num_seeds=2,
                                               sampler=make())
    batched.train(3, progress=False)
    for s in range(2):
        alone = PolicyGradientTrainer(copy.deepcopy(model), tok, AdditionTask(), _config(seed=s, **settings),
                                      sampler=make())
        alone.train(3, progress=False)
        for mine, theirs in zip(batched.history[s], alone.history):
            assert mine["reward"] == theirs["reward"]                     # the same draws from the same rounded copy
            assert abs(mine["sampling/kl"] - theirs["sampling/kl"]) < 1e-4
        assert update_cosine(model, alone.model, batched.model_of(s)) > 0.999
        assert {"sampling/importance_sampling_ratio/max", "sampling/off_policy_masked"} <= set(alone.history[-1])
