"""PPO-RLHF's options for the score: the two rules for a completion without <eos> (TRL's
``missing_eos_penalty`` subtracts, Huang et al.'s ``non_eos_score`` replaces) and InstructGPT's
reward-model normalisation (``reward_bias``, measured by ``reward_model_bias``)."""
import copy
import math

import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse.tasks import PreferenceTask
from rlcourse.lm import load_checkpoint
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer, eos_rule
from rlcourse.lm.scalar_head import ScalarHeadModel, score_completions
from rlcourse.tasks.reward_model import reward_model_bias
from rlcourse.lm.sampling import sample
from rlcourse.lm.value_model import make_value_model


def _by_hand(scores, finished, penalty=None, constant=None):
    out = []
    for s, f in zip(scores.tolist(), finished.tolist()):
        if not f and penalty is not None:
            s = s - penalty
        if not f and constant is not None:
            s = constant
        out.append(s)
    return torch.tensor(out)


@pytest.mark.parametrize("penalty, constant", [(None, None), (1.0, None), (0.25, None), (None, -1.0), (None, 0.5)])
def test_eos_rule_equals_a_loop(penalty, constant):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(9, generator=gen) * 3
    finished = torch.rand(9, generator=gen) < 0.5
    finished[:2] = torch.tensor([True, False])
    got = eos_rule(scores, finished, missing_eos_penalty=penalty, non_eos_score=constant)
    torch.testing.assert_close(got, _by_hand(scores, finished, penalty, constant))
    assert torch.equal(got[finished], scores[finished])   # a finished completion keeps its score


def test_the_two_rules_differ_where_the_reward_model_ranked_unfinished_text():
    scores, finished = torch.tensor([2.0, -3.0, 0.5]), torch.tensor([False, False, True])
    subtracted = eos_rule(scores, finished, missing_eos_penalty=1.0)
    replaced = eos_rule(scores, finished, non_eos_score=-1.0)
    assert subtracted.tolist() == [1.0, -4.0, 0.5]   # the order among unfinished ones is kept
    assert replaced.tolist() == [-1.0, -1.0, 0.5]    # every unfinished one scores the constant


@pytest.mark.parametrize("kwargs, name", [
    (dict(missing_eos_penalty=1.0, non_eos_score=-1.0), "not both"),
    (dict(non_eos_score=float("nan")), "non_eos_score"), (dict(missing_eos_penalty=float("inf")), "missing_eos_penalty"),
    (dict(reward_bias=float("nan")), "reward_bias"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(kl_coef=float("nan")), "kl_coef")])
