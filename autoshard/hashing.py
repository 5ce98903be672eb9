"""Hash-once for the immutable objects that key every memoised planning decision."""
from __future__ import annotations

from typing import Any, Callable


def hash_once(obj: Any, fields: Callable[[], tuple]) -> int:
    """`hash(fields())`, computed on the first call and kept on `obj` (frozen dataclasses too).

    Layouts, meshes and cost models are hashed on every cached `choose` / reshard lookup;
    hashing their nested tuples afresh each time was a visible share of planning.
    """
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(fields())
        object.__setattr__(obj, "_hash", h)
    return h
