"""Paddle's `dist.LocalLayer`: an nnx layer whose `forward` is written for one device's blocks.

    class MaskedMean(dist.LocalLayer):
        def forward(self, loss, mask):          # this device's rows of each
            return jnp.sum(loss * mask), jnp.sum(mask)

    total, count = MaskedMean([(mesh, [dist.Partial(), dist.Replicate()])] * 2)(loss, mask)

Calling the layer runs `forward` through `dist.local_map`: the inputs' local blocks in, each
result read by its entry of `out_dist_attrs` ((mesh, placements) per output, as Paddle writes
them). Eagerly the inputs keep their placements; inside `dist.jit` the plan places values
after tracing, so the layer needs `in_placements` (one list per argument), as local_map does.
`grad_dist_attrs` is accepted for Paddle's signature: jax differentiates the local program,
so each input's gradient comes back in the input's own placements without being told.

The layer's own parameters are not split for it: `forward` sees what it is called with as
blocks; pass what it computes on as arguments.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

from flax import nnx

from ..local_map import LocalMapError, local_map
from ..mesh import ProcessMesh, as_process_mesh

_WRAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> its local_map


def _attrs(out_dist_attrs: Sequence) -> tuple:
    pairs = list(out_dist_attrs) if isinstance(out_dist_attrs, (list, tuple)) else None
    if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                and isinstance(p[0], ProcessMesh)
                                and isinstance(p[1], (list, tuple)) for p in pairs):
        raise LocalMapError(f"LocalLayer: out_dist_attrs is one (process_mesh, placements) "
                            f"pair per output of forward, e.g. [(mesh, [dist.Shard(0)])]; got "
                            f"{out_dist_attrs!r}")
    attrs = tuple((as_process_mesh(mesh), tuple(placements)) for mesh, placements in pairs)
    if not attrs:
        raise LocalMapError("LocalLayer: out_dist_attrs is empty: give one (process_mesh, "
                            "placements) pair per output of forward")
    if any(mesh != attrs[0][0] for mesh, _ in attrs):
        raise LocalMapError("LocalLayer: every output of forward must be on one process_mesh "
                            f"(got {sorted({repr(m) for m, _ in attrs})})")
    return attrs


class LocalLayer(nnx.Module):
    """See the module docstring. Subclasses define `forward(self, *args)`."""

    def __init__(self, out_dist_attrs: Sequence, grad_dist_attrs: Sequence | None = None,
                 in_placements: Sequence | None = None):
        self.out_dist_attrs = _attrs(out_dist_attrs)
        self.grad_dist_attrs = None if grad_dist_attrs is None else tuple(grad_dist_attrs)
        self.in_placements = (None if in_placements is None else
                              tuple(None if p is None else tuple(p) for p in in_placements))

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is a LocalLayer: define "
                                  f"forward(self, ...) on one device's blocks")

    def __call__(self, *args: Any) -> Any:
        fn = _WRAPPED.get(self)
        if fn is None:  # once per layer: eagerly, local_map keeps one program per placements
            layer = weakref.ref(self)  # (a bound method here would keep the layer alive)

            def forward(*blocks):
                return layer().forward(*blocks)

            forward.__name__ = f"{type(self).__name__}.forward"
            fn = _WRAPPED[self] = local_map(
                forward, out_placements=[list(p) for _, p in self.out_dist_attrs],
                in_placements=(None if self.in_placements is None else
                               [None if p is None else list(p) for p in self.in_placements]),
                process_mesh=self.out_dist_attrs[0][0])
        return fn(*args)


__all__ = ["LocalLayer"]
