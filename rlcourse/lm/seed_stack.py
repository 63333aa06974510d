"""Many seeds in one model: S copies of a GPT-2 advanced together, each its own independent run.

Why. A training step of the course's tiny GPT is about a thousand small torch operations, and on a
laptop CPU much of its time goes into dispatching them, not into arithmetic. S independent runs
(different seeds: their own sampling streams, data order, weights and optimiser state) advanced in
one step pay that dispatch once, not S times. The course uses this to judge every contest between
methods over many seeds (``python -m rlcourse.bench seeds`` measures the gain).

How. :func:`stack_models` builds a *seed-stacked* model: the same module tree as a
``GPT2LMHeadModel``, but each parameter carries a leading seed dimension, ``W[s]`` being seed
``s``'s copy. The lean forward of :mod:`rlcourse.lm.fast_gpt2` runs it with batched matrix
products, seed-major: of a batch of ``S * B`` rows, rows ``s * B`` to ``(s + 1) * B - 1`` belong
to seed ``s`` and only ever meet seed ``s``'s weights.

    y[s] = x[s] @ W[s] + b[s]                         (torch.baddbmm, one call for all seeds)

A loss that is the sum of the seeds' losses, ``L = sum_s L_s(W[s])``, has ``dL/dW[s] = dL_s/dW[s]``:
one backward pass gives every seed its own gradient, and nothing crosses from one seed to another.
What must stay per seed is done per seed here: gradient clipping (:func:`clip_grad_norm_per_seed`,
a norm per seed) and Adam (:class:`SeedAdam`, whose step counts are per seed, so a seed that skips
a step is left exactly as it was).

Only plain GPT-2 models (:func:`rlcourse.lm.fast_gpt2.supports`) can be stacked: the stacked
model has no ``transformers`` forward of its own. :func:`seed_model` copies one seed back out as
an ordinary ``GPT2LMHeadModel`` (to evaluate, save or sample it with anything).
"""
from __future__ import annotations

import copy
import warnings

import torch

from rlcourse.lm import fast_gpt2

__all__ = ["stack_models", "seed_model", "seed_runs", "seed_copies", "score_by_seed", "clip_grad_norm_per_seed",
           "SeedAdam"]


def _no_forward(*args, **kwargs):
    raise TypeError("a seed-stacked model has no transformers forward: use rlcourse.lm.sample and "
                    "rlcourse.lm.logprobs.completion_logits (they run rlcourse.lm.fast_gpt2), or seed_model(stack, s)")


def stack_models(models) -> torch.nn.Module:
    """One seed-stacked model from S plain GPT-2 models of one shape (S >= 1): seed ``s`` is ``models[s]``.

    The models are LMs (``GPT2LMHeadModel``) or scalar-head models on a GPT-2 body (the critic of
    PPO-RLHF, :class:`~rlcourse.lm.scalar_head.ScalarHeadModel`), all of one kind.

    The inputs are copied, never shared: training the stack leaves them untouched. Tied weights
    (GPT-2's ``lm_head.weight`` is ``wte.weight``) stay tied in the stack.
    """
    models = list(models)
    if not models:
        raise ValueError("models must hold at least one GPT-2 model")
    for i, m in enumerate(models):
        plain = fast_gpt2.supports(m) or fast_gpt2.supports_scalar_head(m)
        if not plain or fast_gpt2.num_seeds(m) is not None or type(m) is not type(models[0]):
            raise ValueError(f"models[{i}] is not a plain GPT-2 model of the kind of models[0] (rlcourse.lm.fast_gpt2."
                             f"supports, or supports_scalar_head for a reward model or critic): only those can be stacked")
    names = [n for n, _ in models[0].named_parameters()]
    for i, m in enumerate(models[1:], 1):
        if [(n, p.shape) for n, p in m.named_parameters()] != [(n, p.shape) for n, p in models[0].named_parameters()]:
            raise ValueError(f"models[{i}] does not have the shape of models[0]: all seeds must be one architecture")
    stack = copy.deepcopy(models[0])
    vars(stack).pop("forward", None)
    stacked = {}   # id of the template's parameter -> its stacked replacement (keeps tied weights tied)
    for name in names:
        source = [dict(m.named_parameters())[name] for m in models]
        stacked[id(dict(stack.named_parameters())[name])] = torch.nn.Parameter(
            torch.stack([p.detach() for p in source]).clone(), requires_grad=source[0].requires_grad)
    for module in stack.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = stacked[id(p)]
    stack.rlcourse_num_seeds = len(models)
    stack.forward = _no_forward
    return stack


