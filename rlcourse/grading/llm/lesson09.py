"""Checks for lesson 09 (REINFORCE and RLOO for language models).

* :func:`check_leave_one_out_advantages` - RLOO's baseline: the mean of the *other* K-1 rewards of
  the group (mistakes caught: the sample inside its own baseline, K instead of K-1, one mean over
  the whole batch, groups read across the batch instead of as consecutive rows);
* :func:`check_policy_gradient_loss` - the bandit REINFORCE surrogate with a detached advantage
  (wrong sign, undetached advantage, a token mean, padding counted);
* :func:`check_rloo_gradient_estimate` - an experiment: the learner's Monte-Carlo RLOO gradient on
  the exact oracle, measured over thousands of groups: unbiased, with RLOO's variance;
* :func:`check_rloo_step` - a whole RLOO update on the tiny GPT from the learner's own functions,
  checked by its gradient (against the reference step's) and by what 40 steps of it learn;
* :func:`check_rloo_kl_step` - find the bug: RLOO with the KL penalty in the reward, fixed; checked
  the same two ways.
"""
from __future__ import annotations

import numpy as np

import torch

from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, to_numpy, references
from rlcourse.grading._routes import ADVANTAGES, KL_PENALTY, POLICY_GRADIENT_STEP

__all__ = ["check_leave_one_out_advantages", "check_policy_gradient_loss", "check_rloo_gradient_estimate",
           "check_rloo_step", "check_rloo_kl_step"]


def _call_unmutated(name, case, fn, *tensors, **kwargs):
    """``fn(*tensors, **kwargs)``, failing if it wrote into an argument: :func:`~rlcourse.grading._core.call_unmutated`,
    which counts a NaN left where it was as unchanged (``torch.equal`` would call NaN != NaN a change)."""
    __tracebackhide__ = True
    return call_unmutated(name, case, fn, *tensors, **kwargs)


@references(*ADVANTAGES)
def check_leave_one_out_advantages(fn) -> None:
    """``fn(rewards, num_generations) -> (B,)``: ``A_i = r_i - mean of the other K-1 rewards of i's group``.

    Rewards come in groups of ``K = num_generations`` consecutive entries (all completions of one
    prompt next to each other).
    """
    __tracebackhide__ = True
    from rlcourse.losses.grpo import leave_one_out_advantages as reference

    name = "check_leave_one_out_advantages"
    gen = torch.Generator().manual_seed(90)
    cases = [("one group of 4 (K=4)", torch.tensor([1.0, 0.0, 0.0, 0.0]), 4),
             ("two groups of 2 (K=2): the baseline is the one sibling", torch.tensor([1.0, 0.0, 0.5, 0.25]), 2),
             ("three groups of 4, random rewards", torch.randn(12, generator=gen), 4),
             ("integer rewards 0/1 (K=3)", torch.tensor([1, 0, 0, 1, 1, 1]), 3),
             ("a group whose rewards are all equal (its advantages are 0)", torch.tensor([0.7] * 4 + [0.0, 1.0, 1.0, 0.0]), 4),
             ("rewards near 1e6 (K=8)", 1e6 + torch.randn(16, generator=gen, dtype=torch.float64), 8)]
    for case, rewards, K in cases:
        got = _call_unmutated(name, case, fn, rewards, K)
        expected = reference(rewards, K)
        r = rewards.double()
        grouped = r.view(-1, K)
        fail_if_mistake(name, case, expected, got, (grouped - grouped.mean(1, keepdim=True)).reshape(-1),
                        "the baseline must leave the sample out: mean of the K-1 *others*, "
                        "(sum of the group - r_i) / (K - 1); the group mean includes r_i itself")
        fail_if_mistake(name, case, expected, got, (grouped - (grouped.sum(1, keepdim=True) - grouped) / K).reshape(-1),
                        "the others are K - 1 rewards: divide their sum by K - 1, not by K")
        fail_if_mistake(name, case, expected, got, r - (r.sum() - r) / (r.numel() - 1),
                        "the baseline comes from the completion's own group (its prompt), not the whole batch")
        interleaved = r.view(K, -1)
        fail_if_mistake(name, case, expected, got,
                        (interleaved - (interleaved.sum(0, keepdim=True) - interleaved) / (K - 1)).reshape(-1),
                        "a group is K *consecutive* rewards: rewards.view(-1, K), one row per prompt")
        if rewards.dtype == torch.float64:
            g32 = rewards.float().view(-1, K)
            fail_if_mistake(name, case, expected, got, (g32 - (g32.sum(1, keepdim=True) - g32) / (K - 1)).reshape(-1),
                            "these rewards are float64, and float32 keeps only about 7 digits: near 1e6 that is "
                            "steps of 1/16; keep the rewards' precision (convert integers only)")
        atol = 1e-3 if rewards.abs().max() > 1e3 else 1e-6
        assert_close(name, case, expected, got, hint="A_i = r_i - (sum_group - r_i) / (K - 1)", atol=atol)
    passed(name, len(cases))


