"""Paddle's keyword names for autoshard's functions: code ported from Paddle passes
`dist.reshard(dist_tensor=t, ...)` or `dist.to_static(layer=model, loss=fn)`."""
from __future__ import annotations

import functools
from typing import Any, Callable


def paddle_names(**aliases: str) -> Callable:
    """Accept each keyword `paddle_name=` as `our_name=` ({paddle_name: our_name})."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for paddle, ours in aliases.items():
                if paddle in kwargs:
                    if ours in kwargs:
                        raise TypeError(f"{fn.__qualname__}() got both {ours!r} and {paddle!r} "
                                        f"(Paddle's name for it): give one")
                    kwargs[ours] = kwargs.pop(paddle)
            return fn(*args, **kwargs)
        return call
    return wrap


__all__ = ["paddle_names"]
