"""Error classes raised by treemode.

Every message names the transform, the path(s) of the offending objects in the
caller's terms (``args[0].layers[1].kernel``) and what to do about it.
"""

from __future__ import annotations

import sys

# The module that exports treemode's public error and warning classes: their
# ``__module__``, so that a traceback prints ``treemode.AliasError`` (not the
# private module that defines it) and pickle finds each class by that name.
PUBLIC_MODULE = "treemode"


class TreemodeError(Exception):
    """Base class of every error raised by treemode."""

    __module__ = PUBLIC_MODULE


class AliasError(TreemodeError, ValueError):
    """One Variable is reachable twice from the inputs or outputs of a transform.

    Tree mode treats modules as pytrees, so a shared Variable would silently
    become two independent copies. Pass ``graph=True`` to keep the sharing, or
    remove the duplicate reference.
    """

    __module__ = PUBLIC_MODULE


class StructureError(TreemodeError, ValueError):
    """The function changed the structure of an input module inside a transform.

    Adding, deleting or replacing attributes, Variables or static fields cannot be
    written back by a tree-mode transform; do it outside the transform.
    """

    __module__ = PUBLIC_MODULE


class CycleError(StructureError):
    """An object contains itself (a module among its own attributes, a list that
    holds itself): it has no tree to flatten. Break the cycle, or hold the back
    reference outside the module (a weak reference, or an argument)."""

    __module__ = PUBLIC_MODULE


class ClosureError(TreemodeError, ValueError):
    """A Variable reached through the function's closure cannot be used."""

    __module__ = PUBLIC_MODULE


class DonationError(TreemodeError, ValueError):
    """Donated arguments share a buffer, or a donated argument is static."""

    __module__ = PUBLIC_MODULE


class DeletedArrayError(TreemodeError, RuntimeError):
    """An input's array was deleted before the call, and no treemode transform donated it.

    The user's code deleted it (``array.delete()``) or donated it to a plain
    ``jax.jit``. A ``RuntimeError``, as JAX's own error for a deleted array.
    """

    __module__ = PUBLIC_MODULE


class TraceContextError(TreemodeError, ValueError):
    """A transform would write a value into a Variable that belongs to another trace."""

    __module__ = PUBLIC_MODULE


class StaticArgumentError(TreemodeError, TypeError):
    """A static argument is not hashable or its index/name does not exist."""

    __module__ = PUBLIC_MODULE


class ArgnumsError(TreemodeError, TypeError, ValueError):
    """An invalid ``argnums`` of a transform of the grad family: not an int, an
    ``nnx.DiffState`` or a non-empty tuple of them, or an argument given twice.

    A ``TypeError`` as JAX raises for a bad ``argnums``, and a ``ValueError`` as
    Flax does.
    """

    __module__ = PUBLIC_MODULE


class AxisError(TreemodeError, ValueError):
    """An axis specification (``in_axes``, ``out_axes``, ``in_specs``) is invalid.

    Raised for a wrong spec type, an axis out of range, mismatched mapped sizes,
    a spec that is not a prefix of its argument, or a broadcast (unmapped)
    Variable that the function sets to a per-example value. Also raised when a
    transform is made with one of Flax's graph-mode lift objects in a
    specification (``nnx.StateAxes``, ``nnx.StateSharding``, ``nnx.DiffState``
    in ``in_axes``, ``in_shardings``, ``argnums``, ...) or with a Variable in
    place of an axis (``in_axes=(nnx.Param(0),)``).
    """

    __module__ = PUBLIC_MODULE


class MutationError(TreemodeError, ValueError):
    """The function changed a Variable that the transform cannot write back.

    For example a differentiable Variable inside ``treemode.custom_vjp``: its new
    value would have no cotangent, so gradients would silently be wrong. Also a
    trace-time copy of an argument written outside its trace (from a
    ``jax.debug.callback``, a nested plain JAX transform, or after the call).
    """

    __module__ = PUBLIC_MODULE


class ProxyError(TreemodeError, AttributeError):
    """A ``treemode.Pytree`` proxy was edited directly, or a stale reference was used.

    The proxy is a pytree whose state changes only through method calls or a
    ``with proxy as module:`` block, which writes the edits back when it exits.
    """

    __module__ = PUBLIC_MODULE


def user_stacklevel(*packages: str) -> int:
    """The ``warnings.warn`` stacklevel, for the function calling this one, that
    points at the first frame outside treemode and ``packages`` (top-level
    package names, e.g. ``"jax"``): the user's line."""
    skipped = ("treemode", *packages)
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        # JAX's traceback boundary wraps treemode's entry points: not the user's line.
        if name.partition(".")[0] not in skipped and name != "jax._src.traceback_util":
            return level
        frame = frame.f_back
        level += 1
    return 1


__all__ = [
    "AliasError",
    "AxisError",
    "ClosureError",
    "DonationError",
    "MutationError",
    "ProxyError",
    "StaticArgumentError",
    "StructureError",
    "TraceContextError",
    "TreemodeError",
]
