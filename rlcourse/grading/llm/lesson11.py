"""Checks for lesson 11 (DPO): the DPO loss, the implicit reward, the IPO loss, and fitting DPO on
the categorical bandit (an experiment judged by the KL to the policy its comparisons imply, which
the check finds itself: with few comparisons it is not the closed-form optimum of the hidden reward).

The cases expose the usual slips: ``beta`` forgotten or applied twice, the reference log-probs
left out, chosen and rejected swapped, ``-log(sigmoid(z))`` overflowing for confident pairs, a
batch mean where one loss per pair is expected, IPO's target written as ``1/beta``, inputs
modified in place. Two checks run whole pieces of a trainer: :func:`check_dpo_step` (one DPO update,
judged by its gradient and by what 30 steps of it learn) and :func:`check_completion_logprobs` (the
find-the-bug exercise: per-token log-probs from one forward pass, against the course's).
"""
from __future__ import annotations

import torch

from rlcourse.grading._core import assert_close, fail, fail_if_mistake, passed, to_numpy, references
from rlcourse.grading._routes import DPO_LOSS, PREFERENCE_OPTIMA, PREFERENCE_TRAINERS

__all__ = ["check_dpo_loss", "check_implicit_reward", "check_ipo_loss", "check_fit_dpo_policy", "check_dpo_step",
           "check_completion_logprobs"]


def _grad_free(x):
    return x.detach() if hasattr(x, "detach") else x


def _pair_cases(seed: int):
    """(case, chosen, rejected, ref_chosen, ref_rejected, beta) with float64 sequence log-probs."""
    gen = torch.Generator().manual_seed(seed)

    def logps(n, scale=6.0):
        return -scale * torch.rand(n, generator=gen, dtype=torch.float64)

    one = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    cases = [("one pair, policy equal to the reference (loss log 2)", one(-3.0), one(-5.0), one(-3.0), one(-5.0), 0.1)]
    for i, beta in enumerate([0.1, 0.5, 2.0]):
        cases.append((f"random batch #{i} of 8 pairs, beta={beta}", logps(8), logps(8), logps(8), logps(8), beta))
    # A reference very different from the policy: forgetting it changes everything.
    cw, cl = logps(6), logps(6)
    cases.append(("reference far from the policy, beta=0.3", cw, cl, cw - 4.0, cl + 3.0, 0.3))
    # Confident pairs: beta * h = +-2000. -log(sigmoid) overflows to inf on the wrong side.
    big = torch.tensor([4000.0, -4000.0, 0.0], dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    cases.append(("extreme margins (beta*h = +2000 and -2000)", big, zero.clone(), zero.clone(), zero.clone(), 0.5))
    cases.append(("integer beta=1", logps(4), logps(4), logps(4), logps(4), 1))
    return cases


def _call_checked(name, case, fn, *tensors_then_rest):
    """Call ``fn`` on clones of the tensors and fail if any was modified in place."""
    tensors = [t.clone() for t in tensors_then_rest if torch.is_tensor(t)]
    rest = [a for a in tensors_then_rest if not torch.is_tensor(a)]
    before = [t.clone() for t in tensors]
    got = fn(*tensors, *rest)
    if not all(torch.equal(a, b) for a, b in zip(before, tensors)):
        fail(name, case, "inputs left unchanged", "an input tensor was modified in place",
             "build new tensors (e.g. `a - b`) instead of writing into the arguments (`a -= b`)")
    return got


@references(*DPO_LOSS)
def check_dpo_loss(fn) -> None:
    """``fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta) -> (B,)``:
    ``-log sigmoid(beta * ([log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)]))``, one per pair."""
    __tracebackhide__ = True
    from rlcourse.losses import dpo_sigmoid_loss

    name = "check_dpo_loss"
    cases = _pair_cases(110)
    for case, cw, cl, rw, rl, beta in cases:
        got = _call_checked(name, case, fn, cw, cl, rw, rl, beta)
        expected = dpo_sigmoid_loss(cw, cl, rw, rl, beta)
        h = (cw - rw) - (cl - rl)
        received = to_numpy(_grad_free(got)) if got is not None else None
        if received is not None and received.shape == ():
            fail(name, case, f"one loss per pair, shape {tuple(expected.shape)}", "a single number",
                 "return the per-pair losses; the trainer takes the mean")
        for mistake, hint in [
            (-torch.nn.functional.logsigmoid(h), "beta is missing: the implicit reward is beta * log-ratio"),
            (-torch.nn.functional.logsigmoid(beta * (cw - cl)),
             "the reference log-probs are missing: use log pi - log pi_ref for each answer"),
            (-torch.nn.functional.logsigmoid(-beta * h), "chosen and rejected are swapped: the chosen answer must win"),
            (torch.nn.functional.logsigmoid(beta * h), "the sign: the loss is MINUS log sigmoid (a negative log-likelihood)"),
            (-torch.nn.functional.logsigmoid(h / beta), "beta multiplies the log-ratio margin, it does not divide it"),
        ]:
            fail_if_mistake(name, case, expected, _grad_free(got), mistake, hint)
        hint = "loss = -logsigmoid(beta * h), h = (chosen - ref_chosen) - (rejected - ref_rejected)"
        if received is not None and not torch.isfinite(torch.as_tensor(received)).all():
            hint = ("-log(sigmoid(z)) overflows for very negative z: use torch.nn.functional.logsigmoid, "
                    "which is computed stably")
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-7, rtol=1e-7)
    passed(name, len(cases))


