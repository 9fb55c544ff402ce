"""The fast-path record: what a miss concludes about the calls like it.

A training loop calls its jitted step with the same model and optimizer objects
and new batches. `prepare` would flatten each argument (a cache hit), copy the
cached flattenings, search the closure (a cache hit), build and hash the call
key and check aliases, only to reach the same conclusion as on the previous
call. After a call ran through the pipeline, `fast_record` states that
conclusion as a record (``_guard.FastRecord``, or its Python twin
`treemode._pipeline._executor.Record`): the slots of the arguments (a bare array,
or a weak reference to a cached flattening), the closure's reads and objects,
the compiled entry and its donation. The miss returns it; the executor keeps it
in its table and runs every call whose arguments are the same objects (an array
where there was an array) and whose cached flattenings still hold: the same
guards `flatten_arg` checks, so the record is exactly as strict as the cache
behind it. Alias freedom and the call key depend only on those flattenings and
on the closure's answer, which are revalidated, so they carry over.

A `CallSite` is the part of a record that comes from the call's arguments
(`CallSite.from_call`). It holds its flattenings weakly: they belong to the
flattening cache, which drops them with their argument, so a record never
keeps a model alive. Whatever the executor does not match goes back to the
pipeline (the transform's miss), which decides again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.core import Tracer

from .. import _compat
from .._accel import _border, _compiled
from .._tree._closure import closure_snapshot
from .._tree._closure_reads import read_check_args
from .._tree._flatten import (
    ARRAY_KEY,
    ArgFlat,
)
from .._tree._leaves import CONCRETE_ARRAY_TYPES
from . import _executor, _interrupts
from ._writeback import writable_in

if TYPE_CHECKING:
    from ._call import Call, PreparedCall


class CallSite:
    """The arguments' part of a fast-path record, for the same objects.

    Built by `CallSite.from_call` from a prepared `Call`, or not at all when the
    call has anything the executor cannot revalidate by identity: static or graph
    arguments, an argument whose flattening is not cached (a tuple, a plain
    dict, an Equinox module, a module holding tracers), or closure objects the
    closure cache does not answer for.
    """

    __slots__ = ("kw_names", "slots", "snapshot", "lifted_slots")

    kw_names: tuple[str, ...]
    # per argument: a weak reference to its flattening's Guarded (or the flattening); None: an array
    slots: tuple[weakref.ref[Any] | None, ...]
    snapshot: Any  # the cached closure search the lifted objects came from
    lifted_slots: tuple[weakref.ref[Any], ...]

    @classmethod
    def from_call(cls, call: Call) -> CallSite | None:
        """The arguments' part of ``call``'s record, or ``None`` if it cannot be
        revalidated by identity."""
        if call.graph or call.static_positional or call.static_keywords:
            return None
        slots: list[weakref.ref[Any] | None] = []
        for flat in call.arg_flats:
            if flat.key is ARRAY_KEY:
                slots.append(None)
                continue
            cached = _cached_flat(flat)
            if cached is None:
                return None
            slots.append(_slot(cached))
        # ``sources`` are the argument flattenings with Variables, then the closure
        # objects' ones; a closure object without Variables has no cached flattening.
        n_lifted = len(call.sources) - sum(1 for f in call.arg_flats if f.variables)
        snapshot = closure_snapshot(call.fn)
        lifted = [_cached_flat(f) for f in call.sources[len(call.sources) - n_lifted :]]
        if (
            snapshot is None
            or n_lifted != len(call.lifted_roots)
            or call.closure_aliases  # closure objects that are arguments': prepared each call
            or any(cached is None for cached in lifted)
        ):
            return None
        site = cls()
        site.kw_names = call.kw_names
        site.slots = tuple(slots)
        site.snapshot = snapshot
        site.lifted_slots = tuple(map(_slot, lifted))  # type: ignore[arg-type]
        return site


def _slot(flat: ArgFlat) -> weakref.ref[Any]:
    """A memo slot: a weak reference to the cached flattening's ``Guarded`` (what the
    compiled match reads), or to the flattening itself where it has none."""
    return weakref.ref(flat if flat._fast is None else flat._fast)


_GUARDED = _compiled.Guarded


def _cached_flat(flat: ArgFlat) -> ArgFlat | None:
    """The cached flattening ``flat`` comes from (``None`` if it is not cached)."""
    cached = flat.origin or flat
    return cached if cached._ref is not None and cached._guard is not None else None


def fast_record(
    site: CallSite | None,
    call: PreparedCall,
    partial_args: tuple[Any, ...],
    jitted: Callable[..., Any],
    donation: tuple[tuple[int, ...], tuple[int, ...]] | None,
    metadata_updates: bool,
    checked: tuple[tuple[int, Any], ...] = (),
) -> Any:
    """The fast-path record of the calls that match ``site``, or ``None``.

    Made after ``call`` ran, and returned by the miss to the executor
    (``_guard.FastCall``, or its Python twin `treemode._pipeline._executor`);
    ``partial_args`` are the arguments a `jit_partial` bound (the executor
    matches them, then the call's own). The executor runs ``jitted`` on a
    matching call's arrays (or on ``(donated, kept)``, positions given by
    ``donation``) and writes the updates back. ``checked`` gives ``(position,
    abstract value)`` pairs the arrays must have (where an entry's signatures
    write different sets, what tells them apart). ``None`` (every call runs
    through the pipeline) where a fast path cannot be trusted:

    - there is no memo (see `CallSite.from_call`);
    - a flattening has no ``Guarded`` (its guard is not compiled, or its arrays
      are not exactly its Variables' values);
    - a trace of the entry recorded metadata updates (the executor writes
      values only);
    - a tracer is among the arrays, or a Variable may not be written in the
      current trace (the record names that trace; another one is a miss).

    A call's shared donated buffers, a retrace, an unusual signal-hold state:
    those vary per call, so the executor checks them and misses.

    The record's ``key`` is what the executor's table keeps one record per: the
    objects matched (their flattenings' identities) and the checked values.
    """
    if site is None or metadata_updates:
        return None
    if any(isinstance(x, Tracer) for x in call.dynamic):
        return None
    trace = _compat.current_trace_ref()
    if trace is None:
        return None
    make = _executor_record()
    compiled = make is _compiled.FastRecord
    for slot in site.slots + site.lifted_slots:
        if slot is None:
            continue
        held: Any = slot()
        flat = held.flat() if type(held) is _GUARDED else held
        if flat is None or not flat.values_only or not writable_in(trace, flat):
            return None  # the executor matches flattenings of Variable values only
        if compiled and type(held) is not _GUARDED:
            return None  # the compiled match reads Guarded slots only
    snapshot = site.snapshot
    positions = tuple(at for at, _ in checked)
    avals = tuple(aval for _, aval in checked)
    key = (
        site.kw_names,
        tuple(None if slot is None else id(slot()) for slot in site.slots),
        tuple(id(slot()) for slot in site.lifted_slots),
        positions,
        avals,
    )
    return make(
        version=_border.RECORD_VERSION,
        key=key,
        slots=site.slots,
        partial_args=partial_args,
        kw_names=site.kw_names,
        closure_reads=snapshot.reads,
        closure_holders=tuple(holder for _, holder in snapshot.found),
        lifted_slots=site.lifted_slots,
        jitted=jitted,
        donated=None if donation is None else donation[0],
        kept=None if donation is None else donation[1],
        trace=trace,
        checked=positions,
        avals=avals,
    )


def _executor_record() -> Callable[..., Any]:
    """The record type of the executor in use: the compiled one, or its Python twin."""
    return _executor.Record if _compiled.FastRecord is None else _compiled.FastRecord


def configure_fields() -> dict[str, Any]:
    """What the extension reads (`treemode._accel._compiled.configure`'s fields)."""
    kinds, ignore, empty, ignored = read_check_args()
    fields = {
        "raw_value": _compat.raw_value_member,
        "metadata": _compat.metadata_member,
        "trace_state": _compat.CURRENT_TRACE,
        "trace_attr": "value",
        "array_types": CONCRETE_ARRAY_TYPES,
        "closure_kinds": kinds,
        "closure_ignore": ignore,
        "closure_empty": empty,
        "closure_ignored": ignored,
        **_interrupts.hold_state(),
        "typeof": jax.typeof,
        "debug_checks": _compat.DEBUG_CHECKS,
    }
    return {name: fields[name] for name in _border.CONFIGURE_FIELDS}  # the border's order


_compiled.configure(**configure_fields())  # once, at import


__all__ = ["CallSite", "configure_fields", "fast_record"]
