"""8 simulated CPU devices for every test; must run before jax is first imported."""
import os
from importlib.metadata import version

# The tests check values and the collectives in the compiled HLO, never speed. Most of a
# test's time is XLA compiling for the CPU, and most of that is LLVM optimizing the kernels,
# which leaves the HLO (collectives, buffers, memory_analysis) as it is: so the backend level
# is 0, and codegen is one module (its split into modules compiled on threads only contends
# with the other pytest worker on 2 cores) — each unless XLA_FLAGS sets it. A GPT step then
# compiles 2.5x faster. Subprocesses (examples, the launcher, the bench run) inherit these.
_CODEGEN = {"--xla_backend_optimization_level": "0", "--xla_cpu_parallel_codegen_split_count": "1"}
# jaxlib 0.10 still has the CPU backend's older elemental emitter beside the fusion emitters
# (its default): it compiles in a third of the time (a tiny program 0.08 -> 0.03 s; the whole
# suite 20 -> 8 min). The collectives are the same; it expands scatters into while loops, so a
# test counting loops counts its own kind. jaxlib 0.11 removed the flag, and XLA aborts on a
# flag it does not know, so it is set only where it exists.
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
    _CODEGEN["--xla_cpu_use_fusion_emitters"] = "false"
_flags = os.environ.get("XLA_FLAGS", "")
_flags += "".join(f" {k}={v}" for k, v in _CODEGEN.items() if k not in _flags)
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated devices: import jax only after conftest"

from hypothesis import settings  # noqa: E402

# CI draws the same examples on every run, so a red run is a regression, not a new draw;
# HYPOTHESIS_PROFILE=explore draws fresh ones (a hunt for new failing cases).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
