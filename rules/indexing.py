"""Indexing primitives: gather, scatter(-add), dynamic_slice, dynamic_update_slice.

(Rules land with issue 4; until then these primitives run replicated through the fallback.)
"""
from __future__ import annotations

TABLE: dict = {}


def validation_samples() -> list:
    """(name, primitive name, fn, ((shape, kind), ...)) tuples for autoshard.validate."""
    return []
