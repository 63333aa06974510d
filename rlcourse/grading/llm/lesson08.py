"""Checks for lesson 08 (reward models and PPO-RLHF): the Bradley-Terry loss, the score at the last
real token, KL-shaped token rewards, token-level GAE with masks, and the EOS-trick experiment.

Each check compares the learner's function with the reference in :mod:`rlcourse.losses`,
:mod:`rlcourse.tasks.reward_model`, :mod:`rlcourse.trainers.ppo_rlhf` or :mod:`rlcourse.returns` on inputs
built to expose one plausible mistake each: ``log(sigmoid)`` underflowing, the margin's sign, the
score read at the last column (a pad), the score added at every token, the KL term carrying
gradient, GAE bootstrapping from the values after ``<eos>``. :func:`check_ppo_update` runs the learner's
whole PPO-RLHF update (shaping, GAE, whitening, both clipped losses, one step), judged by its gradient
and by what 30 iterations of it learn; :func:`check_ppo_losses` the fixed find-the-bug losses (one of
them averaged over the padding too), on ragged completions.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references, to_numpy)
from rlcourse.grading._routes import DPO_PIECES, PPO_RLHF_TRAINER, SIGMOID_PAIR_LOSSES
from rlcourse.grading.llm.lesson07b import kept_float64

__all__ = ["check_bradley_terry_loss", "check_score_at_last_token", "check_kl_shaped_rewards",
           "check_token_gae", "check_eos_experiment", "check_ppo_update", "check_ppo_losses"]


def _plain(x):
    return x.detach() if hasattr(x, "detach") else x


def _unchanged(name, case, before, after):
    for b, a in zip(before, after):
        if isinstance(a, torch.Tensor) and not torch.equal(b, a):
            fail(name, case, "inputs left unchanged", "an input tensor was modified in place",
                 "build new tensors (e.g. x.clone()) instead of writing into an argument")


# DPO's sigmoid loss with zero reference log-probs and beta = 1 is the Bradley-Terry loss per pair
# (preference_loss averages it): calling either is not writing the loss.
@references(*SIGMOID_PAIR_LOSSES, *DPO_PIECES)
def check_bradley_terry_loss(fn) -> None:
    """``fn(rewards_chosen, rewards_rejected, margin=None) -> scalar``: ``-mean log sigmoid(r_w - r_l - m)``.

    The loss trains the reward model: its gradient must reach both reward tensors (checked with
    autograd against the reference's), and lesson 08's reward model trained with it must come within
    0.07 of the Bayes limit on held-out pairs, as the lesson's does. Float64 rewards give a float64 loss."""
    __tracebackhide__ = True
    from rlcourse.losses import bradley_terry_loss as reference

    name = "check_bradley_terry_loss"
    gen = torch.Generator().manual_seed(80)
    cases = [("one pair, chosen ahead", torch.tensor([1.0]), torch.tensor([0.0]), None),
             ("random pairs", torch.randn(16, generator=gen), torch.randn(16, generator=gen), None),
             ("random pairs, margin 0.5 (a float)", torch.randn(8, generator=gen), torch.randn(8, generator=gen), 0.5),
             ("random pairs, one margin per pair", torch.randn(6, generator=gen), torch.randn(6, generator=gen),
              torch.rand(6, generator=gen) * 2),
             ("badly ranked pairs with huge differences (log(sigmoid) underflows)",
              torch.tensor([-200.0, 150.0, -90.0]), torch.tensor([200.0, -150.0, 20.0]), None),
             ("float64 rewards", torch.randn(5, generator=gen, dtype=torch.float64),
              torch.randn(5, generator=gen, dtype=torch.float64), None)]
    answers = []
    for case, rc0, rr0, margin in cases:
        # leaves the gradient is measured at, and non-leaf views of them handed over (writable in
        # place, so an answer that writes into its argument is seen doing it)
        sources = [rc0.clone().requires_grad_(True), rr0.clone().requires_grad_(True)]
        rc, rr = (x * 1 for x in sources)
        before = [rc0, rr0] + ([margin.clone()] if isinstance(margin, torch.Tensor) else [])
        got = fn(rc, rr, margin) if margin is not None else fn(rc, rr)
        _unchanged(name, case, before, [rc.detach(), rr.detach()] + ([margin] if isinstance(margin, torch.Tensor) else []))
        kept_float64(name, case, got, rc, rr)
        answers.append((case, *sources, margin, got))
        rc, rr = rc0, rr0
        expected = reference(rc, rr, margin)
        d = (rc - rr).double()
        m = torch.as_tensor(0.0 if margin is None else margin, dtype=torch.float64)
        g = None if got is None else _plain(torch.as_tensor(got))
        if g is not None:
            fail_if_mistake(name, case, expected, g, torch.nn.functional.softplus(d - m).mean(),
                            "the sign is flipped: the loss must be small when r_chosen > r_rejected")
            fail_if_mistake(name, case, expected, g, torch.nn.functional.softplus(-(d + m)).mean(),
                            "the margin is subtracted from the difference: log sigmoid(r_w - r_l - m)")
            fail_if_mistake(name, case, expected, g, torch.nn.functional.softplus(-(d - m)).sum(),
                            "average over pairs (mean), do not sum")
            if not np.isfinite(to_numpy(g)).all():
                fail(name, case, expected, g, "log(sigmoid(x)) underflows to -inf for very negative x; "
                     "use torch.nn.functional.logsigmoid")
        assert_close(name, case, expected, g, atol=1e-5, rtol=1e-5,
                     hint="loss = -mean(logsigmoid(r_chosen - r_rejected - margin))")
    # The values first, then the gradients of the same answers: the loss is what trains the model.
    for case, rc, rr, margin, got in answers:
        grads = gradient_flowing(name, case, got, [rc, rr],
                                 "the loss trains the reward model: compute it with torch operations on the rewards "
                                 "(no .item(), NumPy or torch.tensor(...) around a value)")
        inputs = [x.detach().clone().requires_grad_(True) for x in (rc, rr)]
        want = torch.autograd.grad(reference(*inputs, margin), inputs)
        assert_close(name, f"{case}: the gradient with respect to the rewards", torch.stack(want),
                     torch.stack(grads), atol=1e-6, rtol=1e-5,
                     hint="the gradient of -mean logsigmoid(d) is -sigmoid(-d) / n for r_chosen, the opposite for r_rejected")
    accuracy, bayes = _reward_model_trained_with(fn)
    if not accuracy >= bayes - 0.07:
        fail(name, "lesson 08's reward model trained with your loss (100 steps, 2000 pairs)",
             f"held-out accuracy within 0.07 of the Bayes limit {bayes:.3f}", f"{accuracy:.3f}",
             "the values and gradients agreed on the test pairs: the loss must fall as r_chosen - r_rejected grows")
    print(f"✔ {name}: all {len(cases)} cases passed; lesson 08's reward model trained with your loss orders "
          f"{accuracy:.1%} of 2000 held-out pairs as the raters did (Bayes limit {bayes:.1%})")


def _reward_model_trained_with(fn) -> tuple[float, float]:
    """Lesson 08's reward model (``preference-sft`` with a scalar head, 100 AdamW steps of 64 pairs at lr 3e-3
    on 2000 pairs) trained with ``fn`` as its loss: its held-out pairwise accuracy and the Bayes limit."""
    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.measure.bayes_limit import bayes_accuracy
    from rlcourse.lm.scalar_head import ScalarHeadModel
    from rlcourse.tasks.reward_model import train_reward_model

    task = PreferenceTask()
    policy, tokenizer = load_checkpoint("preference-sft", device="cpu")
    torch.manual_seed(0)
    reward_model = ScalarHeadModel(policy)
    out = train_reward_model(reward_model, tokenizer, task.preference_pairs(2000, rng=1), steps=100, lr=3e-3,
                             eval_pairs=task.preference_pairs(2000, rng=2), progress=False,
                             loss_fn=lambda chosen, rejected, margin: fn(chosen, rejected))
    return out["eval"]["eval_accuracy"], bayes_accuracy(task)


def _mask_cases(gen):
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    holes = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]])
    return [("right-padded completions (pads after <eos>)", right),
            ("bool mask", right.bool()),
            ("padding on both sides", left),
            ("masks with holes inside a row", holes)]


