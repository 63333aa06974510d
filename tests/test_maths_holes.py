"""The holes a review of the package found, each with the case that showed it.

Every test here failed before its fix: a +-inf reward that turned a trainer's weights into NaN, a
beta ignored by the RLOO loss, NaN in padding reaching gradients, an exact-oracle cache that missed
an update through ``.data``, a NumPy integer ``n``, masks holding 2, a SAPO temperature of 0, a
GSPO ratio that overflows, and the verl/OpenRLHF bound on KL estimates.
"""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.kl import ESTIMATE_BOUND, kl_k1, kl_k3
from rlcourse.losses import aggregate_loss, group_advantages, importance_weights, per_token_loss, rloo_loss
from rlcourse.returns import n_step_returns

nan, inf = float("nan"), float("inf")


def _batch(seed=0, B=4, T=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=gen, dtype=dtype) * 3).requires_grad_()
    old = -torch.rand(B, T, generator=gen, dtype=dtype) * 3
    ref = -torch.rand(B, T, generator=gen, dtype=dtype) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, old, ref, mask, torch.randn(B, generator=gen, dtype=dtype)


@pytest.mark.parametrize("bad", [inf, -inf, nan])
def test_non_finite_rewards_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_advantages([1.0, bad, 0.0, 1.0], 2)


@pytest.mark.parametrize("level, beta", [("token", 0.0), ("token", 0.1), ("sequence", 0.0), ("sequence", 0.1)])
@pytest.mark.parametrize("garbage", [nan, inf, -inf, 1e30])
def test_padding_holding_anything_changes_neither_loss_nor_gradient(level, beta, garbage):
    """Oracle: the same batch with 0 in the padded entries."""
    results = []
    for fill in (0.0, garbage):
        logp, old, ref, mask, adv = _batch()
        pad = mask == 0
        logp_in = torch.where(pad, torch.full_like(logp, fill), logp)
        loss = aggregate_loss(per_token_loss(logp_in, old.masked_fill(pad, fill), adv, mask, "grpo",
                                             importance_sampling_level=level, beta=beta,
                                             ref_logprobs=ref.masked_fill(pad, fill)), mask, "grpo")
        loss.backward()
        results.append((loss.detach(), logp.grad.clone()))
    assert torch.isfinite(results[1][0]) and torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_rloo_loss_ignores_padding_too():
    logp, old, _, mask, adv = _batch()
    clean = rloo_loss(logp, old, adv, mask)
    dirty = rloo_loss(logp.masked_fill(mask == 0, nan), old.masked_fill(mask == 0, inf), adv, mask)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("bad_mask", [2, 0.5, -1])
def test_a_mask_holding_other_than_0_and_1_is_refused(bad_mask):
    logp, old, _, mask, adv = _batch()
    mask = mask.clone().to(torch.float64)
    mask[1, 1] = bad_mask
    for call in (lambda: per_token_loss(logp, old, adv, mask), lambda: importance_weights(logp, old, mask),
                 lambda: aggregate_loss(torch.zeros(4, 5), mask), lambda: rloo_loss(logp, old, adv, mask)):
        with pytest.raises(ValueError, match="mask must hold only 0/1"):
            call()


@pytest.mark.parametrize("pos, neg", [(0.0, 1.0), (1.0, -0.5), (nan, 1.0)])
def test_sapo_temperatures_must_be_positive(pos, neg):
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig

    logp, old, _, mask, adv = _batch()
    with pytest.raises(ValueError, match="sapo_temperature"):
        per_token_loss(logp, old, adv, mask, "sapo", sapo_temperature_pos=pos, sapo_temperature_neg=neg)
    with pytest.raises(ValueError, match="sapo_temperature"):
        PolicyGradientConfig(loss_type="sapo", sapo_temperature_pos=pos, sapo_temperature_neg=neg)


def test_gspo_sequence_ratio_is_clamped_like_the_token_ratio():
    """float32, a mean log-ratio of 100 in a group of equal rewards (A = 0): TRL's unclamped ratio
    is inf and inf * 0 = NaN; ours is exp(20) and the loss is 0. Inside the bound both are exp(mean)."""
    logp = torch.full((2, 3), 100.0, requires_grad=True)
    old, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    ratio = importance_weights(logp, old, mask, "sequence")
    assert torch.allclose(ratio, torch.full((2, 1), float(np.exp(20.0))))
    loss = aggregate_loss(per_token_loss(logp, old, adv, mask, "grpo", importance_sampling_level="sequence"),
                          mask, "grpo")
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.isfinite(logp.grad).all()
    inside = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(importance_weights(inside, torch.zeros(1, 3), torch.ones(1, 3), "sequence"),
                          torch.tensor([[np.exp(2.0)]], dtype=torch.float32))


