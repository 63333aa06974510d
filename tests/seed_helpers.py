"""Helpers of the seed-batching tests: per-seed copies of a model that a mix-up between seeds would show."""
import copy

import torch


def perturbed_copies(model, seeds, dtype=torch.float32, scale=0.05, offset=100):
    """One copy of ``model`` per seed, in ``dtype`` and eval mode, each moved by its own Gaussian noise."""
    out = []
    for s in seeds:
        m = copy.deepcopy(model).to(dtype).eval()
        g = torch.Generator().manual_seed(offset + s)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=dtype))
        out.append(m)
    return out


def relative_error(a, b) -> float:
    """``max |a - b| / max |b|``."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def update_cosine(start, a, b) -> float:
    """Cosine between two models' moves away from ``start`` (all three of one architecture).

    Two runs that take the same updates up to rounding give a cosine near 1 (not exactly: Adam
    magnifies rounding where a gradient is ~0, m / sqrt(v) of noise).
    """
    import torch.nn.functional as F

    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    origin = flat(start)
    return float(F.cosine_similarity(flat(a) - origin, flat(b) - origin, dim=0))
