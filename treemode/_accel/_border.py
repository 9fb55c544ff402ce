"""The C/Python border of the compiled extension, defined once.

Every structure the C code (``treemode/_accel/_guard*.c``) reads from Python is
named here, field by field, and built by the one function here that makes it:
the C code reads it by the indices `tools/gen_border.py` generates from these
names into ``_border.h``, and the stub ``_guard.pyi`` is generated from them too
(``tests/test_border.py`` fails when either committed file differs from what
this module generates, and checks the stub against the built module).

The structures are plain tuples (a ``NamedTuple`` would cost a Python-level
constructor call where JAX rebuilds the entry's output), so this module names
their fields and builds them; the C types whose fields are named here
(``FastRecord``, ``Guarded``) check them by keyword.
"""

from __future__ import annotations

from typing import Any

# The version of the fast-path record this Python code emits; the C code executes
# only this one (`FastRecord` checks it).
RECORD_VERSION = 2

# `_guard.FastRecord(**fields)` (its Python twin: treemode._pipeline._executor.Record):
# made by treemode._pipeline._callsite.fast_record, returned by the miss.
RECORD_FIELDS = (
    "version",
    "key",
    "slots",
    "partial_args",
    "kw_names",
    "closure_reads",
    "closure_holders",
    "lifted_slots",
    "jitted",
    "donated",
    "kept",
    "trace",
    "checked",
    "avals",
)

# How many records an executor's table keeps (the most recent first): one per set
# of objects a wrapper is called with (and per signature where an entry's
# signatures write different sets), as JAX keeps one executable per signature.
RECORDS_BOUND = 8

# `_guard.Guarded(*fields)`: a cached flattening as the executor reads it
# (treemode._tree._flatten._fast_state).
GUARDED_FIELDS = ("arg", "state", "variables", "flat")

# `_guard.configure(**fields)`: made by treemode._pipeline._callsite.configure_fields.
CONFIGURE_FIELDS = (
    "raw_value",
    "metadata",
    "trace_state",
    "trace_attr",
    "array_types",
    "closure_kinds",
    "closure_ignore",
    "closure_empty",
    "closure_ignored",
    "hold_open",
    "hold_deferred",
    "hold_plan",
    "signals",
    "getsignal",
    "setsignal",
    "typeof",
    "main_thread",
    "debug_checks",
)

# A guard state (treemode._tree._flat_guard.Guard builds it by these names): the
# fields up to ``top_dict``; where the interpreter has dict version tags, the
# three tags after them.
GUARD_STATE_FIELDS = (
    "sized",
    "lens",
    "dicts",
    "values",
    "ordered",
    "items",
    "metadata",
    "metadata_entries",
    "nodes",
    "node_types",
    "owners",
    "owner_dicts",
    "variable_types",
    "top_type",
    "top_dict",
    "dict_tags",
    "ordered_tags",
    "metadata_tags",
)
GUARD_STATE_TAGS = 3  # the last three fields: the version tags

# Every read of a closure search (a record's ``closure_reads``).
CLOSURE_READS_FIELDS = ("dicts", "names", "values", "functions", "codes", "cells", "attrs")
CELL_READ_FIELDS = ("holder", "contents")  # an item of ``cells``
ATTRIBUTE_READ_FIELDS = ("owner", "name", "value")  # an item of ``attrs``

# A holder of an object the closure search found (a record's ``closure_holders``,
# the functions and cells of its reads): a weak reference, or, for an object that
# cannot be weakly referenced, this 1-tuple (treemode._tree._closure_reads.Strong).
HOLDER_FIELDS = ("obj",)

# A record's slot (per argument, ``slots`` and ``lifted_slots``): None for a bare
# array, else a weak reference to the cache entry's `Guarded`
# (treemode._pipeline._callsite._slot); not a tuple, so no fields.

# The signal hold's plan (treemode._pipeline._interrupts._plan, a list changed in
# place) and each swap of its ``swaps``.
HOLD_PLAN_FIELDS = ("handlers", "swaps")
SIGNAL_SWAP_FIELDS = ("signum", "original", "deferring")

# What a compiled entry returns (treemode._transforms._jit_entry): ``updates`` is
# None when the trace updates no Variable.
ENTRY_RESULT_FIELDS = ("out", "updates")

# What an executor's miss returns: the call's output and the record of how calls
# like it run (None: none can be trusted), which the executor adds to its table.
MISS_RESULT_FIELDS = ("out", "record")

# Every structure, by the prefix of its generated C names.
STRUCTURES: dict[str, tuple[str, ...]] = {
    "RECORD": RECORD_FIELDS,
    "GUARDED": GUARDED_FIELDS,
    "CONFIGURE": CONFIGURE_FIELDS,
    "STATE": GUARD_STATE_FIELDS,
    "READS": CLOSURE_READS_FIELDS,
    "CELL_READ": CELL_READ_FIELDS,
    "ATTRIBUTE_READ": ATTRIBUTE_READ_FIELDS,
    "HOLDER": HOLDER_FIELDS,
    "PLAN": HOLD_PLAN_FIELDS,
    "SWAP": SIGNAL_SWAP_FIELDS,
    "ENTRY": ENTRY_RESULT_FIELDS,
    "MISS": MISS_RESULT_FIELDS,
}


def closure_reads(
    dicts: tuple[Any, ...],
    names: tuple[Any, ...],
    values: tuple[Any, ...],
    functions: tuple[Any, ...],
    codes: tuple[Any, ...],
    cells: tuple[Any, ...],
    attrs: tuple[Any, ...],
) -> tuple[
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[Any, ...],
]:
    """The closure reads, in the order of `CLOSURE_READS_FIELDS`."""
    return (dicts, names, values, functions, codes, cells, attrs)


def cell_read(holder: Any, contents: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """One item of the closure reads' ``cells`` (`CELL_READ_FIELDS`)."""
    return (holder, contents)


def attribute_read(owner: Any, name: str, value: Any) -> tuple[Any, str, Any]:
    """One item of the closure reads' ``attrs`` (`ATTRIBUTE_READ_FIELDS`)."""
    return (owner, name, value)


def hold_plan(handlers: tuple[Any, ...], swaps: tuple[Any, ...]) -> list[Any]:
    """The contents of the signal hold's plan (`HOLD_PLAN_FIELDS`)."""
    return [handlers, swaps]


def signal_swap(signum: int, original: Any, deferring: Any) -> tuple[int, Any, Any]:
    """One swap of the plan (`SIGNAL_SWAP_FIELDS`)."""
    return (signum, original, deferring)


def entry_result(out: Any, updates: Any) -> tuple[Any, Any]:
    """What a compiled entry returns (`ENTRY_RESULT_FIELDS`)."""
    return (out, updates)


def miss_result(out: Any, record: Any) -> tuple[Any, Any]:
    """What an executor's miss returns (`MISS_RESULT_FIELDS`)."""
    return (out, record)
