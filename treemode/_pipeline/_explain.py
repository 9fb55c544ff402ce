"""Failure explanation, step 4 of the pipeline: a JAX error turned into one naming its input.

Called only after the JAX transform raised (never on the hot path): an input
array that was deleted (donated to an earlier call), an input holding a tracer
of a trace that has ended (a module created or changed inside a transform and
kept outside it), or a trace-time Variable written by a host callback.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

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
# ``_JitEntry._call_flat(*dynamic)`` or ``_JitEntry._call_split(donated, kept)``).
_INTERNAL_ARGUMENT = re.compile(
    r"\b(dynamic|donated|kept|flat_args|donated_args|kept_args)\[(\d+)\]"
)
_INTERNAL_FUNCTION = re.compile(r"_JitEntry\._call_(?:flat|split)")


def raise_explained(
    call: PreparedCall,
    error: BaseException,
    split: tuple[Sequence[int], Sequence[int]] | None = None,
) -> NoReturn:
    """Raise ``error``, or the treemode error `explain_failure` finds behind it.

    ``split``: ``(donated, kept)``, the indices into the call's dynamic arrays
    of the two tuples an executable with donated arrays takes (see
    `name_internal_paths`). For such a call, an error JAX raised while the
    executable ran is raised as it is (same type and message), with a note
    naming the Variables whose donated buffers that failed run consumed.
    Called inside a treemode entry point, which filters the traceback as it
    leaves (an inner ``jax.jit`` may have filtered it already: its note goes).
    """
    _compat.forget_traceback_filtering(error)
    if isinstance(error, EXPLAINED) or is_deleted_input_error(error):
        better = explain_failure(call.full(), error)
        if better is not None:
            raise better from error
    elif isinstance(error, NAMING) and not isinstance(error, TreemodeError):
        renamed = name_internal_paths(call, error, split)
        if renamed is not None:
            raise renamed from error
    if split is not None and split[0]:
        note_consumed(call, error, split[0])
    raise error


# JAX's errors for an input array deleted before the call: raised while it reads
# the arguments (``jax.Array``'s own check) or when the runtime validates the
# buffers of an executable with donated inputs, both before anything runs.
_DELETED_INPUT = re.compile(
    r"Array has been deleted|Invalid buffer passed to Execute\(\).*deleted or donated"
)


def is_deleted_input_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's refusal of an input deleted before the call (the
    executable did not run, so it consumed nothing)."""
    return isinstance(error, (RuntimeError, ValueError)) and (
        _DELETED_INPUT.search(str(error)) is not None
    )


def note_consumed(call: PreparedCall, error: BaseException, donated: Sequence[int]) -> None:
    """Add a note to ``error`` naming the Variables whose donated buffers are deleted.

    Called for a donated call that failed while its executable ran (a host
    callback raised, the runtime failed): XLA may have consumed the donated
    buffers, as with ``jax.jit``'s ``donate_argnums``, and no new values came
    back to write. Nothing is noted when none of them is deleted.
    """
    dynamic = call.dynamic
    consumed = {
        id(dynamic[i])
        for i in donated
        if i < len(dynamic) and _is_concrete_array(dynamic[i]) and dynamic[i].is_deleted()
    }
    if not consumed:
        return
    _note_consumed_arrays([dynamic[i] for i in donated if id(dynamic[i]) in consumed])
    if not hasattr(error, "add_note"):
        return
    full = call.full()
    paths = [
        where
        for where, leaf in full.paths_and_leaves()
        if is_variable(leaf)
        and any(id(x) in consumed for x in jax.tree_util.tree_leaves(_compat.raw_value_of(leaf)))
    ]
    shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    error.add_note(
        f"treemode.{full.transform}: this call failed while its executable ran, after XLA "
        f"took the buffers it donated: {shown} now "
        f"{'holds a deleted array' if len(paths) == 1 else 'hold deleted arrays'}, as "
        "jax.jit's donate_argnums leaves donated inputs after such a failure (no new "
        "values came back to write). "
        "Restore them before using the module again, e.g. from a checkpoint or from a "
        "copy made with treemode.clone(module, arrays=True) before the call; or call "
        "without donating to keep the inputs through a failure."
    )


def _is_concrete_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, Tracer)


