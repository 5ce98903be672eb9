"""Cyclic garbage collection paused while a compiler pass runs.

A pass allocates many small objects (layouts, equation plans, jax tracers) while the process
holds a large long-lived heap (jax's caches, the traced program, the user's model). Every
full collection that the allocations trigger walks that whole heap and frees almost nothing:
on the 12-layer GPT step, planning took 0.35–0.71 s with collection on and 0.19–0.21 s with it
paused, tracing the local program 0.55 s and 0.27 s. The pass creates no garbage that must go
before it returns; collection resumes when the outermost pass returns (nested passes and a
caller that paused it already leave the setting alone).
"""
from __future__ import annotations

import functools
import gc
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def gc_paused(fn: F) -> F:
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return paused  # type: ignore[return-value]


__all__ = ["gc_paused"]
