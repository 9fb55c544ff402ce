"""Write-back, after the JAX transform returns: step 5 of the pipeline.

`write_back` stores the changed values (and any metadata a trace changed) into
the caller's Variables, all or nothing, after `check_writable` made sure every
target may be written in the current trace. `write_back_all` does the same for
several candidate write-backs at once (the branches of ``cond``/``switch``,
whose closure Variables differ): all of them commit, or none.

`store` is the one place the pipeline writes a Variable (tests inject faults
there); while it is the default, the writes are made in one C-level pass
(``map`` over ``object.__setattr__``). The extension's executor writes in
bulk too, in C, without this module (`write_back` is its twin, bound by
tests/test_twins.py); faults reach it at the Variable level (a Variable type
whose value slot refuses a write).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any, NamedTuple

import jax
from jax.core import Tracer

from .. import _compat
from .._errors import TraceContextError
from .._tree._flatten import ArgFlat
from ._call import PreparedCall


def check_writable(call: PreparedCall, updates: Sequence[Any]) -> None:
    """Raise before writing anything if a target Variable belongs to another trace."""
    # A Variable may be written in the trace it was created in (as Variable itself
    # checks). Fast path: the traces' weak references compared by identity, and
    # remembered per cached argument (a Variable's trace never changes).
    ref = current_trace_ref()
    if ref is not None:
        for flat in call.sources:
            if not writable_in(ref, flat):
                break
        else:
            return
    current = _compat.current_jax_trace()
    targets = [var for var, new in zip(call.variables, updates, strict=True) if new is not None]
    for var in targets:
        if _compat.jax_trace_of(_compat.trace_state_of(var)) != current and not var.hijax:
            index = next(i for i, v in enumerate(call.variables) if v is var)
            path = call.full().variable_paths()[index]
            raise TraceContextError(
                f"treemode.{call.transform}: cannot write the new value of the "
                f"{type(var).__name__} at {path} back: the Variable was created outside "
                "the JAX transform that is currently tracing (for example a module closed "
                "over by jax.jit or jax.lax.scan), so storing a traced value in it would "
                "leak a tracer.\nPass the module as an argument of that outer transform "
                "(e.g. treemode.jit instead of jax.jit over a closure)."
            )


def writable_in(ref: Any, flat: ArgFlat) -> bool:
    """Whether every Variable of ``flat`` was created in the trace behind ``ref``."""
    cached = flat.origin or flat  # remembered on the cached flattening
    if cached.writable_in is ref:
        return True
    writable = all(map(operator.is_, map(_trace_ref_of, flat.variables), repeat(ref)))
    if writable:
        cached.writable_in = ref
    return writable


_trace_ref_of = _compat.trace_ref_of
_raw_value_of = _compat.raw_value_of
_metadata_of = _compat.metadata_of


def write_back(
    call: PreparedCall,
    updates: Sequence[Any],
    metadata_updates: dict[int, dict[str, Any]] | None = None,
) -> None:
    """Store the changed values into the caller's Variables, all or nothing."""
    changed = list(map(operator.is_not, updates, repeat(None)))
    if not metadata_updates and not any(changed):
        return  # the no-update path (a forward pass): nothing to check or write
    if all(changed):  # a train step: every Variable changed
        targets, values = list(call.variables), list(updates)
    else:
        targets = list(compress(call.variables, changed))
        values = list(compress(updates, changed))
    check_writable(call, updates)
    old_values = list(map(_raw_value_of, targets))
    meta_targets = [call.variables[i] for i in metadata_updates] if metadata_updates else []
    old_meta = [(var, _raw_value_of(var), _metadata_of(var)) for var in meta_targets]
    try:
        if store is DEFAULT_STORE:
            # The default hook, in one C-level pass (no interrupt can land midway).
            list(map(_setattr, targets, repeat(_compat.RAW_VALUE), values))
        else:
            for var, value in zip(targets, values, strict=True):
                store(var, value)
        if metadata_updates:
            for var, metadata in zip(meta_targets, metadata_updates.values(), strict=True):
                store(var, _raw_value_of(var), dict(metadata))
    except BaseException:
        if _any_deleted(old_values):
            # The call donated the old buffers and they are gone: the only whole
            # state left to give is the new one, so the write is finished instead.
            finish_write(targets, values)
            if metadata_updates:
                for var, metadata in zip(meta_targets, metadata_updates.values(), strict=True):
                    _setattr(var, _compat.VAR_METADATA, dict(metadata))
        else:
            for var, value in zip(targets, old_values, strict=True):
                _setattr(var, _compat.RAW_VALUE, value)
            for var, value, metadata in old_meta:
                _restore(var, value, metadata)
        raise


_setattr = object.__setattr__


def finish_write(variables: Sequence[Any], values: Sequence[Any]) -> None:
    """Store every new value (``None``: unchanged) after a donated call's write failed.

    Each goes into the Variable's value slot itself, so a Variable whose own
    setter refused the write holds its new value too (as the extension's
    executor does); where the slot is not the known one, setattr is tried and a
    refusal skipped.
    """
    member = _compat.raw_value_member
    for var, value in zip(variables, values, strict=True):
        if value is None:
            continue
        try:
            if member is not None:
                member.__set__(var, value)
            else:
                _setattr(var, _compat.RAW_VALUE, value)
        except Exception:
            continue


def _any_deleted(values: Sequence[Any]) -> bool:
    """Whether a device buffer among ``values`` was deleted (donated to the call)."""
    return any(
        isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()
        for x in jax.tree_util.tree_leaves(list(values))
    )


current_trace_ref = _compat.current_trace_ref


def store(var: Any, value: Any, metadata: dict[str, Any] | None = None) -> None:
    """Write one Variable (bypassing the trace-level check done by ``check_writable``).

    The one place Variables are written, so tests can inject faults here; while
    it is not replaced, `write_back` does the same writes in bulk.
    """
    _compat.set_raw_value(var, value)
    if metadata is not None:
        _compat.set_metadata(var, metadata)


DEFAULT_STORE = store  # the bulk writes run only while `store` is this one


def _restore(var: Any, value: Any, metadata: dict[str, Any]) -> None:
    _compat.set_raw_value(var, value)
    _compat.set_metadata(var, metadata)


class WriteBack(NamedTuple):
    """One candidate write-back: ``updates`` (one per ``call.variables``, ``None``: unchanged)."""

    call: PreparedCall
    updates: Sequence[Any]
    metadata: dict[int, dict[str, Any]] | None = None


def write_back_all(writes: Sequence[WriteBack]) -> None:
    """Every write-back of ``writes``, all or nothing (each is checked before any is made)."""
    if len(writes) == 1:
        write_back(*writes[0])
        return
    for w in writes:
        check_writable(w.call, w.updates)
    # A failure in a later write-back undoes the earlier ones.
    before: list[tuple[Any, Any, Any]] = []
    try:
        for w in writes:
            before.extend((v, _raw_value_of(v), _metadata_of(v)) for v in w.call.variables)
            write_back(*w)
    except BaseException:
        for var, value, metadata in reversed(before):
            _restore(var, value, metadata)
        raise


__all__ = [
    "DEFAULT_STORE",
    "WriteBack",
    "check_writable",
    "writable_in",
    "store",
    "write_back_all",
    "write_back",
]
