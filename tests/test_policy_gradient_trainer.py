"""The policy-gradient trainer: settings, metrics under TRL's names, every loss type and estimator
runs, the on-policy GRPO loss is zero with a non-zero gradient, dynamic sampling, truncation masks,
and a non-GPT-2 causal LM."""
import pytest

import rlcourse  # noqa: F401
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.lm import load_checkpoint
from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
from rlcourse.losses import GRPO_LOSS_TYPES as LOSS_TYPES

TRL_METRICS = {"reward", "reward_std", "frac_reward_zero_std", "clip_ratio/low_mean", "clip_ratio/high_mean",
               "entropy", "completions/mean_length", "completions/clipped_ratio"}


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _trainer(checkpoint, **kw):
    model, tok = checkpoint
    model = type(model)(model.config)
    model.load_state_dict(checkpoint[0].state_dict())
    kw.setdefault("per_device_train_batch_size", 16)
    kw.setdefault("num_generations", 4)
    return PolicyGradientTrainer(model.eval(), tok, AdditionTask(), PolicyGradientConfig(**kw))


@pytest.mark.parametrize("bad", [dict(loss_type="ppo"), dict(advantage_estimator="gae"),
                                 dict(per_device_train_batch_size=10, num_generations=4),
                                 dict(num_iterations=0), dict(temperature=0.0), dict(beta=-1.0),
                                 dict(num_generations=1)])
def test_config_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        PolicyGradientConfig(**bad)


@pytest.mark.parametrize("loss_type", [*LOSS_TYPES, "rloo"])
def test_every_loss_type_trains_and_logs_trl_metrics(checkpoint, loss_type):
    trainer = _trainer(checkpoint, loss_type=loss_type, num_iterations=2, beta=0.04,
                       epsilon_high=5.0 if loss_type == "cispo" else 0.28,
                       advantage_estimator="rloo" if loss_type == "rloo" else "grpo",
                       kl_in_reward=loss_type == "rloo")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train(max_steps=2, progress=False)
    assert TRL_METRICS <= set(history[-1]) and "kl" in history[-1]
    assert all(torch.isfinite(torch.tensor(v)) for v in history[-1].values())
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("estimator", ["batch_mean", "moving_average"])
def test_reinforce_baselines_run(checkpoint, estimator):
    trainer = _trainer(checkpoint, advantage_estimator=estimator, num_generations=1, loss_type="grpo")
    trainer.train(max_steps=2, progress=False)
    if estimator == "moving_average":
        assert trainer.baseline is not None


def test_on_policy_grpo_loss_is_zero_but_its_gradient_is_not(checkpoint):
    trainer = _trainer(checkpoint, loss_type="grpo", num_iterations=1, beta=0.0)
    batch = trainer.make_batch()
    assert batch.advantages.abs().sum() > 0
    loss, _ = trainer._loss(batch)
    loss.backward()
    assert abs(float(loss.detach())) < 1e-6     # advantages sum to 0 in every group and the ratio is 1
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    assert grad.norm() > 1e-3


def test_dynamic_sampling_keeps_only_groups_with_signal(checkpoint):
    trainer = _trainer(checkpoint, dynamic_sampling=True, per_device_train_batch_size=64, num_generations=4)
    batch = trainer.make_batch()
    assert batch.metrics["frac_reward_zero_std"] > 0        # such groups were sampled...
    groups = batch.advantages.view(-1, 4)
    assert bool((groups.abs().sum(1) > 0).all())            # ...and dropped


def test_mask_truncated_completions(checkpoint):
    trainer = _trainer(checkpoint, mask_truncated_completions=True, max_completion_length=2,
                       per_device_train_batch_size=32)
    batch = trainer.make_batch()
    assert batch.metrics["completions/clipped_ratio"] > 0
    ended = (batch.completion_ids == trainer.tokenizer.eos_token_id).any(1)
    assert bool((batch.loss_mask[~ended] == 0).all()) and bool((batch.loss_mask[ended].sum(1) > 0).all())


def test_any_causal_lm(checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = checkpoint[1]
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    trainer = PolicyGradientTrainer(llama, tok, AdditionTask(), PolicyGradientConfig(
        per_device_train_batch_size=8, num_generations=4, beta=0.1, num_iterations=2))
    history = trainer.train(max_steps=2, progress=False)
    assert TRL_METRICS <= set(history[-1])


def test_nan_rewards_are_rejected(checkpoint):
    class NanTask(AdditionTask):
        def reward(self, prompts, completions, kind=None):
            r = super().reward(prompts, completions)
            r[0] = float("nan")
            return r

    model, tok = checkpoint
    trainer = PolicyGradientTrainer(model, tok, NanTask(), PolicyGradientConfig(per_device_train_batch_size=8,
                                                                                num_generations=4))
    with pytest.raises(ValueError, match="reward"):
        trainer.step()
