"""The examples run as a user runs them, and print single-device-equal results."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,args,expect", [
    ("basics.py", [], "all results equal the single-device values"),
    ("train_gpt.py", ["--steps", "60"], "losses equal the one-device run"),
    ("seed_parallel.py", [], "every loss equals the one-device run"),
    ("seed_hybrid.py", [], "every loss and weight equals the one-device run"),
    ("pipeline.py", [], "every loss and weight equals the one-device run"),
    ("pipeline_gpt.py", [], "every loss and weight equals the one-device run"),
    ("spatial_cnn.py", ["--steps", "3"], "every loss equals the one-device run"),
    ("llama_paddlenlp.py", ["--steps", "4"], "every loss equals the one-device run"),
    ("llama_paddlenlp.py", ["--steps", "3", "--sp"], "every loss equals the one-device run"),
    ("llama_paddlenlp.py", ["--steps", "3", "--pp"], "every loss equals the one-device run"),
    ("llama_paddlenlp.py", ["--steps", "3", "--cp", "all2all"],
     "every loss equals the one-device run"),
    ("llama_paddlenlp.py", ["--steps", "3", "--cp", "ring"],
     "every loss equals the one-device run"),
])
def test_example_runs(script, args, expect, tmp_path):
    env = dict(os.environ)
    if script == "train_gpt.py":
        args = args + ["--out", str(tmp_path)]
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                         text=True, env=env, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout
