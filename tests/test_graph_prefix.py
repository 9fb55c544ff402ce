"""Prefixes with graph=True: Flax's `nnx.prefix(..., graph=True)` output in every
transform, and module-shaped prefixes of the outputs (`out_axes`, `out_specs`,
`out_shardings`), each checked against graph=False or against Flax."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import state_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treemode

# What these tests read is the output of Flax's `nnx.prefix(..., graph=True)`, which
# the oldest supported Flax (0.12.6) does not have: there is nothing to read there.
pytestmark = pytest.mark.skipif(
    not hasattr(nnx, "prefix"), reason="this Flax has no nnx.prefix(..., graph=True)"
)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


class Tied(nnx.Module):
    """A submodule reachable twice."""

    def __init__(self, rngs):
        self.a = nnx.Linear(2, 3, rngs=rngs)
        self.b = self.a
        self.count = nnx.BatchStat(jnp.array(0))


def assert_same_arrays(a, b):
    xs, ys = state_arrays(a), state_arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=1e-6)


def make(key):
    return Model(nnx.Rngs(key))


KEYS = jax.random.split(jax.random.key(0), 4)
ABSTRACT = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))


# -- out_axes ------------------------------------------------------------------------


@pytest.mark.parametrize("flax_prefix", [True, False])
def test_vmap_module_shaped_out_axes_graph_true_equals_graph_false(flax_prefix):
    filters = {nnx.Param: 0, ...: None}
    tree_axes = treemode.prefix(ABSTRACT, filters)
    axes = nnx.prefix(ABSTRACT, filters, graph=True) if flax_prefix else tree_axes
    expected = treemode.vmap(make, out_axes=tree_axes)(KEYS)
    model = treemode.vmap(make, out_axes=axes, graph=True)(KEYS)
    assert model.linear.kernel.shape == (4, 2, 3)
    assert model.bn.mean.shape == (3,)
    assert_same_arrays(model, expected)


def test_vmap_out_axes_per_variable_axis_matches_flax():
    filters = {nnx.PathContains("kernel"): 1, nnx.Param: 0, ...: None}
    axes = nnx.prefix(ABSTRACT, filters, graph=True)
    model = treemode.vmap(make, out_axes=axes, graph=True)(KEYS)
    reference = nnx.vmap(make, out_axes=axes, graph=True, graph_updates=False)(KEYS)
    assert model.linear.kernel.shape == (2, 4, 3)
    assert model.linear.bias.shape == (4, 3)
    assert_same_arrays(model, reference)


@pytest.mark.parametrize("flax_prefix", [True, False])
def test_vmap_out_axes_of_a_shared_submodule(flax_prefix):
    abstract = nnx.eval_shape(lambda: Tied(nnx.Rngs(0)))
    filters = {nnx.Param: 0, ...: None}
    if flax_prefix:
        axes = nnx.prefix(abstract, filters, graph=True)
    else:
        axes = treemode.prefix(abstract, filters)
        assert axes.a is axes.b
    tied = treemode.vmap(lambda k: Tied(nnx.Rngs(k)), out_axes=axes, graph=True)(KEYS)
    assert tied.a is tied.b
    assert tied.a.kernel.shape == (4, 2, 3)
    assert tied.count.shape == ()
    for i in range(4):
        np.testing.assert_allclose(tied.a.kernel[i], Tied(nnx.Rngs(KEYS[i])).a.kernel[...])


def test_vmap_prefixes_computed_together_for_one_object_returned_three_times():
    abstract = nnx.eval_shape(lambda: nnx.Linear(3, 3, rngs=nnx.Rngs(0)))
    sa1, sa2, sa3 = nnx.prefix((abstract, abstract, abstract), {...: 0}, graph=True)

    @treemode.vmap(out_axes=(sa1, sa2, sa3), axis_size=2, graph=True)
    def f():
        m = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        return m, m, m

    m1, m2, m3 = f()
    assert m1 is m2 and m2 is m3
    assert m1.kernel.shape == (2, 3, 3)


def test_pmap_module_shaped_out_axes_graph_true():
    axes = nnx.prefix(ABSTRACT, {nnx.Param: 0, ...: None}, graph=True)
    keys = KEYS[:1]
    model = treemode.pmap(make, out_axes=axes, axis_size=1, graph=True)(keys)
    expected = treemode.vmap(make, out_axes=treemode.prefix(ABSTRACT, {nnx.Param: 0, ...: None}))(
        keys
    )
    assert model.linear.kernel.shape == (1, 2, 3)
    assert_same_arrays(model, expected)


def test_scan_module_shaped_out_axes_graph_true_equals_graph_false():
    abstract = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))

    def body(count, key):
        return count + 1, nnx.Linear(2, 3, rngs=nnx.Rngs(key))

    results = []
    for graph, flax_prefix in [(False, False), (True, False), (True, True)]:
        filters = {nnx.PathContains("kernel"): 1, ...: 0}
        if flax_prefix:
            axes = nnx.prefix(abstract, filters, graph=True)
        else:
            axes = treemode.prefix(abstract, filters)
        scan = treemode.scan(body, out_axes=(treemode.Carry, axes), graph=graph)
        count, layers = scan(jnp.array(0), KEYS)
        assert int(count) == 4
        assert layers.kernel.shape == (2, 4, 3)
        assert layers.bias.shape == (4, 3)
        results.append(layers)
    assert_same_arrays(results[1], results[0])
    assert_same_arrays(results[2], results[0])


def test_jit_module_shaped_out_shardings_graph_true():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    kernel, bias = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P("b"))
    abstract = nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
    filters: dict[Any, Any] = {
        nnx.PathContains("kernel"): kernel,
        nnx.PathContains("bias"): bias,
    }
    for shardings in (
        nnx.prefix(abstract, filters, graph=True),
        treemode.prefix(abstract, filters),
    ):
        m = treemode.jit(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)), out_shardings=shardings)()
        g = treemode.jit(
            lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)), out_shardings=shardings, graph=True
        )()
        assert g.bias is not None
        assert g.kernel[...].sharding == kernel and g.bias[...].sharding == bias
        assert_same_arrays(g, m)


def test_jit_module_shaped_in_shardings_graph_true():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    split = NamedSharding(mesh, P(None, "x"))
    m = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    filters = {nnx.PathContains("kernel"): split, ...: NamedSharding(mesh, P())}

    def f(m):
        m.kernel[...] += 1.0
        return m.kernel[...].sum()

    kernel = m.kernel[...]
    for shardings in (treemode.prefix(m, filters), nnx.prefix(m, filters, graph=True)):
        out = treemode.jit(f, in_shardings=(shardings,), graph=True)(m)
        np.testing.assert_allclose(out, float(kernel.sum()) + 32.0, rtol=1e-5)
        # the update comes back with the kernel's input sharding
        assert m.kernel[...].sharding == split
        kernel = m.kernel[...]


class Holder(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(w)


def test_shard_map_graph_prefixes_in_and_out():
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    m = nnx.Linear(2, 8, use_bias=False, rngs=nnx.Rngs(0))
    in_specs = nnx.prefix(m, {nnx.Param: P(None, "model")}, graph=True)
    abstract = nnx.eval_shape(lambda: Holder(jnp.zeros((2, 8))))
    for out_specs in (
        nnx.prefix(abstract, {...: P(None, "model")}, graph=True),
        treemode.prefix(abstract, {...: P(None, "model")}),
    ):

        @treemode.shard_map(mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, graph=True)
        def f(m):
            assert m.kernel.shape == (2, 2)
            return Holder(m.kernel[...] * 2)

        new = f(m)
        assert new.w.shape == (2, 8)
        np.testing.assert_allclose(new.w[...], 2 * m.kernel[...])


# -- in_axes -------------------------------------------------------------------------


def test_vmap_flax_prefix_in_axes_writes_back_like_graph_false():
    def forward(m, x):
        return m(x)

    results = []
    for graph, flax_prefix in [(False, False), (True, True), (False, True)]:
        model = treemode.vmap(make, out_axes=treemode.prefix(ABSTRACT, {...: 0}))(KEYS)
        filters = {(nnx.Param, nnx.BatchStat): 0, ...: None}
        if flax_prefix:
            axes = nnx.prefix(model, filters, graph=True)
        else:
            axes = treemode.prefix(model, filters)
        y = treemode.vmap(forward, in_axes=(axes, 0), graph=graph)(model, jnp.ones((4, 5, 2)))
        assert y.shape == (4, 5, 3)
        results.append((y, model))
    for y, model in results[1:]:
        np.testing.assert_allclose(y, results[0][0], rtol=1e-6)
        assert_same_arrays(model, results[0][1])  # the batch statistics came back


def test_vmap_prefixes_computed_together_keep_the_sharing():
    model = treemode.vmap(lambda k: nnx.Linear(2, 3, rngs=nnx.Rngs(k)))(KEYS)
    px1, px2 = nnx.prefix((model, model), {nnx.Param: 0}, graph=True)

    @treemode.vmap(in_axes=(px1, px2, None), graph=True)
    def forward(m1, m2, x):
        assert m1 is m2
        return m1(x) + m2(x)

    y = forward(model, model, jnp.ones(2))
    np.testing.assert_allclose(y, 2 * treemode.vmap(lambda m: m(jnp.ones(2)))(model), rtol=1e-6)


def test_scan_flax_prefix_in_axes_graph_true():
    rngs = nnx.Rngs(params=0, dropout=1).split({"params": 3}).broadcast({"dropout": 3})
    axes = nnx.prefix(rngs, {...: 0}, graph=True)

    @treemode.scan(in_axes=(axes,), out_axes=0, graph=True)
    def f(rngs):
        return rngs.params(), rngs.dropout()

    params, dropout = f(rngs)
    assert len({int(jax.random.key_data(k).sum()) for k in params}) == 3
    assert len({int(jax.random.key_data(k).sum()) for k in dropout}) == 1


def test_prefixes_from_separate_calls_are_decoded_separately():
    a = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    b = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    pa = nnx.prefix(a, {...: None}, graph=True)
    pb = nnx.prefix(b, {nnx.Param: None}, graph=True)
    f = treemode.vmap(lambda a, b, x: a(x) + b(x), in_axes=(pa, pb, 0), graph=True)
    y = f(a, b, jnp.ones((4, 2)))
    np.testing.assert_allclose(y, a(jnp.ones((4, 2))) + b(jnp.ones((4, 2))), rtol=1e-6)


def test_a_reference_prefix_without_its_target_is_an_error():
    m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    _, second = nnx.prefix((m, m), {...: None}, graph=True)
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap: in_axes holds a prefix made"):
        treemode.vmap(lambda m, x: m(x), in_axes=(second, 0), graph=True)
    with pytest.raises(treemode.AxisError, match=r"nnx\.prefix\(\(m1, m2\), filters"):
        treemode.jit(lambda m: m, out_shardings=second, graph=True)


def test_prefix_keeps_a_shared_submodule_shared():
    tied = Tied(nnx.Rngs(0))
    axes = treemode.prefix(tied, {nnx.Param: 0, ...: None})
    assert axes.a is axes.b and axes.a.kernel == 0 and axes.count is None
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    shardings = treemode.sharding_of(tied, mesh)
    assert shardings.a is shardings.b
    specs = treemode.partition_specs(tied)
    assert specs.a is specs.b


def test_prefixes_computed_together_giving_a_shared_variable_two_values_is_an_error():
    class Foo(nnx.Module):
        def __init__(self, a, b):
            self.a, self.b = a, b

    class Bar(nnx.Module):
        def __init__(self, c, d):
            self.c, self.d = c, d

    v = nnx.Param(jnp.ones((4, 2, 3)))
    foo = Foo(nnx.Param(jnp.ones((4, 2, 3))), v)
    bar = Bar(v, nnx.Param(jnp.ones((2, 4, 3))))
    from_foo = lambda path, x: path[-1] in ("a", "b")  # noqa: E731
    from_bar = lambda path, x: path[-1] in ("c", "d")  # noqa: E731
    ma1, ma2 = nnx.prefix((foo, bar), {from_foo: 0, from_bar: 1}, graph=True)
    forward = lambda foo, bar, x: x @ foo.b + x @ bar.c  # noqa: E731
    with pytest.raises(ValueError, match="Inconsistent aliasing"):
        nnx.vmap(forward, in_axes=(ma1, ma2, None), graph=True, graph_updates=False)(
            foo, bar, jnp.ones(2)
        )
    expected = (
        r"treemode\.vmap: the Param at in_axes\[0\]\.b is also reachable at in_axes\[1\]\.c "
        r".*two different in_axes: 0 at in_axes\[0\]\.b and 1 at in_axes\[1\]\.c.*"
        # Flax's phrase, which Flax's own tests match:
        r"Inconsistent aliasing detected\. The following nodes have different prefixes: "
        r"in_axes\[0\]\.b, in_axes\[1\]\.c\."
    )
    with pytest.raises(treemode.AliasError, match=expected):
        treemode.vmap(forward, in_axes=(ma1, ma2, None), graph=True)
    # One value for the shared Variable: accepted, and it is mapped as in Flax.
    ma1, ma2 = nnx.prefix((foo, bar), {from_foo: 0, nnx.PathContains("d"): 1, ...: 0}, graph=True)
    y = treemode.vmap(forward, in_axes=(ma1, ma2, None), graph=True)(foo, bar, jnp.ones(2))
    ref = nnx.vmap(forward, in_axes=(ma1, ma2, None), graph=True, graph_updates=False)(
        foo, bar, jnp.ones(2)
    )
    np.testing.assert_allclose(y, ref)
