"""Trace-time Variables written outside their trace: an error that names them.

Inside a transform the function receives copies of its arguments whose
Variables hold the traced values; only the traced function itself can write
them. Flax refuses a write from any other trace ("from a different trace
level"): from a host callback such as ``jax.debug.callback`` (it runs on the
host while the compiled function executes), from a plain JAX transform nested
in the function, or through a reference kept after the call. `mark` gives
every copy a trace state that raises a `MutationError` naming the transform,
the argument path and the fix instead.

The trace state holds structure only (the call's `CallKey`), never a tracer or
the caller's objects, and its check costs what Flax's does. A callback error
reaches the caller wrapped in JAX's runtime error; `stale_write_error` turns it
back into the `MutationError` (the message is recognised, not parsed).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from .._errors import MutationError
from .._tree._paths import format_path
from .._tree._specs import StructureKey, VarSpec

# Messages of the last few stale writes (any thread: callbacks run on XLA's).
_recent: collections.deque[str] = collections.deque(maxlen=16)


class _Origin:
    """Which transform call rebuilt a group of Variables: structure only."""

    __slots__ = ("transform", "names", "keys")

    def __init__(self, pure: Any, closure_names: Sequence[str] = ()):
        self.transform: str = pure.transform
        key = pure.key
        static = pure.static_positional
        names = [f"args[{i}]" for i in range(pure.num_args) if i not in static]
        names += [f"kwargs[{name!r}]" for name in pure.kw_names]
        self.names = names
        keys = [k for k in key.positional if isinstance(k, StructureKey)]
        keys += [k for _, k in key.keywords if isinstance(k, StructureKey)]
        names += closure_names  # the lifted closure objects come last
        keys += key.closure
        self.keys = keys

    def describe(self, index: int) -> str:
        """``the <type> at <path>`` for the ``index``-th Variable (error path only)."""
        for name, key in zip(self.names, self.keys, strict=False):
            positions = [j for j, spec in enumerate(key.specs) if type(spec) is VarSpec]
            if index >= len(positions):
                index -= len(positions)
                continue
            spec = key.specs[positions[index]]
            assert type(spec) is VarSpec
            return f"the {spec.var_type.__name__} at {_path(key, positions[index], name)}"
        return "a Variable of an argument"  # pragma: no cover - defensive


def _path(key: StructureKey, position: int, name: str) -> str:
    """The display path of leaf ``position`` of an argument with structure ``key``."""
    marks = [_Mark() for _ in key.specs]
    try:
        tree = key.treedef.unflatten(marks)
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: type(x) is _Mark)[0]
    except Exception:  # a custom pytree that checks its leaves: the argument only
        return name
    target = marks[position]
    for path, leaf in flat:
        if leaf is target:
            return format_path(path, name)
    return name


class _Mark:
    """A placeholder leaf, to recover key paths from a treedef."""

    __slots__ = ()


class TraceTimeState(_compat.TraceState):
    """The trace state of a Variable a transform rebuilt for one trace."""

    __slots__ = ("origin", "index")

    def __init__(self, jax_trace: Any, origin: _Origin, index: int):
        self._jax_trace = jax_trace  # the slot of _compat.TraceState
        self.origin = origin
        self.index = index

    def is_valid(self) -> bool:
        if self._jax_trace == _compat.current_jax_trace():
            return True  # in its own trace: the traced function may write it
        message = _message(self.origin, self.index)
        _recent.append(message)
        raise MutationError(message)


def _message(origin: _Origin, index: int) -> str:
    return (
        f"treemode.{origin.transform}: {origin.describe(index)} was written outside the "
        "trace of the transform that rebuilt it. Inside a transform the function receives "
        "trace-time copies of its arguments, which only the traced function itself can "
        "write: not a host callback such as jax.debug.callback (it runs on the host while "
        "the compiled function executes), not a plain JAX transform nested in the function "
        "(use the treemode version: treemode.scan, treemode.cond, ...), and not a reference "
        "kept after the call. Such a write could never reach your module.\nUpdate the "
        "Variable in the traced function itself (`module.var[...] = value`), or return the "
        "value from the function and assign it outside; give a callback the values it needs "
        "as arguments and do not write modules from inside it."
    )


def mark_trace_time(pure: Any, variables: Sequence[Any], closure_names: Sequence[str] = ()) -> None:
    """Give the Variables a `PureFunction` rebuilt for the current trace their state
    (those of the arguments, then those of the closure objects ``closure_names``)."""
    if not variables:
        return
    origin = _Origin(pure, closure_names)
    for i, var in enumerate(variables):
        state = _compat.jax_trace_of(_compat.trace_state_of(var))
        _compat.set_trace_state(var, TraceTimeState(state, origin, i))


def stale_write_error(error: BaseException) -> MutationError | None:
    """The `MutationError` behind a JAX runtime error raised by a host callback."""
    if not _recent:
        return None
    text = str(error)
    for message in reversed(_recent):
        if message in text:
            return MutationError(message)
    return None
