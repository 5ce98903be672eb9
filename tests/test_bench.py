"""The compiler benchmark runs and reports a well-formed row (numbers are measured, not tested)."""
import json

from autoshard.bench import compiler


def test_compiler_benchmark_quick(tmp_path):
    out = tmp_path / "bench.json"
    rows = compiler.run(layers=[2], scan=[], json_path=str(out))
    (row,) = json.loads(out.read_text())
    assert row == rows[0] and row["workload"] == "gpt unrolled 2L"
    assert row["equations"] > 100 and row["pass_s"] > 0 and row["xla_compile_s"] > 0
    assert row["bytes"] <= row["xla_bytes"]  # deterministic counts from the compiled HLO