def test_rloo_loss_with_beta_in_the_loss_is_refused_not_ignored():
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig

    with pytest.raises(ValueError, match="kl_in_reward"):
        PolicyGradientConfig(advantage_estimator="rloo", loss_type="rloo", beta=0.5)
    PolicyGradientConfig(advantage_estimator="rloo", loss_type="rloo", beta=0.5, kl_in_reward=True)
    PolicyGradientConfig(advantage_estimator="rloo", loss_type="rloo", beta=0.0)


def test_n_step_returns_takes_a_numpy_integer():
    rewards, values = torch.rand(3, 6, dtype=torch.float64), torch.rand(3, 6, dtype=torch.float64)
    assert torch.equal(n_step_returns(rewards, values, 0.9, np.int64(2)), n_step_returns(rewards, values, 0.9, 2))
    with pytest.raises(ValueError, match="n must be an integer"):
        n_step_returns(rewards, values, 0.9, 2.0)


def test_kl_estimates_can_follow_verl_and_openrlhf_bound():
    logp = torch.tensor([0.0, -1.0, -30.0], requires_grad=True)
    logq = torch.tensor([0.0, -0.5, 0.0])
    k3 = kl_k3(logp, logq, bound=ESTIMATE_BOUND)
    # by hand: r = exp(logq - logp); k3 = r - 1 - log r, then clamped at 10
    r = np.exp([0.0, 0.5, 20.0])
    expected = np.minimum(r - 1 - np.log(r), 10.0)
    assert np.allclose(k3.detach().numpy(), expected)
    k3.sum().backward()
    assert logp.grad[2] == 0.0                     # a clamped token is no longer pulled back
    assert torch.equal(kl_k3(logp, logq), kl_k3(logp, logq, bound=None))
    assert float(kl_k1(torch.tensor([0.0]), torch.tensor([-50.0]), bound=10.0)) == 10.0
    with pytest.raises(ValueError, match="bound"):
        kl_k3(logp, logq, bound=0.0)


def test_exact_oracle_notices_an_update_through_data():
    from rlcourse.measure.exact_gradient import EnumerablePolicy

    torch.manual_seed(0)
    policy = EnumerablePolicy(vocab_size=3, max_len=2, n_prompts=2)
    before = policy.score_matrix().clone()
    policy.logits.data += 0.5 * torch.randn_like(policy.logits)
    fresh = torch.autograd.functional.jacobian(lambda th: policy.logprobs(th), policy.logits.detach())
    assert not torch.allclose(before, policy.score_matrix())
    assert torch.allclose(policy.score_matrix(), fresh.reshape(before.shape))


def test_a_special_token_inside_a_completion_is_seen_by_the_reward():
    """Six <pad> then the sum scored 1 on the filler task (the pads were erased when decoding) where
    six dots score 0: the thinking budget could be bypassed. The verifier now sees the pads."""
    from rlcourse.lm.sampling import decode_completions
    from rlcourse.tasks.arithmetic import FillerAdditionTask
    from rlcourse.lm.tokenizer import build_char_tokenizer

    task, tok = FillerAdditionTask(budget=3), build_char_tokenizer()
    prompt = "12+34="
    answer = tok(task.answer(prompt), add_special_tokens=False)["input_ids"]
    dot = tok(".", add_special_tokens=False)["input_ids"]
    rows = {"six <pad>": [tok.pad_token_id] * 6, "six <bos>": [tok.bos_token_id] * 6, "six dots": dot * 6,
            "two dots": dot * 2}
    width = 6 + len(answer) + 1
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, prefix in enumerate(rows.values()):
        row = prefix + answer + [tok.eos_token_id]
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    texts = decode_completions(tok, ids, mask)
    assert texts[0] == "<pad>" * 6 + task.answer(prompt) and texts[3] == ".." + task.answer(prompt)
    rewards = task.reward([prompt] * len(rows), texts).tolist()
    assert rewards == [0.0, 0.0, 0.0, 1.0], dict(zip(rows, rewards))


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=nan), "temperature"), (dict(temperature=inf), "temperature"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_k=True), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=1.5), "max_new_tokens"),
    (dict(max_new_tokens=nan), "max_new_tokens")])
def test_sampling_settings_get_an_error_naming_them(kwargs, name):
    from rlcourse.lm.model import make_model
    from rlcourse.lm.sampling import sample
    from rlcourse.lm.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = make_model("tiny", tok, seed=0)
    call = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=name):
        sample(model, tok, ["12+34="], **call)
    if name == "max_new_tokens":
        return
    out = sample(model, tok, ["12+34="], np.int64(3), top_k=np.int64(5), generator=torch.Generator().manual_seed(0))
    assert out.completion_ids.shape[1] <= 3