@references("rlcourse.lm.scalar_head:score_at_last_token", "rlcourse.lm.scalar_head:last_real_index")
def check_score_at_last_token(fn) -> None:
    """``fn(values, mask) -> (B,)``: ``values[b, t_b]`` with ``t_b`` the last position where ``mask[b]`` is 1.

    Padding may sit on either side or inside a row, and may hold anything (a value head's output
    after ``<eos>``: large numbers, ``nan``, ``-inf``): read the real position, never multiply by
    the mask. The score trains the reward model, so its gradient must reach ``values``.
    """
    __tracebackhide__ = True
    from rlcourse.lm.scalar_head import score_at_last_token as reference

    name = "check_score_at_last_token"
    gen = torch.Generator().manual_seed(81)
    cases = [(case, mask, 1e3) for case, mask in _mask_cases(gen)]
    cases.append(("right-padded, padding holding nan and -inf (0 * nan is nan)",
                  torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]), float("nan")))
    cases.append(("left-padded, padding holding -inf", torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]),
                  -float("inf")))
    answers = []
    for case, mask, pad in cases:
        values = torch.randn(mask.shape, generator=gen)
        if pad != pad:       # nan: alternate nan and -inf along the padding
            fill = torch.tensor([float("nan"), -float("inf")]).repeat(mask.shape[1])[:mask.shape[1]].expand(mask.shape)
        else:
            fill = torch.full_like(values, pad)
        values = torch.where(mask.bool(), values, fill)          # pads hold loud values
        source = values.clone().requires_grad_(True)
        handed = source * 1                                      # writable, with a graph back to source
        got = call_unmutated(name, case, fn, handed, mask)
        expected = reference(values, mask)
        g = None if got is None else _plain(got)
        if g is not None:
            fail_if_mistake(name, case, expected, g, values[:, -1],
                            "that is the last column, a pad for most rows: read the last position where mask is 1")
            count = mask.long().sum(1) - 1
            fail_if_mistake(name, case, expected, g, values.gather(1, count[:, None]).squeeze(1),
                            "mask.sum() - 1 is the last real index only for right padding with no holes; "
                            "find the largest index where mask is 1")
            if not torch.isfinite(torch.as_tensor(to_numpy(g))).all():
                fail(name, case, expected, g, "padding may hold nan or -inf, and 0 * nan is nan: pick the value at "
                     "the last real position (values.gather) instead of multiplying values by a mask")
        assert_close(name, case, expected, g, atol=1e-6,
                     hint="e.g. idx = torch.where(mask.bool(), arange(T), -1).max(1).values; values.gather(1, idx)")
        answers.append((case, source, mask, got))
    for case, source, mask, got in answers:
        (grad,) = gradient_flowing(name, case, got, [source],
                                   "the score is what the reward model's loss differentiates: index values with torch "
                                   "operations (gather), without .item(), NumPy or .detach()")
        ref = source.detach().clone().requires_grad_(True)
        (want,) = torch.autograd.grad(reference(ref, mask).sum(), [ref])
        assert_close(name, f"{case}: the gradient with respect to values", want, grad, atol=1e-6,
                     hint="only the value at each row's last real position receives the gradient, with weight 1")
    passed(name, len(cases))


