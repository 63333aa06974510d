"""LoRA, low-rank adaptation (Hu et al., 2021, arXiv 2106.09685), in plain torch: lesson 12b.

A linear layer ``y = x W^T + b`` (``W``: ``(out, in)``) is frozen, and a rank-``r`` correction is learned:

    y = x W^T + b + (alpha / r) * (x A^T) B^T          A: (r, in), B: (out, r)
      = x (W + (alpha / r) B A)^T + b                    the merged weight

``B`` starts at zero, so the adapted model starts as the base model exactly; ``A`` starts random
(uniform in ``+-1/sqrt(in)``, the bound of ``torch.nn.Linear``'s and ``peft``'s default init), so the
gradient reaching ``B`` is not zero. Only ``A`` and ``B`` train: ``r * (in + out)`` parameters per
layer instead of ``in * out``. After training, :func:`merge_lora` folds ``(alpha / r) B A`` into ``W``
and gives back a plain model (and the lean GPT-2 forward of :mod:`rlcourse.lm.fast_gpt2`).

GPT-2's four projections per block are ``transformers``' ``Conv1D`` (``y = x W + b`` with ``W``:
``(in, out)``, the transpose of ``nn.Linear``'s); :class:`LoRALinear` wraps either kind. ``targets``:

* ``"all"``: every projection of every block (``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
  ``mlp.c_proj``), what "LoRA Without Regret" (Schulman et al., Thinking Machines, 2025) recommends and
  ``peft``'s ``target_modules="all-linear"`` selects;
* ``"attention"``: the attention projections only (``attn.c_attn``, ``attn.c_proj``), the original
  paper's choice.

Embeddings, layer norms and the tied output head stay frozen in both. ``alpha`` defaults to 32, the
value "LoRA Without Regret" uses for every rank (TRL's examples pass ``peft``'s ``LoraConfig``; lesson 13).
"""
from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LoRALinear", "apply_lora", "merge_lora", "lora_layers", "trainable_parameters", "LORA_TARGETS"]

LORA_TARGETS = {"all": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
                "attention": ("attn.c_attn", "attn.c_proj")}


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * (x A^T) B^T`` with ``base`` frozen (an ``nn.Linear`` or GPT-2's ``Conv1D``).

    Args:
        base: the layer to adapt; its weight and bias are frozen (``requires_grad=False``), never copied.
        r: the rank (an integer >= 1).
        alpha: the scale numerator; the correction is multiplied by ``alpha / r``.
        generator: a ``torch.Generator`` for ``A``'s initial draw (``None``: torch's global one).

    ``A``: ``(r, in)``; ``B``: ``(out, r)``, zero at init. :meth:`merged_weight` is ``(out, in)``.
    """

    def __init__(self, base: nn.Module, r: int = 1, alpha: float = 32.0, generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"r must be an integer >= 1, got {r!r}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        if isinstance(base, nn.Linear):
            self.in_features, self.out_features = base.in_features, base.out_features
        elif _is_conv1d(base):
            self.in_features, self.out_features = base.weight.shape
        else:
            raise TypeError(f"base must be a torch.nn.Linear or a transformers Conv1D, got {type(base).__name__}")
        self.base, self.r, self.alpha = base.requires_grad_(False), r, float(alpha)
        w = base.weight
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.empty(r, self.in_features, dtype=w.dtype).uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(w.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, dtype=w.dtype, device=w.device))

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def base_weight(self) -> torch.Tensor:
        """The frozen ``W`` as an ``(out, in)`` matrix (``nn.Linear``'s layout)."""
        return self.base.weight if isinstance(self.base, nn.Linear) else self.base.weight.T

    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / r) B A``, ``(out, in)``: the one matrix the adapted layer applies."""
        return self.base_weight() + self.scale * self.lora_B @ self.lora_A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Two thin matrix products (x A^T, then B): never the (out, in) product B A.
        return self.base(x) + self.scale * (x @ self.lora_A.T) @ self.lora_B.T

    def merged(self) -> nn.Module:
        """A new layer of the base's type whose weight is :meth:`merged_weight` (the bias copied), frozen."""
        import copy

        layer = copy.deepcopy(self.base)
        with torch.no_grad():
            w = self.merged_weight()
            layer.weight.copy_(w if isinstance(layer, nn.Linear) else w.T)
        return layer

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha:g}"


def _targets(targets: str) -> tuple[str, ...]:
    if targets not in LORA_TARGETS:
        raise ValueError(f"targets must be one of {sorted(LORA_TARGETS)}, got {targets!r}")
    return LORA_TARGETS[targets]


def apply_lora(model: nn.Module, r: int = 1, alpha: float = 32.0, targets: str = "all", seed: int = 0) -> nn.Module:
    """Freeze ``model`` and wrap the ``targets`` projections of every GPT-2 block in :class:`LoRALinear`, in place.

    Returns ``model``, whose only trainable parameters are now the ``A`` and ``B`` of each wrapped layer
    (``seed`` draws the ``A``'s, layer after layer). The output equals the base model's exactly until
    a ``B`` moves. The model no longer runs the lean forward (its layers are not plain ``Conv1D``).
    """
    suffixes = _targets(targets)
    body = getattr(model, "transformer", None)
    if body is None or not hasattr(body, "h"):
        raise ValueError(f"model must be a GPT-2 LM (model.transformer.h holds the blocks), got {type(model).__name__}")
    if lora_layers(model):
        raise ValueError("model already holds LoRA layers: apply_lora to a plain model (merge_lora first)")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for block in body.h:
        for suffix in suffixes:
            parent_name, child = suffix.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), r=r, alpha=alpha, generator=generator))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """``{qualified name: layer}`` of every :class:`LoRALinear` in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` in ``model`` by its merged plain layer, in place; unfreeze; return ``model``."""
    for name, layer in lora_layers(model).items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.merged())
    return model.requires_grad_(True)


def trainable_parameters(model: nn.Module) -> int:
    """How many parameters an optimiser would update (``requires_grad``), shared tensors counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
