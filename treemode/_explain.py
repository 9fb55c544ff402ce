"""Failure explanation: a JAX error turned into one that names the input behind it.

Called only after the JAX transform raised (never on the hot path): an input
array that was deleted (donated to an earlier call), an input holding a tracer
of a trace that has ended (a module created or changed inside a transform and
kept outside it), or a trace-time Variable written by a host callback.
"""

from __future__ import annotations

from typing import NoReturn

import jax
from jax.core import Tracer

from . import _compat
from ._call import Call, PreparedCall
from ._errors import DonationError, TraceContextError
from ._leaves import is_variable
from ._stale import stale_write_error

# The errors JAX raises for what `explain_failure` looks for.
EXPLAINED = (RuntimeError, jax.errors.UnexpectedTracerError)


def raise_explained(call: PreparedCall, error: BaseException) -> NoReturn:
    """Raise ``error``, or the treemode error `explain_failure` finds behind it."""
    if isinstance(error, EXPLAINED):
        better = explain_failure(call.full(), error)
        if better is not None:
            raise better from error
    raise error


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
                    return DonationError(
                        f"treemode.{call.transform}: the buffer of {what} was deleted: it "
                        "was donated to an earlier call (donate_argnums) while this "
                        "argument shared it. Give each module its own buffers with "
                        "treemode.clone(module, arrays=True) before donating."
                    )
    return None


__all__ = ["EXPLAINED", "explain_failure", "raise_explained"]
