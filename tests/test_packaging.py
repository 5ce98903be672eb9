"""rules/ installs as autoshard.rules: from the editable install and from a built wheel."""
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_rules_importable_from_this_install():
    import jax

    from autoshard.rules import FAMILIES, REGISTRY, Rule, RuleRegistry

    registry = RuleRegistry()
    rule = Rule(lambda ins, outs, **params: None)
    registry.register(jax.lax.sin_p, rule)
    assert registry.lookup(jax.lax.sin_p) is rule and jax.lax.sin_p in registry
    assert registry.lookup(jax.lax.cos_p) is None
    assert set(FAMILIES) >= {"elementwise", "dot", "reduction", "shape"}
    assert jax.lax.dot_general_p in REGISTRY


def test_rules_importable_from_a_built_wheel(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "wheel"), str(ROOT)],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("autoshard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "autoshard/rules/__init__.py" in names and "autoshard/rules/registry.py" in names
    assert "autoshard/py.typed" in names and not any(n.startswith("rules/") for n in names)
    # every package of the source tree is in the wheel (an editable install would hide a gap)
    for init in (ROOT / "autoshard").rglob("__init__.py"):
        assert str(init.relative_to(ROOT)) in names, init
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = subprocess.run(
        [sys.executable, "-c", "import autoshard.rules as r, autoshard; print(r.__file__); print(autoshard.Shard(0))"],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"},
        timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.splitlines()[0].startswith(str(site)) and "S(0)" in probe.stdout
