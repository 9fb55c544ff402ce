"""The one place treemode reads private attributes of Flax and JAX, checked at import.

Tree mode reads and writes a Variable without going through
``Variable.__getattr__`` / ``__setattr__`` (which check the trace level, run
hooks and cost a Python frame each), and compares traces the way Flax does.
That needs a few names Flax and JAX do not document:

- Flax's ``Variable.__slots__``: ``_raw_value`` (the value), ``_var_metadata``
  (the metadata dict) and ``_trace_state`` (a ``flax.nnx.tracers.TraceState``);
- ``TraceState._jax_trace`` (JAX's opaque trace state, as Flax keeps it) and its
  ``_trace_ref``, the weak reference to the trace that Flax compares;
- JAX's per-thread ``jax._src.core.trace_state``, whose ``value`` is that weak
  reference for the current trace, read without building the opaque wrapper;
- JAX's ``jax._src.config.trace_context()``: the configuration JAX keys its
  traces on, which treemode's caches in front of ``jax.jit`` are keyed on too
  (`trace_key`);
- ``flax.nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache``, set by
  ``nnx.cached_partial`` for the Flax transform it calls to consume: a treemode
  wrapper called through it takes it (clears it, as a Flax transform would) and
  runs as the plain partial (where it is missing, nothing is taken);
- ``flax.nnx.extract.TreeState`` and ``from_tree2``: what ``nnx.prefix(...,
  graph=True)`` returns and how Flax decodes it (optional: where they are
  missing, such prefixes are not recognized; see ``treemode._transforms._prefix``).

Every other module reads them through the accessors below, never by name.
`check` verifies them once, when treemode is imported:

- a name the pure-Python path needs is missing: ``import treemode`` raises an
  `ImportError` naming the supported versions (never an ``AttributeError`` at
  the first call);
- only what the compiled call path relies on differs (the Variable
  attributes are not plain ``__slots__``): treemode runs its pure-Python path
  (`COMPILED_OK` is False), and ``treemode._accel._compiled`` says so in one
  ``treemode.ExtensionWarning`` (and in ``treemode.extension_status()``).

Both messages name the installed versions: pyproject.toml declares minimums
only, so a JAX or Flax newer than the tested ones is installed as it is.
"""

from __future__ import annotations

import functools
import operator
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
from flax import nnx
from flax.nnx import tracers

from ._versions import ISSUES_URL, REQUIRED, describe, installed_versions

# The supported ranges (one source: treemode/_versions.py), named in the messages.
SUPPORTED_VERSIONS = ", ".join(f"{name} {describe(name)}" for name in REQUIRED)

RAW_VALUE = "_raw_value"
VAR_METADATA = "_var_metadata"
TRACE_STATE = "_trace_state"
VARIABLE_SLOTS = (RAW_VALUE, TRACE_STATE, VAR_METADATA)


@dataclass(frozen=True)
class Report:
    """What `check` found: ``missing`` breaks treemode, ``unslotted`` only its compiled path;
    ``fallbacks`` are reads that go through Flax instead of a faster JAX value
    (the compiled path reads through them as well)."""

    missing: tuple[str, ...] = ()
    unslotted: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()


def _jax_trace_state() -> Any:
    """JAX's per-thread trace-state config value, or ``None`` where it has none."""
    try:
        from jax._src.core import trace_state
    except ImportError:
        return None
    return trace_state


