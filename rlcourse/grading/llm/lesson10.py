"""Checks for lesson 10 (GRPO and its variants).

* :func:`check_group_advantages` - GRPO's group-normalised advantage with a std floor (mistakes
  caught: the population std, no floor, the floor under the square root, one mean over the batch,
  groups read across the batch, float leftovers left in groups of equal rewards);
* :func:`check_aggregate_loss` - sequence mean (grpo), token mean (dapo), constant (dr_grpo), with
  ``loss_type`` strings built at run time (``is`` is not ``==``) and padding holding inf and nan
  (multiplying by the mask makes nan);
* :func:`check_sequence_ratio` - GSPO's length-normalised sequence ratio, then GSPO trained with it;
* :func:`check_length_bias_experiment` - an experiment: the policies the learner's training loop on the
  exact oracle hands back (their logits), measured exactly, must reproduce Dr. GRPO's finding (wrong
  answers grow longer under grpo's aggregation);
* :func:`check_grpo_loss` - the clipped per-token loss with clip-higher and TRL's default KL term,
  beta * rho * k3 (``use_bias_correction_kl``), aggregated by ``loss_type``: value and gradient (mistakes
  caught: the sign, max for min, the ratio against the reference, no clip, swapped or symmetric clip
  sides, k3 reversed, k1 for k3, DeepSeekMath's plain k3, the clipped ratio on k3, the ratio detached in
  the KL term (caught by the gradient; on an on-policy batch, where every ratio is 1, plain k3 too),
  another loss_type's average, junk padding let in, a detached ratio);
* :func:`check_grpo_step` - a whole GRPO update, checked by the gradient it hands the optimiser
  (against the reference step on the same samples) and by a short training run that must learn;
* :func:`check_variant_losses` - CISPO's and SAPO's per-token losses: value and gradient (mistakes
  caught: CISPO's weight left with its gradient, uncapped, PPO's clip instead, the ratio weighed
  instead of log pi; SAPO's temperatures as one or swapped, no 4/tau, the gate at rho instead of
  rho - 1; either sign flipped; junk padding let in), then GRPO's update with the learner's loss
  must train;
* :func:`check_grpo_update` - find the bug: an update that samples at a temperature and takes
  several clipped steps, fixed; measured by the ratio before any update and every step's gradient.
"""
from __future__ import annotations

import torch

from rlcourse.grading._core import assert_close, fail, fail_if_mistake, passed, to_numpy, references
from rlcourse.grading._routes import ADVANTAGES, POLICY_GRADIENT_LOSSES, POLICY_GRADIENT_STEP

__all__ = ["check_group_advantages", "check_aggregate_loss", "check_sequence_ratio",
           "check_length_bias_experiment", "check_grpo_loss", "check_grpo_step", "check_variant_losses",
           "check_grpo_update"]


def _unmutated(name, case, fn, *args):
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = fn(*args)
    if any(isinstance(a, torch.Tensor) and not (b.shape == a.shape and torch.allclose(b, a, rtol=0, atol=0, equal_nan=True))
           for b, a in zip(before, args)):     # equal_nan: padding may hold nan, which is never == itself
        fail(name, case, "inputs left unchanged", "an input tensor was modified in place",
             "compute new tensors instead of writing into the arguments")
    return got


@references(*ADVANTAGES)
def check_group_advantages(fn) -> None:
    """``fn(rewards, num_generations, std_floor) -> (B,)``: ``(r - group mean) / (group std + std_floor)``,
    std with Bessel's correction, and exactly 0 for a group whose rewards are all equal."""
    __tracebackhide__ = True
    from rlcourse.losses.grpo import group_advantages as reference

    name = "check_group_advantages"
    gen = torch.Generator().manual_seed(100)
    cases = [("one group of 4 rewards 0/1", torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, 1e-4),
             ("three groups of 4, random", torch.randn(12, generator=gen), 4, 1e-4),
             ("integer rewards (K=2)", torch.tensor([1, 0, 3, 5]), 2, 1e-4),
             ("a larger std_floor (0.5)", torch.tensor([0.0, 0.1, 0.2, 0.3, 1.0, 0.0, 1.0, 0.0]), 4, 0.5),
             ("sixteen rewards of 0.3 in float32 (their mean is not exactly 0.3)", torch.full((16,), 0.3), 16, 1e-4),
             ("a group of equal rewards next to a varied one", torch.tensor([0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5, 0.5]),
              4, 1e-4),
             ("std_floor = 0 with varied groups", torch.tensor([1.0, 2.0, 4.0, 8.0]), 4, 0.0)]
    for case, rewards, K, floor in cases:
        got = _unmutated(name, case, fn, rewards, K, floor)
        expected = reference(rewards, K, "group", floor)
        r = rewards.double().view(-1, K)
        centred = r - r.mean(1, keepdim=True)
        if got is not None and not torch.isfinite(torch.as_tensor(to_numpy(got))).all():
            fail(name, case, expected, got, "a group of equal rewards has std 0: it must get advantage 0, not inf/nan")
        fail_if_mistake(name, case, expected, got, (centred / (r.std(1, unbiased=False, keepdim=True) + floor)).reshape(-1),
                        "use the sample std with Bessel's correction (torch.std's default, as TRL)")
        fail_if_mistake(name, case, expected, got,
                        (centred / (r.var(1, keepdim=True) + floor).sqrt()).reshape(-1),
                        "the floor is added to the std, not to the variance under the square root")
        flat = rewards.double()
        fail_if_mistake(name, case, expected, got, (flat - flat.mean()) / (flat.std() + floor),
                        "normalise within each group (one prompt's K completions), not over the whole batch")
        if rewards.numel() > K:
            inter = rewards.double().view(K, -1)
            fail_if_mistake(name, case, expected, got,
                            ((inter - inter.mean(0)) / (inter.std(0) + floor)).reshape(-1),
                            "a group is K consecutive rewards: rewards.view(-1, K)")
        equal = (r == r[:, :1]).all(1)
        if got is not None and bool(equal.any()):
            g = torch.as_tensor(to_numpy(got)).view(-1, K)
            if g.shape[0] == r.shape[0] and bool((g[equal] != 0).any()):
                fail(name, case, "exactly 0 for the group of equal rewards", got,
                     "float leftovers of the mean divided by a tiny std are not zero: detect groups whose "
                     "rewards are all equal (max == min) and set their advantages to 0")
        assert_close(name, case, expected, got, hint="(r - mean_group) / (std_group + std_floor)", atol=1e-5, rtol=1e-5)
    passed(name, len(cases))


