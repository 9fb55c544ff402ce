"""The optional compiled extension (``treemode/_accel/_guard.c``), imported here and nowhere else.

The extension runs, in C, checks and steps that treemode's Python code also
implements: the flattening guard (``holds``, ``version_tags``), the call-site
match (``match_into``), the closure-read check (``reads_hold``), the bulk write
(``write_changed``) and the memo-matched
``treemode.jit`` call (``MemoCall``, ``SiteCallFields``). Every other module
takes these from here: each is ``None`` where the extension is off, and the
caller uses its Python twin.

It is off when it was not built (no C compiler at install time), when it was
built for another Python and fails to load, when the environment variable
``TREEMODE_NO_EXTENSION`` is set to a non-empty value other than ``0`` (read
once, at import), or when ``treemode._compat`` found a Flax/JAX layout the C
code does not know. `extension_status` (public: ``treemode.extension_status()``)
says which; every reason but the environment variable warns once at import
(`ExtensionWarning`), unless ``TREEMODE_NO_EXTENSION_WARNING`` is set.

The C code reads nothing by convention: `configure` hands it, once, the
Variable slots and JAX trace state `treemode._compat` verified, and the Python
objects the call path needs, as the typed records below.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from .. import _compat

ENV_VAR = "TREEMODE_NO_EXTENSION"
QUIET_ENV_VAR = "TREEMODE_NO_EXTENSION_WARNING"

ACTIVE = "active"
DISABLED = f"disabled by {ENV_VAR}"
NOT_BUILT = "not built"


class ExtensionWarning(RuntimeWarning):
    """treemode's compiled extension is not active, for a reason other than your choice.

    Warned once, when treemode is imported: the extension was not built (treemode
    was installed from source without a C compiler), cannot be loaded (built for
    another Python), or cannot read the installed Flax/JAX. treemode then runs the
    same checks in Python, which makes each call of a `treemode.jit` function
    slower (about 2× a hand-written `jax.jit` for a small model instead of about 1×;
    see the install page). Set ``TREEMODE_NO_EXTENSION_WARNING=1``, or filter the
    warning before importing treemode, to silence it.

    ```python
    import warnings

    import treemode

    assert issubclass(treemode.ExtensionWarning, RuntimeWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", treemode.ExtensionWarning)
    ```
    """


@dataclass(frozen=True)
class ExtensionStatus:
    """Whether treemode's compiled extension is active, and why (`extension_status`).

    ``active`` is a bool; ``reason`` is ``"active"``, ``"disabled by
    TREEMODE_NO_EXTENSION"``, ``"not built"``, ``"failed to load: ..."`` or
    ``"layout not supported: ..."``.

    ```python
    import treemode

    status = treemode.extension_status()
    assert status.active == (status.reason == "active")
    ```
    """

    active: bool
    reason: str


def disabled_by(environ: Any) -> bool:
    """Whether ``environ`` (a mapping like ``os.environ``) turns the extension off."""
    return environ.get(ENV_VAR, "") not in ("", "0")


def _import_guard() -> ModuleType:
    return importlib.import_module(f"{__package__}._guard")


def resolve(
    environ: Any = os.environ,
    layout_problem: str = _compat.LAYOUT_PROBLEM,
    importer: Callable[[], ModuleType] = _import_guard,
) -> tuple[ModuleType | None, ExtensionStatus]:
    """``(the extension module or None, its ExtensionStatus)``, nothing warned.

    ``importer`` imports the compiled module (raising `ImportError` where it
    cannot); ``layout_problem`` is `treemode._compat`'s finding ("" for none).
    """
    if disabled_by(environ):
        return None, ExtensionStatus(False, DISABLED)
    if layout_problem:
        return None, ExtensionStatus(False, f"layout not supported: {layout_problem}")
    try:
        module = importer()
    except ModuleNotFoundError as e:  # built without a C compiler
        if e.name not in (None, f"{__package__}._guard"):
            return None, ExtensionStatus(False, f"failed to load: {e}")
        return None, ExtensionStatus(False, NOT_BUILT)
    except ImportError as e:  # built, but for another Python or platform
        return None, ExtensionStatus(False, f"failed to load: {e}")
    return module, ExtensionStatus(True, ACTIVE)


def warning_text(status: ExtensionStatus) -> str:
    """The `ExtensionWarning` message for an inactive `status`."""
    how = {
        NOT_BUILT: "this installation of treemode has no compiled module: it was installed"
        " from source without a C compiler",
    }.get(status.reason, status.reason)
    return (
        f"treemode's compiled extension is not active ({how}). treemode runs the same"
        " checks in Python: correct, but each call of a treemode.jit function costs more"
        " (about 2x a hand-written jax.jit for a small model, instead of about 1x)."
        " Install a binary wheel (pip install treemode) or reinstall with a C compiler;"
        f" see the install page of the docs. Set {QUIET_ENV_VAR}=1 to silence this warning."
    )


def announce(status: ExtensionStatus, environ: Any = os.environ) -> None:
    """Warn (an `ExtensionWarning`) where the extension is off, but not by choice.

    Called once, by ``treemode/__init__.py`` (the warning points at the
    importing line).
    """
    if status.active or status.reason == DISABLED:
        return
    if environ.get(QUIET_ENV_VAR, "") not in ("", "0"):
        return
    warnings.warn(warning_text(status), ExtensionWarning, stacklevel=3)


def load(environ: Any = os.environ, layout_ok: bool = _compat.COMPILED_OK) -> ModuleType | None:
    """The extension module, or ``None`` where it is off (see the module docstring)."""
    module, _ = resolve(environ, "" if layout_ok else "the layout differs")
    return module


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


guard, STATUS = resolve()
ENABLED = guard is not None  # `announce(STATUS)` runs at the end of treemode/__init__.py


def extension_status() -> ExtensionStatus:
    """Whether treemode's compiled extension is active, and if not, why.

    The extension (a small C module) runs the checks of a repeated
    `treemode.jit` call; without it treemode runs the same checks in Python,
    with the same results, at a higher cost per call (see the install page).
    Decided once, when treemode is imported.

    **Arguments:** none.

    **Returns:** an `ExtensionStatus`: ``active`` (a bool) and ``reason``, one of
    ``"active"``, ``"disabled by TREEMODE_NO_EXTENSION"`` (the environment
    variable was set), ``"not built"`` (installed from source without a C
    compiler), ``"failed to load: ..."`` (built for another Python) or
    ``"layout not supported: ..."`` (a Flax/JAX whose private layout the C code
    cannot read; the message names the installed versions).

    ```python
    import treemode

    status = treemode.extension_status()
    print(status.active, status.reason)  # True active, with a binary wheel
    ```
    """
    return STATUS


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

    Called once, by ``treemode._transforms._jit`` when the call path's objects exist; the C
    functions refuse to run before it (they would not know the layout).
    """
    global _call_path
    _call_path = call_path
    if guard is not None:
        guard.configure(layout(), call_path)


def call_path() -> CallPath:
    """The `CallPath` given to `configure` (which ``import treemode`` calls)."""
    assert _call_path is not None, "treemode._transforms._jit configures the call path at import"
    return _call_path


__all__ = [
    "CallPath",
    "ENABLED",
    "ENV_VAR",
    "EntryPlan",
    "ExtensionStatus",
    "ExtensionWarning",
    "Layout",
    "MemoPlan",
    "QUIET_ENV_VAR",
    "STATUS",
    "SitePlan",
    "extension_status",
]
