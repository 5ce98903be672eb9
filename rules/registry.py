"""The rule registry: JAX primitive object → rule. Empty until the compiler's rule families land."""
from __future__ import annotations

from typing import Any, Callable


class RuleRegistry:
    """A table of SPMD rules keyed by the jax primitive object (never by name strings)."""

    def __init__(self) -> None:
        self._rules: dict[Any, Callable[..., Any]] = {}

    def register(self, primitive: Any, rule: Callable[..., Any]) -> None:
        if not hasattr(primitive, "bind"):
            from autoshard.errors import PlacementTypeError

            raise PlacementTypeError(
                f"register_rule needs a jax primitive (an object with .bind, e.g. "
                f"jax.lax.add_p), got {primitive!r}")
        self._rules[primitive] = rule

    def lookup(self, primitive: Any) -> Callable[..., Any] | None:
        return self._rules.get(primitive)

    def primitives(self) -> list[Any]:
        return sorted(self._rules, key=lambda p: str(p))

    def __contains__(self, primitive: Any) -> bool:
        return primitive in self._rules

    def __len__(self) -> int:
        return len(self._rules)


REGISTRY = RuleRegistry()


def register_rule(primitive: Any, rule: Callable[..., Any]) -> None:
    REGISTRY.register(primitive, rule)


def lookup_rule(primitive: Any) -> Callable[..., Any] | None:
    return REGISTRY.lookup(primitive)


def registered_primitives() -> list[Any]:
    return REGISTRY.primitives()
