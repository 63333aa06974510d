"""PPO-RLHF: KL-shaped token rewards, token GAE on ragged masks, the loss against independent loops,
best-of-n, and a short run of the trainer (TRL's metric names, what is trained and what is frozen)."""
import copy
import math

import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse.tasks import PreferenceTask
from rlcourse.lm import load_checkpoint
from rlcourse.measure.best_of_n import best_of_n, best_of_n_kl
from rlcourse.trainers.ppo_rlhf import (PPOConfig, PPORLHFTrainer, advantages_and_returns, disable_dropout,
                                  kl_shaped_rewards, ppo_rlhf_loss)
from rlcourse.lm.scalar_head import ScalarHeadModel, score_completions
from rlcourse.lm.value_model import make_value_model, token_values


def ragged(seed=0, B=5, T=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 3, T - 1, 4][:B])
    mask = (torch.arange(T) < lengths[:, None]).long()
    logp = -torch.rand(B, T, generator=gen) * 3 * mask
    ref = -torch.rand(B, T, generator=gen) * 3 * mask
    values = torch.randn(B, T, generator=gen) * mask
    scores = torch.randn(B, generator=gen)
    return logp, ref, values, scores, mask, lengths


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_shaped_rewards_by_loop_and_sum_identity(estimator):
    logp, ref, _, scores, mask, lengths = ragged()
    logp = logp.clone().requires_grad_(True)
    rewards, kl = kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.1, kl_estimator=estimator)
    assert not rewards.requires_grad and not kl.requires_grad   # the penalty is a number, not a graph
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if t >= lengths[b]:
                assert rewards[b, t].item() == 0.0 and kl[b, t].item() == 0.0
                continue
            lr = ref[b, t].item() - logp[b, t].item()
            k = -lr if estimator == "k1" else math.expm1(lr) - lr
            expected = -0.1 * k + (scores[b].item() if t == lengths[b] - 1 else 0.0)
            assert rewards[b, t].item() == pytest.approx(expected, abs=1e-6)
    if estimator == "k1":   # sum_t r~_t = score - kl_coef * sum_t k1_t
        k1_sum = ((logp - ref) * mask).sum(1)
        assert torch.allclose(rewards.sum(1), scores - 0.1 * k1_sum.detach(), atol=1e-6)


def test_kl_shaped_rewards_reject_bad_input():
    logp, ref, _, scores, mask, _ = ragged()
    with pytest.raises(ValueError, match="finite"):
        kl_shaped_rewards(torch.tensor([float("nan"), 0, 0, 0, 0]), logp, ref, mask, 0.1)
    with pytest.raises(ValueError, match="scores"):
        kl_shaped_rewards(scores[:3], logp, ref, mask, 0.1)
    mask = mask.clone()
    mask[1] = 0
    with pytest.raises(ValueError, match="no real token"):
        kl_shaped_rewards(scores, logp, ref, mask, 0.1)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_token_gae_equals_a_per_sequence_loop(gamma, lam):
    logp, ref, values, scores, mask, lengths = ragged(1)
    rewards, _ = kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.05)
    values = values + 5.0 * (1 - mask)   # garbage on padding must not matter
    adv, returns = advantages_and_returns(rewards, values, mask, gamma, lam, whiten_advantages=False)
    for b, n in enumerate(lengths.tolist()):
        r, v = rewards[b, :n].tolist(), values[b, :n].tolist()
        running, expected = 0.0, [0.0] * n
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0   # after the last real token: terminal
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            expected[t] = running
        assert adv[b, :n].tolist() == pytest.approx(expected, abs=1e-5)
        assert returns[b, :n].tolist() == pytest.approx([a + x for a, x in zip(expected, v)], abs=1e-5)
        assert adv[b, n:].abs().sum() == 0 and returns[b, n:].abs().sum() == 0
    white, _ = advantages_and_returns(rewards, values, mask, gamma, lam)
    real = white[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-5) and real.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)


def test_whiten_rewards_only_rescales():
    logp, ref, values, scores, mask, _ = ragged(2)
    rewards, _ = kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.05)
    a1, _ = advantages_and_returns(rewards, values * 0, mask, 1.0, 1.0, whiten_rewards=True, whiten_advantages=False)
    a0, _ = advantages_and_returns(rewards, values * 0, mask, 1.0, 1.0, whiten_advantages=False)
    m = mask.bool()
    ratio = a1[m] / a0[m]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4)   # one positive scale for every token
    assert ratio[0] > 0


