"""Who holds what: a DistTensor's blocks per device, as text (terminal) or HTML (notebook)."""
from __future__ import annotations

import html
import itertools

import numpy as np

from .compiler.dtypes import dtype_name
from .layout import block_bounds

_COLOURS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
            "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]


def _block_text(bounds) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in bounds) + "]"


def placement_rows(x) -> list[tuple[int, tuple[int, ...], str, bool]]:
    """(device id, mesh coords, global block as slices, holds a partial value) per device."""
    mesh = x.mesh
    rows = []
    for coords in itertools.product(*(range(s) for s in mesh.shape)):
        bounds = block_bounds(x.layout, mesh, x.shape, coords)
        rows.append((int(mesh.id_array[coords]), coords, _block_text(bounds), bool(x.layout.partial)))
    return rows


def placement_table(x) -> str:
    """A plain-text table of which device holds which block of `x`."""
    from .dtensor import DistTensor

    if not isinstance(x, DistTensor):
        from .errors import PlacementTypeError

        raise PlacementTypeError(f"placement_table needs a DistTensor, got {type(x).__name__}: "
                                 f"place it first with dist.shard_tensor(x, mesh, placements)")
    partial = "".join(f", partial {t.value} over {a!r}" for a, t in x.layout.partial)
    lines = [f"{dtype_name(x.dtype)}{list(x.shape)} on mesh {x.mesh.shape} "
             f"{x.mesh.dim_names} as {x.placements}{partial}; each device holds {list(x.local_shape)}"]
    for device, coords, block, _ in placement_rows(x):
        where = ", ".join(f"{n}={c}" for n, c in zip(x.mesh.dim_names, coords))
        lines.append(f"  device {device:>3} ({where}): block {block}")
    return "\n".join(lines)


def dtensor_html(x) -> str:
    """Mesh grid(s) with one cell per device, coloured by the block it holds."""
    mesh = x.mesh
    rows = {coords: (device, block) for device, coords, block, _ in placement_rows(x)}
    colour = {}
    for _, block in rows.values():
        colour.setdefault(block, _COLOURS[len(colour) % len(_COLOURS)])
    ids = mesh.id_array.reshape((1,) * max(0, 2 - mesh.ndim) + tuple(mesh.shape))
    lead = ids.shape[:-2]
    partial = " ".join(f"P({t.value}) over {a}" for a, t in x.layout.partial)
    parts = [f"<div><b>{html.escape(repr(x.placements))}</b> shape {list(x.shape)}, "
             f"local {list(x.local_shape)} {html.escape(partial)}"]
    for prefix in itertools.product(*(range(s) for s in lead)):
        grid = ids[prefix]
        parts.append("<table style='border-collapse:collapse;margin:4px'>")
        for r in range(grid.shape[0]):
            parts.append("<tr>")
            for c in range(grid.shape[1]):
                full = (prefix + (r, c))[-mesh.ndim:] if mesh.ndim >= 2 else (c,)
                device, block = rows[tuple(full)]
                parts.append(f"<td style='border:1px solid #555;padding:4px 8px;"
                             f"background:{colour[block]}'>dev {device}<br>{block}</td>")
            parts.append("</tr>")
        parts.append("</table>")
    parts.append("</div>")
    return "".join(parts)


__all__ = ["placement_rows", "placement_table", "dtensor_html"]