def check(
    variable_type: type = nnx.Variable,
    tracers_module: Any = tracers,
    trace_state: Any = None,
) -> Report:
    """Check the private names treemode reads (the installed ones by default).

    **Arguments:**

    - ``variable_type``: the Variable class (``flax.nnx.Variable``).
    - ``tracers_module``: the module with ``TraceState`` and ``current_jax_trace``
      (``flax.nnx.tracers``).
    - ``trace_state``: JAX's per-thread trace state (``None``: the installed one).

    **Returns:** a `Report`; empty where everything is as expected.

    ```python
    from treemode import _compat

    assert _compat.check() == _compat.Report()
    ```
    """
    missing: list[str] = []
    unslotted: list[str] = []
    slots = getattr(variable_type, "__slots__", ())
    for name in VARIABLE_SLOTS:
        where = next((c for c in variable_type.__mro__ if name in vars(c)), None)
        if where is None:
            missing.append(f"{variable_type.__qualname__}.{name}")
        elif name not in slots or type(vars(where)[name]) is not types.MemberDescriptorType:
            unslotted.append(f"{variable_type.__qualname__}.{name} is not a __slots__ member")
    trace_state_type = getattr(tracers_module, "TraceState", None)
    current_jax_trace = getattr(tracers_module, "current_jax_trace", None)
    if trace_state_type is None or current_jax_trace is None:
        missing.append("flax.nnx.tracers.TraceState / current_jax_trace")
        return Report(tuple(missing), tuple(unslotted))
    if "_jax_trace" not in getattr(trace_state_type, "__slots__", ()):
        missing.append("flax.nnx.tracers.TraceState._jax_trace")
    try:
        ref = current_jax_trace()._trace_ref
    except AttributeError:
        missing.append("the _trace_ref of jax.extend.core.get_opaque_trace_state()")
        return Report(tuple(missing), tuple(unslotted))
    if trace_state is None:
        trace_state = _jax_trace_state()
    fallbacks: list[str] = []
    if trace_state is None:
        fallbacks.append("jax._src.core.trace_state is missing")
    elif getattr(trace_state, "value", None) is not ref:
        fallbacks.append("jax._src.core.trace_state.value is not the trace reference Flax compares")
    return Report(tuple(missing), tuple(unslotted), tuple(fallbacks))


def resolve(report: Report, installed: str | None = None) -> bool:
    """Act on a `Report`: whether the compiled call path may run.

    **Arguments:**

    - ``report``: what `check` found.
    - ``installed``: the installed versions in words, for the message (default:
      read from the package metadata).

    **Returns:** ``False`` for a slots problem (``treemode._accel._compiled`` then
    leaves the extension off and warns once, naming `slots_problem`), else ``True``.

    **Raises:** `ImportError` naming the installed and the supported versions
    for a missing name (the pure-Python path cannot run either).
    """
    if report.missing:
        installed = installed_versions() if installed is None else installed
        raise ImportError(
            f"treemode does not support the installed Flax/JAX ({installed}): "
            + ", ".join(report.missing)
            + f" not found. Supported: {SUPPORTED_VERSIONS}. This treemode cannot run"
            + " with them (a release newer than the tested ones changed a private name it"
            + f" reads); please report it at {ISSUES_URL} with the versions above."
        )
    return not report.unslotted


def slots_problem(report: Report, installed: str | None = None) -> str:
    """Why the compiled path cannot read the installed Variable slots ("" where it can)."""
    if not report.unslotted:
        return ""
    installed = installed_versions() if installed is None else installed
    versions = f" (installed: {installed}; supported: {SUPPORTED_VERSIONS})"
    return "; ".join(report.unslotted) + versions


REPORT = check()
COMPILED_OK = resolve(REPORT)
SLOTS_PROBLEM = slots_problem(REPORT)

# -- Accessors ---------------------------------------------------------------------

# The member descriptors of the Variable slots (what the compiled path writes
# through; `None` where `check` found another version).
_slot_members: dict[str, Any] = {
    name: vars(c)[name]
    for name in VARIABLE_SLOTS
    for c in nnx.Variable.__mro__
    if name in vars(c) and type(vars(c)[name]) is types.MemberDescriptorType
}
raw_value_member: Any = _slot_members.get(RAW_VALUE)
metadata_member: Any = _slot_members.get(VAR_METADATA)

raw_value_of = operator.attrgetter(RAW_VALUE)
metadata_of = operator.attrgetter(VAR_METADATA)
trace_state_of = operator.attrgetter(TRACE_STATE)
jax_trace_of = operator.attrgetter("_jax_trace")  # of a TraceState
trace_ref_of = operator.attrgetter(f"{TRACE_STATE}._jax_trace._trace_ref")  # of a Variable

TraceState: type = tracers.TraceState
current_jax_trace = tracers.current_jax_trace

_setattr = object.__setattr__


def set_raw_value(var: Any, value: Any) -> None:
    """``var._raw_value = value``, bypassing Variable's trace-level check."""
    _setattr(var, RAW_VALUE, value)


