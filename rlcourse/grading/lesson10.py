"""Checks for lesson 10 (GRPO and its variants).

* :func:`check_group_advantages` - GRPO's group-normalised advantage with a std floor (mistakes
  caught: the population std, no floor, the floor under the square root, one mean over the batch,
  groups read across the batch, float leftovers left in groups of equal rewards);
* :func:`check_aggregate_loss` - sequence mean (grpo), token mean (dapo), constant (dr_grpo), with
  ``loss_type`` strings built at run time (``is`` is not ``==``) and padding holding inf and nan
  (multiplying by the mask makes nan);
* :func:`check_sequence_ratio` - GSPO's length-normalised sequence ratio;
* :func:`check_length_bias_experiment` - an experiment: the learner's training loop on the exact
  oracle must reproduce Dr. GRPO's finding (wrong answers grow longer under grpo's aggregation).
"""
from __future__ import annotations

import torch

from rlcourse.grading._core import assert_close, fail, fail_if_mistake, passed, to_numpy, references

__all__ = ["check_group_advantages", "check_aggregate_loss", "check_sequence_ratio",
           "check_length_bias_experiment"]


def _unmutated(name, case, fn, *args):
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = fn(*args)
    if any(isinstance(a, torch.Tensor) and not (b.shape == a.shape and torch.allclose(b, a, rtol=0, atol=0, equal_nan=True))
           for b, a in zip(before, args)):     # equal_nan: padding may hold nan, which is never == itself
        fail(name, case, "inputs left unchanged", "an input tensor was modified in place",
             "compute new tensors instead of writing into the arguments")
    return got


@references("rlcourse.losses.grpo:group_advantages")
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


@references("rlcourse.losses.grpo:aggregate_loss")
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
    """``fn(logprobs, old_logprobs, mask) -> (B, 1)``: ``exp(mean over real tokens of (logp - old))``."""
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
    passed(name, n)


def check_length_bias_experiment(fn) -> None:
    """``fn(loss_type, seed) -> list`` of the expected wrong-answer length after each training step,
    from the learner's loop on the oracle of the lesson. Measured at seeds 0 and 1: grpo's must end
    at least 0.5 tokens above dr_grpo's (Dr. GRPO's length bias)."""
    __tracebackhide__ = True
    name = "check_length_bias_experiment"
    finals = {}
    for loss_type in ("grpo", "dr_grpo"):
        runs = [fn(loss_type, seed) for seed in (0, 1)]
        for run in runs:
            if run is None or len(run) < 20:
                fail(name, loss_type, "a list with one length per step (>= 20 steps)", run,
                     "append the exact expected length of wrong answers after every step")
        finals[loss_type] = sum(float(r[-1]) for r in runs) / len(runs)
    gap = finals["grpo"] - finals["dr_grpo"]
    if not gap >= 0.5:
        fail(name, "wrong-answer length at the end, mean of seeds 0 and 1",
             "grpo at least 0.5 tokens longer than dr_grpo", f"grpo {finals['grpo']:.2f}, dr_grpo {finals['dr_grpo']:.2f}",
             "use aggregate_loss(per_token, mask, loss_type, max_len): the normalisation is the experiment")
    print(f"✔ {name}: wrong answers end {gap:.2f} tokens longer under grpo than under dr_grpo")
