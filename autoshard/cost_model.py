"""One alpha–beta cost model, shared by the reshard planner and (later) the compiler.

A collective over mesh axes costs `latency + wire_bytes / bandwidth`, with the slowest of the
axes involved; local work (slices, masks, padding) costs `bytes / local_bandwidth`, so that of
two plans with equal traffic the one with less local copying wins; a cross-mesh transfer costs
`latency + bytes / transfer_bandwidth`. Defaults are of the order of one accelerator node
(NVLink-class links, HBM-class memory); override per mesh axis for slower (inter-node) axes:

    dist.CostModel(bandwidth={"dp": 12.5e9}, latency={"dp": 2e-5})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from .hashing import hash_once

DEFAULT_LATENCY_S = 5e-6          # alpha: fixed cost of launching one collective
DEFAULT_BANDWIDTH = 50e9          # beta = 1 / this: bytes per second each device sends
DEFAULT_LOCAL_BANDWIDTH = 500e9   # bytes per second of local memory traffic
DEFAULT_TRANSFER_BANDWIDTH = 25e9  # bytes per second of a device-to-device copy across meshes


def _number(value, what: str, *, zero_ok: bool) -> float:
    """`value` as a float, if it is a real number > 0 (>= 0 with zero_ok; inf is a free link)."""
    from .errors import CostModelError

    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or np.isnan(value) or value < 0 or (value == 0 and not zero_ok) \
            or (zero_ok and np.isinf(value)):
        kind = "seconds, >= 0" if zero_ok else "bytes per second, > 0"
        raise CostModelError(f"dist.CostModel: {what} = {value!r} is not a number of {kind}: "
                             f"write e.g. CostModel(bandwidth={{'dp': 12.5e9}}, "
                             f"latency={{'dp': 2e-5}})")
    return float(value)


def _frozen(mapping: Mapping[str, float] | Iterable[tuple[str, float]] | None,
            name: str) -> tuple:
    from .errors import CostModelError

    if mapping is None:
        return ()
    if isinstance(mapping, (str, bytes)) or not isinstance(mapping, (Mapping, Iterable)):
        raise CostModelError(f"dist.CostModel: {name}={mapping!r} is not a dict of mesh dim "
                             f"name -> value: write e.g. {name}={{'dp': "
                             f"{'2e-5' if name == 'latency' else '12.5e9'}}}")
    items = mapping.items() if isinstance(mapping, Mapping) else mapping
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise CostModelError(f"dist.CostModel: {name}={mapping!r} is not a dict of mesh dim "
                             f"name -> value (or a list of (name, value) pairs)") from None
    return tuple(sorted((str(k), _number(v, f"{name}[{k!r}]", zero_ok=name == "latency"))
                        for k, v in pairs))


def check_cost_model(model, where: str):
    """`model` if it is None or a CostModel, else a CostModelError naming `where`."""
    if model is not None and not isinstance(model, CostModel):
        from .errors import CostModelError

        raise CostModelError(f"{where}: cost_model={model!r:.60} of type {type(model).__name__} is "
                             f"not a dist.CostModel: write cost_model=dist.CostModel("
                             f"bandwidth={{'dp': 12.5e9}}) or leave it out for the default")
    return model


@dataclass(frozen=True)
class CostModel:
    """Alpha–beta costs per mesh axis (seconds); hashable so plans can be cached on it."""

    default_latency: float = DEFAULT_LATENCY_S
    default_bandwidth: float = DEFAULT_BANDWIDTH
    local_bandwidth: float = DEFAULT_LOCAL_BANDWIDTH
    transfer_bandwidth: float = DEFAULT_TRANSFER_BANDWIDTH
    latency: tuple = field(default=())
    bandwidth: tuple = field(default=())

    def __post_init__(self) -> None:
        for name in ("default_latency", "default_bandwidth", "local_bandwidth",
                     "transfer_bandwidth"):
            object.__setattr__(self, name, _number(getattr(self, name), name,
                                                   zero_ok=name == "default_latency"))
        object.__setattr__(self, "latency", _frozen(self.latency, "latency"))
        object.__setattr__(self, "bandwidth", _frozen(self.bandwidth, "bandwidth"))

    def __hash__(self) -> int:
        return hash_once(self, lambda: (self.default_latency, self.default_bandwidth,
                                        self.local_bandwidth, self.transfer_bandwidth,
                                        self.latency, self.bandwidth))

    def axis_latency(self, axis: str) -> float:
        return dict(self.latency).get(axis, self.default_latency)

    def axis_bandwidth(self, axis: str) -> float:
        return dict(self.bandwidth).get(axis, self.default_bandwidth)

    def collective(self, axes: Iterable[str], wire_bytes: float) -> float:
        """Seconds for one collective over `axes` in which each device sends `wire_bytes`."""
        axes = tuple(axes)
        # (alpha, beta) kept per group of axes: the reshard search prices thousands of steps
        # over the same few groups (a model is immutable: its fields are its hash)
        kept = self.__dict__.get("_groups")
        if kept is None:
            kept = {}
            object.__setattr__(self, "_groups", kept)
        found = kept.get(axes)
        if found is None:
            found = kept[axes] = (max(self.axis_latency(a) for a in axes),
                                  min(self.axis_bandwidth(a) for a in axes))
        return found[0] + wire_bytes / found[1]

    def local(self, touched_bytes: float) -> float:
        return touched_bytes / self.local_bandwidth

    def transfer(self, wire_bytes: float) -> float:
        return (self.default_latency if wire_bytes else 0.0) + wire_bytes / self.transfer_bandwidth


_default = CostModel()


def default_cost_model() -> CostModel:
    return _default


def set_default_cost_model(model: CostModel) -> None:
    """Replace the process-wide cost model: dist.jit functions planned with the old one plan
    again on their next call (those given their own cost_model= keep it)."""
    global _default
    if model is None:
        from .errors import CostModelError

        raise CostModelError("set_default_cost_model(None): give a dist.CostModel (the "
                             "built-in default is dist.CostModel())")
    _default = check_cost_model(model, "set_default_cost_model")


__all__ = ["CostModel", "default_cost_model", "set_default_cost_model"]