@references("rlcourse.trainers.ppo_rlhf:kl_shaped_rewards", "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.token_rewards",
            "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.token_rewards", "rlcourse.kl:kl_k1")
def check_kl_shaped_rewards(fn) -> None:
    """``fn(scores, logprobs, ref_logprobs, mask, kl_coef) -> (B, T)``: ``-kl_coef * k1_t`` plus the score at the last real token.

    Masks are right-padded, left-padded and with holes. Accepted borderline: padded log-probs are
    finite junk, never ``-inf`` or ``nan`` (the reference multiplies the KL by the mask, as the
    lesson's solution does)."""
    __tracebackhide__ = True
    from rlcourse.trainers.ppo_rlhf import kl_shaped_rewards as reference

    name = "check_kl_shaped_rewards"
    gen = torch.Generator().manual_seed(82)
    cases = []
    for i, (mask, coef) in enumerate([(torch.ones(2, 4, dtype=torch.long), 0.1),
                                      (torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]), 0.05),
                                      (torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]]), 0.0),
                                      (torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), 2.0),
                                      (torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), 0.1),
                                      (torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0]]), 0.3)]):
        B, T = mask.shape
        logp = (-3 * torch.rand(B, T, generator=gen)).requires_grad_(True)
        ref = -3 * torch.rand(B, T, generator=gen)
        scores = 2 * torch.randn(B, generator=gen)
        cases.append((f"case {i}: mask {mask.tolist()}, kl_coef={coef} (padding holds non-zero log-probs)",
                      scores, logp, ref, mask, coef))
    for case, scores, logp, ref, mask, coef in cases:
        before = [scores.clone(), logp.detach().clone(), ref.clone(), mask.clone()]
        got = fn(scores, logp, ref, mask, coef)
        _unchanged(name, case, before, [scores, logp.detach(), ref, mask])
        if isinstance(got, tuple):
            got = got[0]
        expected, kl = reference(scores, logp, ref, mask, coef)
        if getattr(got, "requires_grad", False):
            fail(name, case, "rewards without a gradient", "a tensor that requires grad",
                 "the KL penalty is part of the reward, a number: compute it from detached log-probs")
        g = None if got is None else _plain(got)
        m = mask.float()
        if g is not None:
            fail_if_mistake(name, case, expected, g, -coef * kl + scores[:, None] * m,
                            "the score goes on the last real token only, not on every token")
            fail_if_mistake(name, case, expected, g, (-coef * kl).index_put((torch.arange(len(scores)),
                            torch.full((len(scores),), mask.shape[1] - 1)), scores, accumulate=True),
                            "the score was put in the last column, a pad for short rows")
            count = mask.long().sum(1) - 1
            fail_if_mistake(name, case, expected, g, (-coef * kl).index_put((torch.arange(len(scores)), count), scores,
                                                                          accumulate=True),
                            "mask.sum() - 1 is the last real index only for right padding without holes; padding "
                            "can sit on either side: put the score at the largest index where mask is 1")
            fail_if_mistake(name, case, expected, g, expected + 2 * coef * kl,
                            "KL_t = log pi_old - log pi_ref; the reward subtracts kl_coef * KL_t")
            fail_if_mistake(name, case, expected, g, expected - coef * (logp.detach() - ref) * (1 - m),
                            "padding positions must be 0: multiply the KL by the mask")
        assert_close(name, case, expected, g, atol=1e-5, rtol=1e-5,
                     hint="r_t = -kl_coef * mask_t * (logprobs_t - ref_logprobs_t), plus the score at the last real token")
    passed(name, len(cases))