def test_a_bf16_reward_head_is_refused_and_a_bf16_body_keeps_a_float32_head():
    from rlcourse.lm.model import make_model
    from rlcourse.lm.scalar_head import ScalarHeadModel
    from rlcourse.lm.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = make_model("tiny", tok, seed=0)
    ids, mask = torch.randint(4, 20, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="head must be float32"):
        ScalarHeadModel(model).to(torch.bfloat16)(ids, mask)
    torch.manual_seed(0)
    full = ScalarHeadModel(model)
    torch.manual_seed(0)
    half_body = ScalarHeadModel(model.to(torch.bfloat16))
    assert half_body.head.weight.dtype == torch.float32
    got, want = half_body(ids, mask), full(ids, mask)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=0.05 * float(want.abs().max()) + 1e-3)



# ------------------------------------------------------------------------------------------------
# The same holes one level up: in the trainer, in every function that takes a count or a mask, and
# in the conventions kl.py cites.
class _RewardTask:
    """AdditionTask's prompts, with every reward replaced by ``value`` for the first completion."""

    def __init__(self, value):
        from rlcourse.tasks import AdditionTask

        self.inner, self.value = AdditionTask(), value
        self.max_new_tokens = self.inner.max_new_tokens

    def prompts(self, n, rng):
        return self.inner.prompts(n, rng)

    def reward(self, prompts, completions):
        rewards = self.inner.reward(prompts, completions).clone()
        rewards[0] = self.value
        return rewards


@pytest.mark.parametrize("bad", [inf, -inf, nan])
def test_the_trainer_refuses_a_non_finite_reward_by_name(bad):
    """A log 0 reward (-inf) passed the trainer's NaN-only test; with advantage_estimator='batch_mean'
    nothing downstream refused it either, and the step's weights became NaN."""
    from rlcourse.lm.model import make_model
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer
    from rlcourse.lm.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    trainer = PolicyGradientTrainer(make_model("tiny", tok, seed=0), tok, _RewardTask(bad),
                                    PolicyGradientConfig(per_device_train_batch_size=4, num_generations=2,
                                                         advantage_estimator="batch_mean"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=r"task.reward must return one finite reward.*no NaN, no \+-inf"):
        trainer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_counts_take_any_integer_and_refuse_floats_and_bools():
    """Oracle: the same call with a Python int. np.int64(2) raised inside torch (n_step_returns) or
    was refused as 'not a positive integer' (num_generations)."""
    from rlcourse.losses import leave_one_out_advantages

    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.5, 3.0])
    for n in (np.int64(2), np.int32(2), np.uint8(2)):
        assert torch.equal(group_advantages(rewards, n), group_advantages(rewards, 2))
        assert torch.equal(leave_one_out_advantages(rewards, n), leave_one_out_advantages(rewards, 2))
    r, v = torch.rand(2, 5, dtype=torch.float64), torch.rand(2, 5, dtype=torch.float64)
    assert torch.equal(n_step_returns(r, v, 0.9, np.uint8(3)), n_step_returns(r, v, 0.9, 3))
    for bad in (2.0, True, np.float64(2.0), "2", 0):
        with pytest.raises(ValueError, match="num_generations must be an integer"):
            group_advantages(rewards, bad)
        with pytest.raises(ValueError, match="n must be an integer"):
            n_step_returns(r, v, 0.9, bad)
    with pytest.raises(ValueError, match="num_generations must be an integer >= 2"):
        leave_one_out_advantages(rewards, 1)


@pytest.mark.parametrize("bad", [2, 0.5, -1, nan])
def test_every_mask_taking_function_refuses_the_same_bad_mask_the_same_way(bad):
    """One mask check (kl.as_mask) behind losses, KL estimators, returns and log-probs: each refuses a
    mask holding 2, 0.5, -1 or NaN with the same message."""
    from rlcourse import returns
    from rlcourse.losses import masked_mean, ppo_clip_loss, reinforce_loss
    from rlcourse.lm.logprobs import sequence_logprobs
    from rlcourse.lm.model import make_model
    from rlcourse.lm.tokenizer import build_char_tokenizer

    logp, old, _, mask, adv = _batch()
    bad_mask = mask.to(torch.float64)
    bad_mask[1, 1] = bad
    tok = build_char_tokenizer()
    model = make_model("tiny", tok, seed=0)
    ids = torch.randint(4, 20, (4, 5))
    calls = {"masked_mean": lambda: masked_mean(logp, bad_mask),
             "reinforce_loss": lambda: reinforce_loss(logp, adv[:, None], bad_mask),
             "ppo_clip_loss": lambda: ppo_clip_loss(logp, old, adv[:, None].expand_as(logp), bad_mask),
             "kl_k3": lambda: kl_k3(logp, old, bad_mask),
             "reward_to_go": lambda: returns.reward_to_go(old, 0.9, mask=bad_mask),
             "whiten": lambda: returns.whiten(old, mask=bad_mask),
             "gae": lambda: returns.gae(old, old, 0.9, 0.95, mask=bad_mask),
             "discount_weights": lambda: returns.discount_weights(bad_mask, 0.9),
             "sequence_logprobs": lambda: sequence_logprobs(model, ids, ids, bad_mask)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="mask must hold only 0/1 or booleans"):
            call()
            pytest.fail(name)