def name_internal_paths(
    call: PreparedCall,
    error: BaseException,
    split: tuple[Sequence[int], Sequence[int]] | None = None,
) -> BaseException | None:
    """``error`` again, naming the user's paths where JAX named treemode's flat arrays.

    JAX names an argument by its place in the function it compiled: for
    ``treemode.jit`` that is ``dynamic[i]`` (or ``donated[i]`` / ``kept[i]``)
    of ``_JitEntry._call_flat``, which says nothing to the user. Each is replaced
    by the path of the array in the call (``args[1]``, ``args[0].b``,
    ``kwargs['n']``) and the function by the user's. ``None`` when the message
    names none of them.
    """
    message = str(error)
    if _INTERNAL_ARGUMENT.search(message) is None and _INTERNAL_FUNCTION.search(message) is None:
        return None
    full = call.full()
    paths = dynamic_paths(full, parameters=True)

    def path_of(match: re.Match[str]) -> str:
        kind, i = match.group(1), int(match.group(2))
        if kind not in ("dynamic", "flat_args"):
            if split is None:
                return match.group(0)
            indices = split[0] if kind.startswith("donated") else split[1]
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
    # A deleted input is blamed only where JAX refused it before running anything:
    # after a failure during execution, a donated input is deleted because this
    # call's executable consumed it (`note_consumed`).
    deleted = is_deleted_input_error(error)
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
            if deleted and isinstance(x, jax.Array) and not isinstance(x, Tracer):
                if x.is_deleted():
                    return _deleted_error(call.transform, what, x, is_variable(leaf))
    return None


# Whether a treemode transform has donated buffers in this process (set when a
# transform with donated arguments builds its executable): without one, a
# deleted input buffer was deleted by the user's own code.
_donation_seen = False


def note_donation() -> None:
    """Record that a treemode executable donates buffers (see `_deleted_error`)."""
    global _donation_seen
    _donation_seen = True


# The arrays a donated call consumed before it failed (`note_consumed`), by id, as
# weak references: a later call passing one is told about that failure.
_consumed: dict[int, weakref.ref[Any]] = {}


def _note_consumed_arrays(arrays: Sequence[Any]) -> None:
    for x in arrays:
        key = id(x)
        try:
            _consumed[key] = weakref.ref(x, lambda _, key=key: _consumed.pop(key, None))
        except TypeError:  # not weakly referable: not remembered
            pass


def _was_consumed(x: Any) -> bool:
    ref = _consumed.get(id(x))
    return ref is not None and ref() is x


def _deleted_error(transform: str, what: str, array: Any, in_variable: bool) -> Exception:
    """The error for an input whose buffer was deleted before the call.

    What treemode can tell: a buffer a failed donated call consumed (noted then);
    a Variable's buffer, which treemode donates only with a new value written in
    its place, so a Variable holding a donated one shared it with another that
    was donated (the sharing story, and ``clone(arrays=True)``); an array that is
    no Variable's value (an Equinox field, an array in a dict), which a donated
    call deletes and does not replace, as ``jax.jit`` does.
    """
    if _was_consumed(array):
        return DonationError(
            f"treemode.{transform}: the buffer of {what} has been deleted or donated: "
            "an earlier call that donated it failed while its executable ran, after XLA "
            "took it (that error's note named it). Restore the value before calling "
            "again: `var[...] = new_value`, or from a copy made with "
            "treemode.clone(module, arrays=True) before the call."
        )
    if not _donation_seen:
        return DeletedArrayError(
            f"treemode.{transform}: the buffer of {what} was deleted before this call, "
            "and no treemode transform has donated buffers: it was deleted outside "
            "treemode (`array.delete()`, or donated to a jax.jit/jax.pmap call with "
            "donate_argnums). Put a live array in the Variable before calling: "
            "`var[...] = new_value`."
        )
    if not in_variable:
        return DonationError(
            f"treemode.{transform}: the buffer of {what} has been deleted or donated. "
            "A treemode transform donates the arrays of a donated argument that are "
            "not Variable values (an Equinox field, an array in a dict or list), as "
            "jax.jit's donate_argnums does, and writes nothing in their place: pass the "
            "arrays the earlier call returned (return the updated tree from the "
            "function), hold the array in an nnx.Variable (treemode writes back its new "
            "value), or do not donate that argument. (If your own code deleted it, "
            "with `.delete()` or a jax.jit donate_argnums outside treemode, pass a "
            "live array.)"
        )
    return DonationError(
        f"treemode.{transform}: the buffer of {what} has been deleted or donated: "
        "treemode writes a new buffer into every Variable it donates, so this Variable "
        "shared its buffer with one donated to an earlier call (donate_argnums), e.g. "
        "a copy made with treemode.clone(module) without arrays=True. Give each module "
        "its own buffers with treemode.clone(module, arrays=True) before donating. (If "
        "your own code deleted it, with `.delete()` or a jax.jit donate_argnums outside "
        "treemode, put a live array in the Variable instead: `var[...] = new_value`.)"
    )


__all__ = [
    "EXPLAINED",
    "EXPLAINED_OR_NAMING",
    "explain_failure",
    "is_deleted_input_error",
    "name_internal_paths",
    "note_consumed",
    "note_donation",
    "raise_explained",
]
