"""8 simulated CPU devices for every test; must run before jax is first imported."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated devices: import jax only after conftest"

from hypothesis import settings  # noqa: E402

# CI draws the same examples on every run, so a red run is a regression, not a new draw;
# HYPOTHESIS_PROFILE=explore draws fresh ones (a hunt for new failing cases).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
