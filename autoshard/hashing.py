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


class Hashed:
    """A tuple key hashed once: the replay key of an equation (its avals and layouts) or a
    block's identity (all of its equations' keys) is looked up many times per program."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple) -> None:
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Hashed and self._hash == other._hash
                                 and self.value == other.value)

    def __repr__(self) -> str:
        return f"Hashed{self.value!r}"
