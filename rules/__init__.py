"""Per-primitive SPMD rules, one module per primitive family, in one registry keyed by primitive.

Installed as `autoshard.rules`. Registration is explicit: a family module lists its rules in a
table and `register_family` puts them in; nothing registers by import side effect.
"""
from .registry import RuleRegistry, lookup_rule, register_rule, registered_primitives

__all__ = ["RuleRegistry", "register_rule", "lookup_rule", "registered_primitives"]