@references("rlcourse.returns:gae", "rlcourse.returns:gae_from_n_step", "rlcourse.returns:td_residuals",
            "rlcourse.trainers.ppo_rlhf:advantages_and_returns", "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.advantages",
            "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.advantages")
def check_token_gae(fn) -> None:
    """``fn(rewards, values, mask, gamma, lam) -> (B, T)``: GAE over each row's real tokens, terminal after the last.

    Masks are right-padded and left-padded (a row's real tokens form one block). Accepted
    borderline: no holes inside a row (bootstrapping across a hole, as the reference does, or from
    0 there, as the lesson's solution does, are both defensible) and padded values are finite."""
    __tracebackhide__ = True
    from rlcourse.returns import gae

    name = "check_token_gae"
    gen = torch.Generator().manual_seed(83)
    cases = []
    for i, (mask, gamma, lam) in enumerate([(torch.ones(1, 4, dtype=torch.long), 1.0, 1.0),
                                            (torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]), 1.0, 0.95),
                                            (torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]), 0.9, 0.5),
                                            (torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]), 1.0, 0.0),
                                            (torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), 0.9, 0.8)]):
        B, T = mask.shape
        rewards = torch.randn(B, T, generator=gen) * mask
        values = torch.randn(B, T, generator=gen) + 3.0 * (1 - mask)   # pads hold values: never bootstrap from them
        cases.append((f"case {i}: mask {mask.tolist()}, gamma={gamma}, lam={lam}", rewards, values, mask, gamma, lam))
    for case, rewards, values, mask, gamma, lam in cases:
        before = [rewards.clone(), values.clone(), mask.clone()]
        got = fn(rewards, values, mask, gamma, lam)
        _unchanged(name, case, before, [rewards, values, mask])
        expected = gae(rewards, values, gamma, lam, mask=mask)
        g = None if got is None else _plain(got)
        if g is not None:
            nxt = torch.cat([values[:, 1:], torch.zeros(values.shape[0], 1)], 1)
            leak = torch.zeros_like(rewards)
            run = torch.zeros(rewards.shape[0])
            for t in reversed(range(rewards.shape[1])):
                run = rewards[:, t] + gamma * nxt[:, t] - values[:, t] + gamma * lam * run
                leak[:, t] = run
            lengths = mask.long().sum(1, keepdim=True)
            prefix = (torch.arange(mask.shape[1]) < lengths).long()
            fail_if_mistake(name, case, expected, g, gae(rewards, values, gamma, lam, mask=prefix),
                            "that treats the first mask.sum() positions as the real ones (right padding); padding "
                            "can sit on either side: use the mask itself, position by position")
            fail_if_mistake(name, case, expected, g, leak * mask,
                            "the last real token bootstrapped from the value after <eos> (a pad): "
                            "the state after the last real token is terminal, V = 0")
        assert_close(name, case, expected, g, atol=1e-5, rtol=1e-5,
                     hint="delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last real token; "
                          "A_t = delta_t + gamma lam A_{t+1}, backwards; 0 on padding")
    passed(name, len(cases))


