"""dpo losses (filled in by its lesson)."""
from __future__ import annotations

__all__: list[str] = []
