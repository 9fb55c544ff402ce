"""treemode.vmap / treemode.pmap: axes, write-back on the input axis, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_state, state_arrays

import treemode


class Acc(nnx.Module):
    """A parameter and a running total, for write-back tests."""

    def __init__(self, w, total):
        self.w = nnx.Param(w)
        self.total = nnx.BatchStat(total)

    def __call__(self, x):
        self.total[...] += x * self.w[...]
        return x * self.w[...]


def snapshot(node):
    return [a.copy() for a in state_arrays(node)]


def assert_unchanged(node, before):
    after = state_arrays(node)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


# -- values --------------------------------------------------------------------


def test_plain_pytree_matches_jax_vmap():
    tree = {"a": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}

    def f(t, s):
        return t["a"] * t["b"] + s

    expected = jax.vmap(f, in_axes=({"a": 0, "b": None}, 0))(tree, jnp.arange(3.0))
    got = treemode.vmap(f, in_axes=({"a": 0, "b": None}, 0))(tree, jnp.arange(3.0))
    np.testing.assert_allclose(got, expected)


def test_create_stack_from_split_rngs_matches_eager_layers():
    rngs = nnx.Rngs(0)
    batch = treemode.split_rngs(rngs, splits=4)

    @treemode.vmap
    def create(r):
        return nnx.Linear(2, 3, rngs=r)

    stack = create(batch)
    assert stack.kernel.shape == (4, 2, 3)
    assert stack.bias.shape == (4, 3)

    # The same keys, used one layer at a time.
    eager_rngs = nnx.Rngs(0)
    keys = eager_rngs.default.split(4).key[...]
    for i in range(4):
        layer = nnx.Linear(2, 3, rngs=nnx.Rngs(keys[i]))
        np.testing.assert_allclose(stack.kernel[...][i], layer.kernel[...])
    # The input stream advanced like the eager split; the split counts came back
    # mapped (one count per layer).
    assert int(rngs.default.count[...]) == int(eager_rngs.default.count[...]) == 1
    assert batch.default.count.shape == (4,)
    assert (batch.default.count[...] == batch.default.count[...][0]).all()
    assert int(batch.default.count[...][0]) > 0


def test_vmapped_forward_over_a_stack_matches_per_layer_calls():
    stack = treemode.vmap(lambda r: nnx.Linear(2, 3, rngs=r))(
        treemode.split_rngs(nnx.Rngs(1), splits=3)
    )
    x = jnp.arange(10.0).reshape(5, 2)
    y = treemode.vmap(lambda layer, x: layer(x), in_axes=(0, None))(stack, x)
    for i in range(3):
        np.testing.assert_allclose(y[i], x @ stack.kernel[...][i] + stack.bias[...][i], rtol=1e-6)


def test_module_shaped_in_axes_per_example_batch_stats():
    n = 3
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    bn.mean = nnx.BatchStat(jnp.zeros((n, 2)))
    bn.var = nnx.BatchStat(jnp.ones((n, 2)))
    axes = treemode.prefix(bn, {nnx.BatchStat: 0, ...: None})
    assert axes.mean == 0 and axes.scale is None
    x = jnp.arange(n * 4 * 2.0).reshape(n, 4, 2)

    y = treemode.vmap(lambda m, x: m(x), in_axes=(axes, 0))(bn, x)

    for i in range(n):
        ref = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        np.testing.assert_allclose(y[i], ref(x[i]), rtol=1e-6)
        np.testing.assert_allclose(bn.mean[...][i], ref.mean[...], rtol=1e-6)
        np.testing.assert_allclose(bn.var[...][i], ref.var[...], rtol=1e-6)
    assert bn.scale.shape == (2,)  # broadcast parameter untouched


def test_updates_return_on_axis_1():
    acc = Acc(jnp.arange(3.0), jnp.zeros((2, 3)))  # total mapped over its axis 1
    axes = treemode.prefix(acc, {nnx.Param: 0, nnx.BatchStat: 1})
    x = jnp.arange(6.0).reshape(3, 2)  # mapped over axis 0

    treemode.vmap(lambda m, x: m(x), in_axes=(axes, 0))(acc, x)

    assert acc.total.shape == (2, 3)
    np.testing.assert_allclose(acc.total[...], (x * jnp.arange(3.0)[:, None]).T)


def test_negative_axis_and_out_axes():
    acc = Acc(jnp.arange(3.0), jnp.zeros((2, 3)))
    axes = treemode.prefix(acc, {nnx.Param: 0, nnx.BatchStat: -1})
    y = treemode.vmap(lambda m, x: m(x), in_axes=(axes, 0), out_axes=1)(acc, jnp.ones((3, 2)))
    assert y.shape == (2, 3)
    np.testing.assert_allclose(acc.total[...], jnp.broadcast_to(jnp.arange(3.0), (2, 3)))


def test_only_changed_variables_are_written_back():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    w_before = acc.w.get_raw_value()
    treemode.vmap(lambda m, x: m(x))(acc, jnp.arange(3.0))
    assert acc.w.get_raw_value() is w_before
    np.testing.assert_allclose(acc.total[...], jnp.arange(3.0))


def test_broadcast_variable_with_unbatched_update_is_written_back():
    class Calls(nnx.Module):
        def __init__(self):
            self.n = nnx.BatchStat(jnp.array(0))

    calls = Calls()

    @treemode.vmap(in_axes=(None, 0))
    def f(c, x):
        c.n[...] += 1
        return x * 2

    f(calls, jnp.ones((4, 2)))
    assert int(calls.n[...]) == 1


def test_broadcast_variable_reduced_with_axis_name():
    acc = Acc(jnp.array(2.0), jnp.zeros(()))
    axes = treemode.prefix(acc, {...: None})

    @treemode.vmap(in_axes=(axes, 0), axis_name="batch")
    def f(m, x):
        m.total[...] += jax.lax.psum(x * m.w[...], "batch")
        return x

    f(acc, jnp.arange(4.0))
    assert float(acc.total[...]) == 12.0


def test_kwargs_are_mapped_over_axis_0():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    y = treemode.vmap(lambda x, m: m(x), in_axes=0)(jnp.arange(3.0), m=acc)
    np.testing.assert_allclose(y, jnp.arange(3.0))
    np.testing.assert_allclose(acc.total[...], jnp.arange(3.0))


def test_closure_variables_are_broadcast_and_written_back():
    stats = Acc(jnp.array(1.0), jnp.zeros(()))

    @treemode.vmap
    def f(x):
        stats.total[...] += 1.0
        return x * stats.w[...]

    f(jnp.arange(3.0))
    f(jnp.arange(3.0))
    assert float(stats.total[...]) == 2.0


def test_module_shaped_out_axes():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(rngs.params.normal((2,)))
            self.steps = nnx.BatchStat(jnp.array(0))

    template = treemode.eval_shape(lambda: Model(nnx.Rngs(0)))
    out_axes = treemode.prefix(template, {nnx.Param: 0, ...: None})

    @treemode.vmap(in_axes=0, out_axes=out_axes)
    def create(r):
        return Model(r)

    model = create(treemode.split_rngs(nnx.Rngs(0), splits=5))
    assert model.w.shape == (5, 2)
    assert model.steps.shape == ()


def test_graph_true_keeps_shared_submodule():
    class Tied(nnx.Module):
        def __init__(self):
            self.a = Acc(jnp.ones(3), jnp.zeros(3))
            self.b = self.a

    tied = Tied()

    @treemode.vmap(graph=True)
    def f(m, x):
        assert m.a is m.b
        return m.a(x) + m.b(x)

    y = f(tied, jnp.arange(3.0))
    np.testing.assert_allclose(y, 2 * jnp.arange(3.0))
    np.testing.assert_allclose(tied.a.total[...], 2 * jnp.arange(3.0))
    assert tied.a is tied.b


def test_graph_true_module_shaped_in_axes():
    class Tied(nnx.Module):
        def __init__(self):
            self.a = Acc(jnp.array(2.0), jnp.zeros(3))
            self.b = self.a

    tied = Tied()
    axes = treemode.prefix(tied, {nnx.Param: None, nnx.BatchStat: 0})
    y = treemode.vmap(lambda m, x: m.b(x), in_axes=(axes, 0), graph=True)(tied, jnp.ones(3))
    np.testing.assert_allclose(y, 2 * jnp.ones(3))
    np.testing.assert_allclose(tied.a.total[...], 2 * jnp.ones(3))


def test_inside_jit_writes_back_and_does_not_retrace(tracer_leaks):
    traces = []
    acc = Acc(jnp.ones(3), jnp.zeros(3))

    @treemode.jit
    def step(m, x):
        traces.append(1)
        return treemode.vmap(lambda m, x: m(x))(m, x)

    step(acc, jnp.arange(3.0))
    step(acc, jnp.arange(3.0))
    assert len(traces) == 1
    np.testing.assert_allclose(acc.total[...], 2 * jnp.arange(3.0))


def test_nested_vmap():
    acc = Acc(jnp.ones((2, 3)), jnp.zeros((2, 3)))
    inner = treemode.vmap(lambda m, x: m(x))
    y = treemode.vmap(lambda m, x: inner(m, x))(acc, jnp.ones((2, 3)))
    assert y.shape == (2, 3)
    np.testing.assert_allclose(acc.total[...], jnp.ones((2, 3)))


def test_method_decorator():
    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(3.0))

        @treemode.vmap(in_axes=(None, 0))
        def apply(self, x):
            return x * self.w[...]

    layer = Layer()
    assert layer.apply(jnp.ones((4, 3))).shape == (4, 3)


def test_transform_metadata_keyword_stacks_sharding_metadata():
    @treemode.vmap(transform_metadata={nnx.PARTITION_NAME: "din"})
    def create(r):
        return nnx.Param(r.uniform((16,)), out_sharding=("dout",), eager_sharding=False)

    v = create(treemode.split_rngs(nnx.Rngs(0), splits=8))
    assert v.shape == (8, 16)
    assert v.out_sharding == ("din", "dout")


# -- errors ----------------------------------------------------------------------


def test_broadcast_variable_set_to_batched_value_names_path():
    acc = Acc(jnp.array(1.0), jnp.zeros(()))
    before = snapshot(acc)
    with pytest.raises(treemode.AxisError) as err:
        treemode.vmap(lambda m, x: m(x), in_axes=(None, 0))(acc, jnp.arange(3.0))
    msg = str(err.value)
    assert "treemode.vmap" in msg and "args[0].total" in msg and "pmean" in msg
    assert_unchanged(acc, before)


def test_batched_broadcast_error_with_axis_name():
    acc = Acc(jnp.array(1.0), jnp.zeros(()))
    with pytest.raises(treemode.AxisError, match=r"args\[0\]\.total.*\n.*pmean\(x, 'b'\)"):
        treemode.vmap(lambda m, x: m(x), in_axes=(None, 0), axis_name="b")(acc, jnp.arange(3.0))


@pytest.mark.parametrize(
    "in_axes, pattern",
    [
        (("a", 0), r"in_axes gives 'a' for args\[0\]\.total; each value must be an int or None"),
        ((0.5, 0), r"gives 0\.5 for args\[0\]\.total"),
        ([0, 0], r"in_axes is a list.*tuple"),
        ((0,), r"in_axes has 1 entries but the function is called with 2"),
        ((0, 0, 0), r"in_axes has 3 entries"),
        ((2, 0), r"maps args\[0\]\.total over axis 2, but it has shape \(3,\)"),
        (({"w": 0}, 0), r"in_axes for args\[0\] does not match its structure"),
        ("x", r"in_axes must be an int or None"),
    ],
)
def test_wrong_axis_specs(in_axes, pattern):
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    before = snapshot(acc)
    with pytest.raises(treemode.AxisError, match=pattern) as err:
        treemode.vmap(lambda m, x: m(x), in_axes=in_axes)(acc, jnp.ones(3))
    assert "treemode.vmap" in str(err.value)
    assert_unchanged(acc, before)


def test_mismatched_sizes_name_both_paths():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    before = snapshot(acc)
    with pytest.raises(treemode.AxisError, match=r"args\[0\]\.total.*size 3.*args\[1\].*size 4"):
        treemode.vmap(lambda m, x: m.total[...] + x.sum())(acc, jnp.ones(4))
    assert_unchanged(acc, before)


def test_nothing_mapped_needs_axis_size():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    with pytest.raises(treemode.AxisError, match="axis_size"):
        treemode.vmap(lambda m: m.w[...], in_axes=None)(acc)
    y = treemode.vmap(lambda m: m.w[...], in_axes=None, axis_size=2)(acc)
    assert y.shape == (2, 3)


def test_alias_is_rejected_and_inputs_unchanged():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    before = snapshot(acc)
    with pytest.raises(treemode.AliasError, match=r"args\[0\].*args\[1\]"):
        treemode.vmap(lambda a, b: a(jnp.ones(3)) + b(jnp.ones(3)), in_axes=0)(acc, acc)
    assert_unchanged(acc, before)


def test_error_in_function_leaves_inputs_unchanged():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    before = snapshot(acc)

    def f(m, x):
        m(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        treemode.vmap(f)(acc, jnp.ones(3))
    assert_unchanged(acc, before)


def test_returning_an_input_variable_is_rejected():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    with pytest.raises(treemode.AliasError, match=r"args\[0\]\.w"):
        treemode.vmap(lambda m: m.w)(acc)


# -- pmap ------------------------------------------------------------------------


def test_pmap_module_shaped_axes_and_write_back():
    n = jax.local_device_count()
    acc = Acc(jnp.array(2.0), jnp.zeros((n, 3)))
    axes = treemode.prefix(acc, {nnx.Param: None, nnx.BatchStat: 0})
    x = jnp.arange(n * 3.0).reshape(n, 3)
    y = treemode.pmap(lambda m, x: m(x), in_axes=(axes, 0))(acc, x)
    np.testing.assert_allclose(y, 2 * x)
    np.testing.assert_allclose(acc.total[...], 2 * x)
    assert acc.w.shape == ()


def test_pmap_replicated_variable_with_psum():
    n = jax.local_device_count()
    acc = Acc(jnp.array(1.0), jnp.zeros(()))

    @treemode.pmap(axis_name="d", in_axes=(None, 0))
    def f(m, x):
        m.total[...] += jax.lax.psum(x.sum(), "d")
        return x

    f(acc, jnp.ones((n, 2)))
    f(acc, jnp.ones((n, 2)))
    assert float(acc.total[...]) == 4.0 * n


def test_pmap_replicated_variable_set_per_device_is_an_error():
    n = jax.local_device_count()
    acc = Acc(jnp.array(1.0), jnp.zeros(()))
    before = snapshot(acc)
    with pytest.raises(treemode.AxisError, match=r"treemode\.pmap.*args\[0\]\.total"):
        treemode.pmap(lambda m, x: m(x.sum()), in_axes=(None, 0), axis_name="d")(
            acc, jnp.arange(float(n))[:, None]
        )
    assert_unchanged(acc, before)


def test_pmap_static_broadcasted_argnums_and_donation():
    n = jax.local_device_count()
    acc = Acc(jnp.ones((n, 3)), jnp.zeros((n, 3)))

    @treemode.pmap(in_axes=(0, None, 0), static_broadcasted_argnums=1, donate_argnums=0)
    def f(m, scale, x):
        return m(x) * scale

    y = f(acc, 3.0, jnp.ones((n, 3)))
    np.testing.assert_allclose(y, 3 * jnp.ones((n, 3)))
    np.testing.assert_allclose(acc.total[...], jnp.ones((n, 3)))
    # The donated module stays usable: its Variables were refreshed.
    f(acc, 3.0, jnp.ones((n, 3)))
    np.testing.assert_allclose(acc.total[...], 2 * jnp.ones((n, 3)))


def test_pmap_matches_vmap():
    n = jax.local_device_count()
    a = Acc(jnp.arange(n * 2.0).reshape(n, 2), jnp.zeros((n, 2)))
    b = treemode.clone(a)
    x = jnp.ones((n, 2))
    np.testing.assert_allclose(
        treemode.pmap(lambda m, x: m(x))(a, x), treemode.vmap(lambda m, x: m(x))(b, x)
    )
    assert_same_state(a, b)


def test_plain_jax_vmap_over_modules_leaves_no_tracer(tracer_leaks):
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    ys = jax.vmap(lambda m, x: m(x), in_axes=(None, 0))(layer, jnp.ones((4, 3)))
    assert ys.shape == (4, 2)
    stack = jax.vmap(lambda k: nnx.Linear(3, 2, rngs=nnx.Rngs(k)))(
        jax.random.split(jax.random.key(0), 4)
    )
    assert stack.kernel.shape == (4, 3, 2)
    for var in jax.tree_util.tree_leaves(
        (layer, stack), is_leaf=lambda x: isinstance(x, nnx.Variable)
    ):
        assert isinstance(var.get_raw_value(), jax.Array)
        assert not isinstance(var.get_raw_value(), jax.core.Tracer)


def test_wrong_out_axes():
    acc = Acc(jnp.ones(3), jnp.zeros(3))
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap: out_axes\[1\] is 'a'"):
        treemode.vmap(lambda m, x: (x, x), out_axes=(0, "a"))
    before = snapshot(acc)
    f = treemode.vmap(lambda m, x: m(x), out_axes={"y": 0})
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap: out_axes does not fit"):
        f(acc, jnp.ones(3))
    assert_unchanged(acc, before)


class _Scale(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))


@pytest.mark.parametrize(
    ("in_axes", "order", "suggested"),
    [
        ((0, 0), "model first", "in_axes=(None, 0)."),
        (0, "model first", "in_axes=(None, 0)."),
        ((1, 0), "model last", "in_axes=(1, None)."),
    ],
)
def test_a_model_mapped_with_the_batch_is_told_to_broadcast(in_axes, order, suggested):
    """The commonest vmap mistake, ``vmap(f, in_axes=(0, 0))(model, x)``: the mapped
    sizes differ, and the error names the in_axes that broadcasts the model."""
    model, x = _Scale(), jnp.ones((2, 3))  # model.w has size 2 on axis 0, x size 2 on 0
    if order == "model first":
        args, f = (model, jnp.ones((3, 2))), (lambda m, x: m.w[...] * x)
    else:
        args, f = (x, model), (lambda x, m: x.T * m.w[...])
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(f, in_axes=in_axes)(*args)
    message = str(info.value)
    assert "mapped axes have different sizes" in message
    where = "args[0]" if order == "model first" else "args[1]"
    assert message.endswith(
        f"\nIf the _Scale at {where} is the same for every example, broadcast it rather "
        f"than map it: {suggested}"
    ), message
    # The suggestion works.
    fixed = eval(suggested.removeprefix("in_axes=").rstrip("."))
    out = treemode.vmap(f, in_axes=fixed)(*args)
    assert out.shape == (3, 2)


def test_no_broadcast_hint_where_no_module_is_mapped():
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(lambda a, b: a + b)(jnp.ones(2), jnp.ones(3))
    assert "broadcast it rather than map it" not in str(info.value)