def _token_cases(seed):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for i, (B, T) in enumerate([(2, 3), (4, 6), (5, 8)]):
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0], lengths[-1] = T, 1
        mask = (torch.arange(T) < lengths[:, None]).long()
        x = torch.randn(B, T, generator=gen)
        x = torch.where(mask.bool(), x, torch.full_like(x, 9.0))            # junk on padding
        cases.append((f"batch #{i} (B={B}, T={T}, lengths {lengths.tolist()}, padding holds 9.0)", x, mask))
    # A padded loss can be inf or nan (a ratio that overflowed where nothing was sampled): 0 * inf is
    # nan, so multiplying by the mask is not enough; select the real tokens.
    B, T = 3, 5
    mask = (torch.arange(T) < torch.tensor([5, 2, 3])[:, None]).long()
    x = torch.randn(B, T, generator=gen)
    x = torch.where(mask.bool(), x, torch.tensor([float("inf"), float("-inf"), float("nan")]).repeat(2)[:T])
    cases.append(("padding holding inf, -inf and nan (B=3, T=5, lengths [5, 2, 3])", x, mask))
    return cases


@references("rlcourse.losses.grpo:aggregate_loss", "rlcourse.losses.policy_gradient:masked_mean")
def check_aggregate_loss(fn) -> None:
    """``fn(per_token_loss, mask, loss_type, max_completion_length) -> scalar`` for
    ``loss_type`` in ``grpo`` (sequence mean), ``dapo`` (token mean), ``dr_grpo`` (constant)."""
    __tracebackhide__ = True
    from rlcourse.losses.grpo import aggregate_loss as reference

    name = "check_aggregate_loss"
    n = 0
    for case, x, mask in _token_cases(101):
        m = mask.double()
        xm = x.double() * m
        # built at run time, as a config read from a file would give them: `is "grpo"` is then False
        for loss_type in ("".join(["gr", "po"]), "".join(["da", "po"]), "".join(["dr_", "grpo"])):
            L = x.shape[1] + 2
            got = _unmutated(name, f"{case}, {loss_type}", fn, x, mask, loss_type, L)
            expected = reference(x, mask, loss_type, L)
            label = f"{case}, loss_type={loss_type!r}, max_completion_length={L}"
            wrong = {"token": (xm.sum() / m.sum(), "grpo is a mean per sequence, then over sequences"),
                     "seq": ((xm.sum(1) / m.sum(1)).mean(), "dapo is one mean over all real tokens of the batch"),
                     "drT": (xm.sum() / (x.shape[0] * x.shape[1]), "dr_grpo divides by B * max_completion_length, "
                                                                   "a constant, not by the padded width"),
                     "nomask": ((x.double().sum(1) / m.sum(1)).mean(), "padding holds junk: leave it out")}
            for key, (value, hint) in wrong.items():
                fail_if_mistake(name, label, expected, got, value, hint)
            if got is not None and not torch.isfinite(torch.as_tensor(to_numpy(got))).all():
                fail(name, label, expected, got, "padding may hold inf or nan and 0 * inf is nan: select the real "
                     "tokens with torch.where(mask.bool(), per_token, 0) instead of multiplying by the mask")
            for other in {"grpo", "dapo", "dr_grpo"} - {loss_type}:
                fail_if_mistake(name, label, expected, got, reference(x, mask, other, L),
                                f"this is the {other!r} loss: a loss_type string is compared with ==, not `is` "
                                f"(`is` holds only for strings Python happened to intern)")
            assert_close(name, label, expected, got, atol=1e-5,
                         hint="grpo: mean_i(sum_t m l / |y_i|); dapo: sum m l / sum m; dr_grpo: sum m l / (B L)")
            n += 1
    passed(name, n)