@references("rlcourse.losses.policy_gradient:reinforce_loss")
def check_policy_gradient_loss(fn) -> None:
    """``fn(logprobs, mask, advantages) -> scalar``: ``-(1/B) sum_i A_i sum_t m_it log pi(y_it)``.

    ``advantages`` may carry a gradient (it came from a differentiable reward or baseline): it is a
    weight and must be detached. Then REINFORCE with the learner's loss (lesson 09's moving-average
    baseline, 40 steps of 64 prompts from ``addition-partial``) must raise held-out exact match by 5 points.
    """
    __tracebackhide__ = True
    name = "check_policy_gradient_loss"
    gen = torch.Generator().manual_seed(91)
    cases = []
    for i, (B, T) in enumerate([(2, 1), (4, 5), (6, 7)]):
        logp = -torch.rand(B, T, generator=gen) * 3
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0] = T
        mask = (torch.arange(T) < lengths[:, None]).long()
        logp = torch.where(mask.bool(), logp, torch.full_like(logp, -7.0))     # padding holds junk
        adv = torch.randn(B, generator=gen)
        cases.append((f"batch #{i} (B={B}, T={T}, padding holds -7.0)", logp, mask, adv))
    # A token outside top-k has log-prob -inf: after <eos> the padding can hold it, and -inf * 0 is nan.
    logp, mask = -torch.rand(3, 4, generator=gen) * 3, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    cases.append(("padding holding -inf (B=3, T=4)", torch.where(mask.bool(), logp, torch.full_like(logp, -float("inf"))),
                  mask, torch.randn(3, generator=gen)))
    for case, logp0, mask, adv0 in cases:
        logp = logp0.clone().requires_grad_()
        source = adv0.clone().requires_grad_()
        advantages = source * 1.0                                    # a non-leaf with a graph behind it
        got = fn(logp, mask, advantages)
        if not isinstance(got, torch.Tensor) or got.ndim != 0:
            fail(name, case, "a scalar tensor", got, "return one number: the loss to minimise")
        m = mask.to(logp0.dtype)
        real = torch.where(mask.bool(), logp0, torch.zeros_like(logp0))
        expected = -(adv0[:, None] * real).sum() / logp0.shape[0]
        if not torch.isfinite(got.detach()).all():
            fail(name, case, expected, got.detach(), "padding may hold -inf and -inf * 0 is nan: select the real "
                 "tokens with torch.where(mask.bool(), logprobs, 0) instead of multiplying by the mask")
        hint = "loss = -(1/B) sum_i A_i sum_t mask_it logprobs_it (minus: optimisers minimise)"
        fail_if_mistake(name, case, expected, got.detach(), -expected, "wrong sign: minimising must raise "
                        "log pi of completions with positive advantage, so the loss is MINUS A log pi")
        fail_if_mistake(name, case, expected, got.detach(), -(adv0[:, None] * real).sum() / m.sum(),
                        "divide by the number of completions B (one REINFORCE term per sequence), not tokens")
        fail_if_mistake(name, case, expected, got.detach(), -(adv0[:, None] * logp0).sum() / logp0.shape[0],
                        "multiply by the mask: padding after <eos> holds junk log-probs")
        assert_close(name, case, expected, got.detach(), hint=hint, atol=1e-5)
        got.backward()
        if not torch.isfinite(logp.grad).all():
            fail(name, case + " (gradient)", "finite gradients", "nan in logprobs.grad",
                 "the padding's -inf reached the gradient: select with torch.where(mask.bool(), logprobs, 0)")
        if source.grad is not None and float(source.grad.abs().sum()) > 0:
            fail(name, case, "no gradient into the advantages", "advantages received a gradient",
                 "detach the advantage (advantages.detach()): it is a weight, not something to optimise")
        assert_close(name, case + " (gradient)", -adv0[:, None] * m / logp0.shape[0], logp.grad, hint=hint, atol=1e-6)
    before, after = _reinforce_trained_with(fn)
    if not after >= before + 0.05:
        fail(name, "40 REINFORCE steps with your loss (64 prompts, one completion each, a moving-average baseline)",
             f"held-out exact match at least {before + 0.05:.3f} (from {before:.3f})", f"{after:.3f}",
             "the values and gradients agreed on the test batches: the loss must fall as the log-probs of "
             "completions with positive advantages rise")
    print(f"✔ {name}: all {len(cases)} cases passed; 40 REINFORCE steps with your loss (moving-average baseline) "
          f"took held-out exact match from {before:.1%} to {after:.1%}")


