"""8 simulated CPU devices for every test; must run before jax is first imported."""
import os

# The tests check values and the collectives in the compiled HLO, never speed: LLVM's
# optimization of the CPU kernels (XLA's backend level, which leaves the HLO as it is) is
# about half of the suite's time, so it is off unless XLA_FLAGS chooses a level itself.
# Subprocesses (examples, the launcher, the bench smoke run) inherit both flags.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
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