@references("rlcourse.losses.dpo:dpo_implicit_reward", "rlcourse.measure.categorical_bandit:CategoricalBandit.implicit_reward")
def check_implicit_reward(fn) -> None:
    """``fn(policy_logps, ref_logps, beta) -> tensor``: ``beta * (log pi(y|x) - log pi_ref(y|x))``."""
    __tracebackhide__ = True
    from rlcourse.losses import dpo_implicit_reward

    name = "check_implicit_reward"
    gen = torch.Generator().manual_seed(111)
    cases = [("policy equal to the reference (reward 0)", torch.tensor([-2.0, -7.0]), torch.tensor([-2.0, -7.0]), 0.1)]
    for i, beta in enumerate([0.1, 0.5, 3.0]):
        cases.append((f"random log-probs #{i}, beta={beta}", -5 * torch.rand(6, generator=gen, dtype=torch.float64),
                      -5 * torch.rand(6, generator=gen, dtype=torch.float64), beta))
    cases.append(("very unlikely sequences (log-probs near -1e4)", torch.tensor([-1.0e4, -2.0e4], dtype=torch.float64),
                  torch.tensor([-1.0001e4, -1.9e4], dtype=torch.float64), 0.2))
    for case, logp, ref, beta in cases:
        got = _call_checked(name, case, fn, logp, ref, beta)
        expected = dpo_implicit_reward(logp, ref, beta)
        for mistake, hint in [((logp - ref), "beta is missing: r_hat = beta * (log pi - log pi_ref)"),
                              (beta * (ref - logp), "the sign: log pi - log pi_ref, the policy first"),
                              ((logp - ref) / beta, "multiply by beta, do not divide"),
                              (beta * logp, "subtract the reference log-prob")]:
            fail_if_mistake(name, case, expected, _grad_free(got), mistake, hint)
        hint = "r_hat = beta * (log pi - log pi_ref)"
        if "unlikely" in case and isinstance(got, torch.Tensor) and not torch.isfinite(got).all():
            hint = ("exp(log pi) of a long sequence underflows (exp(-1e4) is 0 in any float type), and 0 / 0 is nan: "
                    "stay with log-probabilities, log(pi / pi_ref) = log pi - log pi_ref")
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-7, rtol=1e-7)
    passed(name, len(cases))


@references("rlcourse.losses.dpo:ipo_loss", "rlcourse.losses.dpo:preference_loss",
            "rlcourse.losses.dpo:dpo_logratio_margin", "rlcourse.losses.beyond_dpo:preference_objective",
            *PREFERENCE_TRAINERS)