def test_the_score_matrix_cache_survives_a_pickle_and_misses_after_any_change(monkeypatch):
    """Keyed on the logits' values: a pickled copy (a grading worker's) reuses the cached Jacobian,
    where a key of _version / data_ptr missed; an update through .data recomputes it."""
    import pickle

    from rlcourse.measure.exact_gradient import EnumerablePolicy

    policy = EnumerablePolicy(vocab_size=3, max_len=2, n_prompts=2)
    first = policy.score_matrix().clone()
    calls = []
    real = torch.autograd.functional.jacobian
    monkeypatch.setattr(torch.autograd.functional, "jacobian", lambda *a, **k: calls.append(1) or real(*a, **k))
    copy = pickle.loads(pickle.dumps(policy))
    assert torch.equal(copy.score_matrix(), first) and calls == []
    copy.logits.data[0, 0, 0] += 1e-3
    assert not torch.equal(copy.score_matrix(), first) and calls == [1]
    assert torch.equal(policy.score_matrix(), first) and calls == [1]      # the original keeps its own


def _verl_low_var_kl(logp, logq):
    """verl's k3 ('low_var_kl'), restated from verl/trainer/ppo/core_algos.py: the log-ratio
    log(pi_ref/pi) clamped to [-20, 20], then exp(l) - l - 1 clamped to [-10, 10]."""
    l = np.clip(logq - logp, -20.0, 20.0)
    return np.clip(np.exp(l) - l - 1.0, -10.0, 10.0)


def _openrlhf_approx_kl(logp, logq, estimator):
    """OpenRLHF's compute_approx_kl, restated: d = log pi - log pi_ref; k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d; every one clamped to [-10, 10] (no log-ratio clamp)."""
    d = logp - logq
    with np.errstate(over="ignore"):
        value = {"k1": d, "k2": d ** 2 / 2, "k3": np.exp(-d) - 1.0 + d}[estimator]
    return np.clip(value, -10.0, 10.0)


def test_bound_10_is_verl_and_openrlhf_convention_exactly():
    """Grid of log-ratios from -60 to 60, past the +-20 log-ratio clamp: with bound=ESTIMATE_BOUND ours
    equals both restated rules; without it, ours differs from verl's exactly where |log r| > 20
    (verl clamps the '- log r' term too, kl_k3 only the exponential's argument)."""
    from rlcourse.kl import kl_k2

    log_r = np.concatenate([np.linspace(-60, 60, 241), [-20.0, -19.99, 20.0, 20.01]])
    logp = np.full_like(log_r, -1.0)
    logq = logp + log_r
    P, Q = torch.tensor(logp), torch.tensor(logq)
    ours = kl_k3(P, Q, bound=ESTIMATE_BOUND).numpy()
    assert np.allclose(ours, _verl_low_var_kl(logp, logq), rtol=1e-12, atol=1e-12)
    for name, fn in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        assert np.allclose(fn(P, Q, bound=ESTIMATE_BOUND).numpy(), _openrlhf_approx_kl(logp, logq, name),
                           rtol=1e-12, atol=1e-12), name
    clamped = np.clip(log_r, -20.0, 20.0)
    verl_unbounded = np.exp(clamped) - clamped - 1.0
    differs = ~np.isclose(kl_k3(P, Q).numpy(), verl_unbounded, rtol=1e-12)
    assert set(np.flatnonzero(differs)) == set(np.flatnonzero(np.abs(log_r) > 20))


def test_a_bf16_value_head_is_refused_and_a_bf16_policy_gets_a_float32_value_head():
    """The critic is a ScalarHeadModel read at every position: the reward head's rule holds for it."""
    from rlcourse.lm.model import make_model
    from rlcourse.lm.tokenizer import build_char_tokenizer
    from rlcourse.lm.value_model import make_value_model, token_values

    tok = build_char_tokenizer()
    policy = make_model("tiny", tok, seed=0).to(torch.bfloat16)
    critic = make_value_model("policy", policy=policy)
    assert critic.head.weight.dtype == torch.float32
    ids, mask = torch.randint(4, 20, (2, 3)), torch.ones(2, 3, dtype=torch.long)
    values = token_values(critic, ids, mask, ids, mask)
    assert values.dtype == torch.float32 and torch.equal(values, torch.zeros(2, 3))   # zero head
    with pytest.raises(ValueError, match="head must be float32"):
        token_values(critic.to(torch.bfloat16), ids, mask, ids, mask)