@references("rlcourse.losses.grpo:importance_weights")
def check_sequence_ratio(fn) -> None:
    """``fn(logprobs, old_logprobs, mask) -> (B, 1)``: ``exp(mean over real tokens of (logp - old))``, its
    value and gradient; then GSPO's clipped update with the learner's ratio (the paper's range, two steps
    per batch) trains ``addition-partial`` for 30 steps, and held-out exact match must rise by 5 points."""
    __tracebackhide__ = True
    from rlcourse.losses.grpo import importance_weights

    name = "check_sequence_ratio"
    n = 0
    for case, x, mask in _token_cases(102):
        logp = (-x.abs()).clone().requires_grad_()
        old = -x.abs() + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(n))
        old = torch.where(mask.bool(), old, torch.full_like(old, -40.0))
        got = _unmutated(name, case, fn, logp, old, mask)
        expected = importance_weights(logp.detach(), old, mask, "sequence")
        d = (logp.detach() - old).double() * mask
        fail_if_mistake(name, case, expected, got, d.sum(1, keepdim=True).exp(),
                        "GSPO normalises by the length: exp(sum / |y|), the geometric mean of the token ratios")
        fail_if_mistake(name, case, expected, got, (d.sum(1, keepdim=True) / x.shape[1]).exp(),
                        "divide by the number of real tokens (mask.sum(1)), not the padded width")
        fail_if_mistake(name, case, expected, got,
                        ((d.exp() * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)),
                        "the mean is taken of the log-ratios, then exponentiated (not a mean of ratios)")
        if got is not None and not torch.isfinite(torch.as_tensor(to_numpy(got))).all():
            fail(name, case, expected, got, "padding may hold inf or nan and 0 * inf is nan: select the real "
                 "tokens' log-ratios with torch.where(mask.bool(), logp - old, 0) instead of multiplying by the mask")
        assert_close(name, case, expected, got, hint="exp(sum_t m (logp - old) / sum_t m), shape (B, 1)", atol=1e-5)
        got.sum().backward()
        if logp.grad is None:
            fail(name, case, "a gradient into logprobs", None, "keep the graph: do not detach logprobs")
        ref_logp = logp.detach().clone().requires_grad_()
        importance_weights(ref_logp, old, mask, "sequence").sum().backward()
        assert_close(name, case + " (gradient)", ref_logp.grad, logp.grad, atol=1e-5,
                     hint="only old_logprobs is a constant")
        n += 1
    before, after = _train_with(fn_loss=lambda logp, old, adv, mask: _gspo_per_sequence(fn(logp, old, mask), adv),
                                loss_type="grpo", steps=GSPO_LEARNING["steps"])
    if not after >= before + GSPO_LEARNING["margin"]:
        fail(name, f"{GSPO_LEARNING['steps']} GSPO updates with your ratio (clip [1 - 3e-4, 1 + 4e-4], two steps per "
                   f"batch)", f"held-out exact match at least {before + GSPO_LEARNING['margin']:.3f} (from {before:.3f})",
             f"{after:.3f}", "the values and gradients agreed on the test batches: check the ratio's shape (B, 1)")
    print(f"✔ {name}: all {n} cases passed; {GSPO_LEARNING['steps']} GSPO updates with your ratio took held-out exact "
          f"match from {before:.1%} to {after:.1%}")


GSPO_LEARNING = {"steps": 30, "margin": 0.05}


def _gspo_per_sequence(ratio, advantages):
    """GSPO's clipped loss of each completion, ``(B, 1)``, at the GSPO paper's range [1 - 3e-4, 1 + 4e-4]."""
    from rlcourse.losses import ppo_clip_objective

    return -ppo_clip_objective(ratio, advantages.detach()[:, None], 3e-4, 4e-4)


def _train_with(fn_loss, loss_type: str, steps: int, num_iterations: int = 2, lr: float = 1e-4, groups: int = 8,
                num_generations: int = 8, held_out: int = 300) -> tuple[float, float]:
    """Held-out exact match of ``addition-partial`` before and after ``steps`` of the course's GRPO update with
    ``fn_loss(logprobs, old_logprobs, advantages, mask)`` as the per-token (or per-completion) loss, aggregated
    as ``loss_type`` says (Adam, ``groups`` prompts x ``num_generations``, ``num_iterations`` steps per batch)."""
    from rlcourse.grading._steps import train_from_addition

    def step(model, optimizer, tokenizer, task, prompts, generator):
        return _reference_update(model, optimizer, tokenizer, task, prompts, generator, num_generations, loss_type,
                                 num_iterations=num_iterations, per_token_fn=fn_loss)

    before, after, _ = train_from_addition(step, steps, lr, groups, held_out)
    return before, after


LENGTH_BIAS = {"seeds": (0, 1), "margin": 0.5, "learned": 0.5}


def _oracle_start(seed: int):
    """The policy of exercise 4 before training (the lesson's section 3)."""
    from rlcourse.measure.exact_gradient import EnumerablePolicy

    return EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)


def _wrong_answer_length(policy) -> tuple[float, float]:
    """``(E[|y| | y wrong], pi(a <eos>))`` of an oracle policy, exact: computed over every completion it can write."""
    ids = policy.completions
    right = (ids[:, 0] == 1) & (ids[:, 1] == 0)
    with torch.no_grad():
        p = policy.probs()[0].double()
    lengths = policy.lengths.double()
    return float((p * lengths * ~right).sum() / (p * ~right).sum()), float(p[right].sum())


