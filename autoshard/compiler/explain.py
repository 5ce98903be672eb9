"""explain(): the plan as a table — every equation that moved data, every collective, totals."""
from __future__ import annotations

import html
from typing import Any

from ..reshard.planner import format_bytes


def _rows(plan):
    mesh = plan.mesh
    rows = []
    made: dict = {}  # (value, layout) -> the equation whose row lists the move that made it
    for ep in plan.eqns:
        moved = bool(ep.reshards) or ep.fallback or any(L.partial for L in ep.results)
        if not moved:
            continue
        ins = ", ".join(L.describe(mesh) for L in ep.operands)
        outs = ", ".join(L.describe(mesh) for L in ep.results)
        steps = []
        for i, rp in ep.reshards:
            # a value moved the same way twice is moved once (its copy read again): the
            # second reader's row says so, or the table would count its collectives twice
            key = (plan.program.eqns[ep.index].inputs[i], rp.dst)
            if key in made and rp.steps:
                steps.append(f"(same copy as #{made[key]})")
                continue
            made.setdefault(key, ep.index)
            steps.extend(str(s.step) for s in rp.steps)
        comm = "; ".join(steps) or "-"
        rows.append((str(ep.index), ep.primitive, ep.source or "?", f"{ins} → {outs}", ep.strategy, comm))
    return rows


def explain_text(plan) -> str:
    mesh = plan.mesh
    lines = [f"autoshard plan on mesh {mesh.shape} {mesh.dim_names} "
             f"({len(plan.program.eqns)} equations)"]
    if plan.refinement is not None:
        lines.append(f"sub-axes: {plan.refinement.describe()} — a reshape splits a dim finer "
                     f"than the axis")
    lines.append("inputs:  " + ", ".join(L.describe(mesh) for L in plan.inputs))
    lines.append("outputs: " + ", ".join(L.describe(mesh) for L in plan.outputs))
    rows = _rows(plan)
    if rows:
        lines.append("equations that move data or keep a Partial:")
        for r in rows:
            lines.append(f"  #{r[0]:<4} {r[1]:<18} {r[2]:<22} {r[3]}   [{r[4]}]  {r[5]}")
    lines.append("collectives:")
    if not plan.collectives:
        lines.append("  none")
    for c in plan.collectives:
        lines.append(f"  {c.kind:<15} {c.step:<28} {format_bytes(c.bytes_per_device):>10}/device  "
                     f"at {c.source or '(output)'}: {c.reason}")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.collective_counts().items())) or "none"
    lines.append(f"total: {counts}; {format_bytes(plan.total_bytes)} per device")
    per_call = plan.collective_counts(per_call=True)
    if per_call != plan.collective_counts():  # a loop body's collectives run once per iteration
        runs = ", ".join(f"{n} {k}" for k, n in sorted(per_call.items()))
        lines.append(f"per call: {runs}; {format_bytes(plan.bytes_per_call())} per device"
                     + ("" if plan.runs_known else " (a while loop's body counted once)"))
    if plan.fallbacks:
        lines.append("replicated for lack of a rule: " +
                     ", ".join(f"{n} at {s}" for n, s in plan.fallbacks))
    return "\n".join(lines)


def explain_html(plan) -> str:
    head = ("<tr><th>#</th><th>op</th><th>source</th><th>layouts</th><th>strategy</th>"
            "<th>collectives</th></tr>")
    body = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in r) + "</tr>"
                   for r in _rows(plan))
    coll = "".join(
        f"<tr><td>{c.kind}</td><td>{html.escape(c.step)}</td><td>{format_bytes(c.bytes_per_device)}</td>"
        f"<td>{html.escape(c.source or 'output')}</td><td>{html.escape(c.reason)}</td></tr>"
        for c in plan.collectives)
    return (f"<div><b>autoshard plan</b> on mesh {plan.mesh.shape} {plan.mesh.dim_names}: "
            f"{len(plan.collectives)} collectives, {format_bytes(plan.total_bytes)} per device"
            f"<table>{head}{body}</table><table><tr><th>collective</th><th>step</th><th>bytes/device</th>"
            f"<th>source</th><th>why</th></tr>{coll}</table></div>")


class Explanation(str):
    """What f.explain() returns: the plan's text (a str: print it, search it, slice it),
    rendered as HTML in a notebook; `.plan` is the Plan it describes."""

    plan: Any

    def __new__(cls, plan):
        self = super().__new__(cls, explain_text(plan))
        self.plan = plan
        return self

    def __repr__(self) -> str:  # the text itself, as print shows it, not a quoted string
        return str.__str__(self)

    def _repr_html_(self) -> str:
        return explain_html(self.plan)

    # immutable, as a str: a copy is itself; pickled it is its text (a Plan holds a program
    # of jax values, which do not pickle), where str's own reduction would hand the text to
    # __new__ as a plan
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return str, (str.__str__(self),)


class StagedExplanation(str):
    """f.explain() of a function cut into stages on several meshes (cut.py): each stage's
    plan, and before it the values that move onto its mesh, with their bytes and lines — as
    text (a str), `.stages` the plans and moves."""

    name: str
    stages: list

    def __new__(cls, name: str, stages: list):
        self = super().__new__(cls, _staged_text(name, stages))
        self.name = name
        self.stages = stages  # [(plan, [(what, source line, reshard plan)])]
        return self

    def __repr__(self) -> str:
        return str.__str__(self)

    def _repr_html_(self) -> str:
        return "<pre>" + html.escape(str.__str__(self)) + "</pre>"

    __copy__, __deepcopy__, __reduce__ = (Explanation.__copy__, Explanation.__deepcopy__,
                                          Explanation.__reduce__)


def _staged_text(name: str, stages: list) -> str:
    meshes = {str(plan.mesh.process_ids) for plan, _ in stages}
    lines = [f"autoshard: {name} runs as {len(stages)} stages on "
             f"{len(meshes)} meshes, one program each, in order"]
    for k, (plan, moves) in enumerate(stages):
        lines.append(f"── stage {k}, devices {plan.mesh.process_ids}")
        for what, line, rp in moves:
            lines.append(f"  arrives: {what} from devices {rp.src_mesh.process_ids} "
                         f"{rp.src.describe(rp.src_mesh)} → {rp.dst.describe(rp.dst_mesh)} at "
                         f"{line or '?'}: {format_bytes(rp.total_bytes)}/device")
        lines += ["  " + x for x in explain_text(plan).splitlines()]
    return "\n".join(lines)


__all__ = ["explain_text", "explain_html", "Explanation", "StagedExplanation"]
