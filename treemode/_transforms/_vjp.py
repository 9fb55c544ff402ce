"""``treemode.vjp`` and ``treemode.jvp``.

Both differentiate with respect to the floating-point arrays of all primals (the
same split as `treemode.grad`); integer and key Variables are carried as
non-differentiated inputs, and their cotangents are ``float0`` zeros. Variable
updates made by the function ride along as JAX ``aux`` and are written back to
the primals after the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import jax
from flax.nnx import filterlib

from .._pipeline import _call, _core, _pure
from .._tree import _graph
from ._grad import dynamic_like, split_aux, to_array_args
from ._grad_wrt import DiffSplit, check_filter
from ._named_errors import TRACER_ERRORS, at_top_level, raise_named, trace_named
from ._names import named
from ._signature import UNSPECIFIED, check_reduce_axes, suggests_keywords

T = TypeVar("T")
U = TypeVar("U")
# What `vjp` returns to compute the cotangents: one per primal, each of its type.
VjpFunction = Callable[[Any], tuple[Any, ...]]


# As for `jax.vjp`: the output's type, and with `has_aux` the aux's; without
# primals, `vjp` with its options bound.
@overload
def vjp(
    fun: Callable[..., tuple[T, U]],
    primal: Any,
    /,
    *primals: Any,
    has_aux: Literal[True],
    reduce_axes: Sequence[Any] = ...,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> tuple[T, VjpFunction, U]: ...


@overload
def vjp(
    fun: Callable[..., T],
    primal: Any,
    /,
    *primals: Any,
    has_aux: Literal[False] = ...,
    reduce_axes: Sequence[Any] = ...,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> tuple[T, VjpFunction]: ...


@overload
def vjp(
    fun: Callable[..., Any],
    primal: Any,
    /,
    *primals: Any,
    has_aux: bool,
    reduce_axes: Sequence[Any] = ...,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> tuple[Any, ...]: ...


@overload
def vjp(
    fun: Callable[..., Any] = ...,
    /,
    *,
    has_aux: bool = ...,
    reduce_axes: Sequence[Any] = ...,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> Callable[..., Any]: ...


@suggests_keywords
def vjp(
    fun: Callable[..., Any] = UNSPECIFIED,
    *primals: Any,
    has_aux: bool = False,
    reduce_axes: Sequence[Any] = (),
    wrt: filterlib.Filter = ...,
    graph: bool = False,
) -> Any:
    """``jax.vjp`` over Modules and pytrees, writing Variable updates back.

    **Arguments:**

    - `fun`: the function to differentiate.
    - `*primals`: its positional arguments (Modules, Variables, pytrees, arrays,
      Python numbers).
    - `has_aux`: `fun` returns `(output, aux)`; `aux` is not differentiated.
    - `reduce_axes`: accepted for `jax.vjp`'s signature; must be empty.
    - `wrt`: a Flax filter (`nnx.LoRAParam`, `(nnx.Param, nnx.BatchStat)`,
      `nnx.PathContains('lora')`, ...): only the Variables of the primals it
      selects are differentiated, as with `treemode.grad`'s `wrt`; the others'
      cotangents are `float0` zeros. Default `...`: every floating-point Variable.
    - `graph`: if `True`, primals may share Modules/Variables (see `to_tree`).

    Without `fun` (`treemode.vjp(graph=True)`), or with `fun` but no primals,
    returns `vjp` with these options bound, as Flax's `nnx.vjp` does, so it
    can decorate a function: `treemode.vjp(has_aux=True)(f, x)`.

    **Returns:**

    `(output, vjp_fn)` or `(output, vjp_fn, aux)`. `vjp_fn(cotangent)` returns a
    tuple with one cotangent per primal, each of the primal's own type (a Module
    of the same class for a Module); integer and key Variables get `float0`
    zeros. Variables changed by `fn` are written back when `vjp` returns.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    y, vjp_fn = treemode.vjp(lambda m, x: m(x), model, x)
    model_ct, x_ct = vjp_fn(jnp.ones_like(y))
    assert type(model_ct) is nnx.Linear
    assert x_ct.shape == (1, 2)
    ```
    """
    check_reduce_axes("vjp", reduce_axes)
    check_filter("vjp", wrt)
    if fun is UNSPECIFIED:
        return functools.partial(vjp, has_aux=has_aux, wrt=wrt, graph=graph)
    if not primals:
        return functools.partial(vjp, fun, has_aux=has_aux, wrt=wrt, graph=graph)
    primals = to_array_args(primals, range(len(primals)))
    call = _call.prepare("vjp", fun, primals, {}, graph=graph)
    roots = range(len(call.arg_flats))
    split = DiffSplit(call, roots, wrt=None if wrt is ... else dict.fromkeys(roots, wrt))

    def linearize(differentiated: Callable[[Sequence[Any]], Any]) -> Any:
        traced = named(lambda *diff: differentiated(diff), fun)
        return jax.vjp(traced, *split.diff_values(), has_aux=True)

    out, raw_vjp, aux = _differentiate("vjp", call, split, has_aux, linearize)

    def vjp_fn(cotangent: Any) -> tuple[Any, ...]:
        if graph:
            cotangent = _graph.to_tree(cotangent)
        return tuple(split.cotangent_trees(raw_vjp(cotangent)))

    if has_aux:
        return out, vjp_fn, aux
    return out, vjp_fn


# As for `jax.jvp`, with the output's type (and the aux's); without primals and
# tangents, `jvp` with its options bound.
@overload
def jvp(
    fun: Callable[..., tuple[T, U]],
    primals: Sequence[Any],
    tangents: Sequence[Any],
    has_aux: Literal[True],
    *,
    graph: bool = ...,
) -> tuple[T, Any, U]: ...


@overload
def jvp(
    fun: Callable[..., T],
    primals: Sequence[Any],
    tangents: Sequence[Any],
    has_aux: Literal[False] = ...,
    *,
    graph: bool = ...,
) -> tuple[T, Any]: ...


@overload
def jvp(
    fun: Callable[..., Any],
    primals: Sequence[Any],
    tangents: Sequence[Any],
    has_aux: bool,
    *,
    graph: bool = ...,
) -> tuple[Any, ...]: ...


@overload
def jvp(
    fun: Callable[..., Any] = ...,
    primals: Sequence[Any] = ...,
    *,
    has_aux: bool = ...,
    graph: bool = ...,
) -> Callable[..., Any]: ...


@suggests_keywords
def jvp(
    fun: Callable[..., Any] = UNSPECIFIED,
    primals: Sequence[Any] = UNSPECIFIED,
    tangents: Sequence[Any] = UNSPECIFIED,
    has_aux: bool = False,
    *,
    graph: bool = False,
) -> Any:
    """``jax.jvp`` over Modules and pytrees, writing Variable updates back.

    **Arguments:**

    - `fun`: the function to differentiate.
    - `primals`: tuple of its positional arguments.
    - `tangents`: tuple with one tangent per primal, of the primal's own type (a
      Module of the same class for a Module, e.g. `jax.tree.map(jnp.ones_like,
      model)`); `None` stands for zeros. The tangents of integer and key
      Variables are ignored (they are not differentiated).
    - `has_aux`: `fun` returns `(output, aux)`; `aux` is not differentiated.
    - `graph`: if `True`, primals may share Modules/Variables (see `to_tree`).

    Without `fun`, or without `primals` and `tangents`, returns `jvp` with the
    given options bound (as Flax's `nnx.jvp`): `treemode.jvp(graph=True)(f,
    primals, tangents)`.

    **Returns:**

    `(output, output_tangent)` or `(output, output_tangent, aux)`. Variables
    changed by `fn` are written back to the primals.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    tangent = jax.tree.map(jnp.ones_like, model)
    y, y_dot = treemode.jvp(lambda m: m(x), (model,), (tangent,))
    assert y_dot.shape == (1, 3)
    ```
    """
    if fun is UNSPECIFIED:
        return functools.partial(jvp, has_aux=has_aux, graph=graph)
    if primals is UNSPECIFIED or tangents is UNSPECIFIED:
        return functools.partial(jvp, fun, has_aux=has_aux, graph=graph)
    primals = to_array_args(tuple(primals), range(len(primals)))
    tangents = to_array_args(tuple(tangents), range(len(tangents)))
    if len(primals) != len(tangents):
        raise TypeError(
            f"treemode.jvp: got {len(primals)} primal(s) but {len(tangents)} tangent(s); "
            "give one tangent per primal (None for zeros)."
        )
    call = _call.prepare("jvp", fun, primals, {}, graph=graph)
    split = DiffSplit(call, range(len(call.arg_flats)))
    names = [f"primals[{i}]" for i in range(len(primals))]
    diff_tangents = dynamic_like(
        call, split, tangents, transform="jvp", what="tangent", names=names
    )

    def linearize(differentiated: Callable[[Sequence[Any]], Any]) -> Any:
        traced = named(differentiated, fun)
        return jax.jvp(traced, (split.diff_values(),), (diff_tangents,), has_aux=True)

    out, out_tangent, aux = _differentiate("jvp", call, split, has_aux, linearize)
    out_tangent = _core.finish(call, out_tangent)
    if has_aux:
        return out, out_tangent, aux
    return out, out_tangent


def _differentiate(
    transform: str,
    call: _call.Call,
    split: DiffSplit,
    has_aux: bool,
    linearize: Callable[[Callable[[Sequence[Any]], Any]], tuple[Any, Any, Any]],
) -> tuple[Any, Any, Any]:
    """The run `vjp` and `jvp` share; returns ``(output, linear, aux)``.

    ``linearize(differentiated)`` calls ``jax.vjp`` or ``jax.jvp`` (with
    ``has_aux=True``) on ``differentiated``, the function of the differentiated
    arrays (one sequence) that calls the user's function and returns ``(output,
    (aux, updates))``; it returns ``(output, linear, (aux, updates))``, ``linear``
    being the VJP function or the output tangent. The updates are written back;
    the output and ``aux`` (``None`` without ``has_aux``) come back finished.
    """
    pure = _pure.PureFunction(call)
    other = split.other_values()

    def differentiated(diff: Sequence[Any]) -> tuple[Any, Any]:
        out, updates = pure(*split.merge(diff, other))
        if has_aux:
            out, aux = split_aux(transform, out)
        else:
            aux = None
        return out, (aux, updates)

    def jax_call() -> tuple[Any, Any]:
        try:
            out, linear, (aux, updates) = linearize(differentiated)
        except TRACER_ERRORS as e:
            if at_top_level(call):  # under jit, jit's trace names the argument
                raise_named(e, lambda: trace_named(transform, pure, call))
            raise
        return (out, linear, aux), updates

    out, linear, aux = _core.run(call, pure, jax_call, finish=False)
    return _core.finish(call, out), linear, _core.finish(call, aux) if has_aux else None


__all__ = ["jvp", "vjp"]