def set_metadata(var: Any, metadata: dict[str, Any]) -> None:
    """``var._var_metadata = metadata``, bypassing Variable's hooks."""
    _setattr(var, VAR_METADATA, metadata)


def set_trace_state(var: Any, state: Any) -> None:
    """``var._trace_state = state`` (a `TraceState`)."""
    _setattr(var, TRACE_STATE, state)


def _trace_ref_from_jax() -> Any:
    """The weak reference identifying the current JAX trace (what NNX compares)."""
    return getattr(current_jax_trace(), "_trace_ref", None)


class _TraceRefFromFlax:
    """Gives `_trace_ref_from_jax()` as ``value``, like JAX's per-thread ``trace_state``."""

    __slots__ = ()

    @property
    def value(self) -> Any:
        return _trace_ref_from_jax()


# ``CURRENT_TRACE.value``: the current trace's weak reference. JAX's own
# per-thread value where `check` verified it, else read through Flax.
_jax_current = _jax_trace_state()
CURRENT_TRACE: Any = (
    _jax_current if _jax_current is not None and not REPORT.fallbacks else _TraceRefFromFlax()
)


def _graph_context() -> Any:
    try:
        from flax.nnx import graphlib
    except ImportError:  # pragma: no cover - another Flax version
        return None
    return getattr(graphlib, "GRAPH_CONTEXT", None)


_GRAPH_CONTEXT = _graph_context()

# Where ``nnx.cached_partial`` leaves its cache for the Flax transform it calls
# (``(object, attribute)``, which the executor's ``_before_call`` clears).
FLAX_STATIC_CACHE: tuple[Any, str] | None = (
    None if _GRAPH_CONTEXT is None else (_GRAPH_CONTEXT, "tmp_static_cache")
)


def take_flax_static_cache() -> bool:
    """Whether ``nnx.cached_partial`` left a cache for a Flax transform to consume;
    if so, it is taken (cleared), as a Flax transform takes it: treemode needs no
    cache (its own flattening cache and fast path make the repeated call cheap)."""
    if getattr(_GRAPH_CONTEXT, "tmp_static_cache", None) is None:
        return False
    _GRAPH_CONTEXT.tmp_static_cache = None
    return True


def current_trace_ref() -> Any:
    """The weak reference identifying the current JAX trace."""
    return CURRENT_TRACE.value


