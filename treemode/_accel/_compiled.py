"""The optional compiled extension (``treemode/_accel/_guard*.c``), imported here and nowhere else.

The extension holds two kinds of code:

- kernels that treemode's Python code also implements (each pair bound by a
  differential test, tests/test_twins.py): the flattening guard (``holds``,
  ``version_tags``);
- the executor of the fast-path record: the Python pipeline decides how a
  repeated ``treemode.jit`` call runs and emits a ``FastRecord``
  (`treemode._pipeline._callsite.fast_record`); ``FastCall``, the base of
  ``treemode.jit``'s wrapper, executes it, and hands every doubt back to the
  pipeline through one callback, the miss; its write of the new values has
  its twin in ``treemode._pipeline._writeback.write_back``. The cached
  flattenings it matches are ``Guarded`` objects (the pipeline's own match, its twin, is
  `treemode._pipeline._executor.match_into`).

Every other module takes these from here: each is ``None`` where the
extension is off, and the caller uses its Python twin (or, for the executor,
runs every call through the pipeline).

It is off when it was not built (no C compiler at install time), when it was
built for another Python and fails to load, when the environment variable
``TREEMODE_NO_EXTENSION`` is set to a non-empty value other than ``0`` (read
once, at import), or when ``treemode._compat`` found a Flax/JAX whose private
names the C code does not know. `extension_status` (public: ``treemode.extension_status()``)
says which; every reason but the environment variable warns once at import
(`ExtensionWarning`), unless ``TREEMODE_NO_EXTENSION_WARNING`` is set.

The C code reads nothing by convention: `configure` hands it, once and by
keyword, the Variable slots and JAX trace state `treemode._compat` verified
and the objects of the signal hold.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .. import _compat, _versions
from .._errors import PUBLIC_MODULE
from . import _border

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

    __module__ = PUBLIC_MODULE  # shown as treemode.ExtensionWarning


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
    slots_problem: str = _compat.SLOTS_PROBLEM,
    importer: Callable[[], ModuleType] = _import_guard,
) -> tuple[ModuleType | None, ExtensionStatus]:
    """``(the extension module or None, its ExtensionStatus)``, nothing warned.

    ``importer`` imports the compiled module (raising `ImportError` where it
    cannot); ``slots_problem`` is `treemode._compat`'s finding ("" for none).
    """
    if disabled_by(environ):
        return None, ExtensionStatus(False, DISABLED)
    if slots_problem:
        return None, ExtensionStatus(False, f"layout not supported: {slots_problem}")
    try:
        module = importer()
    except ModuleNotFoundError as e:  # built without a C compiler
        if e.name not in (None, f"{__package__}._guard"):
            return None, ExtensionStatus(False, f"failed to load: {e}")
        return None, ExtensionStatus(False, NOT_BUILT)
    except ImportError as e:  # built, but for another Python or platform
        return None, ExtensionStatus(False, f"failed to load: {e}")
    return module, ExtensionStatus(True, ACTIVE)


# How to get the extension back, by reason. treemode is not on the package index
# yet (no binary wheel to install), so the advice is what works today: build the
# extension where it was not built or cannot load.
REBUILD = (
    "pip install --force-reinstall --no-deps --no-cache-dir <treemode's source: a"
    " checkout or its sdist>"
)
_ADVICE = {
    NOT_BUILT: "To get it, install a C compiler (gcc or clang, with the Python headers:"
    " python3-dev on Debian and Ubuntu; xcode-select --install on macOS) and reinstall"
    f" treemode from its source, rebuilding it: {REBUILD}.",
    "failed to load": "To get it back, reinstall treemode from its source with this"
    f" Python, rebuilding it: {REBUILD}.",
    "layout not supported": "A reinstall cannot help: the compiled code does not know how"
    " the installed Flax stores Variables. Install a Flax and JAX of the supported ranges"
    f" (named above) to get it back, or report the versions at {_versions.ISSUES_URL}.",
}


def warning_text(status: ExtensionStatus) -> str:
    """The `ExtensionWarning` message for an inactive `status`: why, what it costs,
    and what brings the extension back for that reason."""
    how = {
        NOT_BUILT: "this installation of treemode has no compiled module: it was installed"
        " from source without a C compiler",
    }.get(status.reason, status.reason)
    advice = _ADVICE.get(status.reason.partition(":")[0], "")
    return (
        f"treemode's compiled extension is not active ({how}). treemode runs the same"
        " checks in Python: correct, but each call of a treemode.jit function costs more"
        " (about 2x a hand-written jax.jit for a small model, instead of about 1x)."
        f" {advice + ' ' if advice else ''}See the install page of the docs."
        f" Set {QUIET_ENV_VAR}=1 to silence this warning."
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


def load(environ: Any = os.environ, compiled_ok: bool = _compat.COMPILED_OK) -> ModuleType | None:
    """The extension module, or ``None`` where it is off (see the module docstring)."""
    module, _ = resolve(environ, "" if compiled_ok else "the Variable slots differ")
    return module


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
    ``"layout not supported: ..."`` (a Flax/JAX whose Variable slots the C code
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
Guarded: type | None = guard.Guarded if guard else None
FastRecord: type | None = guard.FastRecord if guard else None
FastCall: type | None = guard.FastCall if guard else None
# The names of a compiled guard state's fields, in order (defined in _border.py).
GUARD_STATE_FIELDS: tuple[str, ...] = _border.GUARD_STATE_FIELDS if guard else ()


def configure(**fields: Any) -> None:
    """Hand the C code what it reads: called once, by ``treemode._pipeline._callsite``.

    The fields (``_border.CONFIGURE_FIELDS``, checked by keyword in C):
    ``raw_value``, ``metadata`` (the Variable slots' member descriptors from
    `treemode._compat`), ``trace_state``, ``trace_attr`` (``getattr(trace_state,
    trace_attr)`` is the current trace's weak reference), ``array_types`` (the
    live set of types taken as arrays), the closure read check's ``closure_kinds``,
    ``closure_ignore``, ``closure_empty``, ``closure_ignored``, and the signal
    hold's ``hold_open``, ``hold_deferred``, ``hold_plan``, ``signals``,
    ``getsignal``, ``setsignal``, ``main_thread``, ``typeof`` (``jax.typeof``: a
    record's signature check compares what it gives), and ``debug_checks`` (JAX's
    ``jax_debug_nans``/``jax_debug_infs`` states from `treemode._compat`: a
    donated record misses while one is on). The C kernels refuse to run before it.
    """
    if guard is not None:
        guard.configure(**fields)


__all__ = [
    "ENABLED",
    "ENV_VAR",
    "ExtensionStatus",
    "ExtensionWarning",
    "QUIET_ENV_VAR",
    "STATUS",
    "configure",
    "extension_status",
]
