"""The examples run as a user runs them, and print single-device-equal results."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,expect", [("basics.py", "all results equal the single-device values")])
def test_example_runs(script, expect):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True,
                         text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout
