"""The executor of the fast-path record, in Python: the twin of the compiled one.

A miss of a `treemode.jit` wrapper runs the call through the pipeline and
returns the call's output with the record of how calls like it run
(`_callsite.fast_record`; ``None`` where none can be trusted). The executor
keeps those records in its table (the most recent first, at most
``RECORDS_BOUND``, one per key) and runs a call by the first record that matches
it, without the pipeline. With the compiled extension the executor is
``_guard.FastCall`` (``treemode/_accel/_guard_executor.c``); without it, the
same records run here. ``tests/test_twins.py`` binds the two: the same calls,
the same records, the same decisions and writes.

What a record checks, in order (every doubt is a miss: the pipeline decides):
the arguments and keyword names; the current trace (the record's Variables may
be written in its trace only); each argument against its slot (a bare array, or
a cached flattening whose guard still holds); the closure's reads and objects;
the abstract values of the arrays that tell the entry's signatures apart
(``checked``, ``avals``); for a donated call, that no donated buffer is passed
twice and that JAX's NaN/Inf checks are off. Then the compiled entry runs (under
the signal hold when it donates), and the new values are written back, all or
nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat
from .._accel import _border, _compiled
from .._compat import raw_value_of as _raw_value_of
from .._tree._closure_reads import reads_hold_python
from .._tree._flatten import ArgFlat, variables_of
from .._tree._leaves import CONCRETE_ARRAY_TYPES
from . import _interrupts
from ._writeback import write_back

# A record's fields after ``version`` (`_border.RECORD_FIELDS`).
_FIELDS = _border.RECORD_FIELDS[1:]


class Record:
    """A fast-path record (the twin of ``_guard.FastRecord``), made by keyword with
    every field of `_border.RECORD_FIELDS`; read-only."""

    __slots__ = _FIELDS

    key: Any
    slots: tuple[Any, ...]
    partial_args: tuple[Any, ...]
    kw_names: tuple[str, ...]
    closure_reads: tuple[tuple[Any, ...], ...]
    closure_holders: tuple[Any, ...]
    lifted_slots: tuple[Any, ...]
    jitted: Any
    donated: tuple[int, ...] | None
    kept: tuple[int, ...] | None
    trace: Any
    checked: tuple[int, ...]
    avals: tuple[Any, ...]

    def __init__(self, **fields: Any):
        if set(fields) != set(_border.RECORD_FIELDS):
            missing = set(_border.RECORD_FIELDS) - set(fields)
            raise TypeError(f"Record: fields {sorted(missing or set(fields))} differ")
        if fields["version"] != _border.RECORD_VERSION:
            raise ValueError(f"Record: a version {fields['version']!r} record")
        if len(fields["checked"]) != len(fields["avals"]):
            raise TypeError("Record: checked and avals have one item per checked array")
        for name in _FIELDS:
            object.__setattr__(self, name, fields[name])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a record is read-only")


class _Matched:
    """A call a record matched, as `write_back` reads it (a `PreparedCall`)."""

    __slots__ = ("variables", "sources", "dynamic")

    transform = "jit"
    graph = False

    def __init__(self, variables: list[Any], sources: list[ArgFlat], dynamic: list[Any]):
        self.variables = variables
        self.sources = sources
        self.dynamic = dynamic

    def full(self) -> Any:  # pragma: no cover - the record's trace was checked
        raise RuntimeError("treemode: a record's call has no full form")


_PYTHON_NUMBERS = frozenset({bool, int, float, complex})


def match_into(
    slots: tuple[weakref.ref[Any] | None, ...],
    objs: Sequence[Any],
    dynamic: list[Any],
    sources: list[ArgFlat],
) -> bool:
    """Whether every object of ``objs`` still matches its record slot; if so, their
    arrays are appended to ``dynamic`` and their cached flattenings to ``sources``.

    A slot is ``None`` (a bare array: an array of a known type or a Python
    number) or a weak reference to a cached flattening's ``Guarded`` (or to the
    flattening itself, where the extension is off). The compiled executor
    matches the same slots in C and decides alike (tests/test_twins.py): an
    argument that is another object, a flattening whose guard no longer holds,
    a Variable value that is not an array of a known type, are misses.
    """
    if len(objs) != len(slots):
        return False
    for slot, obj in zip(slots, objs, strict=True):
        if slot is None:
            if type(obj) in CONCRETE_ARRAY_TYPES or type(obj) in _PYTHON_NUMBERS:
                dynamic.append(obj)
                continue
            return False
        held = slot()
        cached = held.flat() if held is not None and type(held) is _GUARDED else held
        if cached is None or not cached.values_only:
            return False
        ref = cached._ref
        guard = cached._guard
        if (
            ref is None
            or ref() is not obj
            or guard is None
            or not guard.holds(cached.variables, obj)
        ):
            return False
        values = list(map(_raw_value_of, cached.variables))
        if not CONCRETE_ARRAY_TYPES.issuperset(map(type, values)):
            # Not an array of a known type (a Python number, a value that changed
            # structure): the compiled match misses there too.
            return False
        sources.append(cached)
        dynamic += values
    return True


_GUARDED = _compiled.Guarded


# `execute`'s answer for a call the record does not run.
MISS: Any = object()


def match(record: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """The arrays and the cached flattenings of a call ``record`` runs, as
    ``(dynamic, sources)``; ``None``: a miss."""
    n_kw = len(record.kw_names)
    if (0 if kwargs is None else len(kwargs)) != n_kw:
        return None
    roots: tuple[Any, ...] = (*record.partial_args, *args) if record.partial_args else args
    if n_kw:
        assert kwargs is not None
        try:
            roots = (*roots, *[kwargs[name] for name in record.kw_names])
        except KeyError:
            return None
    if len(roots) != len(record.slots) or _compat.current_trace_ref() is not record.trace:
        return None
    dynamic: list[Any] = []
    sources: list[ArgFlat] = []
    if not match_into(record.slots, roots, dynamic, sources):
        return None
    if not reads_hold_python(record.closure_reads):
        return None
    lifted = [holder() for holder in record.closure_holders]
    if any(obj is None for obj in lifted) or not match_into(
        record.lifted_slots, lifted, dynamic, sources
    ):
        return None
    checked = list(zip(record.checked, record.avals, strict=True))
    if any(at >= len(dynamic) or _shapes_differ(dynamic[at], aval) for at, aval in checked):
        return None  # the shapes first: a cheap answer for another signature's record
    if any(jax.typeof(dynamic[at]) != aval for at, aval in checked):
        return None
    return dynamic, sources


def _shapes_differ(array: Any, aval: Any) -> bool:
    """Whether ``array`` has a shape and ``aval`` (a ``jax.typeof``) another one
    (``False`` where either has none: ``jax.typeof`` decides)."""
    shape = getattr(array, "shape", None)
    return shape is not None and shape != getattr(aval, "shape", shape)


def execute(record: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """Run a call by ``record``: ``(out, None)``; ``(None, error)`` where the compiled
    entry raised (the miss explains it); `MISS`. A failed write raises."""
    matched = match(record, args, kwargs)
    if matched is None:
        return MISS
    dynamic, sources = matched
    variables = variables_of(sources)
    if record.donated is None:
        return _run(record.jitted, dynamic, variables, sources)
    donated = tuple(dynamic[i] for i in record.donated)
    kept = tuple(dynamic[i] for i in record.kept)
    donated_ids = set(map(id, donated))
    if len(donated_ids) != len(donated) or not donated_ids.isdisjoint(map(id, kept)):
        return MISS  # a shared donated buffer: the pipeline names the paths
    if _compat.debug_checks_on():
        return MISS  # the pipeline runs it undonated
    token = _interrupts.hold(donated)
    try:
        return _run(record.jitted, [donated, kept], variables, sources)
    finally:
        if token is not None:
            _interrupts.close()
            _interrupts.release(token)


def _run(
    jitted: Callable[..., Any], arrays: list[Any], variables: list[Any], sources: list[ArgFlat]
) -> Any:
    try:
        result = jitted(*arrays)
    except BaseException as error:  # noqa: BLE001 - handed to the miss, as the C executor does
        return None, error
    if type(result) is not tuple or len(result) != len(_border.ENTRY_RESULT_FIELDS):
        raise SystemError("treemode: a compiled entry returns (out, updates)")
    out, updates = result
    if updates is not None:  # None: the trace updates nothing
        if type(updates) is not tuple or len(updates) != len(variables):
            raise SystemError("treemode: a compiled entry's updates differ from its record's")
        write_back(_Matched(variables, sources, arrays), updates)
    return out, None


def table_add(records: list[Any], record: Any) -> None:
    """Add ``record`` to an executor's table: first, in place of the record with an
    equal key, at most ``RECORDS_BOUND`` (the twin of the compiled ``table_add``)."""
    records[:] = [record, *[r for r in records if r.key != record.key]][: _border.RECORDS_BOUND]


class PyFastCall:
    """The base of a callable whose calls run by the records of its table
    (``_records``), and go to ``_miss(self, error, args, kwargs) -> (out, record)``
    otherwise: the twin of ``_guard.FastCall``."""

    _records: list[Any] | None
    _miss: Any
    _before_call: tuple[Any, str] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._before_call is not None:
            setattr(*self._before_call, None)
        records = self._records
        error = None
        if type(records) is list:
            for record in list(records):
                ran = execute(record, args, kwargs or None)
                if ran is MISS:
                    continue
                out, error = ran
                if error is None:
                    return out
                break
        out, record = self._miss(self, error, args, kwargs or None)
        if record is not None and type(self._records) is list:
            table_add(self._records, record)
        return out


__all__ = ["MISS", "PyFastCall", "Record", "execute", "match", "match_into", "table_add"]