def _reinforce_trained_with(fn, steps: int = 40, prompts_per_step: int = 64, lr: float = 1e-4,
                            held_out: int = 300) -> tuple[float, float]:
    """REINFORCE as lesson 09 runs it (one completion per prompt, the moving-average baseline of
    :func:`rlcourse.trainers.policy_gradient.advantages`) with ``fn(logprobs, mask, advantages)`` as the loss, from
    ``addition-partial`` with Adam: held-out exact match before and after."""
    from rlcourse.grading._steps import train_from_addition
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig, advantages

    config = PolicyGradientConfig(advantage_estimator="moving_average", num_generations=1,
                                  per_device_train_batch_size=prompts_per_step)
    baseline = None                          # the moving average, carried from step to step

    def step(model, optimizer, tokenizer, task, prompts, generator):
        nonlocal baseline
        prompts = list(prompts)
        roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=generator)
        adv, baseline = advantages(config, task.reward(prompts, roll.completions).float(), baseline)
        logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
        loss = fn(logp, roll.completion_mask, adv)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    before, after, _ = train_from_addition(step, steps, lr, prompts_per_step, held_out)
    return before, after


@references("rlcourse.measure.exact_gradient:gradient_estimates", *ADVANTAGES)
def check_rloo_gradient_estimate(fn) -> None:
    """``fn(policy, rewards, K, generator) -> (D,)``: one RLOO gradient estimate from K samples.

    Measured over 3000 calls on an :class:`~rlcourse.measure.exact_gradient.EnumerablePolicy` with a
    seeded generator: the mean must match the exact ``grad J`` within noise (unbiased) and the
    variance must match RLOO's (a plain REINFORCE or a batch-mean baseline are caught).
    """
    __tracebackhide__ = True
    from rlcourse.measure.exact_gradient import EnumerablePolicy, estimator_stats, gradient_estimates

    name = "check_rloo_gradient_estimate"
    n = 3000
    cases = 0
    for seed, K in ((0, 4), (1, 2)):
        policy = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=1, seed=seed)
        rewards = 1.0 + (torch.rand(1, policy.n_completions, generator=torch.Generator().manual_seed(seed)) < 0.4).float()
        exact = policy.flat_grad(policy.objective(rewards)).detach()
        gen = torch.Generator().manual_seed(100 + seed)
        first = fn(policy, rewards, K, gen)
        if first is None or to_numpy(first).shape != tuple(exact.shape):
            fail(name, f"K={K}", f"a flat gradient of shape {tuple(exact.shape)}",
                 None if first is None else f"shape {to_numpy(first).shape}",
                 "return (1/K) sum_i A_i * score[y_i], a vector of policy.logits.numel() numbers")
        again = [torch.as_tensor(to_numpy(fn(policy, rewards, K, torch.Generator().manual_seed(5)))) for _ in range(2)]
        if not torch.equal(again[0], again[1]):
            fail(name, f"K={K}, two generators seeded alike", "the same estimate twice", "two different estimates",
                 "draw the samples with the generator you are given (policy.sample(K, generator=generator)), "
                 "not from torch's global random state: a seeded run must be reproducible")
        draws = torch.stack([torch.as_tensor(to_numpy(fn(policy, rewards, K, gen))) for _ in range(n)]).float()
        ours = estimator_stats(draws, exact)
        ref = estimator_stats(gradient_estimates(policy, rewards, K, "rloo", 20_000,
                                                 torch.Generator().manual_seed(7)), exact)
        case = f"{n} estimates, K={K}, rewards in {{1, 2}}"
        if ours["bias"] > 5 * ours["bias_se"] + 1e-9:
            scale = ours["scale"]
            hint = (f"your mean is {scale:.2f} x the exact gradient: the sample is inside its own baseline "
                    f"(expected (K-1)/K = {(K - 1) / K:.2f})" if abs(scale - (K - 1) / K) < 0.05 else
                    "draw y_i with policy.sample(K, generator), weigh score[y_i] by A_i, average over the K")
            fail(name, case, f"bias within noise (< {5 * ours['bias_se']:.4f})", f"bias {ours['bias']:.4f}", hint)
        if not 0.8 < ours["variance"] / ref["variance"] < 1.25:
            fail(name, case, f"variance near RLOO's {ref['variance']:.4f}", f"{ours['variance']:.4f}",
                 "use the leave-one-out baseline; plain REINFORCE (no baseline) has a far larger variance "
                 "when every reward is shifted by a constant")
        cases += 1
    if not np.isfinite(ours["variance"]):
        fail(name, "finite values", "finite", ours["variance"])
    passed(name, cases)


