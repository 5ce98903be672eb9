"""The rule registry: JAX primitive object → Rule.

A Rule is a pure `sharding(in_avals, out_avals, **params) -> OpSharding | None` (None: this
instance has no rule and runs replicated) plus, where the primitive's params encode global
shapes or positions, a `lower(ctx, *local_inputs, **params)` that binds it on local blocks.
A `lower` that communicates itself (a cross-shard combine) declares what it sends in `comm`,
`comm(in_layouts, out_layouts, in_avals, out_avals, axis_sizes, **params)` → a list of
(hlo kind, description, mesh axes, bytes per device), so the plan still lists every collective;
a fifth item, an operand index, says the collective sends only that operand's data, as the
description says: the same send of the same value is listed once, as XLA computes it once.
A last item `Serves(i)` says the collective makes only result i (top_k's gather of the
indices): where nothing reads that result XLA drops it, and the plan does not list it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autoshard.compiler.factors import Serves  # noqa: F401  (part of a rule's vocabulary)


@dataclass(frozen=True)
class Rule:
    sharding: Callable[..., Any]
    lower: Callable[..., Any] | None = None
    comm: Callable[..., Any] | None = None
    # the operands reach `lower` varying over the union of their axes (what most primitives
    # need under check_vma); False hands them over as they are
    match_vma: bool = True


def _check_rule(primitive: Any, rule: Rule) -> None:
    """A rule's parts are functions, and its sharding takes (in_avals, out_avals, **params):
    checked when it is registered, since a rule that fails when called is read as 'no rule for
    this instance' and the primitive would run replicated without a word."""
    import inspect

    from autoshard.errors import PlacementTypeError

    name = getattr(primitive, "name", primitive)
    for part in ("sharding", "lower", "comm"):
        fn = getattr(rule, part)
        if fn is None and part != "sharding":
            continue
        if not callable(fn):
            what = "the rule" if part == "sharding" else part
            raise PlacementTypeError(
                f"register_rule({name}): {what} is {fn!r:.60} of type {type(fn).__name__}, not "
                f"a function: write a function sharding(in_avals, out_avals, **params) "
                f"returning an OpSharding (or None for an instance it does not describe)"
                + ("" if part == "sharding" else f", and {part}=None or a function"))
    try:
        params = list(inspect.signature(rule.sharding).parameters.values())
    except (TypeError, ValueError):  # a builtin: no signature to read
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise PlacementTypeError(
            f"register_rule({name}): the rule takes {len(positional)} positional argument(s), "
            f"but it is called as rule(in_avals, out_avals, **params) (the primitive's params "
            f"as keywords): write def rule(in_avals, out_avals, **params)")


class RuleRegistry:
    """A table of SPMD rules keyed by the jax primitive object (never by name strings)."""

    def __init__(self) -> None:
        self._rules: dict[Any, Rule] = {}
        # The rules' answers per equation shape (autoshard.compiler.propagate.rule_signature):
        # rules are pure, so only a change of rule makes an answer stale.
        self.memo: dict = {}
        # counts changes of rule: what was made from the rules before (the lowerings replay.py
        # keeps across programs) names the generation it was made with
        self.generation = 0
        # primitive -> what its rule last raised for an instance it did not describe (the
        # fallback warning says it: the rule is there, it declined)
        self.declined: dict = {}

    def register(self, primitive: Any, rule: Rule | Callable[..., Any],
                 lower: Callable[..., Any] | None = None) -> None:
        if not hasattr(primitive, "bind"):
            from autoshard.errors import PlacementTypeError

            raise PlacementTypeError(
                f"register_rule needs a jax primitive (an object with .bind, e.g. "
                f"jax.lax.add_p), got {primitive!r}")
        if not isinstance(rule, Rule):
            rule = Rule(rule, lower)
        _check_rule(primitive, rule)
        self._rules[primitive] = rule
        self.memo.clear()
        self.generation += 1

    def register_table(self, table: dict[Any, Rule]) -> None:
        for primitive, rule in table.items():
            self.register(primitive, rule)

    def lookup(self, primitive: Any) -> Rule | None:
        return self._rules.get(primitive)

    def primitives(self) -> list[Any]:
        return sorted(self._rules, key=lambda p: str(p))

    def __contains__(self, primitive: Any) -> bool:
        return primitive in self._rules

    def __len__(self) -> int:
        return len(self._rules)


REGISTRY = RuleRegistry()


def register_rule(primitive: Any, rule: Rule | Callable[..., Any],
                  lower: Callable[..., Any] | None = None) -> None:
    """Add (or replace) the rule of `primitive`, e.g. for a user-defined primitive."""
    REGISTRY.register(primitive, rule, lower)


def lookup_rule(primitive: Any) -> Rule | None:
    return REGISTRY.lookup(primitive)


def registered_primitives() -> list[Any]:
    return REGISTRY.primitives()