def _finished_share(policy, n_prompts: int = 128) -> float:
    """The share of ``policy``'s completions (``response_length=5``) that end with ``<eos>``, measured here."""
    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint, sample

    _, tokenizer = load_checkpoint("preference-sft", device="cpu")
    prompts = PreferenceTask().test_prompts(n_prompts)
    rollout = sample(policy, tokenizer, prompts, 5, generator=torch.Generator().manual_seed(0))
    return float(rollout.finished.float().mean())


@references()
def check_eos_experiment(fn) -> None:
    """``fn(policy, missing_eos_penalty) -> trained policy``: a short PPO run with ``response_length=5``
    from a copy of ``policy`` (an SFT policy, handed over by the check).

    Judged by what the returned policies do, measured here on 128 test prompts with the check's own
    generator (a reported number could be anything): with the penalty at least 0.3 more of their
    completions must end with ``<eos>`` than without it. The policy handed over is the ``preference-sft``
    checkpoint moved a little by seeded noise, so that a run that loads the checkpoint itself instead of
    copying ``policy`` is seen (the returned weights are nearer the checkpoint than the policy given). It
    must come back unchanged: it is the reference model, which the caller still needs.
    """
    __tracebackhide__ = True
    import copy

    from rlcourse.grading._steps import moved_copy
    from rlcourse.lm import load_checkpoint

    name = "check_eos_experiment"

    def flat(model):
        return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])

    sft, _ = load_checkpoint("preference-sft", device="cpu")
    start = moved_copy(sft, seed=3, scale=0.01)   # the same start for both runs: the comparison stays paired
    checkpoint, handed = flat(sft), flat(start)
    shares = {}
    for penalty in (None, 1.0):
        label = f"missing_eos_penalty={penalty}"
        policy = copy.deepcopy(start)
        trained = fn(policy, penalty)
        if not isinstance(trained, torch.nn.Module) or not hasattr(trained, "get_input_embeddings"):
            fail(name, label, "the trained policy (a causal LM)", f"{type(trained).__name__} {trained!r:.60}",
                 "return the policy the trainer updated (trainer.policy), not a number: the check measures it")
        if not torch.equal(flat(policy), handed):
            fail(name, label, "the policy handed over left unchanged", "its weights were trained",
                 "train a copy (copy.deepcopy(policy)): the policy you are given is the reference model")
        weights = flat(trained)
        from_handed, from_checkpoint = float((weights - handed).norm()), float((weights - checkpoint).norm())
        if weights.shape != handed.shape or not from_handed < from_checkpoint:
            fail(name, label, "a policy trained from the one handed over",
                 f"a policy {from_checkpoint:.2f} from the preference-sft checkpoint and {from_handed:.2f} from the "
                 f"policy handed over", "train a copy of the policy you are given (copy.deepcopy(policy)), not a "
                 "checkpoint loaded again: the check hands over a policy of its own")
        shares[penalty] = _finished_share(trained.cpu().eval())
    if not shares[1.0] >= shares[None] + 0.3:
        fail(name, "the measured effect of the EOS trick", "with the penalty at least 0.3 more completions end",
             f"{shares[None]:.2f} without, {shares[1.0]:.2f} with",
             "pass missing_eos_penalty to PPOConfig, use response_length=5, train a fresh copy of the policy "
             "for each run, and return the trained policy")
    print(f"✔ {name}: the EOS trick raised the share of finished completions by at least 0.3")


