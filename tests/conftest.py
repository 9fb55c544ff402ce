import contextlib
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
# `pytest --hypothesis-profile=fuzz`) runs 50x more, randomly. Where hypothesis
# is not installed (tools/gpu_suite.sh on a machine set up by someone else),
# the test files that use it are left out and the rest still runs.
try:
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None
if settings is not None:
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


# The compiled extension (treemode/_accel/_compiled.py). `make test` runs the suite with
# it, `make test-python` with TREEMODE_NO_EXTENSION=1 (the pure-Python path).
# Tests of a piece that has a compiled and a Python implementation take the
# `implementation` fixture: both where the extension is on, the Python one where
# it is off; tests of the C code alone take `extension`.
import treemode  # noqa: E402
from treemode._accel import _compiled  # noqa: E402
from treemode._pipeline import _call, _callsite, _writeback  # noqa: E402
from treemode._tree import _flat_guard, _flatten  # noqa: E402

IMPLEMENTATIONS = ["compiled", "python"] if _compiled.ENABLED else ["python"]


def pytest_report_header(config):
    state = "on" if _compiled.ENABLED else "off"
    env = os.environ.get(_compiled.ENV_VAR, "")
    return f"treemode compiled extension: {state} ({_compiled.ENV_VAR}={env!r})"


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, monkeypatch):
    """``"compiled"`` or ``"python"``: which helpers the call path runs.

    In ``"python"`` every compiled helper that modules look up per call is
    replaced by its Python twin (the flattening guard, the bulk write), and the
    records run by the Python executor (`python_executor`), as with the extension
    off; `make test-python` runs without the extension at all.
    The flattening cache starts empty (its entries carry the guard they were
    made with).
    """
    monkeypatch.setattr(_flatten, "_cache", {})
    if request.param == "python":
        monkeypatch.setattr(_flat_guard, "_compiled_holds", None)
        # The records of the compiled path (in the tables of module-level functions)
        # hold flattenings whose guards are compiled: start without them.
        treemode.clear_caches()
        with python_executor(monkeypatch):
            yield request.param
        treemode.clear_caches()
        return
    yield request.param


@contextlib.contextmanager
def python_executor(monkeypatch):
    """Within the block, `treemode.jit` wrappers run their records with the Python
    executor (`treemode._pipeline._executor`), which makes Python records: the
    twin of the compiled executor, as with the extension off."""
    from treemode._pipeline import _executor
    from treemode._transforms._jit import JitWrapped

    if "__call__" in JitWrapped.__dict__:  # the extension is off: already so
        yield
        return
    monkeypatch.setattr(_callsite, "_executor_record", lambda: _executor.Record)
    from treemode import _compat

    JitWrapped.__call__ = _compat.api_boundary(_executor.PyFastCall.__call__)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del JitWrapped.__call__


@pytest.fixture
def extension():
    """The compiled extension module, for tests of the C code alone."""
    if _compiled.guard is None:
        pytest.skip(f"the compiled extension is off ({_compiled.ENV_VAR} or not built)")
    return _compiled.guard


class Hooks:
    """The private places of treemode's pipeline a test may replace, named only here.

    Every replacement is undone after the test (or by `undo`).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from treemode._pipeline import _core

        self._patch = monkeypatch
        self._core = _core
        self._writeback = _writeback
        self.real_store = _writeback.store
        self.real_prepare = _call.prepare

    def store(self, fn) -> None:
        """Route every Variable write through ``fn(var, value, metadata=None)``."""
        self._patch.setattr(self._writeback, "store", fn)

    def prepare(self, fn) -> None:
        """Replace call preparation (``fn`` takes `prepare`'s arguments)."""
        self._patch.setattr(_call, "prepare", fn)

    def check_writable(self, fn) -> None:
        """Replace the writability check made before any write."""
        self._patch.setattr(self._writeback, "check_writable", fn)

    def before_write(self, fn) -> None:
        """Run ``fn()`` when a call's updates are about to be written back (Python path)."""
        real = self._core.write_back

        def write_back(*args, **kwargs):
            fn()
            return real(*args, **kwargs)

        self._patch.setattr(self._core, "write_back", write_back)

    def donation_seen(self, seen: bool) -> None:
        """Set whether a treemode transform has donated buffers in this process
        (it decides how a deleted input buffer is reported)."""
        from treemode._pipeline import _explain

        self._patch.setattr(_explain, "_donation_seen", seen)

    def pure_check(self, name: str, fn) -> None:
        """Replace one check of the pure function (a method of `PureFunction`)."""
        self._patch.setattr(self._core.PureFunction, name, fn)

    # What `calls` can count: name -> (module of treemode, function).
    COUNTED = {
        "prepare": ("_pipeline._call", "prepare"),  # a transform call prepared in full
        "store": ("_pipeline._writeback", "store"),  # one Variable written by the pipeline
        "value_spec": ("_tree._specs", "value_spec"),  # one Variable's spec built
        "proxy_build": ("_tree._pytree_capture", "from_tree"),  # a Pytree proxy's module built
        "donation_check": ("_transforms._jit", "_check_donation"),  # the Python donation check
    }

    def calls(self, name: str) -> list:
        """Record the first argument of every call of the step ``name`` (see `COUNTED`)."""
        import importlib

        module_name, attr = self.COUNTED[name]
        module = importlib.import_module(f"treemode.{module_name}")
        real = getattr(module, attr)
        seen: list = []

        def counting(first, *args, **kwargs):
            seen.append(first)
            return real(first, *args, **kwargs)

        self._patch.setattr(module, attr, counting)
        return seen

    def undo(self) -> None:
        self._patch.undo()


@pytest.fixture
def hooks(monkeypatch):
    """`Hooks` for this test."""
    return Hooks(monkeypatch)
