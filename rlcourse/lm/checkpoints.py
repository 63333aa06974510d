"""Small pretrained checkpoints shipped with the package, so LLM lessons start in seconds.

``load_checkpoint("addition")`` returns ``(model, tokenizer)`` read from
``rlcourse/checkpoints/addition/`` (safetensors weights, the GPT-2 config, the tokenizer and a
``recipe.json`` that records how it was trained and what it measured). Every checkpoint is
reproduced by ``python -m rlcourse.tools.train_checkpoints NAME`` (see :mod:`rlcourse.tools.train_checkpoints` for recipes).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


def available_checkpoints() -> list[str]:
    """Names of the checkpoints present in the package."""
    if not CHECKPOINT_DIR.is_dir():
        return []
    return sorted(p.name for p in CHECKPOINT_DIR.iterdir() if (p / "config.json").is_file())


def checkpoint_path(name: str) -> Path:
    path = CHECKPOINT_DIR / name
    if not (path / "config.json").is_file():
        raise ValueError(f"no checkpoint named {name!r}; available: {available_checkpoints()} "
                         f"(make one with `python -m rlcourse.tools.train_checkpoints {name}`)")
    return path


def checkpoint_info(name: str) -> dict:
    """The ``recipe.json`` of a checkpoint: task, size, training settings and measured results."""
    path = checkpoint_path(name) / "recipe.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_checkpoint(name: str, device=None):
    """``(model, tokenizer)`` of a shipped checkpoint, the model in eval mode on ``device``.

    ``device`` defaults to :func:`rlcourse.runtime.device` (CUDA, then MPS, then CPU).
    """
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    from rlcourse.runtime import device as best_device

    path = checkpoint_path(name)
    with _quiet_transformers():
        # local_files_only: a shipped checkpoint never needs the network, whatever HF_HUB_OFFLINE says
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        model = GPT2LMHeadModel.from_pretrained(path, local_files_only=True).to(device or best_device())
    model.eval()
    return model, tokenizer


def save_checkpoint(model, tokenizer, path, recipe: dict | None = None) -> Path:
    """Write ``model`` (safetensors), ``tokenizer`` and ``recipe.json`` into the folder ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    if recipe is not None:
        (path / "recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    return path


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars ("Loading weights ...") for a block.

    They go to stderr, which the course's notebook tests treat as a defect, and a 0.4 MB file
    loads in milliseconds anyway.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