def _ppo_rollout(policy, critic, ref, tokenizer, task, prompts, generator) -> dict:
    """A PPO-RLHF batch as the trainer's rollout makes it (the task's verifier as the reward)."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.lm.value_model import token_values

    roll = sample(policy, tokenizer, prompts, task.max_new_tokens, generator=generator)
    with torch.no_grad():
        ref_logprobs = sequence_logprobs(ref, roll.prompt_ids, roll.completion_ids, roll.completion_mask,
                                         roll.prompt_mask)
        values = token_values(critic, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    return {"prompt_ids": roll.prompt_ids, "prompt_mask": roll.prompt_mask, "completion_ids": roll.completion_ids,
            "completion_mask": roll.completion_mask, "logprobs": roll.logprobs, "ref_logprobs": ref_logprobs,
            "values": values, "scores": task.reward(prompts, roll.completions).float()}


def _ppo_start(critic_seed: int, move_seed: int | None = None):
    """``(task, start, tokenizer, ref, policy, critic)`` for the PPO checks: the ``addition-partial``
    checkpoint, its frozen copy as the reference, a policy (``start`` itself, or a copy moved by noise
    seeded ``move_seed`` so that the KL term is not 0) and a critic on it whose head is not zero. The
    learner's global random stream is left as it was."""
    import copy

    from rlcourse.grading._steps import addition_start
    from rlcourse.lm.scalar_head import ScalarHeadModel

    task, start, tokenizer = addition_start()
    ref = copy.deepcopy(start).requires_grad_(False)
    policy = start
    if move_seed is not None:
        policy = copy.deepcopy(start)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(move_seed)
            for p in policy.parameters():
                p.add_(0.03 * torch.randn(p.shape, generator=gen))
    with torch.random.fork_rng():
        torch.manual_seed(critic_seed)
        critic = ScalarHeadModel(policy, head_std=0.2).eval()
    return task, start, tokenizer, ref, policy, critic


def _reference_ppo_update(policy, critic, optimizer, batch, kl_coef, lam, cliprange, cliprange_value, vf_coef):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.trainers.ppo_rlhf import advantages_and_returns, kl_shaped_rewards, ppo_rlhf_loss
    from rlcourse.lm.value_model import token_values

    m = batch["completion_mask"]
    rewards, _ = kl_shaped_rewards(batch["scores"], batch["logprobs"], batch["ref_logprobs"], m, kl_coef)
    advantages, returns = advantages_and_returns(rewards, batch["values"], m, 1.0, lam)
    logprobs = sequence_logprobs(policy, batch["prompt_ids"], batch["completion_ids"], m, batch["prompt_mask"])
    values = token_values(critic, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], m)
    loss, _, _ = ppo_rlhf_loss(logprobs, batch["logprobs"], advantages, values, batch["values"], returns, m,
                               cliprange, cliprange_value, vf_coef)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


PPO_SETTINGS = [(0.05, 0.95, 0.2, 0.2, 0.1), (0.2, 1.0, 0.1, 0.05, 0.5)]
PPO_LEARNING = {"iterations": 30, "epochs": 2, "batch": 64, "lr": 1e-4, "held_out": 300, "margin": 0.05}


@references("rlcourse.trainers.ppo_rlhf:kl_shaped_rewards", "rlcourse.trainers.ppo_rlhf:advantages_and_returns",
            "rlcourse.returns:gae", "rlcourse.returns:gae_from_n_step", "rlcourse.returns:td_residuals",
            "rlcourse.kl:kl_k1", "rlcourse.trainers.ppo_rlhf:ppo_rlhf_loss", "rlcourse.trainers.ppo_rlhf:minibatch_loss",
            "rlcourse.losses.policy_gradient:ppo_clip_loss", "rlcourse.losses.policy_gradient:ppo_clip_objective",
            "rlcourse.losses.policy_gradient:importance_ratio", "rlcourse.losses.policy_gradient:value_loss",
            *PPO_RLHF_TRAINER)
