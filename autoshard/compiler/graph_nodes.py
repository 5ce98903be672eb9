"""flax nnx modules and optimizers as dist.jit arguments, taken as nnx.jit takes them.

jax.jit flattens an nnx Module like any pytree and traces the function on copies: what the
function does to the module — an optimizer step, BatchNorm statistics, an Rngs counter — is
lost, and a train step run by jax.jit computes the same loss forever. nnx.jit splits the graph
nodes among the arguments into a GraphDef and a State, merges them inside, and writes the State
the function leaves back into the caller's objects. dist.jit does the same, so `@dist.jit` can
replace `@nnx.jit` on `train_step(model, optimizer, x, y)`: the State's DistTensors enter the
program placed as they are, and each variable that comes back with its shape keeps its
placements (as nnx.jit keeps shardings), so the next step finds the same layouts.
`dist.jit(model)` of a Module (or of a method bound to one, `dist.jit(model.generate)`) makes
the module the hidden first argument of each call.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import numpy as np

from ..dtensor import DistTensor
from ..errors import PlacementTypeError


def _nnx():
    from flax import nnx  # imported by whoever made the module we were handed

    return nnx


# what most arguments are made of, answered without asking flax (every dist.jit call, eager
# operators included, checks its arguments)
_PLAIN = (dict, list, tuple, type(None), int, float, bool, str)


def is_graph_node(x: Any) -> bool:
    if type(x) in _PLAIN or isinstance(x, (DistTensor, jax.Array, np.ndarray, np.generic)):
        return False
    nnx = sys.modules.get("flax.nnx")  # not imported: nothing can be an nnx object
    return nnx is not None and (type(x) in nnx.graph.GRAPH_REGISTRY
                                or isinstance(x, nnx.Variable))


def bound_module(fn: Any) -> tuple[Any, Any]:
    """(module, how to call it) when `fn` is an nnx module or a method bound to one — dist.jit
    then passes the module as the hidden first argument — else (None, None)."""
    if is_graph_node(fn):
        return fn, lambda module, *args, **kwargs: module(*args, **kwargs)
    owner = getattr(fn, "__self__", None)
    if owner is not None and is_graph_node(owner) and hasattr(fn, "__func__"):
        return owner, fn.__func__
    return None, None


def _leaf(x: Any) -> bool:
    return isinstance(x, DistTensor) or is_graph_node(x)


class _Key(NamedTuple):
    """The static part of a lifted call: where the graph nodes sat among the arguments, what
    they are (GraphDef), and the placements each state leaf keeps."""
    graphdef: Any
    treedef: Any
    positions: tuple[int, ...]
    statics: tuple
    keep: tuple   # per state leaf: (mesh, placements, shape) of a DistTensor, or None


class _ByEquality:
    """A GraphDef as a cache key when flax cannot hash it: it hashes the static attributes it
    records, and a module holding an unhashable one (a config dict) is as valid as under
    nnx.jit. Keys of one type share a hash; equal GraphDefs are still found by equality."""
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return hash(type(self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByEquality) and self.value == other.value


class Lifted(NamedTuple):
    fn: Any            # the DistributedFunction of the pure function below
    args: tuple        # its arguments: (key, state, other leaves)
    nodes: list        # the caller's graph nodes, to write the new state into


def lift(dfn, args: tuple, kwargs: dict) -> Lifted | None:
    """The call `dfn(*args, **kwargs)` as a pure function of the graph nodes' State, or None
    when no argument is (or holds) an nnx graph node."""
    static_pos = set(dfn._static)
    statics = tuple(a for i, a in enumerate(args) if i in static_pos)
    dynamic = tuple(a for i, a in enumerate(args) if i not in static_pos)
    leaves, treedef = jax.tree.flatten((dynamic, kwargs), is_leaf=_leaf)
    positions = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
    if not positions:
        return None
    nodes = [leaves[i] for i in positions]
    graphdef, state = _nnx().split(nodes)
    at = set(positions)
    others = [x for i, x in enumerate(leaves) if i not in at]
    keep = tuple((x.mesh, tuple(x.placements), x.shape) if isinstance(x, DistTensor) else None
                 for x in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, DistTensor)))
    # Variables that entered as plain arrays (BatchNorm statistics, Rngs keys) come back as
    # DistTensors: the placements first seen stay the key, so that the program built for the
    # first step is found again for the steps after it (jit.py: _placed_as_planned)
    seen = dfn.__dict__.setdefault("_graph_keep", {})
    try:
        first = seen.get((graphdef, treedef, positions, statics))
    except TypeError:  # checked only where hashing fails: a GraphDef hash walks every node
        graphdef = _ByEquality(graphdef)
        first = seen.get((graphdef, treedef, positions, statics))
    if first is not None and len(first) == len(keep) and all(
            a is None or a == b for a, b in zip(first, keep)):
        keep = first
    else:
        seen[(graphdef, treedef, positions, statics)] = keep
    key = _Key(graphdef, treedef, positions, statics, keep)
    # donate_argnums naming a module donates its State (the other arguments are not donated)
    donated = any(_holds_node(args[i]) for i in dfn._donate if i < len(args))
    return Lifted(_inner(dfn, donated), (key, state, others), nodes)


def _holds_node(x: Any, variables: bool = True) -> bool:
    """Whether `x` holds a graph node; with variables=False, one that is not a Variable (a
    Variable, or nnx.grad's State of them, flattens to its value as any pytree does)."""
    nodes = (leaf for leaf in jax.tree.leaves(x, is_leaf=_leaf) if is_graph_node(leaf))
    return any(variables or not isinstance(n, _nnx().Variable) for n in nodes)


def write_back(lifted: Lifted, result: tuple) -> Any:
    out, new_state = result
    # The program's own reshard (`_keep_placements`) restores each leaf's placements, except
    # where a dim does not divide: an uneven dim is computed whole and handed back so; the
    # same reshard after the call splits it again (a local slice; a no-op for the others)
    _nnx().update(lifted.nodes, _as_jax_keys(_keep_placements(new_state, lifted.args[0].keep)))
    return out


def _as_jax_keys(state: Any) -> Any:
    """Typed PRNG keys as jax.Arrays (what nnx.Rngs holds): jax takes keys only so, and a
    DistTensor of them could not draw outside dist.jit (an eager dropout call, the next
    layer built from the same Rngs). Keys are a few words: gathered whole, as to_static's
    write-back does."""
    from ..creation import unshard_dtensor

    def plain(x: Any) -> Any:
        if isinstance(x, DistTensor) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return unshard_dtensor(x)
        return x

    return jax.tree.map(plain, state, is_leaf=lambda v: isinstance(v, DistTensor))


def _inner(dfn, donated: bool):
    cache = dfn.__dict__.setdefault("_graph_inner", {})
    if donated not in cache:
        from .jit import DistributedFunction

        spec = dfn._out_placements
        fn = DistributedFunction(_pure(dfn), static_argnums=(0,),
                                 donate_argnums=(1,) if donated else (),
                                 out_placements=None if spec is None else (spec, None),
                                 cost_model=dfn._cost_model)
        fn.__name__ = dfn.__name__
        fn._lifts = False  # its State holds nnx Variables: graph nodes, already lifted
        cache[donated] = fn
    return cache[donated]


def _pure(dfn):
    def pure(key: _Key, state: Any, others: list):
        nnx = _nnx()
        graphdef = key.graphdef
        nodes = nnx.merge(graphdef.value if isinstance(graphdef, _ByEquality) else graphdef,
                          state)
        leaves, it = list(others), iter(nodes)
        for i in key.positions:
            leaves.insert(i, next(it))
        dynamic, kwargs = jax.tree.unflatten(key.treedef, leaves)
        out = dfn._fn(*dfn._rebuild_args(key.statics, dynamic), **kwargs)
        if _holds_node(out, variables=False):
            raise PlacementTypeError(
                f"{dfn.__name__} returns an nnx module (or another graph node but a Variable): "
                f"dist.jit writes what the function did to its module arguments back into "
                f"them, as nnx.jit does — return arrays (a loss, metrics) and read the updated "
                f"module from the object you passed in, or return nnx.state(module)")
        _, new_state = nnx.split(nodes)
        return out, _keep_placements(new_state, key.keep)

    return pure


def _keep_placements(state: Any, keep: tuple) -> Any:
    """Each state leaf that entered as a DistTensor leaves with its placements (the plan
    computes it as it likes; a reshard at the end converts), when its shape is unchanged."""
    from ..reshard.api import reshard

    leaves, tree = jax.tree.flatten(state, is_leaf=lambda v: isinstance(v, DistTensor))
    if len(leaves) != len(keep):  # the function added or dropped variables: the plan decides
        return state
    return jax.tree.unflatten(tree, [
        reshard(x, k[0], list(k[1])) if k is not None and tuple(x.shape) == k[2]
        and not (isinstance(x, DistTensor) and (x.mesh, tuple(x.placements)) == k[:2]) else x
        for x, k in zip(leaves, keep)])


__all__ = ["is_graph_node", "lift", "write_back", "Lifted"]
