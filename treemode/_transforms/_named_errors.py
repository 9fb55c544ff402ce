"""JAX's tracer errors naming the user's argument where JAX's own trace names none.

When Python needs the concrete value of a traced array (an ``if``, ``int(...)``,
``np.asarray(...)``), JAX's error says which argument the value depends on
(``... depends on the value of the argument x.``), but only for a trace it
stages into a jaxpr, and by the names of the function that trace is of. Some
JAX transforms trace otherwise, and name nothing or their own arguments:

- ``jax.vmap`` traces eagerly: its ``BatchTracer`` says on which line it was
  made, never from which argument;
- ``jax.pmap`` traces the function inside one of its own, ``_fun(*flat_args)``:
  ``the argument flat_args[2]``;
- ``jax.shard_map`` outside ``jit`` runs eagerly, and its tracers say nothing;
- ``checkify`` closes over the arguments: "JAX operations on these lines";
- ``grad``, ``vjp`` and ``jvp`` outside ``jit``: a differentiated value says nothing.

After such an error (on the failure path only: a call that succeeds never
comes here), `raise_named` traces the user's function once more, abstractly
(nothing compiled, nothing run) and as a function named after the user's
whose arrays are named by their paths (``treemode._compat.name_arguments``):
JAX builds its message from those names. The error of that trace is raised
if it is the same error at the same place in the user's code; otherwise the
transform's own error stands. (A value the transform had concrete, a
broadcast argument of an eager ``vmap`` or a primal outside ``jit``, is
abstract in that trace, which may then fail earlier, elsewhere.)
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import jax
from jax.core import Tracer

from .. import _compat
from .._pipeline import _retrace
from ._names import named

# JAX's errors for a traced value used where Python needs a concrete one: their
# message says where the value came from.
TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,  # TracerBoolConversionError too
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)

_JAX = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep
# The whole package (this module sits in its subpackage _transforms/).
_TREEMODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

Place = tuple[tuple[str, int | None, int | None, int | None, int | None], ...]


def failure_place(error: BaseException) -> Place:
    """Where in the user's code ``error`` was raised: the frames below treemode's
    last one (the user's function and what it called, down to the failing
    expression, with its columns), JAX's own frames left out."""
    frames = traceback.extract_tb(error.__traceback__)
    last = max((i for i, f in enumerate(frames) if f.filename.startswith(_TREEMODE)), default=-1)
    return tuple(
        (f.filename, f.lineno, f.end_lineno, f.colno, f.end_colno)
        for f in frames[last + 1 :]
        if not f.filename.startswith(_JAX)
    )


def raise_named(error: BaseException, trace: Callable[[], Any]) -> None:
    """Raise the error of ``trace()`` (a trace of the user's function naming its
    arguments) if it is ``error`` again: the same type, raised at the same place
    in the user's code. Returns otherwise (then ``error`` stands): where JAX
    cannot name arguments, where the trace succeeds or fails otherwise."""
    if not _compat.NAMES_ARGUMENTS:
        return
    try:
        with _retrace.jax_explanations_off():  # treemode's own trace: nothing to explain
            trace()
    except TRACER_ERRORS as named:
        if type(named) is type(error) and failure_place(named) == failure_place(error):
            raise named from None
    except Exception:  # another failure: the transform's own error stands
        return


def trace_named(traced_for: str, pure: Callable[..., Any], call: Any) -> None:
    """Trace ``pure`` (a function of ``call``'s dynamic arrays) abstractly, as a
    function named after the user's whose arrays are named by their paths in
    ``call``, for ``traced_for``; raise what the trace raises."""
    names = _retrace.argument_names(call)
    traced = named(pure, call.fn, traced_for=traced_for, arg_names=names)
    jax.eval_shape(traced, *call.dynamic)


def at_top_level(call: Any) -> bool:
    """Whether no array of ``call`` is a JAX tracer: the transform runs outside any
    other (a tracer error can then only be about the transform's own values)."""
    return not any(isinstance(x, Tracer) for x in call.dynamic)


__all__ = ["TRACER_ERRORS", "at_top_level", "failure_place", "raise_named", "trace_named"]