def test_config_refuses_bad_score_options(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PPOConfig(**kwargs)


@pytest.fixture(scope="module")
def setup():
    policy, tok = load_checkpoint("preference-sft", device="cpu")
    torch.manual_seed(0)
    rm = ScalarHeadModel(policy, head_std=0.5).eval()
    return policy, tok, rm


@pytest.mark.parametrize("options", [dict(), dict(missing_eos_penalty=0.75), dict(non_eos_score=-1.0)])
def test_trainer_scores_are_bias_then_eos_rule(setup, options):
    """The trainer's rollout scores equal ``eos_rule(r - reward_bias, finished, ...)`` computed here
    from a constant reward function, on a batch with finished and unfinished completions."""
    policy, tok, rm = setup
    task = PreferenceTask()
    cfg = PPOConfig(batch_size=16, response_length=3, reward_bias=0.3, **options)
    trainer = PPORLHFTrainer(cfg, copy.deepcopy(policy), tok, lambda prompts, completions: [2.0] * len(prompts),
                             make_value_model("reward", reward_model=rm), task.prompts)
    batch = trainer.rollout(task.prompts(16, rng=0))
    finished = batch["finished"]
    assert 0 < int(finished.sum()) < 16, "the batch must hold both kinds for the test to mean anything"
    expected = _by_hand(torch.full((16,), 2.0 - 0.3), finished, options.get("missing_eos_penalty"),
                        options.get("non_eos_score"))
    torch.testing.assert_close(batch["scores"], expected)


def test_reward_model_bias_centres_the_sft_policy_on_held_out_prompts(setup):
    """After subtracting the bias measured on training prompts, fresh SFT samples on held-out
    prompts score 0 on average (within 4 standard errors), although the raw scores do not."""
    policy, tok, rm = setup
    task = PreferenceTask()
    bias = reward_model_bias(rm, policy, tok, task.prompts(512, rng=1), task.max_new_tokens,
                             generator=torch.Generator().manual_seed(1), batch_size=200)
    held_out = task.test_prompts(512)
    ro = sample(policy, tok, held_out, task.max_new_tokens, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        raw = score_completions(rm, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    se = float(raw.std()) / math.sqrt(len(raw))
    assert abs(float(raw.mean())) > 4 * se, "the raw level must be far from 0 for the test to mean anything"
    assert abs(float((raw - bias).mean())) < 4 * se
    # Only the level moves: differences between scores are unchanged.
    torch.testing.assert_close((raw - bias)[1:] - (raw - bias)[:-1], raw[1:] - raw[:-1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="prompts"):
        reward_model_bias(rm, policy, tok, [], task.max_new_tokens)


def test_best_of_n_names_a_bad_sampling_setting(setup):
    from rlcourse.measure.best_of_n import best_of_n

    policy, tok, rm = setup
    for kwargs, name in [(dict(temperature=float("nan")), "temperature"), (dict(max_new_tokens=0), "max_new_tokens"),
                         (dict(n=0), "n must")]:
        call = {"n": 2, "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=name):
            best_of_n(policy, tok, rm, ["ab:"], call.pop("n"), call.pop("max_new_tokens"), **call)


def test_ppo_ptx_adds_the_old_tasks_nll_times_its_coefficient_to_each_minibatch_loss(setup):
    """PPO-ptx: the minibatch loss with ``ptx_coef = c`` is the plain loss plus ``c`` times the mean
    NLL of the ptx batch, computed here token by token from a fresh forward pass; so is its gradient."""
    policy, tok, rm = setup
    task = PreferenceTask()
    old_task = [{"prompt": p, "completion": c} for p, c in zip(task.prompts(6, rng=5), ["ab", "cde", "f", "gh", "a", "bcd"])]
    reward = lambda prompts, completions: [1.0] * len(prompts)  # noqa: E731
    plain_cfg = PPOConfig(batch_size=6, response_length=3)
    ptx_cfg = PPOConfig(batch_size=6, response_length=3, ptx_coef=0.7)
    critic = make_value_model("reward", reward_model=rm)
    plain = PPORLHFTrainer(plain_cfg, copy.deepcopy(policy), tok, reward, critic, task.prompts)
    ptx = PPORLHFTrainer(ptx_cfg, plain.policy, tok, reward, critic, task.prompts, ptx_fn=lambda n, rng: old_task[:n])
    batch = plain.rollout(task.prompts(6, rng=0))
    batch["rewards"], batch["kl"] = plain.token_rewards(batch)
    batch["advantages"], batch["returns"] = plain.advantages(batch)
    mb = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    nll_terms = []   # the NLL of each completion token (and <eos>) of the old-task examples, one by one
    for e in old_task:
        ids = tok(e["prompt"] + e["completion"])["input_ids"] + [tok.eos_token_id]
        n_prompt = len(tok(e["prompt"])["input_ids"])
        logp = torch.log_softmax(plain.policy(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        nll_terms += [-logp[t - 1, ids[t]] for t in range(n_prompt, len(ids))]
    nll = torch.stack(nll_terms).mean()
    loss_plain, _ = plain.loss(mb)
    loss_ptx, stats = ptx.loss(mb)
    torch.testing.assert_close(loss_ptx, loss_plain + 0.7 * nll, rtol=1e-5, atol=1e-6)
    assert stats["loss/ptx"] == pytest.approx(nll.item(), rel=1e-5)
    params = [p for p in plain.policy.parameters() if p.requires_grad]
    g_ptx = torch.autograd.grad(loss_ptx, params, allow_unused=True)
    g_sum = torch.autograd.grad(loss_plain + 0.7 * nll, params, allow_unused=True)
    for a, b in zip(g_ptx, g_sum):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ppo_ptx_names_what_it_needs():
    with pytest.raises(ValueError, match="ptx_coef"):
        PPOConfig(ptx_coef=-0.1)
    with pytest.raises(ValueError, match="ptx_fn"):
        PPORLHFTrainer(PPOConfig(ptx_coef=0.5), None, None, None, None, None)