def seed_model(stack: torch.nn.Module, s: int):
    """Seed ``s`` of a stacked model as an ordinary model of its kind (a copy: no memory shared)."""
    seeds = fast_gpt2.num_seeds(stack)
    if seeds is None:
        raise ValueError("stack is not a seed-stacked model (build one with stack_models)")
    if not 0 <= s < seeds:
        raise ValueError(f"s must be a seed index in [0, {seeds}), got {s!r}")
    model = copy.deepcopy(stack)
    for attribute in ("rlcourse_num_seeds", "forward"):
        vars(model).pop(attribute, None)
    single = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in single:
                    single[id(p)] = torch.nn.Parameter(p.detach()[s].clone(), requires_grad=p.requires_grad)
                module._parameters[key] = single[id(p)]
    return model


def seed_runs(model, first_seed: int, num_seeds: int | None = None, seeds=None) -> tuple[list, list[int]]:
    """The S starting models and S seeds of a seed-batched trainer: ``(models, seeds)``.

    ``model`` is one model (every seed starts from it) or a list of S models. S comes from
    ``num_seeds``, else from ``seeds``, else from the list's length; the seeds default to
    ``first_seed, first_seed + 1, ...``.
    """
    if seeds is not None:
        num_seeds = len(seeds) if num_seeds is None else num_seeds
    elif isinstance(model, (list, tuple)):
        num_seeds = len(model) if num_seeds is None else num_seeds
    if not isinstance(num_seeds, int) or isinstance(num_seeds, bool) or num_seeds < 1:
        raise ValueError(f"num_seeds must be an integer >= 1 (or given by seeds or a list of models), got {num_seeds!r}")
    models = list(model) if isinstance(model, (list, tuple)) else [model] * num_seeds
    if len(models) != num_seeds:
        raise ValueError(f"model must be one model or a list of num_seeds={num_seeds} models, got {len(models)}")
    seeds = [first_seed + s for s in range(num_seeds)] if seeds is None else [int(s) for s in seeds]
    if len(seeds) != num_seeds:
        raise ValueError(f"seeds must hold num_seeds={num_seeds} seeds, got {seeds}")
    return models, seeds


def seed_copies(obj, num_seeds: int, name: str) -> list:
    """``obj`` once per seed: a deep copy each, so a reward with state (a seeded coin, a noisy rater, a
    counter) evolves in seed ``s`` exactly as in seed ``s``'s solo run given ``obj`` as it is now.

    A ``torch.nn.Module`` (a frozen reward model, which keeps no state between calls) and None are
    shared, not copied. ``obj`` itself is never called. Python copies a plain function by reference,
    so state held in a closure or a default argument stays shared: keep it on an object instead.
    """
    if obj is None or isinstance(obj, torch.nn.Module):
        return [obj] * num_seeds
    try:
        return [copy.deepcopy(obj) for _ in range(num_seeds)]
    except (TypeError, copy.Error) as error:
        raise ValueError(f"{name} cannot be copied for each seed ({error}): make it deep-copyable, or run the "
                         f"single-seed trainer once per seed") from error


def score_by_seed(fns: list):
    """One reward function ``f(prompts, completions)`` over S seed-major blocks of rows: block ``s``
    scored by ``fns[s]`` alone (float32, one value per completion)."""
    def score(prompts, completions):
        n = len(prompts) // len(fns)
        return torch.cat([torch.as_tensor(f(prompts[s * n:(s + 1) * n], completions[s * n:(s + 1) * n]),
                                          dtype=torch.float32).flatten().cpu() for s, f in enumerate(fns)])
    return score


def _seed_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def clip_grad_norm_per_seed(parameters, max_norm: float) -> torch.Tensor:
    """Each seed's gradient scaled to norm <= ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` per seed.

    ``norm_s = sqrt(sum over parameters of ||g[s]||^2)``; ``g[s] *= min(1, max_norm / (norm_s + 1e-6))``.
    Returns the (S,) norms before clipping.
    """
    grads = [p.grad for p in parameters if p.grad is not None]    # anything with a (S, ...) .grad
    if not grads:
        raise ValueError("no parameter has a gradient: call backward() first")
    # as torch does it: each gradient's norm, then the norm of those norms (per seed here)
    norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(_seed_view(g), dim=1) for g in grads]), dim=0)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *[1] * (g.dim() - 1)))
    return norms