def _debug_check_states() -> tuple[Any, ...]:
    """JAX's ``jax_debug_nans`` and ``jax_debug_infs`` config states, whose ``value``
    is the current setting (``jax.debug_nans(True)`` blocks included); ``()`` where
    JAX keeps them elsewhere (then only the public flags are read, in Python)."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - every supported JAX has it
        return ()
    states = tuple(getattr(config, name, None) for name in ("debug_nans", "debug_infs"))
    if any(not isinstance(getattr(s, "value", None), bool) for s in states):
        return ()  # pragma: no cover - another version
    return states


# JAX's NaN/Inf checks: under them a donated call runs undonated (JAX's re-run
# of the function, which names the primitive, needs the inputs alive). The
# compiled executor reads their ``value`` and misses while one is on.
DEBUG_CHECKS = _debug_check_states()


def debug_checks_on() -> bool:
    """Whether ``jax_debug_nans`` or ``jax_debug_infs`` is on in this thread."""
    if DEBUG_CHECKS:
        return DEBUG_CHECKS[0].value or DEBUG_CHECKS[1].value
    flags = ("jax_debug_nans", "jax_debug_infs")  # pragma: no cover - another version
    return any(bool(getattr(jax.config, flag, False)) for flag in flags)  # pragma: no cover


def _traceback_util() -> Any:
    """JAX's ``jax._src.traceback_util`` (its ``api_boundary``,
    ``register_exclusion`` and ``filter_traceback``), or ``None`` where it has
    another version."""
    try:
        from jax._src import traceback_util
    except ImportError:  # pragma: no cover - every supported JAX has it
        return None
    names = ("api_boundary", "register_exclusion", "filter_traceback")
    if not all(callable(getattr(traceback_util, name, None)) for name in names):
        return None  # pragma: no cover - another version
    return traceback_util


_TRACEBACK_UTIL = _traceback_util()
F = TypeVar("F", bound=Callable[..., Any])


def api_boundary(fn: F) -> F:
    """``fn`` as a boundary of JAX's traceback filtering (``jax.jit``'s own kind).

    An exception leaving the outermost boundary has the frames of JAX and of
    treemode (registered below) removed from its traceback, unless
    ``JAX_TRACEBACK_FILTERING=off``; boundaries inside it leave that to it.
    The exceptions chained to it (its ``__cause__`` and ``__context__``: the
    ``TypeError`` of an unhashable static argument behind a
    ``StaticArgumentError``, JAX's error behind a ``DonationError``) lose the same
    frames (`hide_internal_frames_of_causes`), so no printed part of the
    traceback starts inside treemode. Where JAX has no such function, ``fn``
    itself.
    """
    if _TRACEBACK_UTIL is None:
        return fn  # pragma: no cover - another version

    @functools.wraps(fn)
    def filtered(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            hide_internal_frames_of_causes(error)
            raise

    return _TRACEBACK_UTIL.api_boundary(filtered)


def _filtering_mode() -> str:
    """JAX's traceback filtering mode in force (``"auto"`` resolved, as JAX does)."""
    mode = getattr(_TRACEBACK_UTIL, "_filtering_mode", None)
    if callable(mode):
        return str(mode())
    value = jax.config.values.get("jax_traceback_filtering")  # pragma: no cover - another version
    return "quiet_remove_frames" if value in (None, "auto") else str(value)  # pragma: no cover


def hide_internal_frames_of_causes(error: BaseException) -> None:
    """Remove JAX's and treemode's frames from the tracebacks of the exceptions
    chained to ``error`` (causes and contexts, transitively), as JAX's boundary
    does for ``error``'s own; the user's frames stay (a ``__hash__`` that raised).

    Nothing changes with ``JAX_TRACEBACK_FILTERING=off``; under IPython
    (``tracebackhide``) the frames are marked hidden instead, as JAX marks them.
    """
    if _TRACEBACK_UTIL is None:
        return  # pragma: no cover - another version
    mode = _filtering_mode()
    if mode == "off":
        return
    seen = {id(error)}
    chained = [error.__cause__, error.__context__]
    while chained:
        link = chained.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        chained += [link.__cause__, link.__context__]
        tb = link.__traceback__
        if tb is None:
            continue
        if mode == "tracebackhide":
            hide = getattr(_TRACEBACK_UTIL, "_add_tracebackhide_to_hidden_frames", None)
            if callable(hide):
                hide(tb)
        else:
            link.with_traceback(_TRACEBACK_UTIL.filter_traceback(tb))


def forget_traceback_filtering(error: BaseException) -> None:
    """Drop the note JAX's filtering added to ``error`` (JAX's ``_simplified_tb_msg``).

    For an error a ``jax.jit`` boundary already filtered with no treemode
    boundary around it (the compiled executor calls ``jax.jit`` directly) and
    that now leaves through treemode's: that one filters it again and adds the
    note again.
    """
    message = getattr(_TRACEBACK_UTIL, "_simplified_tb_msg", None)
    notes = getattr(error, "__notes__", None)
    if not isinstance(message, str) or not isinstance(notes, list):
        return
    for i, note in enumerate(notes):
        if isinstance(note, str) and note.endswith(message):
            del notes[i]
            return


def exclude_from_tracebacks(path: str) -> None:
    """Have JAX's traceback filtering leave out the frames of files under ``path``."""
    if _TRACEBACK_UTIL is not None:
        _TRACEBACK_UTIL.register_exclusion(path)


# treemode's frames are filtered from user tracebacks the way JAX filters its
# own (its public entry points are `api_boundary`s): the whole package.
exclude_from_tracebacks(os.path.dirname(os.path.abspath(__file__)) + os.sep)


def _flax_graph_prefix() -> tuple[type | None, Any]:
    """``(TreeState, from_tree2)`` of ``flax.nnx.extract``, or ``(None, None)``."""
    try:
        from flax.nnx import extract
    except ImportError:  # pragma: no cover - every supported Flax has it
        return None, None
    tree_state = getattr(extract, "TreeState", None)
    decode = getattr(extract, "from_tree2", None)
    if not isinstance(tree_state, type) or not callable(decode):
        return None, None
    return tree_state, decode


# The node type of ``nnx.prefix(..., graph=True)`` output (one per graph node of
# the prefixed tree: its GraphDef and a State holding the prefix values) and
# Flax's decoder of such trees (objects rebuilt, shared references restored).
FLAX_TREE_STATE, flax_from_tree = _flax_graph_prefix()


def _trace_context() -> Callable[[], Any]:
    """JAX's trace context: the configuration its trace caches are keyed on (x64,
    default matmul precision, dtype and rank promotion, default device, mesh and
    sharding modes, debug flags, ...), read from JAX so that no option is missed."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - every supported JAX has it
        return lambda: ()
    context = getattr(config, "trace_context", None)
    if not callable(context):  # pragma: no cover - another version
        raise ImportError(
            "treemode: this JAX has no jax._src.config.trace_context, which treemode's "
            f"caches are keyed on (supported: {SUPPORTED_VERSIONS})."
        )
    return context


trace_context = _trace_context()


def trace_key(avals: Any) -> tuple[Any, ...]:
    """The key of a trace as ``jax.jit`` keys its own: the inputs' abstract values
    (``jax.typeof``: shape, dtype, weak type and, with explicit sharding, sharding)
    and the current trace context. A cache in front of ``jax.jit`` that is keyed on
    this is reused exactly where ``jax.jit`` would reuse its trace."""
    return (trace_context(), tuple(avals))


# -- the names JAX gives a traced function's arguments ----------------------------
#
# JAX names the arguments of a function it traces in its messages (tracer
# conversion and concretization errors, leaked tracers, ``jax_explain_cache_misses``)
# from a ``DebugInfo`` built by ``jax._src.api_util.debug_info``, which returns the
# one a function carries as ``__fun_debug_info__`` where it has one. treemode's flat
# functions carry one whose ``arg_names`` are the user's paths (`name_arguments`).


def _debug_info_reader() -> Any:
    """``api_util.debug_info`` where it honours ``__fun_debug_info__`` (else ``None``)."""
    try:
        from jax._src import api_util

        def probe(x: Any) -> Any:
            return x

        built = api_util.debug_info("jit", probe, (0,), {})
        probe.__fun_debug_info__ = built._replace(arg_names=("probe name",))  # type: ignore[attr-defined]
        if api_util.debug_info("jit", probe, (0,), {}).arg_names != ("probe name",):
            return None
        return api_util.debug_info
    except Exception:  # another layout: JAX names the arguments from the signature
        return None


_DEBUG_INFO = _debug_info_reader()
# Whether JAX's messages can name the user's arguments (`name_arguments`).
NAMES_ARGUMENTS = _DEBUG_INFO is not None


def debug_info_named(traced_for: str, like: Callable[..., Any], names: Any) -> Any:
    """JAX's debug info for a function traced for ``traced_for``, named and located as
    ``like`` (the user's function), its flat arguments named by ``names``
    (``None`` where the installed JAX's layout differs)."""
    if _DEBUG_INFO is None:
        return None
    info = _DEBUG_INFO(traced_for, like, (), {})
    return info._replace(arg_names=tuple(names))


def name_arguments(fn: Callable[..., Any], traced_for: str, names: Any) -> bool:
    """Make JAX name the flat arguments of ``fn`` by ``names`` (one per array, in
    order) when it traces ``fn`` for ``traced_for`` (``"jit"``, ``"vmap"``...).

    ``fn``'s name and source location are read as JAX reads them (set them first).
    Returns whether JAX will use the names (False on a JAX whose layout differs: it
    then names them from ``fn``'s signature).
    """
    if _DEBUG_INFO is None:
        return False
    info = _DEBUG_INFO(traced_for, fn, (), {})
    fn.__fun_debug_info__ = info._replace(arg_names=tuple(names))  # type: ignore[attr-defined]
    return True


__all__ = [
    "COMPILED_OK",
    "SLOTS_PROBLEM",
    "Report",
    "SUPPORTED_VERSIONS",
    "NAMES_ARGUMENTS",
    "check",
    "debug_info_named",
    "name_arguments",
    "slots_problem",
    "resolve",
]
