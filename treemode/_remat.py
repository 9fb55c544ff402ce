"""``treemode.remat`` (alias ``treemode.checkpoint``): ``jax.checkpoint`` with write-back."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _core


def remat(
    fn: Callable[..., Any] | None = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | Sequence[int] = (),
    policy: Callable[..., bool] | None = None,
    graph: bool = False,
) -> Callable[..., Any]:
    """Recompute ``fn``'s intermediates in the backward pass (``jax.checkpoint``).

    Modules and pytrees may be passed freely; Variables changed by `fn` are written
    back. Works as a function or method decorator.

    **Arguments:**

    - `fn`: the function to rematerialize. Omit it to use
      `remat(policy=...)` as a decorator.
    - `prevent_cse`: as in `jax.checkpoint`.
    - `static_argnums`: positional arguments that are static (part of the trace,
      must be hashable), as in `jax.checkpoint`.
    - `policy`: which intermediates may be saved instead of recomputed, e.g.
      `jax.checkpoint_policies.save_only_these_names("h")`.
    - `graph`: if `True`, inputs may share Modules/Variables (see `to_tree`).

    **Returns:**

    The wrapped function, with the same outputs as `fn`.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 3))
    forward = treemode.remat(lambda m, x: jnp.tanh(m(x)))

    def loss_fn(model):
        return jnp.sum(forward(model, x))

    grads = treemode.grad(loss_fn)(model)
    expected = treemode.grad(lambda m: jnp.sum(jnp.tanh(m(x))))(model)
    assert jnp.allclose(grads.kernel[...], expected.kernel[...])
    ```
    """
    if fn is None:
        return functools.partial(
            remat,
            prevent_cse=prevent_cse,
            static_argnums=static_argnums,
            policy=policy,
            graph=graph,
        )
    statics = frozenset((static_argnums,) if isinstance(static_argnums, int) else static_argnums)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nums = frozenset(i + len(args) if i < 0 else i for i in statics)
        call = _core.prepare("remat", fn, args, kwargs, graph=graph, static_argnums=nums)
        pure = _core.PureFunction(call)
        checkpointed = jax.checkpoint(pure, prevent_cse=prevent_cse, policy=policy)
        return _core.run(call, pure, lambda: checkpointed(*call.dynamic))

    return wrapper


checkpoint = remat
