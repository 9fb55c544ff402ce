"""The optional compiled extension (``treemode/_guard.c``), imported here and nowhere else.

The extension runs, in C, checks and steps that treemode's Python code also
implements: the flattening guard (``holds``, ``version_tags``), the call-site
match (``match_into``), the closure-read check (``reads_hold``), the bulk write
(``write_changed``) and the memo-matched
``treemode.jit`` call (``MemoCall``, ``SiteCallFields``). Every other module
takes these from here: each is ``None`` where the extension is off, and the
caller uses its Python twin.

It is off when it was not built (no C compiler), when the environment variable
``TREEMODE_NO_EXTENSION`` is set to a non-empty value other than ``0`` (read
once, at import), or when ``treemode._compat`` found a Flax/JAX layout the C
code does not know (with one warning).

The C code reads nothing by convention: `configure` hands it, once, the
Variable slots and JAX trace state `treemode._compat` verified, and the Python
objects the call path needs, as the typed records below.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from . import _compat

ENV_VAR = "TREEMODE_NO_EXTENSION"


def disabled_by(environ: Any) -> bool:
    """Whether ``environ`` (a mapping like ``os.environ``) turns the extension off."""
    return environ.get(ENV_VAR, "") not in ("", "0")


def load(environ: Any = os.environ, layout_ok: bool = _compat.COMPILED_OK) -> ModuleType | None:
    """The extension module, or ``None`` where it is off (see the module docstring)."""
    if disabled_by(environ) or not layout_ok:
        return None
    try:
        from . import _guard
    except ImportError:  # built without a C compiler
        return None
    return _guard


class Layout(NamedTuple):
    """The private Flax/JAX layout the C code reads, from `treemode._compat`."""

    raw_value: Any  # the member descriptor of Variable._raw_value
    var_metadata: Any  # the member descriptor of Variable._var_metadata
    current_trace: Any  # an object whose attribute `current_trace_attr` is the trace's weakref
    current_trace_attr: str


class CallPath(NamedTuple):
    """What the compiled ``treemode.jit`` call path calls back or compares with."""

    array_types: set[type]  # types taken as arrays without asking `match_slow`
    match_slow: Callable[[Any, Any], list[Any] | None]  # _callsite._match_slow
    closure_kinds: dict[type, int]  # _closure's per-type kinds, and its sentinels:
    closure_ignore: int
    closure_empty: object
    closure_ignored: object
    site_call: type  # _callsite.SiteCall (a SiteCallFields subclass)
    raise_failure: Callable[[Any, BaseException], Any]  # raises the explained error
    store_owner: Any  # `getattr(store_owner, store_name) is default_store`: write in C
    store_name: str
    default_store: Callable[..., Any]


class SitePlan(NamedTuple):
    """The part of a memo plan that matches a call's objects (from a `CallSite`)."""

    site: Any
    slots: tuple[Any, ...]
    partial_args: tuple[Any, ...]
    closure_reads: tuple[tuple[Any, ...], ...]
    closure_found: list[tuple[str, Any]]
    lifted_slots: tuple[Any, ...]


class EntryPlan(NamedTuple):
    """The part of a memo plan that runs the compiled entry and writes back."""

    jitted: Callable[..., Any]
    binding: Any
    entry: Any  # has `write_back(call, updates)`
    record: Any  # has `metadata_updates`
    donation: tuple[tuple[int, ...], tuple[int, ...], Callable[[Any], Any]] | None


class MemoPlan(NamedTuple):
    site: SitePlan
    entry: EntryPlan


guard = load()
ENABLED = guard is not None

holds: Callable[..., bool] | None = guard.holds if guard else None
version_tags: Callable[..., bytes | None] | None = guard.version_tags if guard else None
match_into: Callable[..., bool] | None = guard.match_into if guard else None
reads_hold: Callable[..., bool] | None = guard.reads_hold if guard else None
write_changed: Callable[..., int] | None = guard.write_changed if guard else None
MemoCall: type | None = guard.MemoCall if guard else None
SiteCallFields: type | None = guard.SiteCallFields if guard else None


def layout() -> Layout:
    """The `Layout` of the installed Flax/JAX (as `treemode._compat` verified it)."""
    return Layout(_compat.raw_value_member, _compat.metadata_member, _compat.CURRENT_TRACE, "value")


_call_path: CallPath | None = None


def configure(call_path: CallPath) -> None:
    """Hand the call path's configuration to the C code, and keep it for its Python twin.

    Called once, by ``treemode._jit`` when the call path's objects exist; the C
    functions refuse to run before it (they would not know the layout).
    """
    global _call_path
    _call_path = call_path
    if guard is not None:
        guard.configure(layout(), call_path)


def call_path() -> CallPath:
    """The `CallPath` given to `configure` (which ``import treemode`` calls)."""
    assert _call_path is not None, "treemode._jit configures the call path at import"
    return _call_path


__all__ = ["CallPath", "ENABLED", "ENV_VAR", "EntryPlan", "Layout", "MemoPlan", "SitePlan"]