def _reference_rloo_step(model, optimizer, tokenizer, task, prompts, generator, num_generations):
    """RLOO's update: one group per prompt, leave-one-out advantages, the REINFORCE loss (a sum over each
    completion's tokens, a mean over completions), one optimiser step. Returns ``(mean reward,)``."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.losses.grpo import leave_one_out_advantages
    from rlcourse.losses.policy_gradient import reinforce_loss

    group = [p for p in prompts for _ in range(num_generations)]
    roll = sample(model, tokenizer, group, task.max_new_tokens, generator=generator)
    rewards = task.reward(group, roll.completions).float()
    advantages = leave_one_out_advantages(rewards, num_generations)
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    loss = reinforce_loss(logp, advantages[:, None], roll.completion_mask)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return (float(rewards.mean()),)


RLOO_LEARNING = {"steps": 40, "lr": 1e-4, "groups": 8, "num_generations": 8, "extra": (), "held_out": 300,
                 "margin": 0.05}


@references(*POLICY_GRADIENT_STEP)
def check_rloo_step(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations) -> mean reward``: one
    RLOO update. Checked twice: the gradient each of two calls hands the optimiser equals the reference
    step's (same weights, same generator), and 40 steps with Adam from ``addition-partial`` raise greedy
    exact match on 300 held-out prompts by at least 5 points."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import check_sampling_step

    check_sampling_step("check_rloo_step", fn, _reference_rloo_step, [("RLOO", ())], RLOO_LEARNING,
                        "another direction: each completion's baseline is the mean reward of the other completions "
                        "of its prompt; the advantage weighs the sum of the completion's token log-probs (with grad); "
                        "padding is left out")


def _reference_rloo_kl_step(model, optimizer, tokenizer, task, prompts, generator, num_generations, ref_model, beta):
    """RLOO with the KL penalty in the reward (TRL's ``RLOOTrainer``): ``r_i - beta sum_t (log pi - log pi_ref)``,
    a number, then leave-one-out advantages and the REINFORCE loss. Returns ``(mean task reward,)``."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.losses.grpo import leave_one_out_advantages
    from rlcourse.losses.policy_gradient import reinforce_loss

    group = [p for p in prompts for _ in range(num_generations)]
    roll = sample(model, tokenizer, group, task.max_new_tokens, generator=generator)
    mask = roll.completion_mask
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask)
    with torch.no_grad():
        ref_logp = sequence_logprobs(ref_model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask)
    task_rewards = task.reward(group, roll.completions).float()
    rewards = task_rewards - beta * (logp.detach() - ref_logp).sum(1)
    loss = reinforce_loss(logp, leave_one_out_advantages(rewards, num_generations)[:, None], mask)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return (float(task_rewards.mean()),)


@references(*POLICY_GRADIENT_STEP, *KL_PENALTY)
def check_rloo_kl_step(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, ref_model, beta) -> mean
    task reward``: the fixed find-the-bug step, RLOO with the KL penalty in the reward. Checked by the
    gradient of two calls (against the reference step's), the second beta's with a reference other than the
    policy's start, and by 40 steps that must learn."""
    __tracebackhide__ = True
    import copy

    from rlcourse.grading._steps import addition_start, check_sampling_step, moved_copy

    start = addition_start()[1]
    ref = copy.deepcopy(start).requires_grad_(False)
    other = moved_copy(start, seed=92).requires_grad_(False)      # a reference that is not where the policy starts
    learning = {**RLOO_LEARNING, "extra": (ref, 0.05)}
    settings = [("beta=0.1", (ref, 0.1)),
                ("beta=0.5, ref_model not the policy's start (addition-partial moved by seeded noise)", (other, 0.5))]
    check_sampling_step("check_rloo_kl_step", fn, _reference_rloo_kl_step, settings, learning,
                        "the update is not the policy-gradient estimate of the KL-regularised reward (the KL "
                        "against ref_model, the model handed over): it has another direction than the reference "
                        "step's")
