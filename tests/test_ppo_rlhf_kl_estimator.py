"""PPOConfig(kl_estimator="k3") warns, and what it warns about is true: through kl_shaped_rewards (the
trainer's own reward shaping), the expected policy gradient of a k1 penalty is the gradient of
KL(pi || ref), and that of a k3 penalty is grad KL(pi || ref) - grad KL(ref || pi), summed exactly
over a vocabulary."""
import warnings

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.kl import exact_kl
from rlcourse.trainers.ppo_rlhf import PPOConfig, kl_shaped_rewards


def test_k3_in_the_reward_warns_at_construction_and_names_the_lesson():
    with pytest.warns(UserWarning, match=r"kl_estimator='k3'.*grad KL\(pi \|\| ref\) - grad KL\(ref \|\| pi\).*07b") as record:
        PPOConfig(kl_estimator="k3")
    assert len(record) == 1
    assert record[0].filename == __file__, "the warning should point at the line that built the config"


@pytest.mark.parametrize("settings", [dict(), dict(kl_estimator="k1")])
def test_k1_builds_without_a_warning(settings):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PPOConfig(**settings)


def _expected_reward_gradient(logits, logq, estimator):
    """Exact E_{v ~ pi}[r(v) grad log pi(v)] w.r.t. the logits, r the shaped reward of a one-token completion v."""
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    vocab = logp.shape[-1]
    tokens_logp, tokens_logq = logp.reshape(-1, 1), logq.reshape(-1, 1)          # every token, one per row
    rewards, _ = kl_shaped_rewards(torch.zeros(tokens_logp.shape[0], dtype=z.dtype), tokens_logp, tokens_logq,
                                   torch.ones_like(tokens_logp), kl_coef=1.0, kl_estimator=estimator)
    objective = (logp.exp().detach() * rewards.reshape(-1, vocab) * logp).sum()   # the rewards are detached numbers
    return torch.autograd.grad(objective, z)[0]


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_a_k3_penalty_in_the_reward_follows_the_difference_of_the_two_kls(far):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 11, generator=g, dtype=torch.float64)
    logq = torch.log_softmax(logits + (2.0 if far else 0.1) * torch.randn(8, 11, generator=g, dtype=torch.float64), -1)

    def kl_gradient(reverse):
        z = logits.clone().requires_grad_(True)
        logp = torch.log_softmax(z, -1)
        return torch.autograd.grad(exact_kl(logp, logq).sum() if reverse else exact_kl(logq, logp).sum(), z)[0]

    reverse, forward = kl_gradient(True), kl_gradient(False)
    k1 = _expected_reward_gradient(logits, logq, "k1")
    k3 = _expected_reward_gradient(logits, logq, "k3")
    # The reward is -kl_coef * k, so the expected gradient of the reward is minus that of the penalty.
    torch.testing.assert_close(-k1, reverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(-k3, reverse - forward, rtol=1e-10, atol=1e-12)
    # And the difference is not small: k3 in the reward is not the KL's gradient.
    assert (-k3 - reverse).norm() > 0.1 * reverse.norm()
