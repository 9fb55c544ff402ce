import os

# 8 virtual CPU devices for sharding, pmap and shard_map tests; must be set
# before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def tracer_leaks():
    """Run a test with ``jax.check_tracer_leaks`` on."""
    with jax.check_tracer_leaks(True):
        yield
