"""Cut: a function whose values live on several meshes → one program per stage, in order.

Paddle's pipeline idiom moves an activation to the next stage's mesh inside the model:
`y = dist.reshard(y, mesh1, [Shard(0), Shard(2)])`. One SPMD program cannot span two meshes,
so dist.jit cuts the traced function where values change mesh: every equation is given the
mesh of its operands (a reshard / shard_tensor hint gives the mesh it names), and equations are
grouped into stages — maximal runs on one mesh, ordered so that each stage reads only what
earlier stages made. Each stage becomes a dist.jit program on its mesh; values that cross are
moved between meshes by the cross-mesh reshard, arriving with the hint's placements.

A train step traced with jax.grad inside crosses back: the cotangent of a hinted value is
marked (`hint_back_p`, trace.py) and goes to the mesh of whoever reads it, as do 0-d values (a
step count, a learning rate, the loss): moving those is cheap and the user never placed them
on purpose. Any other value read on a mesh it does not live on is an error that names both
meshes and the line — the user moves it with dist.reshard, as in Paddle.

Equations that read no placed value (iota, constants) run in every stage that needs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jax import lax
from jax.extend import core as jex_core

from ..dtensor import DistTensor
from ..errors import MeshMismatchError
from ..layout import Layout
from ..mesh import ProcessMesh
from .trace import bind_eqn, hint_back_p, hint_p, source_line


@dataclass
class StagePart:
    """One stage: equations of the traced jaxpr that run on `mesh`."""

    mesh: ProcessMesh
    eqns: list = field(default_factory=list)      # in program order, free ones it needs included
    inputs: list = field(default_factory=list)    # Vars read from outside the stage
    outputs: list = field(default_factory=list)   # Vars that later stages or the result read
    arrivals: dict = field(default_factory=dict)  # Var -> Layout | None, for values that move
    # here from another mesh (None: keep their placements if this mesh can, else replicate)
    lines: dict = field(default_factory=dict)     # Var -> the user's line that reads it there


@dataclass
class Cut:
    stages: list[StagePart]
    consts: dict          # constvar -> value
    invars: list          # the jaxpr's inputs, in order
    outvars: list         # the jaxpr's outputs (Vars or Literals)
    meshes: dict          # Var -> the mesh it lives on (None: unplaced)
    free_eqns: list       # what computes the results that read nothing placed...
    free_results: list    # ...those results: plain arrays, on no mesh


def meshes_named(closed: Any, in_meshes: list) -> list[ProcessMesh]:
    """The distinct meshes of the inputs and of the hints (inside calls too), in order of
    appearance."""
    found: list[ProcessMesh] = []
    named = []
    for e in closed.jaxpr.eqns:
        named += [e.params["mesh"]] if e.primitive is hint_p else _hint_meshes_inside(e)
    for m in [*in_meshes, *named]:
        if m is not None and m not in found:
            found.append(m)
    return found


_CALLS = {"pjit", "jit", "closed_call", "core_call"}  # a call is its body: the same values


def _moves_inside(eqn) -> bool:
    """A call whose body (any depth) places values: a hint, or the cotangent of one."""
    if eqn.primitive.name not in _CALLS:
        return False

    def visit(jaxpr) -> bool:
        return any(e.primitive in (hint_p, hint_back_p) or any(map(visit, _sub_jaxprs(e.params)))
                   for e in jaxpr.eqns)

    return any(map(visit, _sub_jaxprs(eqn.params)))


def _call_body(eqn):
    return eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]


def inline_calls_that_move(closed: Any, spanning: tuple = ()) -> Any:
    """`closed` with the jax.jit bodies that move values to a mesh spliced in (any depth), so
    that the cut can put their equations on the stages they belong to; also the calls of the
    bodies in `spanning` (bodies found reading values of several meshes, such as optax's
    jitted bias correction over every parameter), and the conds whose branches are there
    (optax.apply_if_finite's update of every param) as their branches computed and each result
    selected — exact for branches without effects; other equations stay as they are. Only
    for programs on several meshes (one-mesh programs keep their calls)."""
    def inlined(e) -> bool:
        return _moves_inside(e) or (e.primitive.name in _CALLS
                                    and any(_call_body(e) is b for b in spanning))

    def selected(e) -> bool:
        return e.primitive.name == "cond" and any(e.params["branches"] is b for b in spanning)

    if not any(inlined(e) or selected(e) for e in closed.jaxpr.eqns):
        return closed
    constvars, consts, eqns = list(closed.jaxpr.constvars), list(closed.consts), []

    def splice(jaxpr, body_consts, args: list, top: bool) -> list:
        env: dict = {}
        for v, c in zip(jaxpr.constvars, body_consts):
            if top:
                env[v] = v
            else:
                env[v] = fresh = jex_core.Var(v.aval)
                constvars.append(fresh)
                consts.append(c)
        env.update(zip(jaxpr.invars, args))

        def read(a):
            return env.get(a, a) if _is_var(a) else a

        for e in jaxpr.eqns:
            ins = [read(a) for a in e.invars]
            if inlined(e):
                body = _call_body(e)
                inner, inner_consts = ((body.jaxpr, body.consts)
                                       if isinstance(body, jex_core.ClosedJaxpr) else (body, ()))
                env.update(zip(e.outvars, splice(inner, inner_consts, ins, False)))
                continue
            if selected(e):
                # every branch computed, each result selected by the index: a select runs
                # element by element, so each result is made on its own mesh
                made = [splice(b.jaxpr, b.consts, ins[1:], False) for b in e.params["branches"]]
                for j, v in enumerate(e.outvars):
                    if isinstance(v, jex_core.DropVar):
                        continue
                    out = v if top else jex_core.Var(v.aval)
                    eqns.append(jex_core.new_jaxpr_eqn(
                        [ins[0], *(m[j] for m in made)], [out], lax.select_n_p, {}, set(),
                        e.source_info))
                    env[v] = out
                continue
            outs = list(e.outvars) if top else [
                v if isinstance(v, jex_core.DropVar) else jex_core.Var(v.aval)
                for v in e.outvars]
            env.update(zip(e.outvars, outs))
            eqns.append(e.replace(invars=ins, outvars=outs))
        return [read(a) for a in jaxpr.outvars]

    jaxpr = closed.jaxpr
    outvars = splice(jaxpr, closed.consts, list(jaxpr.invars), True)
    return jex_core.ClosedJaxpr(
        jex_core.Jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info),
        consts)


_REMAT = {"remat2", "checkpoint"}  # jax.checkpoint / nnx.remat: the body is recomputed


def hoist_moves_out_of_remat(closed: Any) -> Any:
    """`closed` with the moves at a jax.checkpoint body's edges taken out of it.

    pp_config puts the stage boundary's reshard first in a layer's call; a remat layer then
    starts by moving its input to the next mesh (and its backward ends by moving the
    input's cotangent back). Done just outside, the move is the same, and the body runs on
    one mesh with its remat policy kept. A move of an operand read nowhere else in the body
    is made before the call (reusing an identical move already made outside), a move that makes
    a result after it; moves deeper inside still raise in the cut."""
    if not any(e.primitive.name in _REMAT and _moves_at_edges(e.params["jaxpr"])
               for e in closed.jaxpr.eqns):
        return closed
    eqns: list = []
    moved: dict = {}  # (operand, params) -> the outer hint's result
    for e in closed.jaxpr.eqns:
        if e.primitive in (hint_p, hint_back_p) and _is_var(e.invars[0]):
            moved.setdefault((e.primitive, e.invars[0], _hint_key(e.params)), e.outvars[0])
        if e.primitive.name not in _REMAT:
            eqns.append(e)
            continue
        body, before, after = _hoist(e.params["jaxpr"])
        ins, outs, post = list(e.invars), list(e.outvars), []
        for i, h in before:
            key = (h.primitive, ins[i], _hint_key(h.params))
            v = moved.get(key) if _is_var(ins[i]) else None
            if v is None:
                v = jex_core.Var(h.outvars[0].aval)
                eqns.append(h.replace(invars=[ins[i]], outvars=[v]))
                if _is_var(ins[i]):
                    moved[key] = v
            ins[i] = v
        for k, h in after:
            if isinstance(outs[k], jex_core.DropVar):
                continue  # nobody reads it: no move
            u = jex_core.Var(h.invars[0].aval)
            post.append(h.replace(invars=[u], outvars=[outs[k]]))
            outs[k] = u
        eqns.append(e.replace(invars=ins, outvars=outs, params={**e.params, "jaxpr": body}))
        eqns += post
    return jex_core.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def _hint_key(params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def _moves_at_edges(body) -> bool:
    _, before, after = _hoist(body)
    return bool(before or after)


def _hoist(body) -> tuple:
    """(body without its edge moves, [(operand index, hint)], [(result index, hint)])."""
    uses: dict = {}
    for e in body.eqns:
        for a in e.invars:
            if _is_var(a):
                uses[a] = uses.get(a, 0) + 1
    for a in body.outvars:
        if _is_var(a):
            uses[a] = uses.get(a, 0) + 1
    invars, outvars = list(body.invars), list(body.outvars)
    position = {v: i for i, v in enumerate(body.invars)}
    producer = {v: e for e in body.eqns for v in e.outvars}
    dropped: set = set()
    before, after = [], []
    for e in body.eqns:
        a = e.invars[0] if e.primitive in (hint_p, hint_back_p) else None
        if a is not None and _is_var(a) and a in position and uses[a] == 1:
            invars[position[a]] = e.outvars[0]
            dropped.add(id(e))
            before.append((position[a], e))
    for k, v in enumerate(body.outvars):
        e = producer.get(v) if _is_var(v) else None
        if (e is not None and e.primitive in (hint_p, hint_back_p) and uses[v] == 1
                and id(e) not in dropped and _is_var(e.invars[0])):
            outvars[k] = e.invars[0]
            dropped.add(id(e))
            after.append((k, e))
    if not dropped:
        return body, [], []
    return (body.replace(invars=invars, outvars=outvars,
                         eqns=[e for e in body.eqns if id(e) not in dropped]), before, after)


def _is_var(a) -> bool:
    return not isinstance(a, jex_core.Literal)


class _CallSpansMeshes(Exception):
    """A call reads values of several meshes: its body is inlined and the cut made again (a
    cond's branches, given as `body`, are inlined and their results selected)."""

    def __init__(self, body):
        super().__init__()
        self.body = body


def cut_by_mesh(closed: Any, in_meshes: list) -> Cut:
    """Stages of `closed` (a ClosedJaxpr) whose inputs live on `in_meshes` (None: unplaced)."""
    spanning: tuple = ()
    while True:
        try:
            return _cut(hoist_moves_out_of_remat(inline_calls_that_move(closed, spanning)),
                        in_meshes)
        except _CallSpansMeshes as found:
            spanning += (found.body,)


def _cut(closed: Any, in_meshes: list) -> Cut:
    jaxpr = closed.jaxpr
    mesh_of: dict = {}
    movable: set = set()   # values that go to their reader's mesh
    stage_of: dict = {}    # Var -> index of the stage that makes it
    free: dict = {}        # Var -> the equation (reading no placed value) that makes it
    parts: list[StagePart] = []
    for v, m in zip(jaxpr.invars, in_meshes):
        mesh_of[v] = m
        if m is not None and v.aval.shape == ():
            movable.add(v)
    for v in jaxpr.constvars:
        mesh_of[v] = None

    for eqn in jaxpr.eqns:
        ins = [a for a in eqn.invars if _is_var(a)]
        if eqn.primitive is hint_p:
            mesh, loose = eqn.params["mesh"], False
        else:
            fixed = []
            for v in ins:
                m = mesh_of[v]
                if m is not None and v not in movable and m not in fixed:
                    fixed.append(m)
            elsewhere = [m for m in _hint_meshes_inside(eqn) if m not in fixed[:1]]
            if elsewhere and (fixed or len(set(elsewhere)) > 1):
                raise MeshMismatchError(
                    f"`{eqn.primitive.name}` (the body of a jax.checkpoint or a custom "
                    f"derivative) moves values to {elsewhere[0]!r} inside it; a body runs on one "
                    f"mesh — call dist.reshard before or after it, outside the body (a jax.jit "
                    f"body may move values: it is cut like inline code)",
                    where=source_line(eqn.source_info))
            if len(fixed) > 1 and eqn.primitive.name in _CALLS:
                raise _CallSpansMeshes(_call_body(eqn))  # a jax.jit body is cut like inline code
            if len(fixed) > 1 and eqn.primitive.name == "cond" and not eqn.effects:
                # (optax.apply_if_finite updates every stage's params in one lax.cond): its
                # branches are computed and each result selected, which the cut can split
                raise _CallSpansMeshes(eqn.params["branches"])
            if len(fixed) > 1:
                # an argument read as it came, beside a value computed on another mesh: most
                # often a label placed on the first stage's mesh
                position = {v: k for k, v in enumerate(jaxpr.invars)}
                given = [(position[v], mesh_of[v]) for v in ins if v in position
                         and mesh_of[v] is not None and v not in movable]
                computed = [mesh_of[v] for v in ins if v not in position
                            and mesh_of[v] is not None and v not in movable]
                label = ""
                if given and computed and given[0][1] != computed[0]:
                    label = (f"; an argument (leaf {given[0][0]} of the flattened arguments) "
                             f"is read here as it was given, on {given[0][1]!r}: place it on "
                             f"{computed[0]!r}, where it is read "
                             f"(a label of a pipeline: dist.shard_dataloader(..., meshes=[first "
                             f"stage's mesh, last stage's mesh]) puts labels on the last)")
                raise MeshMismatchError(
                    f"values on {fixed[0]!r} and on {fixed[1]!r} meet in `{eqn.primitive.name}`: "
                    f"an operation runs on one mesh — move one of them first with "
                    f"dist.reshard(x, mesh, placements) (pipeline stages pass activations so; "
                    f"a parameter that layers of two stages share, such as tied input and output "
                    f"embeddings, needs a copy on each mesh: dist.reshard(param, mesh, "
                    f"placements) where it is read — its gradient goes back and is summed — or "
                    f"keep those layers in one stage){label}",
                    where=source_line(eqn.source_info))
            placed = [mesh_of[v] for v in ins if mesh_of[v] is not None]
            mesh = fixed[0] if fixed else (placed[0] if placed else None)
            loose = eqn.primitive is hint_back_p or not fixed
        if mesh is None:  # reads nothing placed: made wherever it is needed
            for v in eqn.outvars:
                mesh_of[v] = None
                free[v] = eqn
            continue
        after = max((stage_of[v] for v in ins if v in stage_of), default=0)
        k = next((i for i in range(after, len(parts)) if parts[i].mesh == mesh), None)
        if k is None:
            k = len(parts)
            parts.append(StagePart(mesh))
        parts[k].eqns.append(eqn)
        for v in eqn.outvars:
            mesh_of[v], stage_of[v] = mesh, k
            if loose or v.aval.shape == ():
                movable.add(v)

    parts, stage_of = _late_as_read(jaxpr, parts, stage_of, mesh_of, free)
    # results that read nothing placed are computed apart, as plain arrays (`free_function`)
    free_results = [v for v in jaxpr.outvars if _is_var(v) and v in free]

    consumers: dict = {}  # Var -> stages reading it
    for k, part in enumerate(parts):
        needed = _free_closure(part, free)
        part.eqns = sorted(part.eqns + needed, key=_position(jaxpr))
        made = {v for e in part.eqns for v in e.outvars}
        constvars = set(jaxpr.constvars)
        for e in part.eqns:
            for v in e.invars:
                if not _is_var(v) or v in made or v in constvars or v in part.inputs:
                    continue
                part.inputs.append(v)
                consumers.setdefault(v, set()).add(k)
                home = mesh_of[v]
                if home is not None and home != part.mesh and v not in part.arrivals:
                    part.arrivals[v] = (e.params["layout"] if e.primitive is hint_p else None)
                    part.lines[v] = source_line(e.source_info)
    results = {v for v in jaxpr.outvars if _is_var(v)}
    for k, part in enumerate(parts):
        made = [v for e in part.eqns for v in e.outvars]
        part.outputs = [v for v in dict.fromkeys(made)
                        if v in results and stage_of.get(v) == k
                        or any(j != k for j in consumers.get(v, ()))]
    return Cut(parts, dict(zip(jaxpr.constvars, closed.consts)), list(jaxpr.invars),
               list(jaxpr.outvars), mesh_of,
               sorted(_free_closure(StagePart(None, outputs=free_results), free),
                      key=_position(jaxpr)), free_results)


def _late_as_read(jaxpr, parts: list, stage_of: dict, mesh_of: dict, free: dict) -> tuple:
    """Equations that read only the function's inputs (params: a weight's norm, ZeRO-3's
    gather of a weight) were put in the first stage on their mesh; with several stages on one
    mesh (VPP's chunks) that may be long before the stage reading the result, which was then
    carried through the stages between, every micro-batch. Each moves to the last stage on its
    mesh up to its first reader (never past one; a result the function returns stays)."""
    if len({id(p.mesh) for p in parts}) == len(parts):
        return parts, stage_of  # one stage per mesh: nowhere later to go
    given = set(jaxpr.invars) | set(jaxpr.constvars) | set(free)
    stage_eqn: dict = {}  # id(eqn) -> its stage, for equations reading only `given` values
    for e in jaxpr.eqns:
        outs = [v for v in e.outvars if v in stage_of]
        if outs and not e.effects and all(v in given for v in e.invars if _is_var(v)):
            stage_eqn[id(e)] = stage_of[outs[0]]
            given.update(e.outvars)
    if not stage_eqn:
        return parts, stage_of
    readers: dict = {}  # Var -> {stage: how many of its equations read it}
    for k, part in enumerate(parts):
        for e in part.eqns:
            for v in e.invars:
                if _is_var(v):
                    count = readers.setdefault(v, {})
                    count[k] = count.get(k, 0) + 1
    returned = {v for v in jaxpr.outvars if _is_var(v)}
    moved: dict = {}  # id(eqn) -> the stage it moves to
    for e in reversed(jaxpr.eqns):  # readers first: a chain moves together
        k = stage_eqn.get(id(e))
        if k is None or any(v in returned for v in e.outvars):
            continue
        first = min((r for v in e.outvars for r in readers.get(v, ())), default=None)
        if first is None:
            continue
        to = max(j for j in range(k, first + 1) if parts[j].mesh == parts[k].mesh)
        if to == k:
            continue
        moved[id(e)] = to
        for v in e.outvars:
            stage_of[v] = to
        for v in e.invars:
            if _is_var(v) and v in readers:
                count = readers[v]
                count[to] = count.get(to, 0) + 1
                count[k] -= 1
                if not count[k]:
                    del count[k]
    if moved:
        arriving = [[] for _ in parts]
        for k, part in enumerate(parts):
            stay = []
            for e in part.eqns:
                (arriving[moved[id(e)]] if id(e) in moved else stay).append(e)
            part.eqns = stay
        for part, more in zip(parts, arriving):
            part.eqns.extend(more)  # (a stage's equations are put in program order later)
    kept = [k for k, p in enumerate(parts) if p.eqns]
    if len(kept) < len(parts):
        renumber = {k: n for n, k in enumerate(kept)}
        parts = [parts[k] for k in kept]
        stage_of = {v: renumber[k] for v, k in stage_of.items()}
    return parts, stage_of


def _hint_meshes_inside(eqn) -> list:
    """Meshes that hints inside an equation's sub-jaxprs name (any depth)."""
    found: list = []

    def visit(jaxpr) -> None:
        for e in jaxpr.eqns:
            if e.primitive is hint_p and e.params["mesh"] not in found:
                found.append(e.params["mesh"])
            for sub in _sub_jaxprs(e.params):
                visit(sub)

    for sub in _sub_jaxprs(eqn.params):
        visit(sub)
    return found


def _sub_jaxprs(params: dict):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex_core.Jaxpr):
                yield v


def _position(jaxpr):
    index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
    return lambda e: index[id(e)]


def _free_closure(part: StagePart, free: dict) -> list:
    """The free equations whose results this stage reads (transitively), each once."""
    todo = [v for e in part.eqns for v in e.invars if _is_var(v) and v in free]
    todo += [v for v in part.outputs if v in free]
    picked: dict = {}
    while todo:
        v = todo.pop()
        e = free[v]
        if id(e) in picked:
            continue
        picked[id(e)] = e
        todo += [u for u in e.invars if _is_var(u) and u in free]
    return list(picked.values())


def eval_eqns(eqns: list, env: dict) -> dict:
    """Bind `eqns` again (a stage's, traced by its program) on the values in `env`, which
    gains their results."""
    for eqn in eqns:
        ins = [a.val if isinstance(a, jex_core.Literal) else env[a] for a in eqn.invars]
        env.update(zip(eqn.outvars, bind_eqn(eqn, ins)))
    return env


def arrive(x: Any, part: StagePart, v: Any) -> Any:
    """Value `v` of an earlier stage as stage `part` reads it: moved onto its mesh when it
    lives elsewhere (see `arrival_placements`)."""
    from ..reshard.api import reshard

    if not isinstance(x, DistTensor) or x.mesh == part.mesh:
        return x
    return reshard(x, part.mesh, arrival_placements(x, part.mesh, part.arrivals.get(v)))


def arrival_placements(x: Any, mesh: ProcessMesh, layout: Layout | None) -> list:
    """Where a value moving to `mesh` lands: the hint's layout, else its own placements when
    this mesh has the same dims (a cotangent going back to its stage), else replicated."""
    from ..placement import Replicate

    if layout is not None:
        return layout.placements(mesh)
    own = getattr(x, "mesh", None)
    if own is not None and own.shape == mesh.shape and not x.layout.partial:
        return x.placements
    return [Replicate()] * mesh.ndim


__all__ = ["Cut", "StagePart", "cut_by_mesh", "meshes_named", "arrival_placements", "arrive",
           "eval_eqns"]