def check_ppo_update(fn) -> None:
    """``fn(policy, value_model, optimizer, batch, kl_coef, lam, cliprange, cliprange_value, vf_coef) -> loss``:
    one PPO-RLHF gradient step on a rollout batch. Checked by the gradient (policy and critic) two calls
    on one batch hand the optimiser, against the reference update (the second call's ratios and values
    have moved, so both clips act), then by 30 iterations of PPO on ``addition-partial`` (the verifier
    as the reward, 2 calls per batch) that must raise held-out exact match by 5 points."""
    __tracebackhide__ = True
    import copy

    from rlcourse.grading._steps import RecordingSGD, assert_call_gradient
    from rlcourse.trainers import exact_match
    from rlcourse.lm.scalar_head import ScalarHeadModel

    name = "check_ppo_update"
    task, start, tokenizer, ref, moved, critic = _ppo_start(critic_seed=8, move_seed=7)
    for kl_coef, lam, clip, clip_v, vf_coef in PPO_SETTINGS:
        case = f"kl_coef={kl_coef}, lam={lam}, cliprange={clip}, cliprange_value={clip_v}, vf_coef={vf_coef}"
        batch = _ppo_rollout(moved, critic, ref, tokenizer, task, task.prompts(24, rng=70),
                             torch.Generator().manual_seed(9))
        sides = []
        for _ in range(2):
            policy, value_model = copy.deepcopy(moved), copy.deepcopy(critic)
            sides.append((policy, value_model, RecordingSGD([*policy.parameters(), *value_model.parameters()], lr=0.5)))
        (p_mine, v_mine, opt_mine), (p_theirs, v_theirs, opt_theirs) = sides
        for call in (0, 1):                    # the same batch twice: the second call is PPO's second epoch
            label = f"{case}, 24 completions, call {call + 1} on the batch"
            loss = fn(p_mine, v_mine, opt_mine, {k: v.clone() for k, v in batch.items()}, kl_coef, lam, clip, clip_v,
                      vf_coef)
            expected_loss = _reference_ppo_update(p_theirs, v_theirs, opt_theirs, batch, kl_coef, lam, clip, clip_v,
                                                  vf_coef)
            assert_call_gradient(name, label, call, opt_mine, opt_theirs,
                                 "another direction: the advantages come from your KL-shaped rewards and your GAE "
                                 "(gamma = 1) and are whitened over the real tokens; the returns are the advantages "
                                 "before whitening plus the stored values; the ratio is against the batch's "
                                 "log-probs (the sampler's); both losses are means over the real tokens",
                                 longer="a loss averaged over another number of terms, or vf_coef applied elsewhere",
                                 close="almost the reference's direction: the same tokens weighted a little differently "
                                       "(are the advantages whitened over the real tokens only, and the returns taken "
                                       "from the advantages before whitening?)")
            got = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
            if got is None or abs(float(got) - expected_loss) > 1e-5:
                fail(name, label, f"loss {expected_loss:.6f}", got, "return the loss the step minimised, as a float")
    s = PPO_LEARNING
    held_out = task.test_prompts(s["held_out"])
    before = exact_match(start, tokenizer, task, held_out)
    policy = copy.deepcopy(start)
    value_model = ScalarHeadModel(policy, head_std=0.0)
    optimizer = torch.optim.Adam([*policy.parameters(), *value_model.parameters()], lr=s["lr"])
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    for _ in range(s["iterations"]):
        batch = _ppo_rollout(policy, value_model, ref, tokenizer, task, task.prompts(s["batch"], rng), gen)
        for _ in range(s["epochs"]):
            fn(policy, value_model, optimizer, batch, 0.05, 0.95, 0.2, 0.2, 0.1)
    after = exact_match(policy, tokenizer, task, held_out)
    if not after >= before + s["margin"]:
        fail(name, f"{s['iterations']} PPO iterations with your update (Adam, lr {s['lr']}, {s['batch']} completions, "
             f"{s['epochs']} calls per batch)", f"held-out exact match at least {before + s['margin']:.3f} "
             f"(from {before:.3f})", f"{after:.3f}", "the update is right on one batch but does not learn over many")
    print(f"✔ {name}: gradients equal the reference update's ({len(PPO_SETTINGS)} settings x 2 calls); "
          f"{s['iterations']} iterations raised held-out exact match {before:.3f} -> {after:.3f}")


def _reference_ppo_losses(policy, value_model, mb, cliprange, cliprange_value):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.lm.value_model import token_values
    from rlcourse.losses.policy_gradient import ppo_clip_loss, value_loss

    m = mb["completion_mask"]
    logprobs = sequence_logprobs(policy, mb["prompt_ids"], mb["completion_ids"], m, mb["prompt_mask"])
    values = token_values(value_model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], m)
    return (ppo_clip_loss(logprobs, mb["logprobs"], mb["advantages"], m, clip_coef=cliprange),
            value_loss(values, mb["returns"], mb["values"], clip_coef=cliprange_value, mask=m))