@references("rlcourse.measure.length_bias:wrong_answer_lengths")
def check_length_bias_experiment(fn) -> None:
    """``fn(loss_type, seed) -> the trained policy's logits``: the learner's loop on the oracle of the lesson
    (60 steps from ``EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)``), handing back
    ``policy.logits``, the table it trained. The check measures that policy itself, exactly: the right
    answer's probability must have risen to at least 0.5, two seeds must give two policies, and the expected
    length of a wrong answer, mean of seeds 0 and 1, must end at least 0.5 tokens longer under grpo than
    under dr_grpo (Dr. GRPO's length bias)."""
    __tracebackhide__ = True
    name = "check_length_bias_experiment"
    s = LENGTH_BIAS
    finals, trained = {}, {}
    for loss_type in ("grpo", "dr_grpo"):
        lengths = []
        for seed in s["seeds"]:
            case = f"fn({loss_type!r}, {seed})"
            policy = _oracle_start(seed)
            start_right = _wrong_answer_length(policy)[1]
            got = fn("".join(loss_type), seed)     # built at run time: a string compared with `is` would fail
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(policy.logits.shape):
                shown = (f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor)
                         else f"{type(got).__name__} {got!r:.60}")
                fail(name, case, f"the trained policy's logits, a tensor of shape {tuple(policy.logits.shape)}", shown,
                     "return policy.logits, the table your loop trained: the check measures its wrong answers' "
                     "length itself")
            with torch.no_grad():
                policy.logits.copy_(got.detach().to(policy.logits.dtype))
            length, right = _wrong_answer_length(policy)
            if not right >= s["learned"]:
                fail(name, case, f"a policy that writes the right answer 'a <eos>' with probability at least "
                     f"{s['learned']} (the start's: {start_right:.3f})", f"probability {right:.3f}",
                     "train the policy whose logits you return: 60 steps of 16 groups of 8 completions, Adam at lr "
                     "0.1 on the logits, the loss aggregated as loss_type says")
            trained[(loss_type, seed)] = policy.logits.detach().clone()
            lengths.append(length)
        first, second = (trained[(loss_type, seed)] for seed in s["seeds"])
        if torch.equal(first, second):
            fail(name, f"fn({loss_type!r}, {s['seeds'][0]}) and fn({loss_type!r}, {s['seeds'][1]})",
                 "two different policies: the seed sets the start and the draws", "the same policy twice",
                 "start from EnumerablePolicy(..., seed=seed) and draw with torch.Generator().manual_seed(seed)")
        finals[loss_type] = sum(lengths) / len(lengths)
    gap = finals["grpo"] - finals["dr_grpo"]
    if not gap >= s["margin"]:
        fail(name, "the expected length of a wrong answer at the end, measured on the policies returned, mean of "
                   "seeds 0 and 1", f"grpo at least {s['margin']} tokens longer than dr_grpo",
             f"grpo {finals['grpo']:.2f}, dr_grpo {finals['dr_grpo']:.2f}",
             "aggregate with your aggregate(per_token, mask, loss_type, 6): the normalisation is the experiment")
    print(f"✔ {name}: measured on the policies returned, wrong answers end {gap:.2f} tokens longer under grpo "
          f"({finals['grpo']:.2f}) than under dr_grpo ({finals['dr_grpo']:.2f})")


def _loss_cases(seed):
    """(case, logprobs, old, ref, advantages, mask): ragged masks, junk padding, ratios on both sides of
    the clip, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (B, T) in enumerate([(4, 5), (6, 7)]):
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0], lengths[-1] = T, 1
        mask = (torch.arange(T) < lengths[:, None]).long()
        logp = -torch.rand(B, T, generator=gen) * 3 - 0.05
        old = logp + 0.4 * torch.randn(B, T, generator=gen)           # ratios from about 0.3 to 3
        ref = logp + 0.5 * torch.randn(B, T, generator=gen)
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0])
        fill = junk.repeat(B * T // 4 + 1)[:B * T].view(B, T)
        logp, old, ref = (torch.where(mask.bool(), x, fill) for x in (logp, old, ref))
        adv = torch.randn(B, generator=gen)
        out.append((f"batch #{i} (B={B}, T={T}, lengths {lengths.tolist()}, padding holds nan, inf and 7)",
                    logp, old, ref, adv, mask))
    return out


def _on_policy_batch(cases):
    """The last of ``cases`` made on-policy: ``old = logprobs``, so every ratio is 1 in value (the first
    step on fresh samples), with another reference and the advantages' signs flipped."""
    case, logp, _, ref, adv, mask = cases[-1]
    return [(case.replace("batch #1 (", "batch #2, on-policy: old_logprobs = logprobs, every ratio 1 in value ("),
             logp, logp.clone(), ref - 0.3, -adv, mask)]


@references(*POLICY_GRADIENT_LOSSES, "rlcourse.losses.policy_gradient:masked_mean", "rlcourse.kl:kl_k3",
            "rlcourse.trainers.policy_gradient:loss_and_stats")