def check_ipo_loss(fn) -> None:
    """``fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta) -> (B,)``:
    ``(h - 1 / (2 beta))^2`` per pair, ``h`` the log-ratio margin (sequence-level, no length normalisation).
    Then a tabular policy fitted with the learner's loss (L-BFGS on the exact expected loss over every
    labelled pair of a small bandit) must land on the fit with the course's ``ipo_loss``."""
    __tracebackhide__ = True
    from rlcourse.losses import ipo_loss

    name = "check_ipo_loss"
    cases = [c for c in _pair_cases(112) if "extreme" not in c[0]]
    # a pair exactly at the target: loss 0
    cases.append(("a pair exactly at the target margin 1/(2 beta) = 2.5", torch.tensor([-1.0], dtype=torch.float64),
                  torch.tensor([-3.5], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                  torch.zeros(1, dtype=torch.float64), 0.2))
    for case, cw, cl, rw, rl, beta in cases:
        got = _call_checked(name, case, fn, cw, cl, rw, rl, beta)
        expected = ipo_loss(cw, cl, rw, rl, beta)
        h = (cw - rw) - (cl - rl)
        for mistake, hint in [((h - 1 / beta) ** 2, "the target is 1 / (2 beta), not 1 / beta"),
                              ((beta * h - 1 / (2 * beta)) ** 2,
                               "IPO regresses the log-ratio margin h itself, not beta * h"),
                              ((h + 1 / (2 * beta)) ** 2, "the chosen answer must be AHEAD by 1/(2 beta): h - 1/(2 beta)"),
                              ((h - 1 / (2 * beta)), "square the difference"),
                              (((cw - cl) - 1 / (2 * beta)) ** 2, "the reference log-probs are missing")]:
            fail_if_mistake(name, case, expected, _grad_free(got), mistake, hint)
        assert_close(name, case, expected, _grad_free(got), hint="(h - 1/(2 beta))^2, h = the log-ratio margin",
                     atol=1e-7, rtol=1e-7)
    gap, kl_to_dpo = _fit_ipo_with(fn)
    if not gap < 1e-4:
        fail(name, "a tabular policy fitted with your loss to every labelled pair of a 3-prompt, 4-answer bandit "
                   "(beta 0.5)", "IPO's optimum (the same fit with the course's ipo_loss)",
             f"a policy {gap:.2e} away in log-probability", "the values agreed on the test pairs: keep the loss "
                                                            "differentiable in the log-probs (torch operations, no .item())")
    print(f"✔ {name}: all {len(cases)} cases passed; a tabular policy fitted with your loss lands on IPO's optimum "
          f"(largest log-prob gap {gap:.0e}), {kl_to_dpo:.3f} nats of KL from DPO's")


def _fit_ipo_with(fn) -> tuple[float, float]:
    """Fit a tabular policy to every labelled pair of a small bandit (exact weights) with ``fn`` as IPO's loss;
    return its largest |log-prob| gap to the fit with the course's ``ipo_loss``, and the mean KL from the
    reference fit to DPO's optimum (IPO's finite target keeps it elsewhere)."""
    from rlcourse.measure.categorical_bandit import CategoricalBandit
    from rlcourse.losses import ipo_loss
    from rlcourse.measure.preference_optima import labelled_pairs, minimise_expected_loss

    bandit, beta = CategoricalBandit.random(n_prompts=3, n_answers=4, reward_scale=1.5, seed=11), 0.5
    d, ref = labelled_pairs(bandit), bandit.ref_logprobs
    x, a, b, w = d["prompt"], d["chosen"], d["rejected"], d["weight"]

    def expected(loss):
        return lambda logp: (w * torch.as_tensor(loss(logp[x, a], logp[x, b], ref[x, a], ref[x, b], beta))).sum()

    theirs = minimise_expected_loss(bandit, expected(ipo_loss))["logprobs"]
    try:
        mine = minimise_expected_loss(bandit, expected(fn))["logprobs"]
    except RuntimeError:                   # no graph to differentiate
        return float("inf"), float("nan")
    dpo = bandit.optimal_logprobs(beta)
    return float((mine - theirs).abs().max()), float(bandit.kl(theirs, dpo).mean())


def optimum_of_the_data(bandit, pairs: dict, loss) -> torch.Tensor:
    """The tabular policy (P, K) that minimises the mean of ``loss(logp, x, chosen, rejected)`` (one loss per
    comparison) over the comparisons ``pairs``: what a fit to these comparisons converges to, whatever
    reward they were drawn from. Each distinct comparison is counted once with its frequency as weight;
    L-BFGS from ``pi_ref`` (:func:`~rlcourse.measure.preference_optima.minimise_expected_loss`)."""
    from rlcourse.measure.preference_optima import minimise_expected_loss

    P, K = bandit.n_prompts, bandit.n_answers
    key = (pairs["prompt"] * K + pairs["chosen"]) * K + pairs["rejected"]
    counts = torch.bincount(key, minlength=P * K * K).double()
    seen = torch.nonzero(counts).flatten()
    x, a, b, w = seen // (K * K), seen // K % K, seen % K, counts[seen] / counts.sum()
    fit = minimise_expected_loss(bandit, lambda logp: (w * loss(logp, x, a, b)).sum())
    assert fit["grad"] < 1e-6, "these comparisons have no finite optimum: choose another sample"
    return fit["logprobs"]


def fitted_table(name: str, case: str, got, bandit) -> torch.Tensor:
    """The learner's table as float64 log-probs (P, K), or a failure saying what it is."""
    __tracebackhide__ = True
    if got is None:
        fail(name, case, "a (P, K) tensor of log-probs", None, "did you forget `return`?")
    got = torch.as_tensor(to_numpy(got), dtype=torch.float64)
    if got.shape != bandit.ref_logprobs.shape:
        fail(name, case, f"shape {tuple(bandit.ref_logprobs.shape)}", f"shape {tuple(got.shape)}",
             "return log-probs, one row per prompt and one column per answer")
    sums = got.exp().sum(-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-6):
        fail(name, case, "rows of log-probs (exp sums to 1)", sums,
             "return torch.log_softmax(logits, -1), not the logits")
    return got


# (bandit, beta, comparisons, their seed). With 200 comparisons the data imply a policy 0.12 and 0.09 nats
# from pi*, so a closed form typed from the bandit's reward fails; with 20000 it is 0.0003 from pi*.
FIT_DPO_CASES = [({"n_prompts": 3, "n_answers": 4, "reward_scale": 1.5, "seed": 11}, 0.5, 200, 36),
                 ({"n_prompts": 2, "n_answers": 5, "reward_scale": 1.0, "seed": 12}, 1.0, 200, 10),
                 ({"n_prompts": 2, "n_answers": 5, "reward_scale": 1.0, "seed": 12}, 1.0, 20000, 6)]
FIT_TOLERANCE = 2e-3     # nats of KL per prompt; the solution lands within 1e-12


@references(*PREFERENCE_OPTIMA, *DPO_LOSS)
def check_fit_dpo_policy(fn) -> None:
    """``fn(bandit, pairs, beta) -> (P, K)`` log-probs of a tabular policy fitted by DPO to ``pairs``.

    Judged by where it lands: each sample of Bradley-Terry comparisons implies one policy, the minimiser
    of the mean DPO loss over them (:func:`optimum_of_the_data`, found here by L-BFGS), and the fit must
    be within 0.002 nats of KL per prompt of it. With 200 comparisons that policy is 0.09 to 0.12 nats
    from the closed-form optimum ``pi* = pi_ref exp(r / beta) / Z`` of the hidden reward, which only a
    fit to these comparisons finds; with 20000 it is 0.0003 from ``pi*``: DPO recovers the optimum from
    comparisons alone.
    """
    __tracebackhide__ = True
    from rlcourse.measure.categorical_bandit import CategoricalBandit

    name = "check_fit_dpo_policy"
    worst, to_pi_star = 0.0, {}
    for kwargs, beta, n, data_seed in FIT_DPO_CASES:
        bandit = CategoricalBandit.random(**kwargs)
        case = f"{bandit.n_prompts} prompts x {bandit.n_answers} answers, beta={beta}, {n} comparisons"
        pairs = bandit.sample_pairs(n, rng=data_seed)
        got = fitted_table(name, case, fn(bandit, {k: v.clone() for k, v in pairs.items()}, beta), bandit)
        ref = bandit.ref_logprobs
        target = optimum_of_the_data(bandit, pairs, lambda lp, x, a, b: torch.nn.functional.softplus(
            -beta * ((lp[x, a] - ref[x, a]) - (lp[x, b] - ref[x, b]))))
        pi_star = bandit.optimal_logprobs(beta)
        kl = float(bandit.kl(got, target).mean())
        to_pi_star[n] = max(to_pi_star.get(n, 0.0), float(bandit.kl(pi_star, target).mean()))
        if not kl < FIT_TOLERANCE:
            hint = "train longer or with a larger learning rate (full-batch Adam, a few hundred steps)"
            if float(bandit.kl(got, pi_star).mean()) < 1e-6:
                hint = (f"this is pi* = pi_ref exp(r / beta) / Z, computed from the bandit's reward, not a fit to "
                        f"these comparisons: {n} of them lead DPO to a policy {to_pi_star[n]:.3f} nats from pi*. "
                        f"Minimise the mean DPO loss over pairs")
            elif float(bandit.kl(got).mean()) < 1e-6:
                hint = "the policy never left pi_ref: is the optimiser stepping on the logits you return?"
            elif float(bandit.kl(got, torch.log_softmax(target - ref, -1)).mean()) < kl:
                hint = "it looks like the reference was left out of the log-ratios"
            fail(name, case, f"KL(pi_fit || the policy these comparisons imply) < {FIT_TOLERANCE}", f"KL = {kl:.4f}",
                 hint)
        worst = max(worst, kl)
    print(f"✔ {name}: all {len(FIT_DPO_CASES)} cases passed; each fit lands on the policy its comparisons imply "
          f"(KL at most {worst:.0e}), which is {to_pi_star[200]:.3f} nats from pi* with 200 comparisons and "
          f"{to_pi_star[20000]:.4f} with 20000")


def _preference_start():
    """The preference task, the ``preference-sft`` policy (eval mode), its frozen reference and tokenizer."""
    import copy

    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint

    start, tokenizer = load_checkpoint("preference-sft", device="cpu")
    start.eval()
    return PreferenceTask(), start, copy.deepcopy(start).requires_grad_(False), tokenizer


def _reference_dpo_step(model, ref_model, optimizer, batch, beta):
    from rlcourse.lm import sequence_logprobs
    from rlcourse.losses.dpo import dpo_sigmoid_loss

    def logps(m):
        return sequence_logprobs(m, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"],
                                 batch["prompt_mask"]).sum(-1).chunk(2)

    chosen, rejected = logps(model)
    with torch.no_grad():
        ref_chosen, ref_rejected = logps(ref_model)
    loss = dpo_sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _as_float(x):
    return float(x.detach()) if isinstance(x, torch.Tensor) else x


DPO_STEP_LEARNING = {"steps": 30, "pairs": 32, "lr": 1e-3, "beta": 0.1, "held_out": 500, "accuracy": 0.6}


@references(*DPO_LOSS)
def check_dpo_step(fn) -> None:
    """``fn(model, ref_model, optimizer, batch, beta) -> loss``: one DPO update on a batch of pairs
    (:func:`rlcourse.tasks.reward_model.encode_preference_pairs`' layout, chosen rows first). Checked by
    the gradient two calls hand the optimiser (against the reference step from the same weights), then
    by 30 steps from ``preference-sft``: the implicit reward must order at least 60% of 500 held-out
    pairs the way the labels do (it orders none before training: every implicit reward is 0). The
    second beta's calls hand over a reference other than the policy's start, so a reference taken from
    anywhere but ``ref_model`` is seen from the first call."""
    __tracebackhide__ = True
    import math

    import numpy as np

    from rlcourse.grading._steps import assert_call_gradient, moved_copy, twin_runs
    from rlcourse.lm import sequence_logprobs
    from rlcourse.tasks.reward_model import encode_preference_pairs

    name = "check_dpo_step"
    task, start, ref, tokenizer = _preference_start()
    other = moved_copy(ref, seed=51).requires_grad_(False)      # a reference that is not where the policy starts
    moved = ", ref_model not the policy's start (preference-sft moved by seeded noise)"
    for beta, ref_model, which in ((0.1, ref, ""), (0.5, other, moved)):
        mine, theirs, opt_mine, opt_theirs = twin_runs(start, lr=0.5)
        for call in (0, 1):            # the second call: the policy has moved, the reference has not
            batch = encode_preference_pairs(tokenizer, task.preference_pairs(12, rng=50 + call))
            label = f"beta={beta}{which}, a batch of 12 pairs, call {call + 1}"
            loss = _as_float(fn(mine, ref_model, opt_mine, {k: v.clone() for k, v in batch.items()}, beta))
            expected_loss = _reference_dpo_step(theirs, ref_model, opt_theirs, batch, beta)
            if call == 1 and loss is not None and abs(float(loss) - math.log(2)) < 1e-6 < abs(expected_loss - math.log(2)):
                fail(name, label, f"loss {expected_loss:.4f}", f"{float(loss):.6f} = log 2",
                     "every implicit reward is 0 although the policy has moved: the reference log-probs must "
                     "come from ref_model, which stays where it was")
            assert_call_gradient(name, label, call, opt_mine, opt_theirs,
                                 "another direction: the chosen rows come first in the batch, then the rejected ones; "
                                 "a sequence's log-prob is the sum over its real tokens; the reference is a constant",
                                 longer="the loss is averaged over another number of terms (one loss per pair, "
                                        "averaged over the pairs), or beta is applied differently",
                                 close=None if ref_model is ref else
                                 "almost the reference's direction: the reference log-probs come from ref_model, "
                                 "which here is not the model the policy started from")
            if loss is None or abs(float(loss) - expected_loss) > 1e-5:
                fail(name, label, f"loss {expected_loss:.6f} (the mean over the batch's pairs)", loss,
                     "return the loss the update minimised, as a float")
    s = DPO_STEP_LEARNING
    held_out = encode_preference_pairs(tokenizer, task.preference_pairs(s["held_out"], rng=2))

    def accuracy(model):
        with torch.no_grad():
            args = (held_out["prompt_ids"], held_out["completion_ids"], held_out["completion_mask"],
                    held_out["prompt_mask"])
            chosen, rejected = sequence_logprobs(model, *args).sum(-1).chunk(2)
            ref_chosen, ref_rejected = sequence_logprobs(ref, *args).sum(-1).chunk(2)
        return float(((chosen - ref_chosen) > (rejected - ref_rejected)).float().mean())

    import copy

    model = copy.deepcopy(start)
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    pairs = task.preference_pairs(s["steps"] * s["pairs"], rng=10)
    losses = [_as_float(fn(model, ref, optimizer, encode_preference_pairs(tokenizer, pairs[k * s["pairs"]:(k + 1) * s["pairs"]]),
                       s["beta"])) for k in range(s["steps"])]
    after = accuracy(model)
    if not after >= s["accuracy"]:
        fail(name, f"{s['steps']} steps of your dpo_step (Adam, lr {s['lr']}, {s['pairs']} pairs, beta {s['beta']})",
             f"the implicit reward ordering at least {s['accuracy']:.0%} of {s['held_out']} held-out pairs",
             f"{after:.1%}", f"the training loss went {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f} "
                              f"(first and last 5 steps)")
    print(f"✔ {name}: gradients equal the reference step's (2 betas x 2 calls); {s['steps']} steps: the implicit "
          f"reward orders {after:.1%} of {s['held_out']} held-out pairs as the labels do")


def _completion_cases(tokenizer, task):
    """Batches that expose an off-by-one, a padding slip or a log-softmax not gathered: left-padded
    prompts of several lengths, right-padded completions of several lengths."""
    from rlcourse.tasks.reward_model import encode_preference_pairs

    cases = []
    for i, n in enumerate((3, 7)):
        batch = encode_preference_pairs(tokenizer, task.preference_pairs(n, rng=60 + i))
        cases.append((f"{2 * n} completions (completions of lengths "
                      f"{sorted(set(batch['completion_mask'].sum(1).tolist()))}, right-padded)", batch))
    # Every prompt of this task has one length: pad them on the left by 2 more columns, as a batch
    # with longer prompts would, so that a position counted from column 0 is off by 2.
    padded = dict(batch)
    pad = torch.full((batch["prompt_ids"].shape[0], 2), tokenizer.pad_token_id, dtype=batch["prompt_ids"].dtype)
    padded["prompt_ids"] = torch.cat([pad, batch["prompt_ids"]], 1)
    padded["prompt_mask"] = torch.cat([torch.zeros_like(pad), batch["prompt_mask"]], 1)
    cases.append((f"{2 * n} completions, every prompt left-padded by 2 columns", padded))
    return cases


@references("rlcourse.lm.logprobs:sequence_logprobs", "rlcourse.lm.logprobs:completion_logits",
            "rlcourse.lm.logprobs:token_logprobs_from_logits", "rlcourse.trainers.dpo:pair_token_logprobs",
            "rlcourse.trainers.policy_gradient:logits_and_logprobs")
def check_completion_logprobs(fn) -> None:
    """``fn(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> (B, T)``: the model's
    log-prob of every real completion token, 0 on padding, from one forward pass; compared with
    :func:`rlcourse.lm.sequence_logprobs` on batches with padding on both sides, the last on another
    model. Called with gradients on, as DPO's loss calls it: the gradient of a weighted sum of the
    log-probs with respect to the weights must equal the course's."""
    __tracebackhide__ = True
    from rlcourse.grading._steps import moved_copy
    from rlcourse.lm import sequence_logprobs

    name = "check_completion_logprobs"
    task, start, _, tokenizer = _preference_start()
    n = 0
    for i, (case, b) in enumerate(_completion_cases(tokenizer, task)):
        # the last batch on another model (preference-sft moved by seeded noise): the log-probs are the model's
        model = start if i < 2 else moved_copy(start, seed=61)
        case = case if i < 2 else f"{case}, on another model (preference-sft moved by seeded noise)"
        args = (b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"])
        got = fn(model, *(a.clone() for a in args))              # with gradients on, as DPO's loss calls it
        with torch.no_grad():
            expected = sequence_logprobs(model, b["prompt_ids"], b["completion_ids"], b["completion_mask"],
                                         b["prompt_mask"])
        if got is not None and tuple(getattr(got, "shape", ())) == tuple(expected.shape):
            g = torch.as_tensor(to_numpy(got))
            real = b["completion_mask"].bool()
            if bool((g[real] > 1e-6).any()):
                fail(name, case, "log-probabilities (<= 0) at the real tokens", got,
                     "a log-prob is at most 0: take log_softmax over the vocabulary, then the entry of the token")
            if bool((g[~real] != 0).any()):
                fail(name, case, "0 at every padded position", got, "a pad is not a token of the completion")
            gap = float((g[real] - expected[real].double()).abs().max())
            if gap > 1e-4:
                fail(name, case, expected, got,
                     f"the real tokens' log-probs differ by up to {gap:.3g} from the model's own: these are "
                     "log-probabilities, but not the ones the model gives these tokens after their prefixes")
        assert_close(name, case, expected, got, atol=1e-4, rtol=1e-4,
                     hint="shape (B, T): log pi(y_t | x, y_<t) at real tokens, 0 at padding")
        # DPO differentiates these log-probs: their gradient must reach the model's weights, as the course's does
        weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(62 + i), dtype=torch.float64)
        params = [p for p in model.parameters() if p.requires_grad]
        if not isinstance(got, torch.Tensor) or got.grad_fn is None:
            fail(name, case, "log-probs with a graph back to the model's weights", "a tensor without a gradient",
                 "DPO's loss is differentiated through these log-probs: compute them with the model's forward pass "
                 "and torch operations, without torch.no_grad(), .detach() or .item()")
        mine = torch.autograd.grad((got.double() * weights).sum(), params, allow_unused=True)
        course = sequence_logprobs(model, b["prompt_ids"], b["completion_ids"], b["completion_mask"], b["prompt_mask"])
        theirs = torch.autograd.grad((course.double() * weights).sum(), params)
        flat = [torch.cat([(torch.zeros_like(p) if g is None else g).flatten().double() for g, p in zip(grads, params)])
                for grads in (mine, theirs)]
        if float(flat[0].abs().max()) == 0.0:
            fail(name, f"{case}: the gradient with respect to the model's weights", "a gradient reaching the model "
                 "handed over", "none: the log-probs do not depend on its weights",
                 "compute the log-probs with the model you are given, model(input_ids=..., attention_mask=..., "
                 "position_ids=...)")
        assert_close(name, f"{case}: the gradient of a weighted sum of the log-probs with respect to the model's "
                           f"weights", flat[1], flat[0], atol=1e-5, rtol=1e-3,
                     hint="the values are right but not their gradient: keep every log-prob on the model's graph")
        n += 1
    passed(name, n)
