"""Failure explanation: a JAX error turned into one that names the input behind it.

Called only after the JAX transform raised (never on the hot path): an input
array that was deleted (donated to an earlier call), an input holding a tracer
of a trace that has ended (a module created or changed inside a transform and
kept outside it), or a trace-time Variable written by a host callback.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NoReturn

import jax
from jax.core import Tracer

from .. import _compat
from .._errors import DeletedArrayError, DonationError, TraceContextError, TreemodeError
from .._tree._leaves import is_variable
from ._call import Call, PreparedCall
from ._retrace import dynamic_paths
from ._stale import stale_write_error

# The errors JAX raises for what `explain_failure` looks for.
EXPLAINED = (RuntimeError, jax.errors.UnexpectedTracerError)
# Errors in which JAX may name an array by its place among treemode's flat arrays
# (`name_internal_paths`), and every error `raise_explained` looks at.
NAMING = (ValueError, TypeError, OverflowError)
EXPLAINED_OR_NAMING = (*EXPLAINED, *NAMING)

# JAX's names for the arrays of treemode's executables (``jax.jit`` of
# ``_Entry._call_flat(*dynamic)`` or ``_Entry._call_split(donated, kept)``).
_INTERNAL_ARGUMENT = re.compile(
    r"\b(dynamic|donated|kept|flat_args|donated_args|kept_args)\[(\d+)\]"
)
_INTERNAL_FUNCTION = re.compile(r"_Entry\._call_(?:flat|split)")


def raise_explained(
    call: PreparedCall,
    error: BaseException,
    layout: tuple[Sequence[int], Sequence[int]] | None = None,
) -> NoReturn:
    """Raise ``error``, or the treemode error `explain_failure` finds behind it.

    ``layout``: ``(donated, kept)``, the indices into the call's dynamic arrays
    of the two tuples an executable with donated arrays takes (see
    `name_internal_paths`).
    """
    if isinstance(error, EXPLAINED) or _deleted_input(error):
        better = explain_failure(call.full(), error)
        if better is not None:
            raise better from error
    elif isinstance(error, NAMING) and not isinstance(error, TreemodeError):
        renamed = name_internal_paths(call, error, layout)
        if renamed is not None:
            raise renamed from error
    raise error


def _deleted_input(error: BaseException) -> bool:
    """JAX's C++ dispatch (a warm call) reports a deleted input buffer as a
    ``ValueError`` where its Python path raises a ``RuntimeError``."""
    return isinstance(error, ValueError) and "has been deleted or donated" in str(error)


def name_internal_paths(
    call: PreparedCall,
    error: BaseException,
    layout: tuple[Sequence[int], Sequence[int]] | None = None,
) -> BaseException | None:
    """``error`` again, naming the user's paths where JAX named treemode's flat arrays.

    JAX names an argument by its place in the function it compiled: for
    ``treemode.jit`` that is ``dynamic[i]`` (or ``donated[i]`` / ``kept[i]``)
    of ``_Entry._call_flat``, which says nothing to the user. Each is replaced
    by the path of the array in the call (``args[1]``, ``args[0].b``,
    ``kwargs['n']``) and the function by the user's. ``None`` when the message
    names none of them.
    """
    message = str(error)
    if _INTERNAL_ARGUMENT.search(message) is None and _INTERNAL_FUNCTION.search(message) is None:
        return None
    full = call.full()
    paths = dynamic_paths(full)

    def path_of(match: re.Match[str]) -> str:
        kind, i = match.group(1), int(match.group(2))
        if kind not in ("dynamic", "flat_args"):
            if layout is None:
                return match.group(0)
            indices = layout[0] if kind.startswith("donated") else layout[1]
            if i >= len(indices):
                return match.group(0)
            i = indices[i]
        return paths[i] if i < len(paths) else match.group(0)

    name = getattr(full.fn, "__qualname__", None) or getattr(full.fn, "__name__", "the function")
    message = _INTERNAL_ARGUMENT.sub(path_of, message)
    message = _INTERNAL_FUNCTION.sub(f"{name} (treemode.{full.transform})", message)
    try:
        renamed = type(error)(message)
    except Exception:  # an error class with another constructor: keep JAX's
        return None
    return renamed


def explain_failure(call: Call, error: BaseException) -> Exception | None:
    """A treemode error naming the input behind a JAX failure, if there is one."""
    stale = stale_write_error(error)  # a host callback wrote a trace-time Variable
    if stale is not None:
        return stale
    for where, leaf in call.paths_and_leaves():
        values = jax.tree_util.tree_leaves(
            _compat.raw_value_of(leaf) if is_variable(leaf) else leaf
        )
        what = f"the {type(leaf).__name__} at {where}" if is_variable(leaf) else where
        for x in values:
            if isinstance(error, jax.errors.UnexpectedTracerError) and isinstance(x, Tracer):
                return TraceContextError(
                    f"treemode.{call.transform}: {what} holds a value traced by a JAX "
                    "transform that has already returned (the module was created or "
                    "changed inside a transform and kept outside it, e.g. appended to a "
                    "list). Return new modules from the transform instead of storing "
                    "them, and rebuild this one outside any transform."
                )
            if isinstance(x, jax.Array) and not isinstance(x, Tracer):
                if x.is_deleted():
                    return _deleted_error(call.transform, what)
    return None


# Whether a treemode transform has donated buffers in this process (set when a
# transform with donated arguments builds its executable): without one, a
# deleted input buffer was deleted by the user's own code.
_donation_seen = False


def note_donation() -> None:
    """Record that a treemode executable donates buffers (see `_deleted_error`)."""
    global _donation_seen
    _donation_seen = True


def _deleted_error(transform: str, what: str) -> Exception:
    if _donation_seen:
        return DonationError(
            f"treemode.{transform}: the buffer of {what} was deleted: it was donated to "
            "an earlier call (donate_argnums) while this argument shared it. Give each "
            "module its own buffers with treemode.clone(module, arrays=True) before "
            "donating. (If your own code deleted it, with `.delete()` or a jax.jit "
            "donate_argnums outside treemode, put a live array in the Variable instead: "
            "`var[...] = new_value`.)"
        )
    return DeletedArrayError(
        f"treemode.{transform}: the buffer of {what} was deleted before this call, and "
        "no treemode transform has donated buffers: it was deleted outside treemode "
        "(`array.delete()`, or donated to a jax.jit/jax.pmap call with donate_argnums). "
        "Put a live array in the Variable before calling: `var[...] = new_value`."
    )


__all__ = [
    "EXPLAINED",
    "EXPLAINED_OR_NAMING",
    "explain_failure",
    "name_internal_paths",
    "note_donation",
    "raise_explained",
]
