"""Per-primitive SPMD rules, one module per primitive family, in one registry keyed by primitive.

Installed as `autoshard.rules`. Registration is explicit: each family module holds a TABLE and
`install_builtin_rules` puts them in; importing a module registers nothing.
"""
from . import (callbacks, conv, cumulative, dot, elementwise, indexing, linalg, random, reduction, shape,
               shift, special, window)
from .registry import REGISTRY, Rule, RuleRegistry, lookup_rule, register_rule, registered_primitives

FAMILIES = {"elementwise": elementwise, "dot": dot, "conv": conv, "reduction": reduction, "shape": shape,
            "indexing": indexing, "random": random, "cumulative": cumulative,
            "shift": shift, "window": window, "linalg": linalg, "callbacks": callbacks,
            "special": special}


def install_builtin_rules(registry: RuleRegistry = REGISTRY) -> RuleRegistry:
    for module in FAMILIES.values():
        registry.register_table(module.TABLE)
    return registry


install_builtin_rules()

__all__ = ["Rule", "RuleRegistry", "REGISTRY", "register_rule", "lookup_rule",
           "registered_primitives", "install_builtin_rules", "FAMILIES"]
