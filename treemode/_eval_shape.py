"""``treemode.eval_shape``: abstract evaluation that never mutates its inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from . import _core


def eval_shape(fn: Callable[..., Any], *args: Any, graph: bool = False, **kwargs: Any) -> Any:
    """Shapes and dtypes of ``fn(*args, **kwargs)`` without running it.

    Arguments may hold `jax.ShapeDtypeStruct` in place of arrays. Variables the
    function would change are left exactly as they are, and no Variable ever ends
    up holding a tracer. Modules created by `fn` come back with
    `jax.ShapeDtypeStruct` values: the usual way to build an abstract model.

    **Arguments:**

    - `fn`: the function to evaluate.
    - `*args`, `**kwargs`: its arguments (modules, pytrees, arrays).
    - `graph`: if `True`, arguments may share Modules/Variables.

    **Returns:**

    The output of `fn` with every array replaced by a `jax.ShapeDtypeStruct`.

    ```python
    import jax
    import treemode
    from flax import nnx

    abstract = treemode.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert isinstance(abstract.kernel.get_raw_value(), jax.ShapeDtypeStruct)
    assert abstract.kernel.shape == (2, 3)
    ```
    """
    call = _core.prepare("eval_shape", fn, args, kwargs, graph=graph, abstract=True)
    pure = _core.PureFunction(call)
    # The updates' shapes are dropped: nothing is written back.
    return _core.run(call, pure, lambda: (jax.eval_shape(pure, *call.dynamic)[0], None))
