"""``treemode.remat`` (alias ``treemode.checkpoint``): ``jax.checkpoint`` with write-back."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import jax

from .. import _compat
from .._pipeline import _call, _core, _pure, _retrace
from ._names import named
from ._signature import as_tuple, resolve_argnums, suggests_keywords

P = ParamSpec("P")
R = TypeVar("R")


# The function's signature is kept for type checkers, decorator form or not.
@overload
def remat(
    fun: Callable[P, R],
    *,
    prevent_cse: bool | Sequence[bool] = ...,
    policy: Callable[..., bool] | None = ...,
    static_argnums: int | tuple[int, ...] = ...,
    static_argnames: str | Iterable[str] = ...,
    graph: bool = ...,
) -> Callable[P, R]: ...


@overload
def remat(
    fun: None = None,
    *,
    prevent_cse: bool | Sequence[bool] = ...,
    policy: Callable[..., bool] | None = ...,
    static_argnums: int | tuple[int, ...] = ...,
    static_argnames: str | Iterable[str] = ...,
    graph: bool = ...,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@suggests_keywords
def remat(
    fun: Callable[..., Any] | None = None,
    *,
    prevent_cse: bool | Sequence[bool] = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | tuple[int, ...] = (),
    static_argnames: str | Iterable[str] = (),
    graph: bool = False,
) -> Callable[..., Any]:
    """Recompute ``fn``'s intermediates in the backward pass (``jax.checkpoint``).

    Modules and pytrees may be passed freely; Variables changed by `fn` are written
    back. Works as a function or method decorator.

    **Arguments:**

    - `fun`: the function to rematerialize. Omit it to use
      `remat(policy=...)` as a decorator.
    - `prevent_cse`: as in `jax.checkpoint`.
    - `policy`: which intermediates may be saved instead of recomputed, e.g.
      `jax.checkpoint_policies.save_only_these_names("h")`.
    - `static_argnums`, `static_argnames`: arguments that are static (part of
      the trace, must be hashable), by position or by name, as in
      `jax.checkpoint`.
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
    if fun is None:
        return functools.partial(
            remat,
            prevent_cse=prevent_cse,
            policy=policy,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            graph=graph,
        )
    fn = fun
    statics, static_names = resolve_argnums(
        "remat", fn, as_tuple(static_argnums), as_tuple(static_argnames), "static"
    )

    @functools.wraps(fn)
    @_compat.api_boundary
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nums = frozenset(i + len(args) if i < 0 else i for i in statics)
        call = _call.prepare(
            "remat",
            fn,
            args,
            kwargs,
            graph=graph,
            static_argnums=nums,
            static_argnames=static_names,
        )
        pure = _pure.PureFunction(call)
        # JAX traces the function at every call (as jax.checkpoint does): naming its
        # arrays by the user's paths costs little beside that trace.
        names = _retrace.argument_names(call)
        traced = named(pure, fn, traced_for="checkpoint / remat", arg_names=names)
        checkpointed = jax.checkpoint(traced, prevent_cse=prevent_cse, policy=policy)
        return _core.run(call, pure, lambda: checkpointed(*call.dynamic))

    return wrapper


checkpoint = remat
