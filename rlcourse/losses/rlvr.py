"""Pieces of RL on verifiable rewards that are neither an advantage nor a surrogate: length shaping and
which tokens learn (lesson 10b).

* :func:`overlong_penalty` - DAPO's soft overlong punishment (Yu et al., 2025, arXiv 2503.14476,
  eq. 13), a reward added to each completion by its length;
* :func:`high_entropy_mask` - the "forking tokens" of Wang et al., 2025 (arXiv 2506.01939): keep only
  the highest-entropy share of tokens in the policy loss (TRL's ``top_entropy_quantile``);
* :func:`adaptive_entropy_coef` and :func:`applied_entropy_coef` - Skywork-OR1's adaptive entropy
  control (He et al., 2025, arXiv 2505.22312; TRL's ``use_adaptive_entropy``): the coefficient of the
  entropy bonus moves by a fixed step towards holding the entropy at a target.

The entropy bonus that TRL's ``entropy_coef`` multiplies is the mean entropy over the tokens the
loss acts on, :func:`rlcourse.losses.policy_gradient.entropy_bonus` (lesson 06's, on the logits).

Shapes: ``entropies`` and ``mask`` are ``(B, T)``, one value per completion token; ``lengths`` is
``(B,)``. ``tests/test_rlvr_losses.py`` checks them against closed forms and NumPy's quantile, and
``tests/test_trl_parity_rlvr.py`` the trainer that uses them against TRL 1.16's ``GRPOTrainer``.
"""
from __future__ import annotations

import torch

from rlcourse.kl import as_mask
from rlcourse.returns import check_integer

__all__ = ["overlong_penalty", "high_entropy_mask", "adaptive_entropy_coef", "applied_entropy_coef"]


def overlong_penalty(lengths, max_completion_length: int, overlong_buffer_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment of each completion, shape ``(B,)``, in ``[-1, 0]``.

    With ``L = max_completion_length``, ``C = overlong_buffer_len`` and ``|y|`` the completion's
    length in tokens (its ``<eos>`` included, as TRL counts ``completion_ids``)::

        R_length(y) = 0                      if |y| <= L - C
                    = ((L - C) - |y|) / C    if L - C < |y| <= L
                    = -1                     if |y| > L

    The penalty grows linearly over the last ``C`` tokens of the budget, so a completion learns
    that it is running long before it is cut. TRL ships it as a reward function,
    ``trl.rewards.get_soft_overlong_punishment(max_completion_len=L, soft_punish_cache=C)``; verl
    calls ``C`` ``overlong_buffer.len``. ``C = 0`` gives 0 up to ``L`` (only a cut completion pays).
    """
    L = check_integer("max_completion_length", max_completion_length, 1)
    C = check_integer("overlong_buffer_len", overlong_buffer_len, 0)
    if C > L:
        raise ValueError(f"overlong_buffer_len ({C}) must be <= max_completion_length ({L})")
    lengths = torch.as_tensor(lengths)
    if lengths.ndim != 1 or lengths.is_floating_point() or bool((lengths < 0).any()):
        raise ValueError(f"lengths must be a 1-D tensor of token counts >= 0, got {lengths!r}")
    lengths = lengths.to(torch.float32)
    start = float(L - C)
    inside = (start - lengths) / C if C > 0 else torch.zeros_like(lengths)
    out = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    return torch.where(lengths > L, torch.full_like(lengths, -1.0), out)


def high_entropy_mask(entropies: torch.Tensor, mask, top_entropy_quantile: float) -> torch.Tensor:
    """Which tokens stay in the policy loss: the top ``rho = top_entropy_quantile`` share by entropy.

    ``keep_t = m_t  and  H_t >= q``, with ``q`` the ``(1 - rho)``-quantile of ``{H_t : m_t = 1}`` (linear
    interpolation, ``torch.quantile``'s default, as TRL computes it). ``rho = 0.2`` is Wang et al.'s
    choice: only the ~20% of tokens where the policy hesitates (the "forking" tokens) carry a
    gradient; ``rho = 1`` keeps every token; ``rho = 0`` keeps only the highest-entropy one(s). An
    empty mask keeps nothing. Returns a bool ``(B, T)``; ``entropies`` is detached.
    """
    rho = float(top_entropy_quantile)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile!r}")
    if not isinstance(entropies, torch.Tensor) or entropies.ndim != 2 or not entropies.is_floating_point():
        raise ValueError(f"entropies must be a (B, T) float tensor, got {getattr(entropies, 'shape', entropies)!r}")
    m = as_mask(mask, entropies)
    # The threshold and the comparison in one dtype: the first token of a prompt's completions has one
    # entropy for the whole group, so ties at the quantile are common, and a float32 threshold
    # compared with float64 entropies would drop them.
    h = entropies.detach().to(torch.promote_types(entropies.dtype, torch.float32))
    values = h[m]
    if values.numel() == 0:
        return torch.zeros_like(m)
    threshold = torch.quantile(values, 1.0 - rho)
    return (h >= threshold) & m



def adaptive_entropy_coef(entropy_coef: float, entropy: float, *, entropy_target: float = 0.2,
                          entropy_coef_delta: float = 0.005, entropy_coef_min: float = 0.0,
                          entropy_coef_max: float = 1.0) -> float:
    """One step of Skywork-OR1's entropy controller: the coefficient after an optimiser step, a float.

    With ``c`` the coefficient, ``H`` the mean token entropy measured in this step (over the tokens
    the bonus acts on), ``H*`` the target and ``delta`` the step::

        c <- min(c + delta, c_max)    if H <= H*      (entropy too low: push harder)
        c <- max(c - delta, c_min)    otherwise        (entropy high enough: relax)

    A bang-bang controller with a fixed step, as TRL 1.16's ``GRPOTrainer`` runs it once per
    optimiser step (defaults TRL's: ``entropy_target=0.2``, ``entropy_coef_delta=0.005``, bounds
    ``[0, 1]``). Whether the coefficient is *applied* is :func:`applied_entropy_coef`'s business.
    """
    for name, value in (("entropy_coef", entropy_coef), ("entropy", entropy), ("entropy_target", entropy_target),
                        ("entropy_coef_delta", entropy_coef_delta)):
        if not (isinstance(value, (int, float)) and value == value and abs(value) != float("inf")):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if entropy_coef_delta < 0 or not entropy_coef_min <= entropy_coef_max:
        raise ValueError(f"entropy_coef_delta must be >= 0 and entropy_coef_min <= entropy_coef_max, got "
                         f"{entropy_coef_delta!r}, [{entropy_coef_min!r}, {entropy_coef_max!r}]")
    if entropy <= entropy_target:
        return float(min(entropy_coef + entropy_coef_delta, entropy_coef_max))
    return float(max(entropy_coef - entropy_coef_delta, entropy_coef_min))


def applied_entropy_coef(entropy_coef: float, last_entropy: float, entropy_target: float) -> float:
    """The coefficient that multiplies the entropy bonus in this step's loss: ``c`` if the entropy measured
    at the previous optimiser step was at or below the target, else 0.

    The gate is TRL's: above the target the bonus is off whatever ``c`` is, so the controller only
    ever lifts the entropy back up, never pushes it above the target. Before the first step
    ``last_entropy`` is ``inf`` (TRL's start): no bonus.
    """
    return float(entropy_coef) if last_entropy <= entropy_target else 0.0
