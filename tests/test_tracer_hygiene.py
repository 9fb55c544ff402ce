"""Tracer hygiene: every treemode transform nested inside every JAX transform.

The module goes into the outer JAX transform as a pytree argument (so inside
it, its Variables hold the outer transform's tracers), the inner treemode
transform reads and writes it, and the outer transform returns. Afterwards no
Variable anywhere (the caller's module, the module returned by the outer
transform, the flatten cache) may hold a tracer, and JAX's own leak checker
(``jax.check_tracer_leaks``, on for every test here) must find nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import treemode
from treemode._tree import _flatten


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([1.0, 2.0]))
        self.count = nnx.BatchStat(jnp.array(0))


def body(m: Model, x: jax.Array) -> jax.Array:
    m.count[...] += 1
    m.w[...] = m.w[...] + x
    return jnp.sum(m.w[...] * x)


def body_unbatched(m: Model, x: jax.Array) -> jax.Array:
    m.count[...] += 1
    m.w[...] = m.w[...] * 2.0
    return jnp.sum(m.w[...] * x)


def _tree_sum(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum((jnp.sum(x) for x in leaves), jnp.zeros(()))


def _while_body(v: tuple[Model, jax.Array, jax.Array]) -> Any:
    # Only the integer counter changes: JAX cannot differentiate a while_loop
    # whose carry depends on a differentiated input (jax.grad outside).
    m, x, i = v
    m.count[...] += 1
    return m, x, i + 1.0


# The inner treemode transforms: each takes (module, x) and returns a scalar.
INNER: dict[str, Callable[[Model, jax.Array], jax.Array]] = {
    "jit": lambda m, x: treemode.jit(body)(m, x),
    "vmap": lambda m, x: jnp.sum(treemode.vmap(body_unbatched, in_axes=(None, 0))(m, x[None])),
    "scan": lambda m, x: jnp.sum(
        treemode.scan(lambda m, x: (m, body(m, x)), in_axes=(treemode.Carry, 0))(m, x[None])[1]
    ),
    "cond": lambda m, x: treemode.cond(jnp.array(True), body, lambda m, x: jnp.sum(x), m, x),
    "switch": lambda m, x: treemode.switch(jnp.array(1), [lambda m, x: jnp.sum(x), body], m, x),
    "while_loop": lambda m, x: treemode.while_loop(
        lambda v: v[2] < 2, _while_body, (m, x, jnp.zeros(()))
    )[2],
    "fori_loop": lambda m, x: jnp.sum(
        treemode.fori_loop(0, 2, lambda i, v: (v[0], v[1] + body(v[0], v[1]) * 0), (m, x))[1]
    ),
    "grad": lambda m, x: _tree_sum(treemode.grad(body)(m, x)),
    "remat": lambda m, x: treemode.remat(body)(m, x),
    "eval_shape": lambda m, x: jnp.zeros(()) + treemode.eval_shape(body, m, x).size,
}


def _outer_jit(inner, m, x):
    return jax.jit(lambda m, x: (m, inner(m, x)))(m, x)


def _outer_vmap(inner, m, x):
    return jax.vmap(lambda m, x: (m, inner(m, x)), in_axes=(None, 0), out_axes=(0, 0))(
        m, jnp.stack([x, x])
    )


def _outer_scan(inner, m, x):
    return jax.lax.scan(lambda m, x: (m, inner(m, x)), m, jnp.stack([x, x]))


def _outer_grad(inner, m, x):
    return None, jax.grad(lambda m, x: inner(m, x), allow_int=True)(m, x)


def _outer_eval_shape(inner, m, x):
    return jax.eval_shape(lambda m, x: (m, inner(m, x)), m, x)


def _outer_checkpoint(inner, m, x):
    return jax.checkpoint(lambda m, x: (m, inner(m, x)))(m, x)


OUTER = {
    "jax.jit": _outer_jit,
    "jax.vmap": _outer_vmap,
    "jax.lax.scan": _outer_scan,
    "jax.grad": _outer_grad,
    "jax.eval_shape": _outer_eval_shape,
    "jax.checkpoint": _outer_checkpoint,
}


def _variables(tree: Any) -> list[Any]:
    return [
        v
        for v in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
        if isinstance(v, nnx.Variable)
    ]


def _assert_no_tracers(tree: Any, where: str) -> None:
    for v in _variables(tree):
        for leaf in jax.tree_util.tree_leaves(v.get_raw_value()):
            assert not isinstance(leaf, jax.core.Tracer), f"{where}: {v!r}"


def _assert_cache_clean() -> None:
    for entry in list(_flatten._cache.values()):
        for v in entry.variables:
            assert not isinstance(v.get_raw_value(), jax.core.Tracer)
        for x in entry.leaves:
            assert not isinstance(x, jax.core.Tracer)


@pytest.mark.parametrize("outer", sorted(OUTER))
@pytest.mark.parametrize("inner", sorted(INNER))
def test_no_variable_holds_a_tracer_after_the_outer_transform(inner, outer):
    model = Model()
    before = [v.get_raw_value() for v in _variables(model)]
    with jax.check_tracer_leaks(True):
        returned, out = OUTER[outer](INNER[inner], model, jnp.array([0.5, 1.0]))
    # The caller's module was an input of a pure JAX transform: untouched.
    assert all(v.get_raw_value() is b for v, b in zip(_variables(model), before, strict=True))
    _assert_no_tracers(model, "the caller's module")
    _assert_no_tracers(returned, "the module returned by the outer transform")
    _assert_no_tracers(out, "the output")
    _assert_cache_clean()
    # The caller's module still works with the same treemode transform.
    jax.block_until_ready(INNER[inner](model, jnp.array([0.5, 1.0])))
    _assert_no_tracers(model, "the caller's module after a direct call")


def test_module_created_inside_the_outer_transform():
    """A module built from traced arrays inside jax.jit and used by treemode.jit."""

    @jax.jit
    def outer(w):
        m = Model()
        m.w[...] = w
        y = treemode.jit(body)(m, w)
        return m.w[...], y

    with jax.check_tracer_leaks(True):
        w, y = outer(jnp.array([1.0, 2.0]))
    assert w.tolist() == [2.0, 4.0] and float(y) == 10.0
    _assert_cache_clean()