def check_grpo_loss(fn) -> None:
    """``fn(logprobs, old_logprobs, ref_logprobs, advantages, mask, loss_type, epsilon, epsilon_high, beta,
    max_completion_length) -> scalar``: GRPO's clipped per-token loss plus TRL's default KL term
    ``beta * rho * k3`` (``use_bias_correction_kl=True``: k3 times the unclipped ratio, with its
    gradient), aggregated by ``loss_type``; its value and its gradient with respect to ``logprobs`` are
    compared. One batch is on-policy (every ratio 1 in value), where plain k3 and a detached ratio give
    the right value and the wrong gradient."""
    __tracebackhide__ = True
    from rlcourse.losses.grpo import aggregate_loss, per_token_loss

    name = "check_grpo_loss"
    settings = [("grpo", 0.2, None, 0.0), ("dapo", 0.2, 0.28, 0.0), ("dr_grpo", 0.2, None, 0.04),
                ("grpo", 0.1, 0.3, 0.1), ("dapo", 0.2, None, 0.04)]
    n = 0
    cases = _loss_cases(103)
    for case, logp, old, ref, adv, mask in cases + _on_policy_batch(cases):
        real = mask.bool()
        L = logp.shape[1] + 1
        for loss_type, eps, eps_high, beta in settings:
            label = (f"{case}, loss_type={loss_type!r}, epsilon={eps}, epsilon_high={eps_high}, beta={beta}, "
                     f"max_completion_length={L}")
            mine = logp.clone().requires_grad_()
            got = _unmutated(name, label, fn, mine, old, ref, adv, mask, "".join(loss_type), eps, eps_high, beta, L)
            theirs = logp.clone().requires_grad_()
            expected = aggregate_loss(per_token_loss(theirs, old, adv, mask, loss_type, eps, eps_high, beta=beta,
                                                     ref_logprobs=ref, use_bias_correction_kl=True),
                                      mask, loss_type, L)

            # the usual mistakes, each computed on the real tokens
            def agg(per_token):
                return aggregate_loss(torch.where(real, per_token, torch.zeros_like(per_token)), mask, loss_type, L)

            z = torch.zeros_like(logp)
            lp, o, r = (torch.where(real, x, z).double() for x in (logp, old, ref))
            a = adv.double()[:, None]
            high = eps if eps_high is None else eps_high
            rho, rho_ref = (lp - o).exp(), (lp - r).exp()
            k3 = (r - lp).exp() - (r - lp) - 1

            def clipped(w, lo, hi):
                return torch.minimum(w * a, w.clamp(1 - lo, 1 + hi) * a)

            kl_term = rho * k3                                   # TRL's default: k3 times the unclipped ratio
            mistakes = [
                (agg(clipped(rho, eps, high) - beta * kl_term),
                 "the optimiser minimises: the loss is -min(...) + beta * rho * k3"),
                (agg(-torch.maximum(rho * a, rho.clamp(1 - eps, 1 + high) * a) + beta * kl_term),
                 "PPO's objective takes the min of the clipped and unclipped terms, not the max"),
                (agg(-clipped(rho_ref, eps, high) + beta * kl_term),
                 "the ratio is against pi_old (old_logprobs, the sampler's), not against the reference"),
                (agg(-rho * a + beta * kl_term), "the ratio must be clipped to [1 - epsilon, 1 + epsilon_high]"),
                (agg(-clipped(rho, eps, eps) + beta * kl_term),
                 "the clip range is [1 - epsilon, 1 + epsilon_high]: epsilon_high, when given, sets the upper side "
                 "(clip-higher)"),
                (agg(-clipped(rho, high, eps) + beta * kl_term),
                 "the clip range is [1 - epsilon, 1 + epsilon_high]: epsilon the lower side, epsilon_high the upper"),
                (agg(-clipped(rho, eps, high) + beta * rho * ((lp - r).exp() - (lp - r) - 1)),
                 "k3 of KL(pi || pi_ref) is pi_ref/pi - log(pi_ref/pi) - 1: the ratio ref over policy"),
                (agg(-clipped(rho, eps, high) + beta * rho * (lp - r)),
                 "the KL term is the k3 estimate, not k1 = log pi - log pi_ref"),
                (agg(-clipped(rho, eps, high) + beta * k3),
                 "that is DeepSeekMath's plain k3; the exercise asks for TRL's default (use_bias_correction_kl=True): "
                 "k3 times the ratio rho = pi / pi_old, whose gradient makes the KL term follow grad KL(pi || pi_ref)"),
                (agg(-clipped(rho, eps, high) + beta * rho.clamp(1 - eps, 1 + high) * k3),
                 "TRL multiplies k3 by the unclipped ratio rho: the clip belongs to the policy term only"),
            ]
            for other in {"grpo", "dapo", "dr_grpo"} - {loss_type}:
                mistakes.append((aggregate_loss(per_token_loss(logp, old, adv, mask, loss_type, eps, eps_high, beta=beta,
                                                               ref_logprobs=ref, use_bias_correction_kl=True),
                                                mask, other, L),
                                 f"this is the {other!r} average: average as loss_type says"))
            for value, hint in mistakes:
                fail_if_mistake(name, label, expected, got, value, hint)
            if got is not None and not torch.isfinite(torch.as_tensor(to_numpy(got))).all():
                fail(name, label, expected, got, "padding may hold nan or inf: leave the padded tokens out")
            assert_close(name, label, expected, got, atol=1e-5, rtol=1e-5,
                         hint="-min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta rho k3 per token, averaged "
                              "as loss_type says")
            expected.backward()
            if not isinstance(got, torch.Tensor) or got.grad_fn is None:
                fail(name, label, "a loss with a gradient into logprobs", type(got).__name__,
                     "compute the loss with torch operations on logprobs, keeping its graph")
            got.backward()
            grad = mine.grad if mine.grad is not None else torch.zeros_like(mine)
            if beta:                        # the KL term's ratio held constant (on the on-policy batch: plain k3 too)
                frozen = logp.clone().requires_grad_()
                lpf = torch.where(real, frozen, torch.zeros_like(frozen))
                d = torch.where(real, ref, torch.zeros_like(ref)) - lpf
                held = torch.exp(lpf - torch.where(real, old, torch.zeros_like(old))).detach() * (d.exp() - d - 1)
                aggregate_loss(per_token_loss(frozen, old, adv, mask, loss_type, eps, eps_high)
                               + beta * torch.where(real, held, torch.zeros_like(held)), mask, loss_type, L).backward()
                fail_if_mistake(name, label + " (gradient with respect to logprobs)", theirs.grad, grad, frozen.grad,
                                "the value is right but not its gradient: the KL term's ratio carries a gradient, "
                                "even where its value is 1. Keep the ratio's gradient in the KL term (rho = "
                                "exp(logprobs - old_logprobs), neither detached nor left out where it is 1): it adds "
                                "k3 * grad log pi, the score-function term that makes the KL term follow "
                                "grad KL(pi || pi_ref) (lesson 07b, exercise 4)")
            assert_close(name, label + " (gradient with respect to logprobs)", theirs.grad, grad, atol=1e-5, rtol=1e-4,
                         hint="the value is right but not its gradient: only logprobs carries the graph; "
                              "old_logprobs, ref_logprobs and the advantages are constants")
            n += 1
    passed(name, n)


