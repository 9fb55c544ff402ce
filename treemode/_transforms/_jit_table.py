"""What every `treemode.jit` wrapper of one callable with the same options shares.

``jax.jit`` keeps its traces and executables in caches keyed weakly on the
function, so a wrapper made anew (inline, in a loop) for a function already
seen reuses them. treemode does the same: `shared_state` finds the `SharedJit`
of a callable and its options in a table of this module, keyed on the callable
by identity and held weakly:

- nothing is written on the user's callable (its ``__dict__`` stays as the user
  left it, so it still pickles: ``cloudpickle``, multiprocessing, Ray);
- nothing in the shared state refers back to the callable strongly (the
  entries reach it only through the bound call, the memos and the rebuild
  through weak references), so when the user drops the callable, its entry in
  the table goes, and with it the executables and the constants their traces
  closed over, by reference counting, with no cycle for the collector.

Any callable that can be weakly referenced is shared: plain functions, the
same ``functools.partial`` object, callable instances. A bound method made
anew (``obj.method`` read again) is a new callable, as it is for ``jax.jit``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _caches
from .._pipeline import _call

if TYPE_CHECKING:
    from ._jit_entry import _JitEntry
    from ._jit_options import JitOptions


class SharedJit:
    """The resolved options, entries and executor's table of fast-path records of
    the wrappers of one callable with one set of options."""

    __slots__ = ("fn_ref", "options", "entries", "records", "__weakref__")

    def __init__(self, fn_ref: weakref.ref[Callable[..., Any]]):
        self.fn_ref = fn_ref
        self.options: JitOptions | None = None  # set by the first wrapper
        self.entries: dict[_call.CallKey, _JitEntry] = {}
        self.records: list[Any] = []  # the executor's table, one list for every wrapper

    def clear_cache(self) -> None:
        for entry in self.entries.values():
            entry.clear()
        self.entries.clear()
        self.records.clear()


class _CallableState:
    """The table's value for one callable: its weak reference, and a `SharedJit` per
    set of options."""

    __slots__ = ("ref", "by_options")

    def __init__(self, ref: weakref.ref[Any]):
        self.ref = ref
        self.by_options: dict[tuple[Any, ...], SharedJit] = {}


# id(callable) -> its state; an entry is removed when its callable dies.
_TABLE: dict[int, _CallableState] = {}


def _forget(key: int, table: dict[int, _CallableState], ref: weakref.ref[Any]) -> None:
    # ``table`` is bound at creation so the callback works during interpreter exit.
    state = table.get(key)
    if state is not None and state.ref is ref:
        table.pop(key, None)  # another thread may have removed it meanwhile


def shared_state(fn: Callable[..., Any], options: tuple[Any, ...]) -> SharedJit | None:
    """The state the wrappers of ``fn`` with ``options`` share (``None``: the options
    are unhashable, or ``fn`` cannot be weakly referenced)."""
    try:
        hash(options)
    except TypeError:
        return None
    key = id(fn)
    state = _TABLE.get(key)
    if state is None or state.ref() is not fn:
        try:
            ref = weakref.ref(fn, functools.partial(_forget, key, _TABLE))
        except TypeError:
            return None
        state = _TABLE[key] = _CallableState(ref)
    shared = state.by_options.get(options)
    if shared is None:
        shared = state.by_options[options] = SharedJit(state.ref)
        _caches.track(shared)
    return shared


def table_size() -> int:
    """How many callables the table holds state for (what tests count)."""
    return len(_TABLE)


__all__ = ["SharedJit", "shared_state", "table_size"]