@references("rlcourse.trainers.ppo_rlhf:ppo_rlhf_loss", "rlcourse.trainers.ppo_rlhf:minibatch_loss",
            "rlcourse.losses.policy_gradient:ppo_clip_loss", "rlcourse.losses.policy_gradient:ppo_clip_objective",
            "rlcourse.losses.policy_gradient:importance_ratio", "rlcourse.losses.policy_gradient:value_loss",
            "rlcourse.trainers.ppo_rlhf:PPORLHFTrainer.loss",
            "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.losses",
            "rlcourse.trainers.ppo_rlhf_seeds:SeedBatchedPPORLHFTrainer.loss")
def check_ppo_losses(fn) -> None:
    """``fn(policy, value_model, minibatch, cliprange, cliprange_value) -> (policy_loss, value_loss)``: the
    fixed find-the-bug function. Both losses and their gradients (policy and critic) are compared with
    the reference's on minibatches of ragged completions (a third of a rollout, its advantages whitened over
    the whole rollout), after the models have moved from the rollout."""
    __tracebackhide__ = True
    import copy

    from rlcourse.trainers.ppo_rlhf import advantages_and_returns, kl_shaped_rewards

    name = "check_ppo_losses"
    task, start, tokenizer, ref, _, critic = _ppo_start(critic_seed=11)
    n = 0
    for i, (clip, clip_v) in enumerate([(0.2, 0.2), (0.1, 0.05)]):
        batch = _ppo_rollout(start, critic, ref, tokenizer, task, task.prompts(24, rng=80 + i),
                             torch.Generator().manual_seed(12 + i))
        m = batch["completion_mask"]
        rewards, _ = kl_shaped_rewards(batch["scores"], batch["logprobs"], batch["ref_logprobs"], m, 0.05)
        batch["advantages"], batch["returns"] = advantages_and_returns(rewards, batch["values"], m, 1.0, 0.95)
        # A minibatch of a third of the rollout, as PPO's epochs take it: its advantages were whitened over
        # the whole batch, so they are not whitened over the minibatch (mean 0, std 1) themselves.
        rows = torch.arange(i, 24, 3)
        batch = {k: v[rows] for k, v in batch.items()}
        m = batch["completion_mask"]
        padding = 1 - float(m.float().mean())
        case = (f"a minibatch of 8 of a rollout's 24 completions, of lengths {sorted(set(m.sum(1).tolist()))} "
                f"({padding:.0%} of the positions are padding), cliprange={clip}, cliprange_value={clip_v}")
        models = []
        for _ in range(2):                     # both sides start from the same moved weights: the clips act
            policy, value_model = copy.deepcopy(start), copy.deepcopy(critic)
            with torch.no_grad():
                gen = torch.Generator().manual_seed(13 + i)
                for p in [*policy.parameters(), *value_model.parameters()]:
                    p.add_(0.02 * torch.randn(p.shape, generator=gen))
            models.append((policy, value_model))
        (p_mine, v_mine), (p_theirs, v_theirs) = models
        got = fn(p_mine, v_mine, {k: v.clone() for k, v in batch.items()}, clip, clip_v)
        expected = _reference_ppo_losses(p_theirs, v_theirs, batch, clip, clip_v)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            fail(name, case, "a pair (policy_loss, value_loss)", type(got).__name__, "return both losses")
        for which, g, e, params_mine, params_theirs in (("policy loss", got[0], expected[0], p_mine, p_theirs),
                                                         ("critic's loss", got[1], expected[1], v_mine, v_theirs)):
            value = float(g.detach()) if isinstance(g, torch.Tensor) else g
            target = float(e.detach())
            if value is None or abs(value - target) > 1e-5 * max(1, abs(target)):
                ratio = value / target if value is not None and target != 0 else float("nan")
                fail(name, f"{case}: the {which}", f"{target:.6f}", value,
                     f"the {which} is {ratio:.3g} times the reference's on this batch, where {padding:.0%} of the "
                     f"positions are padding")
            e.backward()
            g.backward()
            grads_mine = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                    for p in params_mine.parameters()])
            grads_theirs = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                      for p in params_theirs.parameters()])
            assert_close(name, f"{case}: the gradient of the {which}", grads_theirs, grads_mine, atol=1e-5, rtol=1e-4,
                         hint="the value is right but not its gradient")
            n += 1
    passed(name, n)
