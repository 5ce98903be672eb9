"""`out_placements` of dist.jit, resolved to one entry per flat output.

Written as jax.jit's `out_shardings` are: one placements list for every output, one entry per
flat output, or a pytree prefix of the function's result — `[{"w": [R, S(1)], "b": None},
None]` for a function that returns `(params, loss)`. A placements list (`[Replicate(),
Shard(0)]`) or None stands for every output beneath it. Lists and tuples match each other
(a Python `return a, b` is a tuple; users write lists).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax._src.tree_util import broadcast_prefix  # not in jax.tree_util's public names

from ..errors import PlacementError, PlacementTypeError
from ..placement import Placement, parse_placement
from .plan import KEEP


def is_placements(x: Any) -> bool:
    """A placements list (a leaf of an out_placements tree)."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(p, (Placement, str)) for p in x)


def _is_keep(x: Any) -> bool:
    return isinstance(x, str) and x == KEEP


def _covers(x: Any) -> bool:
    """Stands for every output beneath it."""
    return x is None or _is_keep(x) or is_placements(x)


def _check_entries(spec: Sequence, where: str) -> None:
    """Why a list standing for one output is not a placements list, said for its entry."""
    for k, p in enumerate(spec):
        if isinstance(p, type) and issubclass(p, Placement):
            raise PlacementTypeError(
                f"{where}[{k}] is the class dist.{p.__name__}, not a placement: write "
                f"dist.{p.__name__}({'0' if p.__name__ == 'Shard' else ''})")
        if p is None or isinstance(p, str):
            if isinstance(p, str):
                try:
                    parse_placement(p)
                    continue
                except PlacementError:
                    pass
            raise PlacementTypeError(
                f"{where}[{k}] is {p!r}, not a placement: out_placements name one placement "
                f"per mesh dim, as shard_tensor does (dist.Shard(0), dist.Replicate(), 'S(0)', "
                f"'R'); a spec of mesh dim names per tensor dim, as jax's P('dp', None), is "
                f"written out_shardings=NamedSharding(mesh.to_jax(), P('dp', None))")


def _flat(spec: Any, n: int) -> bool:
    """One entry per output of `n`: a list of placements lists (or None / KEEP)."""
    return isinstance(spec, (list, tuple)) and len(spec) == n and all(_covers(s) for s in spec)


def per_output(spec: Any, out_tree: Any, n: int) -> list:
    """One entry (None, KEEP or a placements list) per flat output of a result shaped
    `out_tree` (a PyTreeDef, None if unknown) with `n` leaves."""
    if isinstance(spec, str) and not _is_keep(spec):
        near = " (did you mean 'keep'?)" if spec.lower().startswith("k") else ""
        raise PlacementTypeError(
            f"out_placements is the string {spec!r}{near}: give 'keep' to leave Partial "
            f"outputs unreduced, or placements lists (e.g. [dist.Shard(0), dist.Replicate()])")
    if _covers(spec):
        return [spec] * n
    flat = _flat(spec, n)
    if flat or out_tree is None:
        if not flat:
            raise PlacementTypeError(
                f"out_placements has {len(spec) if isinstance(spec, (list, tuple)) else 1} "
                f"entries for {n} outputs: give one placements list per output (None to let the "
                f"plan choose), one list for all, or a pytree prefix of the result")
        return list(spec)
    result = jax.tree.unflatten(out_tree, list(range(n)))
    found: list = [None] * n
    _match(spec, result, found, "out_placements")
    return found


def _match(spec: Any, node: Any, found: list, where: str) -> None:
    if _covers(spec):
        for i in jax.tree.leaves(node):
            found[i] = spec
        return
    leaves = jax.tree.leaves(node)
    if leaves and _flat(spec, len(leaves)) and not (
            isinstance(node, (list, tuple)) and len(node) == len(spec)):
        # one entry per leaf of this part of the result, flat (as at the top): an optimizer's
        # init placed leaf by leaf, inside the (result, module state) pair an nnx-lifted call
        # returns (a tuple of as many elements reads element by element, as before)
        for i, s in zip(leaves, spec):
            found[i] = s
        return
    if isinstance(node, dict) and isinstance(spec, dict):
        if set(spec) != set(node):
            raise PlacementTypeError(
                f"{where} has keys {sorted(map(str, spec))} where the result has "
                f"{sorted(map(str, node))}: name the same keys, or give one placements list "
                f"(or None) for the whole dict")
        for k in node:
            _match(spec[k], node[k], found, f"{where}[{k!r}]")
        return
    if isinstance(node, (list, tuple)) and isinstance(spec, (list, tuple)):
        if len(spec) != len(node):
            raise PlacementTypeError(
                f"{where} has {len(spec)} entries where the result has {len(node)}: give one "
                f"per element, or one placements list (or None) for all of them")
        for k, (s, x) in enumerate(zip(spec, node)):
            _match(s, x, found, f"{where}[{k}]")
        return
    if isinstance(node, int):  # one output (its flat index): jax's message would say "int"
        if isinstance(spec, (list, tuple)):
            _check_entries(spec, where)
        shape = (f"a {type(spec).__name__} of {len(spec)} entries"
                 if isinstance(spec, (list, tuple, dict)) else repr(spec))
        raise PlacementTypeError(
            f"{where} is {shape} where the result is one array: give one placements list for "
            f"it (e.g. [dist.Shard(0), dist.Replicate()]), or None to let the plan choose")
    try:  # other pytree nodes (dataclasses, flax State): jax's own prefix matching
        leaves = broadcast_prefix(spec, node, is_leaf=_covers)
    except (ValueError, TypeError) as exc:
        raise PlacementTypeError(
            f"{where} does not match the result's structure ({type(node).__name__}): give a "
            f"pytree prefix of the result whose leaves are placements lists or None "
            f"({exc})") from None
    for i, s in zip(jax.tree.leaves(node), leaves):
        found[i] = s


__all__ = ["is_placements", "per_output"]
