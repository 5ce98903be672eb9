"""Peak memory of a plan: the most bytes one device holds at once, were its equations run in
program order, each value freed after its last reader.

An estimate, not XLA's buffer assignment (which reorders, fuses and reuses buffers): it serves
to compare two plans of one program, where a choice that holds whole what the other keeps split
shows up as a higher peak. Counted: every value in its planned layout (a pending sum at its
full local size), from the equation that makes it (inputs and constants: from the start) to its
last reader (program outputs: to the end), and each copy a move makes for a reader while that
reader runs.
"""
from __future__ import annotations

from .dtypes import local_nbytes


def peak_bytes(plan) -> int:
    program, layouts = plan.program, plan.layouts
    sizes = plan.mesh.axis_sizes
    n = len(program.eqns)
    change = [0] * (n + 2)  # bytes that become live before equation k (k = n: the outputs)

    def held(v, start: int, stop: int) -> None:
        L = layouts.get(v)
        if L is None:
            return
        b = local_nbytes(v.shape, v.dtype, L, sizes)
        change[start] += b
        change[stop + 1] -= b

    last = {v: r[-1][0] for v, r in program.readers().items()}
    for v in program.outputs:
        last[v] = n
    for v in (*program.inputs, *program.consts):
        held(v, 0, last.get(v, 0))
    for k, (e, ep) in enumerate(zip(program.eqns, plan.eqns)):
        for v in e.outputs:
            held(v, k, last.get(v, k))
        for i, rp in ep.reshards:
            v = e.inputs[i]
            b = local_nbytes(v.shape, v.dtype, rp.dst, sizes)
            change[k] += b
            change[k + 1] -= b
    for i, rp in plan.output_reshards:
        v = program.outputs[i]
        change[n] += local_nbytes(v.shape, v.dtype, rp.dst, sizes)
    peak = live = 0
    for d in change:
        live += d
        peak = max(peak, live)
    return peak


__all__ = ["peak_bytes"]
