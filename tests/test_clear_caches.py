"""`treemode.clear_caches()`: every transform traces again afterwards, with the same
values and write-backs; the caches it clears are registered in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import treemode
from treemode import _caches

X = jnp.arange(2.0)
XS = jnp.stack([X, X])
N = jax.local_device_count()


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.full(2, 2.0))
        self.count = nnx.BatchStat(jnp.array(0))


TRACES: list[str] = []


def body(m: Model, x: jax.Array) -> jax.Array:
    TRACES.append("trace")  # a Python side effect: runs once per trace
    m.count[...] += 1
    return jnp.sum(m.w[...] * x)


def _loop_body(i: Any, v: tuple[Model, jax.Array]) -> tuple[Model, jax.Array]:
    return v[0], v[1] + body(v[0], X)


def _below_one(v: tuple[Model, jax.Array]) -> jax.Array:
    return v[1] < 1.0


def _while_body(v: tuple[Model, jax.Array]) -> tuple[Model, jax.Array]:
    return _loop_body(0, v)


def _scan_body(m: Model, x: jax.Array) -> tuple[Model, jax.Array]:
    return m, body(m, x)


def _custom_vjp() -> Callable[[Model], Any]:
    g = treemode.custom_vjp(body)
    g.defvjp(lambda m, x: (body(m, x), None), lambda res, ct: (None, ct * X))
    return lambda m: g(m, X)


def _shard_map() -> Callable[[Model], Any]:
    mesh = jax.make_mesh((1,), ("d",))
    g = treemode.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    return lambda m: g(m, X)


def _checkify() -> Callable[[Model], Any]:
    g = treemode.checkify(body)
    return lambda m: g(m, X)[1]


# name -> (builds the wrapped function once: model -> value, the value of one call
# (2 * (0 + 1) = 2), how many times one call adds to `count`)
CASES: dict[str, tuple[Callable[[], Callable[[Model], Any]], float, int]] = {
    "jit": (lambda: (lambda g: lambda m: g(m, X))(treemode.jit(body)), 2.0, 1),
    "jit_partial": (lambda: None, 2.0, 1),  # built per model below
    "eval_shape": (lambda: lambda m: treemode.eval_shape(body, m, X), None, 0),
    "vmap": (
        lambda: (lambda g: lambda m: g(m, XS)[0])(treemode.vmap(body, in_axes=(None, 0))),
        2.0,
        1,
    ),
    "pmap": (
        lambda: (lambda g: lambda m: g(m, jnp.stack([X] * N))[0])(
            treemode.pmap(body, in_axes=(None, 0))
        ),
        2.0,
        1,
    ),
    "shard_map": (_shard_map, 2.0, 1),
    "scan": (
        lambda: (lambda g: lambda m: g(m, XS)[1][0])(
            treemode.scan(_scan_body, in_axes=(treemode.Carry, 0), out_axes=(treemode.Carry, 0))
        ),
        2.0,
        2,
    ),
    "while_loop": (
        lambda: lambda m: treemode.while_loop(_below_one, _while_body, (m, jnp.float32(0.0)))[1],
        2.0,
        1,
    ),
    "fori_loop": (
        lambda: lambda m: treemode.fori_loop(0, 1, _loop_body, (m, jnp.float32(0.0)))[1],
        2.0,
        1,
    ),
    "cond": (lambda: lambda m: treemode.cond(jnp.array(True), body, body, m, X), 2.0, 1),
    "switch": (lambda: lambda m: treemode.switch(jnp.array(1), [body, body], m, X), 2.0, 1),
    "grad": (lambda: (lambda g: lambda m: g(m, X))(treemode.grad(body, argnums=1)), None, 1),
    "value_and_grad": (
        lambda: (lambda g: lambda m: g(m, X)[0])(treemode.value_and_grad(body, argnums=1)),
        2.0,
        1,
    ),
    "vjp": (lambda: lambda m: treemode.vjp(body, m, X)[0], 2.0, 1),
    "jvp": (lambda: lambda m: treemode.jvp(body, (m, X), (None, X))[0], 2.0, 1),
    "custom_vjp": (_custom_vjp, 2.0, 1),
    "remat": (lambda: (lambda g: lambda m: g(m, X))(treemode.remat(body)), 2.0, 1),
    "checkify": (_checkify, 2.0, 1),
    "transform_metadata": (
        lambda: (lambda g: lambda m: g(m, X))(
            treemode.transform_metadata(body, in_axes=None, out_axes=None, partition="p")
        ),
        2.0,
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_call_after_clear_caches_traces_again_and_gives_the_same_answer(name):
    build, value, writes = CASES[name]
    m = Model()
    if name == "jit_partial":
        g = treemode.jit_partial(body, m)
        f = lambda m: g(X)  # noqa: E731
    else:
        f = build()
    first = f(m)
    if value is not None:
        np.testing.assert_allclose(first, value)
    f(m)
    TRACES.clear()
    treemode.clear_caches()
    again = f(m)
    assert TRACES, f"treemode.{name}: the call after clear_caches() did not trace"
    if value is not None:
        np.testing.assert_allclose(again, value)
    else:
        assert jax.tree.structure(again) == jax.tree.structure(first)
    assert int(m.count[...]) == 3 * writes  # every call wrote back, the retraced one too


@pytest.mark.parametrize("name", ["jit", "jit_partial", "scan", "while_loop", "fori_loop"])
def test_cached_transforms_do_not_trace_again_without_clear_caches(name):
    """The check of the check: these reuse their trace, so the retrace above is the
    clear's doing."""
    build, _, _ = CASES[name]
    m = Model()
    if name == "jit_partial":
        g = treemode.jit_partial(body, m)
        f = lambda m: g(X)  # noqa: E731
    else:
        f = build()
    f(m)
    TRACES.clear()
    f(m)
    assert not TRACES


