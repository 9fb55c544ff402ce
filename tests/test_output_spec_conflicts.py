"""``graph=True``: one Variable returned at two paths takes one output specification.

A shared Variable is one output of the JAX transform. Output specifications
(``vmap``/``pmap``/``scan`` ``out_axes``, ``shard_map`` ``out_specs``, ``jit``
``out_shardings``) that give its two paths two different values raise
`AliasError` naming both paths and both specifications, as the input side
does, instead of silently applying the first path's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treemode


class Pair(nnx.Module):
    def __init__(self, w):
        self.a = nnx.Param(w)
        self.b = self.a  # one Variable, two paths


def both(x):
    p = Pair(x * jnp.ones(3))
    return p.a, p.b


def _mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def _check_message(info, what, first, second, specs):
    message = str(info.value)
    assert f"two different {what}, {first}: {specs[0]} and {second}: {specs[1]}" in message
    assert f"Fix: give both places the same {what}" in message


def test_vmap_out_axes():
    f = treemode.vmap(both, out_axes=(0, 1), graph=True)
    with pytest.raises(treemode.AliasError) as info:
        f(jnp.ones(4))
    assert str(info.value).startswith(
        "treemode.vmap: Inconsistent aliasing detected: the Param returned at output[0] "
        "is also returned at output[1] (shared, graph=True)"
    )
    _check_message(info, "out_axes", "output[0]", "output[1]", ("0", "1"))


def test_vmap_out_axes_that_agree_keep_the_sharing():
    a, b = treemode.vmap(both, out_axes=(1, 1), graph=True)(jnp.arange(4.0))
    assert a is b and a.shape == (3, 4)


def test_pmap_out_axes():
    f = treemode.pmap(both, out_axes=(0, None), graph=True)
    with pytest.raises(treemode.AliasError) as info:
        f(jnp.ones(8))
    _check_message(info, "out_axes", "output[0]", "output[1]", ("0", "None"))


def test_scan_out_axes():
    def step(c, x):
        return c, both(x)

    f = treemode.scan(
        step, in_axes=(treemode.Carry, 0), out_axes=(treemode.Carry, (0, 1)), graph=True
    )
    with pytest.raises(treemode.AliasError) as info:
        f(jnp.zeros(()), jnp.ones(4))
    _check_message(info, "out_axes", "ys[0][0]", "ys[0][1]", ("0", "1"))


def test_shard_map_out_specs():
    mesh = _mesh()
    xs = jax.device_put(jnp.arange(24.0).reshape(8, 3), NamedSharding(mesh, P("x")))

    def body(x):
        p = Pair(x)
        return p.a, p.b

    f = treemode.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P()), graph=True)
    with pytest.raises(treemode.AliasError) as info:
        f(xs)
    _check_message(info, "out_specs", "output[0]", "output[1]", ("P('x',)", "P()"))


def test_jit_out_shardings():
    mesh = _mesh()
    one, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))

    def body(x):
        p = Pair(x)
        return p.a, p.b

    f = treemode.jit(body, out_shardings=(rows, one), graph=True)
    with pytest.raises(treemode.AliasError) as info:
        f(jnp.ones(8))
    _check_message(info, "out_shardings", "output[0]", "output[1]", (repr(rows), repr(one)))
    # The same sharding at both paths: accepted, one shared Variable.
    a, b = treemode.jit(body, out_shardings=(rows, rows), graph=True)(jnp.arange(8.0))
    assert a is b and a.sharding == rows
    np.testing.assert_array_equal(a[...], np.arange(8.0))


def test_module_paths_are_named():
    def make(x):
        return Pair(x * jnp.ones(3))

    # A module-shaped prefix is fine as long as both paths agree (one axis).
    p = treemode.vmap(make, out_axes=1, graph=True)(jnp.ones(4))
    assert p.a is p.b and p.a.shape == (3, 4)

    def two(x):
        p = make(x)
        return {"first": p, "second": p.b}

    f = treemode.vmap(two, out_axes={"first": 0, "second": 1}, graph=True)
    with pytest.raises(treemode.AliasError) as info:
        f(jnp.ones(4))
    message = str(info.value)
    assert "output['first'].a" in message and "output['second']" in message
    assert "output['first'].a: 0 and output['second']: 1" in message
