"""Where each preference loss leads, exactly: its minimiser on an enumerable problem, against the KL-regularised optimum.

The problem is lesson 11's categorical bandit (:class:`~rlcourse.measure.categorical_bandit.CategoricalBandit`:
prompts ``x``, answers ``y``, a reference ``pi_ref`` and a reward ``r``), with two additions that
the losses of lesson 11b can see: every answer has a *length* ``|y|`` (SimPO and ORPO divide by
it, R-DPO penalises it), and the raters' utility may differ from the reward, ``u = r + b |y|``
(raters with a taste for length, as lesson 08b's).

The data is the limit of :meth:`~rlcourse.measure.categorical_bandit.CategoricalBandit.sample_pairs` as the
number of comparisons grows: a prompt drawn uniformly, an answer ``a`` from ``pi_ref``, a second
one from ``pi_ref`` redrawn until it differs, the first preferred with Bradley-Terry probability
``sigmoid(u(x, a) - u(x, b))``. Every ordered pair (chosen ``a``, rejected ``b``) of a prompt then
has a known weight, and a loss's expectation over the data is a finite weighted sum:

    E[loss](pi) = sum_{x, a != b} w(x, a, b) loss(x, a, b; pi),
    w(x, a, b)  = (1 / P) pi_ref(a|x) pi_ref(b|x) [1 / (1 - pi_ref(a|x)) + 1 / (1 - pi_ref(b|x))] sigmoid(u_a - u_b).

:func:`expected_preference_loss` computes it with the course's loss functions
(:mod:`rlcourse.losses.dpo`, :mod:`rlcourse.losses.beyond_dpo`), :func:`minimise_expected_loss`
finds the tabular policy it leads to, and :func:`simpo_optimum` is SimPO's minimiser in closed form
(for ``gamma = 0``), derived in its docstring.
"""
from __future__ import annotations

import torch

from rlcourse.measure.categorical_bandit import CategoricalBandit
from rlcourse.losses.beyond_dpo import kto_loss, kto_reference_point, orpo_loss, rdpo_loss, simpo_loss
from rlcourse.losses.dpo import _check_beta, dpo_sigmoid_loss, ipo_loss

__all__ = ["EXACT_LOSSES", "labelled_pairs", "expected_preference_loss", "minimise_expected_loss", "simpo_optimum"]

EXACT_LOSSES = ("sigmoid", "ipo", "rdpo", "simpo", "orpo", "kto")


def _lengths(bandit: CategoricalBandit, lengths) -> torch.Tensor:
    """``lengths`` as a (P, K) float64 table: one length per answer (K,), or per prompt and answer (P, K)."""
    L = torch.as_tensor(lengths, dtype=torch.float64)
    if L.dim() < 2:
        L = L.expand(bandit.n_prompts, bandit.n_answers) if L.numel() in (1, bandit.n_answers) else L
    if L.shape != bandit.ref_logprobs.shape or not bool((L >= 1).all()):
        raise ValueError(f"lengths must be >= 1, one per answer (K={bandit.n_answers},) or per prompt and answer "
                         f"{tuple(bandit.ref_logprobs.shape)}, got shape {tuple(L.shape)}")
    return L


def labelled_pairs(bandit: CategoricalBandit, utility=None) -> dict[str, torch.Tensor]:
    """Every ordered pair (prompt, chosen, rejected) of different answers and its weight in the data.

    ``utility`` (P, K) is what the raters compare (default: the bandit's reward). The weights sum to 1.
    Returns ``{"prompt", "chosen", "rejected", "weight"}``, tensors of shape (P * K * (K - 1),).
    """
    u = bandit.reward if utility is None else torch.as_tensor(utility, dtype=torch.float64)
    if u.shape != bandit.reward.shape:
        raise ValueError(f"utility must have the reward's shape {tuple(bandit.reward.shape)}, got {tuple(u.shape)}")
    P, K = bandit.n_prompts, bandit.n_answers
    x, a, b = (t.flatten() for t in torch.meshgrid(torch.arange(P), torch.arange(K), torch.arange(K), indexing="ij"))
    keep = a != b
    x, a, b = x[keep], a[keep], b[keep]
    ref = bandit.ref_logprobs.exp()
    drawn = ref[x, a] * ref[x, b] * (1 / (1 - ref[x, a]) + 1 / (1 - ref[x, b])) / P   # {a, b} proposed, either order
    weight = drawn * torch.sigmoid(u[x, a] - u[x, b])                                 # ... and a chosen
    return {"prompt": x, "chosen": a, "rejected": b, "weight": weight}