def test_jax_clear_caches_and_treemode_clear_caches_clear_different_things():
    """`jax.clear_caches()` empties the caches of the `jax.jit` wrappers treemode holds
    (the next call traces again) but not treemode's own: the wrapper entries and
    the flattenings stay. `treemode.clear_caches()` drops those (and the wrappers)."""
    from treemode._tree import _flatten

    f = treemode.jit(body)
    m = Model()
    f(m, X)
    TRACES.clear()
    jax.clear_caches()
    np.testing.assert_allclose(f(m, X), 2.0)
    assert TRACES == ["trace"]
    assert len(f._cache) == 1 and len(_flatten._cache) > 0
    treemode.clear_caches()
    assert len(f._cache) == 0 and len(_flatten._cache) == 0
    np.testing.assert_allclose(f(m, X), 2.0)
    assert TRACES == ["trace", "trace"]
    assert int(m.count[...]) == 3


def test_copies_and_memo_are_cleared_too():
    """A copy of a jitted function shares its entries and has its own call memo: both go."""
    import copy

    f = treemode.jit(body)
    g = copy.copy(f)
    m = Model()
    g(m, X)
    g(m, X)  # the memo of `g` is set
    TRACES.clear()
    treemode.clear_caches()
    np.testing.assert_allclose(g(m, X), 2.0)
    assert TRACES == ["trace"]
    assert int(m.count[...]) == 3


def test_every_module_level_cache_is_emptied():
    from treemode._pipeline import _call, _trace_cache
    from treemode._tree import _closure, _closure_code, _flatten, _leaves, _pytree_def

    f = treemode.jit(body)
    m = Model()
    f(m, X)
    treemode.scan(_scan_body, in_axes=(treemode.Carry, 0), out_axes=(treemode.Carry, 0))(m, XS)
    treemode.Pytree(Model())
    tables = {
        "_flatten._cache": _flatten._cache,
        "_closure_code.plans": _closure_code.plans,
        "_closure._snapshots": _closure._snapshots,
        "_leaves._variable_types": _leaves._variable_types,
        "_trace_cache._registry": _trace_cache._registry,
        "_pytree_def._interned": _pytree_def._interned,
    }
    filled = [name for name, table in tables.items() if len(table)]
    assert "_flatten._cache" in filled and "_trace_cache._registry" in filled
    treemode.clear_caches()
    assert {name: len(t) for name, t in tables.items() if len(t)} == {}
    assert len(_call._overlap_memo) == 0
    assert len(f._cache) == 0 and f._records == []


def test_a_registered_cache_and_a_tracked_owner_are_cleared():
    table = {"a": 1}
    _caches.register(table.clear)

    class Owner:
        cleared = 0

        def clear_cache(self):
            self.cleared += 1

    owner = Owner()
    _caches.track(owner)
    treemode.clear_caches()
    assert table == {} and owner.cleared == 1
    del owner  # held weakly: a dead owner is dropped, not cleared
    treemode.clear_caches()