def _reference_update(model, optimizer, tokenizer, task, prompts, generator, num_generations, loss_type="dapo",
                      epsilon=0.2, epsilon_high=None, temperature=1.0, num_iterations=1, per_token_fn=None):
    """The reference GRPO update: one group per prompt sampled at ``temperature``, then
    ``num_iterations`` clipped steps on it. Returns the mean reward and, per step, the share of real
    tokens whose ratio was outside [1 - epsilon, 1 + epsilon] when its gradient was taken.
    ``per_token_fn(logprobs, old_logprobs, advantages, mask)``, when given, replaces
    :func:`~rlcourse.losses.grpo.per_token_loss` (a learner's loss trained by the course's update)."""
    from rlcourse.lm import sample, sequence_logprobs
    from rlcourse.losses.grpo import aggregate_loss, group_advantages, per_token_loss

    group = [p for p in prompts for _ in range(num_generations)]
    roll = sample(model, tokenizer, group, task.max_new_tokens, temperature=temperature, generator=generator)
    rewards = task.reward(group, roll.completions).float()
    advantages = group_advantages(rewards, num_generations)
    mask = roll.completion_mask
    outside = []
    for _ in range(num_iterations):
        logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask, temperature)
        per_token = (per_token_fn(logp, roll.logprobs, advantages, mask) if per_token_fn is not None
                     else per_token_loss(logp, roll.logprobs, advantages, mask, loss_type, epsilon, epsilon_high))
        loss = aggregate_loss(per_token, mask, loss_type, task.max_new_tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ratio = torch.exp(logp.detach() - roll.logprobs)
        outside.append(float((((ratio - 1).abs() > epsilon) & mask.bool()).sum() / mask.sum()))
    return float(rewards.mean()), outside


# (loss_type, epsilon, epsilon_high, task budget). One on-policy update draws its batch from the weights it
# steps on, so every ratio is 1 and no clip acts: epsilon varies all the same. dr_grpo divides by
# max_completion_length: at a budget of 6 new tokens, which no completion fills (the sums have 2 or 3
# digits), that is not the batch's padded width.
STEP_SETTINGS = [("dapo", 0.2, None, None), ("grpo", 0.2, 0.28, None), ("dr_grpo", 0.1, None, 6)]
STEP_LEARNING = {"steps": 40, "lr": 1e-4, "groups": 8, "num_generations": 8, "extra": ("dapo", 0.2, None),
                 "held_out": 300, "margin": 0.05}


@references(*POLICY_GRADIENT_STEP)
def check_grpo_step(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, loss_type, epsilon,
    epsilon_high) -> mean reward``: one GRPO update. Checked twice: the gradient each of two calls hands
    the optimiser equals the reference step's (same weights, same generator), and 40 steps with Adam
    from ``addition-partial`` raise greedy exact match on 300 held-out prompts by at least 5 points."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import check_sampling_step

    settings = [(f"loss_type={t!r}, epsilon={e}, epsilon_high={h}" + (f", task.max_new_tokens={b}" if b else ""),
                 ("".join(t), e, h), {"max_new_tokens": b} if b else {}) for t, e, h, b in STEP_SETTINGS]
    check_sampling_step("check_grpo_step", fn, _reference_update, settings, STEP_LEARNING,
                        "another direction: the advantages are normalised within each group of num_generations "
                        "completions; the ratio is the model's log-probs (with grad) against the sampler's; padding "
                        "is left out of every sum",
                        close="almost the reference's direction: the same tokens weighted a little differently (check "
                              "the average that loss_type asks for)")


VARIANT_SETTINGS = [("cispo", 5.0, 1.0, 1.05), ("cispo", 1.5, 1.0, 1.05), ("sapo", 5.0, 1.0, 1.05),
                    ("sapo", 5.0, 2.0, 0.5)]
VARIANT_LEARNING = {"steps": 30, "lr": 1e-4, "groups": 8, "num_generations": 8, "num_iterations": 2,
                    "held_out": 300, "margin": 0.05}


def _variant_mistakes(loss_type, rho, a, logp, eps_max, tau_pos, tau_neg):
    """(per-token loss, hint) of the usual slips, computed on the real tokens (float64)."""
    if loss_type == "cispo":
        w = rho.clamp(max=eps_max)
        return [(w * a * logp, "the optimiser minimises: the loss is -sg(min(rho, epsilon_max)) A log pi"),
                (-rho * a * logp, "the weight is capped: min(rho, epsilon_max)"),
                (-torch.minimum(rho * a, rho.clamp(0.8, 1 + eps_max) * a),
                 "that is PPO's clipped surrogate: CISPO weighs log pi by the capped ratio, a constant"),
                (-w * a, "CISPO's loss is the capped ratio (a constant) times A times log pi")]
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    swapped = torch.where(a > 0, torch.full_like(a, tau_neg), torch.full_like(a, tau_pos))

    def gate(t, shift=1.0, scale=True):
        return -torch.sigmoid(t * (rho - shift)) * (4.0 / t if scale else 1.0) * a

    return [(-gate(tau), "the optimiser minimises: the loss is -(4 / tau) sigmoid(tau (rho - 1)) A"),
            (gate(torch.full_like(a, tau_pos)), "tau is tau_pos where A > 0 and tau_neg elsewhere"),
            (gate(torch.full_like(a, tau_neg)), "tau is tau_pos where A > 0 and tau_neg elsewhere"),
            (gate(swapped), "tau_pos and tau_neg swapped: tau_pos belongs to A > 0"),
            (gate(tau, scale=False), "the gate is scaled by 4 / tau, so that its gradient at rho = 1 is the plain one"),
            (gate(tau, shift=0.0), "the gate is centred at rho = 1: sigmoid(tau (rho - 1))")]


@references(*POLICY_GRADIENT_LOSSES, "rlcourse.trainers.policy_gradient:loss_and_stats")
def check_variant_losses(fn) -> None:
    """``fn(logprobs, old_logprobs, advantages, mask, loss_type, epsilon_max, tau_pos, tau_neg) -> (B, T)``:
    the per-token losses of CISPO (``-sg(min(rho, epsilon_max)) A log pi``) and SAPO
    (``-(4 / tau) sigmoid(tau (rho - 1)) A``), 0 on padding. Their values and the gradient of their sum
    with respect to ``logprobs`` are compared with :func:`~rlcourse.losses.grpo.per_token_loss` on ragged
    batches with junk padding and ratios from about 0.3 to 3. Then the course's GRPO update, with the
    learner's per-token loss in place of the course's, trains ``addition-partial`` for 30 steps per loss
    (8 prompts x 8 completions, two steps per batch): held-out exact match must rise by 5 points."""
    __tracebackhide__ = True
    from rlcourse.losses.grpo import per_token_loss

    name = "check_variant_losses"
    n = 0
    for case, logp, old, _, adv, mask in _loss_cases(107):
        real = mask.bool()
        for loss_type, eps_max, tau_pos, tau_neg in VARIANT_SETTINGS:
            knobs = f"epsilon_max={eps_max}" if loss_type == "cispo" else f"tau_pos={tau_pos}, tau_neg={tau_neg}"
            label = f"{case}, loss_type={loss_type!r}, {knobs}"
            mine = logp.clone().requires_grad_()
            got = _unmutated(name, label, fn, mine, old, adv, mask, "".join(loss_type), eps_max, tau_pos, tau_neg)
            theirs = logp.clone().requires_grad_()
            expected = per_token_loss(theirs, old, adv, mask, loss_type, 0.2, eps_max, sapo_temperature_pos=tau_pos,
                                      sapo_temperature_neg=tau_neg)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
                fail(name, label, f"a tensor of shape {tuple(expected.shape)}: one loss per token",
                     getattr(got, "shape", type(got).__name__), "return the per-token losses, before any average")
            zero = torch.zeros_like(logp)
            lp, o = (torch.where(real, x, zero).double() for x in (logp, old))
            for value, hint in _variant_mistakes(loss_type, (lp - o).exp(), adv.double()[:, None], lp, eps_max,
                                                 tau_pos, tau_neg):
                fail_if_mistake(name, label, expected, got, torch.where(real, value, torch.zeros_like(value)), hint)
            if not torch.isfinite(got.detach()).all():
                fail(name, label, expected, got, "padding may hold nan or inf: padded positions get 0")
            assert_close(name, label, expected, got, atol=1e-5, rtol=1e-5,
                         hint="cispo: -sg(min(rho, epsilon_max)) A log pi; sapo: -(4 / tau) sigmoid(tau (rho - 1)) A; "
                              "0 on padding")
            expected.sum().backward()
            if got.grad_fn is None:
                fail(name, label, "losses with a gradient into logprobs", "no graph",
                     "compute the losses with torch operations on logprobs, keeping its graph")
            got.sum().backward()
            grad = mine.grad if mine.grad is not None else torch.zeros_like(mine)
            assert_close(name, label + " (gradient of the summed losses with respect to logprobs)", theirs.grad, grad,
                         atol=1e-5, rtol=1e-4,
                         hint=("the value is right but not its gradient: the capped ratio is a weight, sg(...) stops "
                               "its gradient (detach it), so each token's gradient is -min(rho, epsilon_max) A "
                               "grad log pi" if loss_type == "cispo" else
                               "the value is right but not its gradient: only logprobs carries the graph; "
                               "old_logprobs and the advantages are constants"))
            n += 1
    s = VARIANT_LEARNING
    reached = {}
    for loss_type in ("cispo", "sapo"):
        def yours(logprobs, old_logprobs, advantages, mask, loss_type=loss_type):
            return fn(logprobs, old_logprobs, advantages, mask, loss_type, 5.0, 1.0, 1.05)

        before, reached[loss_type] = _train_with(yours, loss_type, s["steps"], s["num_iterations"], s["lr"], s["groups"],
                                                 s["num_generations"], s["held_out"])
        if not reached[loss_type] >= before + s["margin"]:
            fail(name, f"{s['steps']} GRPO updates with your {loss_type!r} loss (Adam, lr {s['lr']}, {s['groups']} "
                       f"prompts x {s['num_generations']}, {s['num_iterations']} steps per batch)",
                 f"held-out exact match at least {before + s['margin']:.3f} (from {before:.3f})",
                 f"{reached[loss_type]:.3f}", "the values and gradients agreed on the test batches: look at what your "
                                               "loss does with advantages of either sign")
    print(f"✔ {name}: values and gradients equal the reference's ({n} cases); {s['steps']} GRPO updates with your "
          f"losses took held-out exact match from {before:.1%} to {reached['cispo']:.1%} (cispo) and "
          f"{reached['sapo']:.1%} (sapo)")


# (temperature, num_iterations, epsilon, num_generations, prompts). Each later step's gradient must stay well
# above float rounding: at temperature 0.5, epsilon 0.1 and 6 prompts x 4 completions every token with an
# advantage was clipped from the second step on (gradient norm 1e-7), and two processes disagreed on noise.
BUG_SETTINGS = [(0.7, 2, 0.2, 8, 6), (0.5, 3, 0.1, 6, 8)]


@references(*POLICY_GRADIENT_STEP)
def check_grpo_update(fn) -> None:
    """``fn(model, optimizer, tokenizer, task, prompts, generator, num_generations, temperature, num_iterations,
    epsilon) -> [share of tokens outside the clip range at each step]``: the fixed find-the-bug update.
    Measured: before any update every ratio is 1 (no token outside the clip range at the first step),
    and the gradient of every step equals the reference update's on the same samples."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import addition_start, assert_same_gradient, twin_runs

    name = "check_grpo_update"
    task, start, tokenizer = addition_start()
    n = 0
    for temperature, iterations, epsilon, K, n_prompts in BUG_SETTINGS:
        case = (f"temperature {temperature}, num_iterations {iterations}, epsilon {epsilon}, {n_prompts} prompts x {K} "
                f"completions")
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.02)
        prompts = task.prompts(n_prompts, rng=40)
        shares = fn(mine, opt_mine, tokenizer, task, list(prompts), torch.Generator().manual_seed(6), K, temperature,
                    iterations, epsilon)
        _, expected_shares = _reference_update(theirs, opt_theirs, tokenizer, task, prompts,
                                               torch.Generator().manual_seed(6), K, "dapo", epsilon, None, temperature,
                                               iterations)
        if len(opt_mine.seen) != iterations:
            fail(name, case, f"{iterations} optimizer steps", f"{len(opt_mine.seen)}",
                 "one optimizer step per iteration on the batch")
        if shares is None or len(shares) != iterations:
            fail(name, case, f"a list of {iterations} shares", shares, "return the list the function builds")
        if float(shares[0]) > 0:
            fail(name, case, "no token outside the clip range before any update (every ratio is 1)",
                 f"{float(shares[0]):.1%} of the tokens outside [{1 - epsilon:g}, {1 + epsilon:g}] at the first step",
                 "at the first step the policy is the one that drew the tokens, so pi / pi_old must be exactly 1: "
                 "the two log-probs of a token are not of the same distribution")
        for step, (expected, received) in enumerate(zip(opt_theirs.seen, opt_mine.seen)):
            assert_same_gradient(name, f"{case}, step {step + 1}", expected, received,
                                 "another direction: the completions are drawn and scored at the same temperature, "
                                 "and each step starts from zeroed gradients",
                                 longer="the log-probs are not those of the distribution the tokens were drawn from "
                                        "(a temperature divides the logits), or the average is over other terms")
            n += 1
        if abs(float(shares[-1]) - expected_shares[-1]) > 0.01:       # a token of about 150 may round across
            fail(name, f"{case}, step {iterations}", f"{expected_shares[-1]:.4f} of the tokens outside the clip range",
                 float(shares[-1]), "the share of real tokens whose ratio is outside [1 - epsilon, 1 + epsilon]")
    print(f"✔ {name}: every ratio is 1 before the first update, and all {n} steps match the reference's gradient")