def expected_preference_loss(logprobs, bandit: CategoricalBandit, loss_type: str, beta: float, lengths=1,
                             utility=None, simpo_gamma: float = 0.0, rdpo_alpha: float = 0.0) -> torch.Tensor:
    """``E[loss](pi)`` over the data of :func:`labelled_pairs`, for the tabular policy ``logprobs`` (P, K).

    ``loss_type``: ``sigmoid`` (DPO), ``ipo``, ``rdpo`` (``rdpo_alpha``), ``simpo`` (``simpo_gamma``;
    reads ``log pi / |y|``), ``orpo`` (the chosen answers' NLL per token, a ratio of expectations, plus
    ``beta`` times the odds-ratio term on ``log pi / |y|``) or ``kto`` (each pair split into a
    desirable and an undesirable single; the reference point ``z0`` as the trainer estimates it,
    ``max(0, mean log pi/pi_ref)`` over answers that rated pairs hold, paired with *other* prompts,
    held constant: no gradient flows through it).
    """
    _check_beta(beta)
    logp = torch.as_tensor(logprobs)
    ref, L = bandit.ref_logprobs, _lengths(bandit, lengths)
    d = labelled_pairs(bandit, utility)
    x, a, b, w = d["prompt"], d["chosen"], d["rejected"], d["weight"]
    cw, cl, rw, rl = logp[x, a], logp[x, b], ref[x, a], ref[x, b]
    if loss_type == "sigmoid":
        return (w * dpo_sigmoid_loss(cw, cl, rw, rl, beta)).sum()
    if loss_type == "ipo":
        return (w * ipo_loss(cw, cl, rw, rl, beta)).sum()
    if loss_type == "rdpo":
        return (w * rdpo_loss(cw, cl, rw, rl, L[x, a], L[x, b], beta, rdpo_alpha)).sum()
    if loss_type == "simpo":
        return (w * simpo_loss(cw / L[x, a], cl / L[x, b], beta, simpo_gamma)).sum()
    if loss_type == "orpo":
        nll = -(w * cw).sum() / (w * L[x, a]).sum()            # mean over every chosen token of a large batch
        return nll + (w * orpo_loss(cw / L[x, a], cl / L[x, b], beta)).sum()
    if loss_type == "kto":
        # answers as the data holds them: y' of prompt x' (either side of a pair), scored under every prompt x
        held = torch.zeros_like(ref).index_put_((x, a), w / 2, accumulate=True).index_put_((x, b), w / 2, accumulate=True)
        answer_law = held.sum(0) / held.sum()                   # an answer of a random other prompt
        mismatched = (answer_law * (logp - ref)).sum(-1).mean()
        z0 = kto_reference_point(mismatched.reshape(1), torch.zeros(1, dtype=logp.dtype))
        per_single = kto_loss(cw, cl, rw, rl, z0, beta)         # desirable singles, then undesirable ones
        return (torch.cat([w, w]) * per_single).sum() / 2
    raise ValueError(f"loss_type must be one of {EXACT_LOSSES}, got {loss_type!r}")


def minimise_expected_loss(bandit: CategoricalBandit, loss, rounds: int = 3, max_iter: int = 300) -> dict:
    """The tabular policy (one logit per prompt and answer, started at ``pi_ref``) that minimises
    ``loss(logprobs) -> scalar``: L-BFGS with a strong-Wolfe line search, ``rounds`` restarts of
    ``max_iter`` iterations each.

    Returns ``{"logprobs": (P, K), "grad": max |d loss / d logit| at the end, "loss": final value}``:
    a gradient near 0 says a minimiser was reached.
    """
    if not isinstance(rounds, int) or rounds < 1 or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"rounds and max_iter must be positive integers, got {rounds!r} and {max_iter!r}")
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([logits], lr=1, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = loss(torch.log_softmax(logits, -1))
        value.backward()
        return value
    for _ in range(rounds):
        opt.step(closure)
    value = loss(torch.log_softmax(logits, -1))
    (grad,) = torch.autograd.grad(value, logits)
    return {"logprobs": torch.log_softmax(logits.detach(), -1), "grad": float(grad.abs().max()),
            "loss": float(value.detach())}


def simpo_optimum(utility, lengths, beta: float) -> torch.Tensor:
    """SimPO's minimiser for ``gamma = 0``, in closed form: ``log pi(y|x) = |y| (u(x, y) / beta + c(x))``.

    Why: with Bradley-Terry labels on ``u``, each pair's expected loss
    ``-p log sigmoid(z) - (1 - p) log sigmoid(-z)`` is smallest where the model's margin
    ``z = beta (log pi(a)/|a| - log pi(b)/|b|)`` equals ``u(a) - u(b)`` (a cross-entropy is smallest at
    the true probability). All pairs at once can have it: ``log pi(y)/|y| = u(y)/beta + c``, one
    constant ``c(x)`` per prompt, fixed by ``sum_y pi(y|x) = 1``. Its left side increases with ``c``
    from 0 to infinity, so ``c`` is unique; found here by bisection. ``pi_ref`` appears nowhere.
    ``utility`` and ``lengths``: (P, K) (lengths may be one row (K,)). Returns ``log pi`` (P, K).
    """
    _check_beta(beta)
    u = torch.as_tensor(utility, dtype=torch.float64)
    L = torch.as_tensor(lengths, dtype=torch.float64).expand_as(u)
    if not bool((L > 0).all()):
        raise ValueError("lengths must be > 0")
    per_token = u / beta
    total = lambda c: torch.logsumexp(L * (per_token + c[:, None]), dim=-1)   # noqa: E731  log sum_y pi(y)
    lo = -(per_token.max(-1).values + 1.0)          # every term <= e^{-|y|}; lowered until their sum is below 1
    step = 1.0
    while bool((total(lo) > 0).any()):              # lo may start above 0 (every u < -beta): step down, not lo * 2
        lo = torch.where(total(lo) > 0, lo - step, lo)
        step *= 2
    hi = -per_token.min(-1).values + 1.0            # the largest-term answer alone exceeds 1
    for _ in range(200):
        mid = (lo + hi) / 2
        above = total(mid) > 0
        hi, lo = torch.where(above, mid, hi), torch.where(above, lo, mid)
    c = (lo + hi) / 2
    return L * (per_token + c[:, None])
