"""``treemode.checkify``: ``jax.experimental.checkify`` with Variable write-back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from jax.experimental import checkify as jax_checkify

from .. import _compat
from .._pipeline import _call, _core, _pure
from ._named_errors import TRACER_ERRORS, raise_named, trace_named
from ._names import named
from ._signature import suggests_keywords

P = ParamSpec("P")
R = TypeVar("R")


@suggests_keywords
def checkify(
    f: Callable[P, R],
    errors: frozenset[Any] = jax_checkify.user_checks,
    *,
    graph: bool = False,
) -> Callable[P, tuple[jax_checkify.Error, R]]:
    """Functionalize the checks of `f`, like `jax.experimental.checkify.checkify`.

    The wrapped function returns `(error, out)`; `error.throw()` raises if a
    check failed, `error.get()` gives the message or `None`. Variables that `f`
    changes are written back, whether or not a check failed (as with JAX, the
    computation runs to the end).

    **Arguments:**

    - `f`: the function; its arguments may be modules, pytrees and arrays.
    - `errors`: the error categories to check (`checkify.user_checks`,
      `checkify.float_checks`, `checkify.all_checks`, ...).
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    A function returning `(error, output)`.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx
    from jax.experimental import checkify

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.array(0))

    def step(counter, x):
        checkify.check(x > 0, "x must be positive, got {x}", x=x)
        counter.count[...] += 1
        return x * 2

    counter = Counter()
    err, y = treemode.checkify(step)(counter, jnp.array(3.0))
    assert err.get() is None and float(y) == 6.0 and int(counter.count[...]) == 1
    err, _ = treemode.checkify(step)(counter, jnp.array(-1.0))
    assert "must be positive" in err.get()
    ```
    """

    @functools.wraps(f)
    @_compat.api_boundary
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        call = _call.prepare("checkify", f, args, kwargs, graph=graph)
        pure = _pure.PureFunction(call)
        checked = jax_checkify.checkify(named(pure, f), errors=errors)

        def jax_call() -> tuple[Any, Any]:
            try:
                error, (out, updates) = checked(*call.dynamic)
            except TRACER_ERRORS as e:
                # checkify closes over the arguments: JAX's message names none of
                # them; the same trace of a function of the arrays names them.
                raise_named(e, lambda: trace_named("checkify", pure, call))
                raise
            return (error, out), updates

        error, out = _core.run(call, pure, jax_call, finish=False)
        return error, _core.finish(call, out)

    return wrapped


__all__ = ["checkify"]