class SeedAdam:
    """Adam (Kingma and Ba, 2015, arXiv 1412.6980) for seed-stacked parameters, one Adam per seed.

    Per element, with ``t_s`` seed ``s``'s own step count (torch.optim.Adam's defaults)::

        m <- beta1 m + (1 - beta1) g          v <- beta2 v + (1 - beta2) g^2
        p <- p - lr / (1 - beta1^t_s) * m / (sqrt(v) / sqrt(1 - beta2^t_s) + eps)

    Adam is elementwise, so a stack of S seeds is S independent Adams as long as each seed counts
    its own steps: ``step(active)`` updates only the seeds where ``active`` is True (a seed whose
    batch had nothing to learn from keeps its weights, moments and count). ``step(lr=...)`` takes
    one learning rate per seed (each seed's own schedule). ``weight_decay`` is AdamW's decoupled
    decay (Loshchilov and Hutter, arXiv 1711.05101), ``p <- p (1 - lr weight_decay)`` before the
    update, as ``torch.optim.AdamW`` applies it.

    Why the parameters move: at construction every parameter (S, ...) is re-homed into one (S, N)
    buffer, seed-major (``p.data`` becomes a view of it), and so is its gradient. The update and
    :meth:`clip_grad_norm_` then run a handful of kernels over that buffer, instead of a handful per
    parameter: for a small model that is most of their cost. Gradients are zeroed, not freed, by
    :meth:`zero_grad` (backward adds into the buffer).
    """

    def __init__(self, parameters, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.params = [p for p in parameters if p.requires_grad]
        if not self.params:
            raise ValueError("parameters holds no parameter that requires a gradient")
        if not lr > 0 or not eps > 0 or not all(0 <= b < 1 for b in betas) or not weight_decay >= 0:
            raise ValueError(f"need lr > 0, eps > 0, betas in [0, 1) and weight_decay >= 0, got lr={lr!r}, "
                             f"betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.seeds = self.params[0].shape[0]
        if any(p.dim() < 1 or p.shape[0] != self.seeds for p in self.params):
            raise ValueError(f"every parameter must be seed-stacked with {self.seeds} seeds first")
        first = self.params[0]
        sizes = [p[0].numel() for p in self.params]
        self.flat = torch.empty(self.seeds, sum(sizes), dtype=first.dtype, device=first.device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.grad_views, at = [], 0
        for p, n in zip(self.params, sizes):
            view = self.flat[:, at:at + n]
            view.copy_(p.detach().reshape(self.seeds, -1))
            p.data = view.view(p.shape)
            self.grad_views.append(self.flat_grad[:, at:at + n].view(p.shape))
            p.grad = self.grad_views[-1]
            at += n
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.steps = torch.zeros(self.seeds, dtype=torch.float64)

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        for p, view in zip(self.params, self.grad_views):
            if p.grad is not view:          # freed or replaced elsewhere (model.zero_grad()): re-attach
                p.grad = view

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, adding into the gradient buffer.

        Each gradient is a strided view of that buffer (its rows are N apart, not packed), which
        autograd's "gradient layout contract" expects only of packed tensors: it warns once that
        this "may impair performance" and adds in place all the same. The warning is expected here
        and silenced; the buffer is what makes the update cheap.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
            loss.backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Each seed's gradient clipped as :func:`clip_grad_norm_per_seed` does; the (S,) norms before."""
        return clip_grad_norm_per_seed([self], max_norm)

    @property
    def grad(self) -> torch.Tensor:          # lets clip_grad_norm_per_seed read the whole buffer at once
        return self.flat_grad

    @torch.no_grad()
    def step(self, active: torch.Tensor | None = None, lr=None) -> None:
        active = (torch.ones(self.seeds, dtype=torch.bool) if active is None
                  else torch.as_tensor(active, dtype=torch.bool).cpu())
        if active.shape != (self.seeds,):
            raise ValueError(f"active must be ({self.seeds},) booleans, one per seed, got shape {tuple(active.shape)}")
        lrs = torch.as_tensor(self.lr if lr is None else lr, dtype=torch.float64).expand(self.seeds)
        if not bool(active.any()):
            return
        beta1, beta2 = self.betas
        self.steps += active.double()
        t = self.steps.clamp(min=1)
        dev, dtype = self.flat.device, self.flat.dtype
        step_size = (lrs / (1 - beta1 ** t)).to(dev, dtype)[:, None]
        root_bias2 = (1 - beta2 ** t).sqrt().to(dev, dtype)[:, None]
        rows = slice(None) if bool(active.all()) else active.nonzero().squeeze(1).to(dev)
        p, m, v, g = self.flat, self.exp_avg, self.exp_avg_sq, self.flat_grad
        if self.weight_decay:
            p[rows] = p[rows] * (1 - lrs.to(dev, dtype)[:, None][rows] * self.weight_decay)
        if isinstance(rows, slice):         # every seed steps: in place, a few kernels in all
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.sub_((m / (v.sqrt() / root_bias2).add_(self.eps)).mul_(step_size))
        else:                               # some seeds skip: update the others' rows only
            m[rows] = m[rows].lerp(g[rows], 1 - beta1)
            v[rows] = v[rows] * beta2 + (1 - beta2) * g[rows] * g[rows]
            p[rows] = p[rows] - (m[rows] / (v[rows].sqrt() / root_bias2[rows] + self.eps)) * step_size[rows]