def test_ppo_rlhf_loss_equals_an_independent_loop():
    logp_old, _, v_old, _, mask, lengths = ragged(3)
    gen = torch.Generator().manual_seed(4)
    logp = (logp_old + 0.4 * torch.randn(logp_old.shape, generator=gen)).requires_grad_(True)
    values = (v_old + 0.5 * torch.randn(v_old.shape, generator=gen)).requires_grad_(True)
    adv = torch.randn(logp.shape, generator=gen)
    returns = torch.randn(logp.shape, generator=gen)
    loss, pg, vf = ppo_rlhf_loss(logp, logp_old, adv, values, v_old, returns, mask, 0.2, 0.3, 0.1)
    pg_terms, vf_terms = [], []
    for b, n in enumerate(lengths.tolist()):
        for t in range(n):
            ratio = math.exp(logp[b, t].item() - logp_old[b, t].item())
            a = adv[b, t].item()
            pg_terms.append(-min(ratio * a, min(max(ratio, 0.8), 1.2) * a))
            v, vo, R = values[b, t].item(), v_old[b, t].item(), returns[b, t].item()
            clipped = vo + min(max(v - vo, -0.3), 0.3)
            vf_terms.append(0.5 * max((v - R) ** 2, (clipped - R) ** 2))
    pg_loop, vf_loop = sum(pg_terms) / len(pg_terms), sum(vf_terms) / len(vf_terms)
    assert pg.item() == pytest.approx(pg_loop, abs=1e-5)
    assert vf.item() == pytest.approx(vf_loop, abs=1e-5)
    assert loss.item() == pytest.approx(pg_loop + 0.1 * vf_loop, abs=1e-5)
    loss.backward()
    assert logp.grad[~mask.bool()].abs().sum() == 0 and values.grad[~mask.bool()].abs().sum() == 0


def test_config_names_and_validation():
    cfg = PPOConfig()
    for name in ("kl_coef", "kl_estimator", "cliprange", "cliprange_value", "vf_coef", "gamma", "lam",
                 "whiten_rewards", "missing_eos_penalty", "num_ppo_epochs", "num_mini_batches"):
        assert hasattr(cfg, name)
    assert (cfg.gamma, cfg.lam, cfg.kl_estimator, cfg.cliprange) == (1.0, 0.95, "k1", 0.2)
    with pytest.raises(ValueError, match="kl_estimator"):
        PPOConfig(kl_estimator="k2")
    with pytest.raises(ValueError, match="num_mini_batches"):
        PPOConfig(batch_size=10, num_mini_batches=3)


def test_best_of_n_kl_formula():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75)
    with pytest.raises(ValueError):
        best_of_n_kl(0)


@pytest.fixture(scope="module")
def setup():
    policy, tok = load_checkpoint("preference-sft", device="cpu")
    torch.manual_seed(0)
    rm = ScalarHeadModel(policy).eval()
    return policy, tok, rm


def test_best_of_n_keeps_the_best_sample(setup):
    policy, tok, rm = setup
    prompts = ["ab:", "cd:", "hh:"]
    out = best_of_n(policy, tok, rm, prompts, 5, 8, generator=torch.Generator().manual_seed(0), chunk=7)
    assert out["all_scores"].shape == (3, 5)
    assert torch.equal(out["scores"], out["all_scores"].max(1).values)
    from rlcourse.lm.scalar_head import encode_completions
    from rlcourse.lm.sampling import encode_prompts
    with torch.no_grad():
        again = score_completions(rm, *encode_prompts(tok, prompts), *encode_completions(tok, out["completions"]))
    assert torch.allclose(again, out["scores"], atol=1e-4)


def test_token_values_read_the_state_before_each_token(setup):
    policy, tok, rm = setup
    critic = make_value_model("reward", reward_model=rm).eval()
    ids = tok("ab:abc")["input_ids"] + [tok.eos_token_id]
    full = critic(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    pids, cids = torch.tensor([ids[:4]]), torch.tensor([ids[4:] + [tok.pad_token_id]])
    cmask = torch.tensor([[1, 1, 1, 1, 0]])
    v = token_values(critic, pids, torch.ones_like(pids), cids, cmask)[0]
    assert torch.allclose(v[:4], full[3:7], atol=1e-5) and v[4] == 0
    zero = make_value_model("policy", policy=policy)
    assert zero.head.weight.abs().sum() == 0
    with pytest.raises(ValueError, match="init"):
        make_value_model("random", policy=policy)


def test_trainer_runs_logs_trls_names_and_trains_only_policy_and_critic(setup):
    policy, tok, rm = setup
    task = PreferenceTask()
    for p in rm.parameters():   # a frozen reward model: its copy (the critic) must still learn
        p.requires_grad_(False)
    pol = copy.deepcopy(policy)
    critic = make_value_model("reward", reward_model=rm)
    rm_before = [p.clone() for p in rm.parameters()]
    critic_before = [p.clone() for p in critic.parameters()]
    policy_before = [p.clone() for p in pol.parameters()]
    cfg = PPOConfig(batch_size=8, num_mini_batches=2, num_ppo_epochs=2, response_length=8, missing_eos_penalty=1.0)
    trainer = PPORLHFTrainer(cfg, pol, tok, rm, critic, task.prompts, gold_fn=task.gold)
    history = trainer.train(2, progress=False)
    assert len(history) == 2
    for key in ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/num_eos_tokens", "episode", "gold/scores"):
        assert key in history[-1] and math.isfinite(history[-1][key]), key
    assert history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)   # the policy starts as the reference
    assert all(torch.equal(a, b) for a, b in zip(rm_before, rm.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, critic.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, pol.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(policy_before, trainer.ref_policy.parameters()))


def test_disable_dropout():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3))
    disable_dropout(model)
    assert model[1].p == 0.0
