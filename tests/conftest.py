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


# Hypothesis profiles (tests/test_properties.py): "ci" is the default, small and
# derandomized so every run checks the same examples; "fuzz" (`make fuzz`, or
# `pytest --hypothesis-profile=fuzz`) runs 50x more, randomly.
from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    max_examples=20,
    derandomize=True,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)
settings.register_profile(
    "fuzz",
    max_examples=1000,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Tracer-leak mode: `pytest --tracer-leaks` (or TREEMODE_TRACER_LEAKS=1) runs
# every test under jax.check_tracer_leaks(True), which fails a test whose
# traces leave a tracer referenced anywhere (see docs/contributing.md).
def pytest_addoption(parser):
    parser.addoption(
        "--tracer-leaks",
        action="store_true",
        help="run every test under jax.check_tracer_leaks(True)",
    )


@pytest.fixture(autouse=True)
def _tracer_leak_mode(request):
    if request.config.getoption("--tracer-leaks") or os.environ.get("TREEMODE_TRACER_LEAKS"):
        with jax.check_tracer_leaks(True):
            yield
    else:
        yield
