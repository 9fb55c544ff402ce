"""The private Flax/JAX names treemode reads are checked once, at import (treemode._compat).

A Flax or JAX whose layout differs must give one clear message at import: an
ImportError naming the supported versions where the pure-Python path cannot
work, one warning and the pure-Python path where only the compiled path
relies on the difference. The checks run here on stand-ins for Flax's classes.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
from flax import nnx
from flax.nnx import tracers

from treemode import _compat
from treemode._accel import _compiled


class _Ref:
    pass


REF = _Ref()


class _Opaque:
    _trace_ref = REF


class FakeTracers:
    """A stand-in for ``flax.nnx.tracers`` whose current trace is ``REF``."""

    class TraceState:
        __slots__ = ("_jax_trace",)

    @staticmethod
    def current_jax_trace() -> Any:
        return _Opaque()


class FakeTraceState:
    """A stand-in for JAX's per-thread trace state."""

    value = REF


class SlotVariable:
    __slots__ = ("_raw_value", "_trace_state", "_var_metadata")


class DictVariable:  # the attributes exist, but as properties over an instance dict
    _raw_value = property(lambda self: self.__dict__["v"])
    _trace_state = property(lambda self: None)
    _var_metadata = property(lambda self: {})


class RenamedVariable:  # a Flax that renamed its value slot
    __slots__ = ("_value", "_trace_state", "_var_metadata")


@pytest.fixture
def fake_flax():
    """``check``'s arguments for a Flax/JAX laid out as the supported ones."""
    return {"tracers_module": FakeTracers, "trace_state": FakeTraceState()}


def test_the_installed_versions_pass():
    # Older JAX releases keep the trace reference elsewhere: read through Flax
    # (a fallback), which keeps the compiled path.
    assert not _compat.REPORT.missing and not _compat.REPORT.unslotted
    assert _compat.COMPILED_OK
    assert _compat.check() == _compat.REPORT


def test_the_supported_layout_passes(fake_flax):
    assert _compat.check(SlotVariable, **fake_flax) == _compat.Report()


def test_a_missing_slot_is_an_import_error_naming_the_versions(fake_flax):
    report = _compat.check(RenamedVariable, **fake_flax)
    assert report.missing == ("RenamedVariable._raw_value",)
    with pytest.raises(ImportError, match=r"RenamedVariable\._raw_value not found") as raised:
        _compat.resolve(report, installed="jax 0.13.0, jaxlib 0.13.0, flax 0.14.1")
    message = str(raised.value)
    assert message.startswith(
        "treemode does not support the installed Flax/JAX (jax 0.13.0, jaxlib 0.13.0, "
        "flax 0.14.1): RenamedVariable._raw_value not found. Supported: "
        "jax 0.9.2 or newer (tested to 0.12.x), jaxlib 0.9.2 or newer (tested to 0.12.x), "
        "flax 0.12.6 or newer (tested to 0.12.x). This treemode cannot run with them"
    ), message
    assert "https://github.com/treemode/treemode/issues" in message
    assert "pip install" not in message  # no command that would move JAX down


def test_attributes_outside_slots_turn_the_compiled_path_off_with_one_warning(fake_flax):
    report = _compat.check(DictVariable, **fake_flax)
    assert not report.missing
    assert report.unslotted == tuple(
        f"DictVariable.{name} is not a __slots__ member" for name in _compat.VARIABLE_SLOTS
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # _compat only decides; _compiled warns
        assert _compat.resolve(report) is False
    problem = _compat.slots_problem(report, installed="jax 0.13.0, jaxlib 0.13.0, flax 0.14.1")
    assert problem == (
        "; ".join(report.unslotted)
        + " (installed: jax 0.13.0, jaxlib 0.13.0, flax 0.14.1; supported: "
        + _compat.SUPPORTED_VERSIONS
        + ")"
    )
    # ... and the extension is then not loaded, whatever the environment says,
    # with one ExtensionWarning naming the problem and the versions.
    module, status = _compiled.resolve(environ={}, slots_problem=problem)
    assert module is None
    assert status == _compiled.ExtensionStatus(False, f"layout not supported: {problem}")
    with pytest.warns(_compiled.ExtensionWarning) as caught:
        _compiled.announce(status, environ={})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "flax 0.14.1" in message and "runs the same checks in Python" in message
    assert _compiled.load(environ={}, compiled_ok=False) is None


def test_another_jax_trace_state_reads_the_trace_through_flax(fake_flax):
    class Elsewhere:
        value = object()

    report = _compat.check(SlotVariable, FakeTracers, Elsewhere())
    assert report.unslotted == () and report.missing == ()
    assert report.fallbacks == (
        "jax._src.core.trace_state.value is not the trace reference Flax compares",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.resolve(report) is True  # the compiled path stays on


def test_a_flax_without_the_trace_helpers_is_an_import_error():
    report = _compat.check(SlotVariable, types.SimpleNamespace(), FakeTraceState())
    assert report.missing == ("flax.nnx.tracers.TraceState / current_jax_trace",)
    with pytest.raises(ImportError, match="Supported:"):
        _compat.resolve(report)


def test_the_installed_flax_is_checked_by_default():
    # The defaults are the installed classes: a check of them alone agrees.
    assert _compat.check(nnx.Variable, tracers) == _compat.REPORT


def test_no_warning_for_the_supported_versions():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.resolve(_compat.Report()) is True


@pytest.mark.parametrize(("value", "off"), [("", False), ("0", False), ("1", True), ("yes", True)])
def test_the_environment_variable_turns_the_extension_off(value, off):
    assert _compiled.disabled_by({_compiled.ENV_VAR: value}) is off
    if off:
        assert _compiled.load(environ={_compiled.ENV_VAR: value}) is None


def test_the_accessors_read_and_write_a_variable():
    v = nnx.Param(1.0)
    _compat.set_raw_value(v, 2.0)
    assert _compat.raw_value_of(v) == 2.0 == v.get_raw_value()
    _compat.set_metadata(v, {**_compat.metadata_of(v), "tag": "x"})
    assert v.get_metadata()["tag"] == "x"
    assert _compat.trace_ref_of(v) is _compat.current_trace_ref()


def test_the_supported_jax_takes_treemodes_argument_names():
    # JAX reads a traced function's DebugInfo from ``__fun_debug_info__``: on the
    # supported versions treemode's flat functions name their arrays by the user's
    # paths (issue 40); a JAX that stops reading it fails here, not silently.
    assert _compat.NAMES_ARGUMENTS

    def flat(*arrays: Any) -> Any:
        return arrays

    assert _compat.name_arguments(flat, "jit", ["model.kernel", "x"])
    from jax._src import api_util

    info = api_util.debug_info("jit", flat, (1, 2), {})
    assert info.arg_names == ("model.kernel", "x")
    assert info.func_src_info.startswith("flat at ")
