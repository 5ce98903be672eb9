"""Zero pads and crops folded into the convolutions (and sum pools) they feed or come from.

flax's CAUSAL convolution (and code that pads by hand) writes `jnp.pad` then a VALID
convolution, and its gradient crops the input gradient's convolution (a pad with negative
widths, or a slice). Each of them changes the spatial dim's length — 16 rows padded to 19 no
longer divide over 8 devices — so the dim would be gathered whole, where the same convolution
with the pad as its own padding keeps the length and lets its rule fetch a halo
(rules/conv.py). Exact: a convolution pads with zeros, and negative padding crops; a crop of a
stride-1 convolution's output is the same convolution with less padding. An average pool's
gradient pads with interior zeros before a sum pool: the sum pool's base dilation and padding.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from jax import lax


def constant(v: Any, made_by: dict) -> Any:
    """The value of a constant, or of a constant converted (jnp.pad's `0` reaches lax.pad
    converted); None for anything computed."""
    if v.is_const:
        return None if v.const is None else np.asarray(v.const)
    e = made_by.get(v)
    if e is not None and e.primitive is lax.convert_element_type_p:
        c = constant(e.inputs[0], made_by)
        return None if c is None else c.astype(v.dtype)
    return None


def is_zero(v: Any, made_by: dict) -> bool:
    c = constant(v, made_by)
    return c is not None and not np.any(c)


def _spatial_widths(config, spatial: list[int]) -> list[tuple[int, int]] | None:
    """(lo, hi) per spatial dim of a pad's config; None if it pads another dim or interiorly."""
    if any(interior for _, _, interior in config):
        return None
    if any((lo, hi) != (0, 0) for d, (lo, hi, _) in enumerate(config) if d not in spatial):
        return None
    return [tuple(config[d][:2]) for d in spatial]


def _crop_widths(e, size: tuple[int, ...], spatial: list[int],
                 made_by: dict) -> list[tuple[int, int]] | None:
    """(lo, hi) (≤ 0) per spatial dim of a crop: a pad with no positive widths or a slice
    with unit strides; None for anything else."""
    if e.primitive is lax.pad_p and is_zero(e.inputs[1], made_by):
        widths = _spatial_widths(e.params["padding_config"], spatial)
        if widths is None or any(w > 0 for pair in widths for w in pair):
            return None
        return widths
    strides = e.params.get("strides") or ()
    if e.primitive is lax.slice_p and all(s in (None, 1) for s in strides):
        start, limit = e.params["start_indices"], e.params["limit_indices"]
        if any((start[d], limit[d]) != (0, size[d]) for d in range(len(size)) if d not in spatial):
            return None
        return [(-start[d], limit[d] - size[d]) for d in spatial]
    return None


def _with_padding(e, extra: list[tuple[int, int]], params_key, **more) -> None:
    padding = tuple((lo + a, hi + b) for (lo, hi), (a, b) in zip(e.params["padding"], extra))
    e.params = {**e.params, "padding": padding, **more}
    e.params_key = params_key(e.params)
    e.sharding_cache = {}


def fold_conv_padding(eqns: list, outputs: list, regions: list) -> list:
    """`eqns` with zero pads of a convolution's (or sum pool's) input and crops of a
    convolution's output made part of its padding; the pads and crops left unread are dropped
    (regions' bounds follow)."""
    from .trace import params_key

    conv = lax.conv_general_dilated_p
    if not any(e.primitive is lax.pad_p or e.primitive is conv for e in eqns):
        return eqns  # most programs: one pass over the equations, nothing to fold
    uses = Counter(v for e in eqns for v in e.inputs)
    uses.update(outputs)
    # a custom region's boundary values are its interface: never renamed or dropped
    pinned = {v for r in regions for v in (*r.inputs, *r.outputs)}
    made_by = {e.outputs[0]: e for e in eqns
               if e.primitive in (lax.pad_p, conv, lax.convert_element_type_p)}
    dead: set = set()
    for e in eqns:
        if e.primitive is conv:
            lhs_spec, _, _ = e.params["dimension_numbers"]
            spatial = list(lhs_spec[2:])
            pad = made_by.get(e.inputs[0])
            if (pad is not None and pad.primitive is lax.pad_p and is_zero(pad.inputs[1], made_by)
                    and e.inputs[0] not in pinned
                    and all(d == 1 for d in e.params["lhs_dilation"])):
                widths = _spatial_widths(pad.params["padding_config"], spatial)
                if widths is not None:
                    _with_padding(e, widths, params_key)
                    uses[e.inputs[0]] -= 1
                    e.inputs = [pad.inputs[0], *e.inputs[1:]]
                    uses[pad.inputs[0]] += 1
            continue
        if e.primitive is lax.reduce_window_sum_p:
            pad = made_by.get(e.inputs[0])
            if (pad is not None and pad.primitive is lax.pad_p and is_zero(pad.inputs[1], made_by)
                    and e.inputs[0] not in pinned and all(d == 1 for d in e.params["base_dilation"])
                    and all(lo >= 0 and hi >= 0 for lo, hi, _ in pad.params["padding_config"])):
                # the transposed sum pool (an avg pool's gradient): pad with interior zeros,
                # then sum windows — the same as summing over a base-dilated, padded input
                config = pad.params["padding_config"]
                _with_padding(e, [(lo, hi) for lo, hi, _ in config], params_key,
                              base_dilation=tuple(interior + 1 for _, _, interior in config))
                uses[e.inputs[0]] -= 1
                e.inputs = [pad.inputs[0]]
                uses[pad.inputs[0]] += 1
            continue
        if e.primitive not in (lax.pad_p, lax.slice_p):
            continue
        source = made_by.get(e.inputs[0])
        if (source is None or source.primitive is not conv or uses[e.inputs[0]] != 1
                or e.inputs[0] in pinned or id(source) in dead):
            continue
        _, _, out_spec = source.params["dimension_numbers"]
        spatial = list(out_spec[2:])
        widths = _crop_widths(e, e.inputs[0].shape, spatial, made_by)
        if widths is None or any(s != 1 for s, w in zip(source.params["window_strides"], widths)
                                 if w != (0, 0)):
            continue
        _with_padding(source, widths, params_key)
        source.outputs = list(e.outputs)
        made_by[e.outputs[0]] = source
        dead.add(id(e))
    for e in eqns:  # pads read only by the convolutions they were folded into
        if e.primitive is lax.pad_p and uses[e.outputs[0]] == 0 and e.outputs[0] not in pinned:
            dead.add(id(e))
    return without(eqns, dead, regions)


def without(eqns: list, dead: set, regions: list) -> list:
    """`eqns` less those whose ids are in `dead`; regions' bounds follow."""
    if not dead:
        return eqns
    return spliced(eqns, {i: () for i in dead}, regions)


def spliced(eqns: list, replaced: dict, regions: list) -> list:
    """`eqns` with each equation whose id `replaced` names swapped for the equations it maps
    to (none: dropped); regions' bounds follow."""
    new, new_index = [], []
    for e in eqns:
        new_index.append(len(new))
        new.extend(replaced.get(id(e), (e,)))
    new_index.append(len(new))
    for r in regions:
        r.start, r.stop = new_index[r.start], new_index[r.stop]
    return new


__all__ = ["fold_conv_padding", "without", "spliced", "constant", "is_zero"]
