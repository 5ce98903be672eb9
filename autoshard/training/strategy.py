"""dist.Strategy: Paddle's training-strategy sections, settable as a dict or as attributes."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..errors import AutoshardError, did_you_mean


class StrategyError(AutoshardError, ValueError):
    """A strategy setting that does not exist or has a value it cannot take."""


class StrategyAttributeError(StrategyError, AttributeError):
    """A strategy section or setting read that does not exist (`strategy.pipline.enable`):
    also an AttributeError, so hasattr / getattr with a default keep working."""


_SECTIONS: dict[str, dict[str, Any]] = {
    "sharding": {"enable": False, "stage": 1, "mesh_dim": None, "degree": None,
                 "offload": False},
    "gradient_merge": {"enable": False, "k_steps": 1, "avg": True},
    # Loss scaling applies to float16 only; the defaults are Paddle's.
    "amp": {"enable": False, "dtype": "bfloat16", "level": "o1", "init_loss_scaling": 32768.0,
            "use_dynamic_loss_scaling": True, "incr_every_n_steps": 1000,
            "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.8,
            "custom_white_list": (), "custom_black_list": ()},
    "recompute": {"enable": False, "policy": None},
    "pipeline": {"enable": False, "schedule_mode": "1F1B", "micro_batch_size": 1,
                 "accumulate_steps": 1, "vpp_degree": 1},
}
_CHOICES = {
    ("sharding", "stage"): (1, 2, 3),
    ("amp", "dtype"): ("bfloat16", "float16"),
    ("amp", "level"): ("o1", "o2"),
    ("pipeline", "schedule_mode"): ("FThenB", "1F1B", "VPP", "ZBH1"),
}


_POSITIVE_INTS = ("k_steps", "micro_batch_size", "accumulate_steps", "vpp_degree",
                  "incr_every_n_steps", "decr_every_n_nan_or_inf")
# Open intervals: a scale that does not grow on growth, or shrink on backoff, never recovers.
_RANGES = {"init_loss_scaling": (0.0, float("inf")), "incr_ratio": (1.0, float("inf")),
           "decr_ratio": (0.0, 1.0)}


class _Section:
    def __init__(self, name: str, values: dict[str, Any] | None = None):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", dict(_SECTIONS[name]))
        object.__setattr__(self, "_written", set())  # the settings the user gave
        for key, value in (values or {}).items():
            setattr(self, key, value)

    def __getattr__(self, key: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if key in values:
            return values[key]
        if key.startswith("__"):  # copy / pickle probing for hooks
            raise AttributeError(key)
        name = object.__getattribute__(self, "_name")
        raise StrategyAttributeError(
            f"strategy.{name} has no setting {key!r}{did_you_mean(key, values)}; its settings are "
            f"{sorted(values)}")

    def __setattr__(self, key: str, value: Any) -> None:
        name = self._name
        if key not in _SECTIONS[name]:
            raise StrategyError(f"strategy.{name} has no setting {key!r}"
                                f"{did_you_mean(key, _SECTIONS[name])}; its settings are "
                                f"{sorted(_SECTIONS[name])}")
        if (name, key) == ("amp", "level") and isinstance(value, str):
            value = value.lower()  # Paddle's docs write both "O2" and "o2"
        allowed = _CHOICES.get((name, key))
        if allowed is not None and value not in allowed:
            raise StrategyError(f"strategy.{name}.{key} = {value!r} is not one of {list(allowed)}")
        if key in _POSITIVE_INTS and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
            raise StrategyError(f"strategy.{name}.{key} must be a positive int, got {value!r}")
        if isinstance(_SECTIONS[name][key], bool) and not isinstance(value, (bool, np.bool_)):
            # a string "False" is true: read as a switch it would turn the feature on
            raise StrategyError(f"strategy.{name}.{key} is a switch: write True or False, not "
                                f"{value!r}")
        if key in ("custom_white_list", "custom_black_list") and (
                isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset))
                or not all(isinstance(v, str) for v in value)):
            raise StrategyError(f"strategy.amp.{key} is a list of jax primitive names, e.g. "
                                f"['dot_general', 'conv_general_dilated'], got {value!r}")
        if key == "mesh_dim" and not (value is None or isinstance(value, str) or (
                isinstance(value, int) and not isinstance(value, bool))):
            raise StrategyError(f"strategy.sharding.mesh_dim names the mesh dim the optimizer "
                                f"states are split over: a dim name such as 'dp', its index, or "
                                f"None (the mesh's 'dp' or first dim), got {value!r}")
        if key == "degree" and value is not None and (not isinstance(value, int) or value < 1):
            raise StrategyError(f"strategy.{name}.degree must be a positive int (the number of "
                                f"devices the optimizer states are split over), got {value!r}")
        if key == "policy" and isinstance(value, str) and not hasattr(
                jax.checkpoint_policies, value):
            names = sorted(n for n in dir(jax.checkpoint_policies) if not n.startswith("_"))
            raise StrategyError(f"strategy.recompute.policy = {value!r} is not one of "
                                f"jax.checkpoint_policies: {names} (or pass a policy function, "
                                f"or None to save nothing)")
        if key == "policy" and not (value is None or isinstance(value, str) or callable(value)):
            raise StrategyError(f"strategy.recompute.policy must be a name in "
                                f"jax.checkpoint_policies, a policy function or None, got "
                                f"{value!r}")
        low, high = _RANGES.get(key, (None, None))
        if low is not None and not (isinstance(value, (int, float)) and low < value < high):
            raise StrategyError(f"strategy.{name}.{key} = {value!r} must lie strictly between "
                                f"{low} and {high}")
        self._values[key] = value
        self._written.add(key)

    def written(self, key: str) -> bool:
        """Whether `key` was given (a value equal to the default included), not defaulted."""
        return key in self._written

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class Strategy:
    """Sections: sharding, gradient_merge, amp, recompute, pipeline (Paddle's names).

        strategy = dist.Strategy({"sharding": {"enable": True, "stage": 2}})
        strategy.gradient_merge.enable = True; strategy.gradient_merge.k_steps = 4
    """

    def __init__(self, config: dict[str, dict[str, Any]] | None = None):
        if config is not None and not isinstance(config, dict):
            raise StrategyError(f"dist.Strategy takes a dict of sections, e.g. "
                                f"dist.Strategy({{'sharding': {{'enable': True, 'stage': 1}}}}), "
                                f"not {type(config).__name__} {config!r:.60}")
        config = dict(config or {})
        unknown = set(config) - set(_SECTIONS)
        if unknown:
            raise StrategyError(f"unknown strategy sections {sorted(unknown)}; the sections are "
                                f"{sorted(_SECTIONS)}")
        for name in _SECTIONS:
            section = config.get(name)
            if section is not None and not isinstance(section, dict):
                raise StrategyError(f"strategy section {name!r} must be a dict, got {section!r}")
            object.__setattr__(self, name, _Section(name, section))

    def __getattr__(self, key: str) -> Any:  # only for names that are not sections
        if key.startswith("__"):
            raise AttributeError(key)
        raise StrategyAttributeError(
            f"strategy has no section {key!r}{did_you_mean(key, _SECTIONS)}; its sections are "
            f"{sorted(_SECTIONS)} (Paddle's other sections have no counterpart in autoshard)")

    def __setattr__(self, key: str, value: Any) -> None:
        if key in _SECTIONS and isinstance(value, dict):
            value = _Section(key, value)
        if key not in _SECTIONS:
            raise StrategyError(f"unknown strategy section {key!r}{did_you_mean(key, _SECTIONS)}; the "
                                f"sections are {sorted(_SECTIONS)}")
        if not (isinstance(value, _Section) and value._name == key):
            raise StrategyError(f"strategy.{key} must be a dict of its settings, e.g. "
                                f"strategy.{key} = {{'enable': True}}, got {value!r:.60} (or set "
                                f"one setting: strategy.{key}.enable = True)")
        object.__setattr__(self, key, value)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}

    def __repr__(self) -> str:
        return "Strategy(" + ", ".join(repr(getattr(self, n)) for n in _SECTIONS) + ")"


__all__ = ["Strategy", "StrategyError", "StrategyAttributeError"]
