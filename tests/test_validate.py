"""The rule validator, run by the suite: every registered primitive, sampled 1-d placements."""
import subprocess
import sys

import pytest

from autoshard import validate as validator
from autoshard.rules import FAMILIES


def _families():
    by_prim: dict[str, list] = {}
    for s in validator.samples():
        by_prim.setdefault(s.primitive, []).append(s)
    return sorted(by_prim)


def test_every_builtin_rule_has_a_sample():
    sampled = {s.primitive for s in validator.samples()}
    registered = {p.name for module in FAMILIES.values() for p in module.TABLE}
    assert registered - sampled <= {"imag", "conj"}  # exercised inside the "real" sample


@pytest.mark.parametrize("primitive", _families())
def test_rules_give_single_device_results(primitive):
    reports = validator.validate(primitive, limit=5)
    report = reports[primitive]
    assert report.cases > 0
    assert report.wrong == [], report.wrong
    assert report.needless == [], report.needless


def test_command_line():
    out = subprocess.run([sys.executable, "-m", "autoshard.validate", "--primitive", "dot_general",
                          "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dot_general" in out.stdout and " 0 wrong" in out.stdout
