"""NNX modules inside Equinox modules, eqx.filter_*, optax and plain JAX transforms
(through treemode.Pytree), and Equinox modules inside NNX modules (treemode transforms)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Counter

import treemode
from treemode import Pytree


def body(momentum: float = 0.9, rate: float = 0.1) -> nnx.Sequential:
    return nnx.Sequential(
        nnx.Linear(2, 8, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(8, momentum=momentum, rngs=nnx.Rngs(0)),
        nnx.Dropout(rate, rngs=nnx.Rngs(1)),
    )


class Model(eqx.Module):
    net: Pytree
    head: eqx.nn.Linear

    def __init__(self, momentum: float = 0.9, rate: float = 0.1):
        self.net = Pytree(body(momentum, rate))
        self.head = eqx.nn.Linear(8, 1, key=jax.random.key(2))

    def __call__(self, x):
        return jax.vmap(self.head)(jax.nn.relu(self.net(x)))


def data():
    x = jax.random.normal(jax.random.key(3), (16, 2))
    return x, jnp.sin(x[:, :1]) + x[:, 1:]


def eqx_trainer(params_filter):
    """An Equinox training step; ``params_filter(model)`` picks what is trained."""
    opt = optax.adamw(1e-2, weight_decay=0.5)
    traces = []

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        traces.append(None)
        params, static = eqx.partition(model, params_filter(model))

        def loss_fn(params):
            m = eqx.combine(params, static)
            return jnp.mean((m(x) - y) ** 2), m

        (loss, model), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    def init(model):
        return opt.init(eqx.filter(model, params_filter(model)))

    return init, step, traces


def select_params(model):
    return treemode.filter(model, nnx.Param)


def test_train_with_eqx_filter_jit_grad_and_adamw():
    model = Model()
    init, step, traces = eqx_trainer(select_params)
    opt_state = init(model)
    x, y = data()
    losses = []
    for _ in range(25):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert len(traces) == 1  # the proxy's static part is a stable jit cache key
    net = model.net
    assert int(net.layers[2].rngs.count[...]) == 25  # a new dropout mask every step
    assert np.abs(np.asarray(net.layers[1].mean[...])).sum() > 0
    assert not np.allclose(net.layers[1].var[...], 1.0)
    # Both halves were trained: the NNX Linear and the Equinox head.
    fresh = Model()
    assert not np.allclose(net.layers[0].kernel[...], fresh.net.layers[0].kernel[...])
    assert not np.allclose(model.head.weight, fresh.head.weight)


def test_optimizer_state_holds_only_parameters():
    model = Model()
    init, _, _ = eqx_trainer(select_params)
    params = eqx.filter(model, select_params(model))
    # NNX Params (kernel, bias, scale, bias) and the Equinox head (weight, bias).
    assert len(jax.tree.leaves(params)) == 6
    adam_state = init(model)[0]
    assert jax.tree.structure(adam_state.mu) == jax.tree.structure(params)
    assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(adam_state.mu))


def test_running_statistics_are_not_decayed():
    # momentum=1.0: BatchNorm itself never moves its running statistics, so any
    # change would come from the optimizer (weight decay on a BatchStat).
    model = Model(momentum=1.0)
    init, step, _ = eqx_trainer(select_params)
    opt_state = init(model)
    x, y = data()
    for _ in range(5):
        model, opt_state, _ = step(model, opt_state, x, y)
    np.testing.assert_array_equal(model.net.layers[1].var[...], np.ones(8))
    np.testing.assert_array_equal(model.net.layers[1].mean[...], np.zeros(8))


def test_selecting_by_dtype_decays_running_statistics():
    # The failure the filter fixes: Equinox's dtype rule trains the BatchStats.
    model = Model(momentum=1.0)
    init, step, _ = eqx_trainer(lambda m: jax.tree.map(eqx.is_inexact_array, m))
    opt_state = init(model)
    x, y = data()
    for _ in range(5):
        model, opt_state, _ = step(model, opt_state, x, y)
    assert not np.allclose(model.net.layers[1].var[...], 1.0)


def test_train_with_treemode_jit_and_value_and_grad():
    model = Model()
    opt = optax.adamw(1e-2, weight_decay=0.5)
    opt_state = opt.init(eqx.filter(model, select_params(model)))
    x, y = data()

    @treemode.jit
    def step(model, opt_state, x, y):
        params, static = eqx.partition(model, treemode.filter(model, nnx.Param))

        def loss_fn(params):
            m = eqx.combine(params, static)
            return jnp.mean((m(x) - y) ** 2), m

        (loss, model), grads = treemode.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(25):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert int(model.net.layers[2].rngs.count[...]) == 25
    assert np.abs(np.asarray(model.net.layers[1].mean[...])).sum() > 0


# -- plain JAX transforms --------------------------------------------------------------


def test_scan_with_the_proxy_as_carry():
    proxy = Pytree(body(rate=0.5))
    xs = jax.random.normal(jax.random.key(0), (3, 4, 2))

    def step(p, x):
        return p, p(x)

    final, ys = jax.lax.scan(step, proxy, xs)
    reference = body(rate=0.5)
    for i in range(3):
        np.testing.assert_allclose(ys[i], reference(xs[i]), rtol=1e-5, atol=1e-6)
    assert int(final.layers[2].rngs.count[...]) == 3
    np.testing.assert_allclose(
        final.layers[1].mean[...], reference.layers[1].mean[...], rtol=1e-5, atol=1e-7
    )
    assert int(proxy.layers[2].rngs.count[...]) == 0  # the input is untouched


def test_vmap_over_a_batch_of_proxies():
    @jax.vmap
    def make(key):
        return Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(key)))

    keys = jax.random.split(jax.random.key(0), 4)
    proxies = make(keys)
    assert proxies.kernel.shape == (4, 2, 3)
    xs = jnp.ones((4, 1, 2))
    ys = jax.vmap(lambda p, x: p(x))(proxies, xs)
    for i in range(4):
        one = nnx.Linear(2, 3, rngs=nnx.Rngs(keys[i]))
        np.testing.assert_allclose(ys[i], one(xs[i]), rtol=1e-6)


def test_jax_jit_returns_the_updated_proxy_without_retracing():
    proxy = Pytree(body())
    traces = []

    @jax.jit
    def step(p, x):
        traces.append(None)
        return p(x), p

    x = jnp.ones((4, 2))
    reference = body()
    for _ in range(3):
        y, proxy = step(proxy, x)
        np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-6)
    assert len(traces) == 1
    assert int(proxy.layers[2].rngs.count[...]) == 3


def test_jax_eval_shape():
    abstract = jax.eval_shape(lambda: Pytree(body()))
    assert type(abstract) is Pytree
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert abstract.layers[0].kernel.shape == (2, 8)
    assert isinstance(abstract.layers[0].kernel[...], jax.ShapeDtypeStruct)
    out = jax.eval_shape(lambda p, x: p(x), Pytree(body()), jnp.ones((4, 2)))
    assert out.shape == (4, 8)


def test_eqx_tree_at():
    model = Model()
    new = eqx.tree_at(lambda m: m.net.layers[0].kernel[...], model, jnp.zeros((2, 8)))
    np.testing.assert_array_equal(new.net.layers[0].kernel[...], np.zeros((2, 8)))
    assert not np.allclose(model.net.layers[0].kernel[...], 0.0)  # the input is unchanged
    both = eqx.tree_at(
        lambda m: (m.net.layers[1].scale[...], m.head.bias),
        model,
        (jnp.full((8,), 2.0), jnp.ones(1)),
    )
    np.testing.assert_array_equal(both.net.layers[1].scale[...], np.full(8, 2.0))
    np.testing.assert_array_equal(both.head.bias, np.ones(1))


def test_eqx_partition_and_combine():
    model = Model()
    params, rest = eqx.partition(model, treemode.filter(model, nnx.Param))
    # The parameter half holds no BatchStat, key or counter.
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert sorted(jax.tree_util.keystr(p) for p, _ in flat) == [
        ".head.bias",
        ".head.weight",
        ".net.layers[0].bias",
        ".net.layers[0].kernel",
        ".net.layers[1].bias",
        ".net.layers[1].scale",
    ]
    combined = eqx.combine(params, rest)
    assert jax.tree.structure(combined) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(combined), jax.tree.leaves(model), strict=True):
        assert a is b
    x = jnp.ones((4, 2))
    np.testing.assert_allclose(combined(x), Model()(x), rtol=1e-6)


def test_tree_flatten_with_path_of_a_mixed_model():
    flat = jax.tree_util.tree_flatten_with_path(Model())[0]
    assert [jax.tree_util.keystr(p) for p, _ in flat] == [
        ".net.layers[0].bias",
        ".net.layers[0].kernel",
        ".net.layers[1].bias",
        ".net.layers[1].mean",
        ".net.layers[1].scale",
        ".net.layers[1].var",
        ".net.layers[2].rngs.count",
        ".net.layers[2].rngs.key",
        ".head.weight",
        ".head.bias",
    ]


def test_filter_on_plain_nnx_modules_and_nnx_filters():
    tree = {"nnx": body(), "eqx": eqx.nn.Linear(2, 2, key=jax.random.key(0)), "n": 3}
    mask = treemode.filter(tree, nnx.Param)
    assert jax.tree.structure(mask) == jax.tree.structure(tree)
    params, _ = eqx.partition(tree, mask)
    assert len(jax.tree.leaves(params)) == 6
    assert treemode.filter(tree, nnx.Param, others=False)["eqx"].weight is False
    assert treemode.filter(tree, nnx.Param)["n"] is False

    proxy = Pytree(body())

    def picked(flt, **kw):
        m = treemode.filter(proxy, flt, **kw)
        return [
            jax.tree_util.keystr(p)
            for (p, _), keep in zip(
                jax.tree_util.tree_flatten_with_path(proxy)[0], jax.tree.leaves(m), strict=True
            )
            if keep
        ]

    assert picked(nnx.BatchStat) == [".layers[1].mean", ".layers[1].var"]
    assert picked((nnx.BatchStat, nnx.RngCount)) == [
        ".layers[1].mean",
        ".layers[1].var",
        ".layers[2].rngs.count",
    ]
    assert picked(nnx.All(nnx.Param, nnx.PathContains(1))) == [
        ".layers[1].bias",
        ".layers[1].scale",
    ]
    assert picked(lambda path, v: v.shape == (2, 8)) == [".layers[0].kernel"]
    assert picked(nnx.Not(nnx.Param)) == [
        ".layers[1].mean",
        ".layers[1].var",
        ".layers[2].rngs.count",
        ".layers[2].rngs.key",
    ]
    assert picked(...) == picked(nnx.Variable)
    assert picked(None) == []


# -- Equinox modules inside NNX modules, under treemode transforms ------------------------


class Hybrid(nnx.Module):
    """An NNX module holding Equinox modules with non-array fields (activations)."""

    def __init__(self):
        self.mlp = nnx.data(eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.gelu, key=jax.random.key(0)))
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(jax.vmap(self.mlp)(x)))


def test_equinox_inside_nnx_under_treemode_jit():
    model, reference = Hybrid(), Hybrid()
    x = jnp.arange(8.0).reshape(4, 2)
    y = treemode.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.bn.mean[...], reference.bn.mean[...], rtol=1e-6)
    assert model.mlp.activation is jax.nn.gelu


def test_equinox_inside_nnx_under_treemode_eval_shape():
    model = Hybrid()
    out = treemode.eval_shape(lambda m, x: m(x), model, jnp.ones((4, 2)))
    assert out.shape == (4, 2)
    np.testing.assert_array_equal(model.bn.mean[...], np.zeros(2))  # never mutated


def test_equinox_inside_nnx_under_treemode_value_and_grad():
    model = Hybrid()
    x = jnp.arange(8.0).reshape(4, 2)

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    value, grads = treemode.value_and_grad(loss)(model, x)
    graphdef, state = nnx.split(Hybrid())
    ref_value, ref = jax.value_and_grad(lambda s: loss(nnx.merge(graphdef, s), x))(state)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(
        grads.lin.kernel[...], ref["lin"]["kernel"][...], rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(
        grads.mlp.layers[0].weight, ref["mlp"]["layers"][0]["weight"], rtol=1e-4, atol=1e-6
    )
    assert grads.mlp.activation is jax.nn.gelu
    eager = Hybrid()
    eager(x)
    np.testing.assert_allclose(model.bn.mean[...], eager.bn.mean[...], rtol=1e-5)


def test_equinox_inside_nnx_under_treemode_vmap():
    model = Hybrid()
    xs = jnp.arange(16.0).reshape(2, 4, 2)
    ys = treemode.vmap(lambda m, x: m.lin(jax.vmap(m.mlp)(x)), in_axes=(None, 0))(model, xs)
    ref = Hybrid()
    for i in range(2):
        np.testing.assert_allclose(ys[i], ref.lin(jax.vmap(ref.mlp)(xs[i])), rtol=1e-5)


def test_pytree_proxy_returned_from_treemode_jit():
    proxy = Pytree(Hybrid())
    x = jnp.arange(8.0).reshape(4, 2)
    y, new = treemode.jit(lambda p, x: (p(x), p))(proxy, x)
    reference = Hybrid()
    np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.bn.mean[...], reference.bn.mean[...], rtol=1e-5)
    np.testing.assert_array_equal(proxy.bn.mean[...], np.zeros(2))  # a pure pytree input


def test_pytree_proxy_in_the_aux_of_treemode_grad():
    proxy = Pytree(Hybrid())
    x = jnp.arange(8.0).reshape(4, 2)
    grads, new = treemode.grad(lambda p, x: (jnp.sum(p(x) ** 2), p), has_aux=True)(proxy, x)
    assert type(grads) is Pytree and type(new) is Pytree
    graphdef, state = nnx.split(Hybrid())
    ref = jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2))(state)
    np.testing.assert_allclose(
        grads.lin.kernel[...], ref["lin"]["kernel"][...], rtol=1e-4, atol=1e-6
    )
    assert np.abs(np.asarray(new.bn.mean[...])).sum() > 0


@pytest.mark.parametrize("transform", ["jit", "grad", "eval_shape"])
def test_unreturned_proxy_state_change_is_an_error(transform):
    proxy = Pytree(Hybrid())
    x = jnp.arange(8.0).reshape(4, 2)
    before = [np.asarray(v) for v in jax.tree.leaves(proxy)]
    fn = {
        "jit": lambda: treemode.jit(lambda p, x: p(x))(proxy, x),
        "grad": lambda: treemode.grad(lambda p, x: jnp.sum(p(x)))(proxy, x),
        "eval_shape": lambda: treemode.eval_shape(lambda p, x: p(x), proxy, x),
    }[transform]
    with pytest.raises(treemode.StructureError) as info:
        fn()
    message = str(info.value)
    assert message.startswith(
        f"treemode.{transform}: the function changed the state of the "
        "treemode.Pytree at args[0] (first at args[0].bn.mean)"
    )
    assert "return y, proxy" in message
    for a, b in zip(jax.tree.leaves(proxy), before, strict=True):
        np.testing.assert_array_equal(a, b)


def _forward(m, x):
    return m(x)


_X = jnp.arange(8.0).reshape(4, 2)

# name -> (run the transform on (model, x) and return y, number of forward passes)
_TRANSFORMS = {
    "scan": (
        lambda m, x: treemode.scan(lambda m, x: (m, m(x)), m, jnp.stack([x, x]))[1][-1],
        2,
    ),
    "fori_loop": (
        lambda m, x: treemode.fori_loop(0, 2, lambda i, c: (c[0], c[0](x)), (m, x * 0))[1],
        2,
    ),
    "while_loop": (
        lambda m, x: treemode.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1], c[1](x)), (0, m, x * 0)
        )[2],
        2,
    ),
    "cond": (lambda m, x: treemode.cond(True, _forward, lambda m, x: x * 0, m, x), 1),
    "switch": (lambda m, x: treemode.switch(0, [_forward, lambda m, x: x * 0], m, x), 1),
    "remat": (lambda m, x: treemode.remat(_forward)(m, x), 1),
    "checkify": (lambda m, x: treemode.checkify(_forward)(m, x)[1], 1),
    "vjp": (lambda m, x: treemode.vjp(_forward, m, x)[0], 1),
}


@pytest.mark.parametrize("name", sorted(_TRANSFORMS))
def test_equinox_inside_nnx_under_more_treemode_transforms(name):
    run, passes = _TRANSFORMS[name]
    model, reference = Hybrid(), Hybrid()
    y = run(model, _X)
    for _ in range(passes):
        expected = reference(_X)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.bn.mean[...], reference.bn.mean[...], rtol=1e-5, atol=1e-7)
    assert model.mlp.activation is jax.nn.gelu


# An Equinox MLP as an NNX attribute, an NNX module as an Equinox field, and a
# treemode.jit nested in jax.jit.


class WithEquinox(nnx.Module):
    def __init__(self, key):
        self.mlp = nnx.data(eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.gelu, key=key))
        self.steps = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.steps[...] += 1
        return self.mlp(x)


class Holder(eqx.Module):
    inner: Counter
    linear: eqx.nn.Linear
    name: str = eqx.field(static=True, default="holder")

    def __call__(self, x):
        return self.linear(self.inner(x))


def test_equinox_inside_nnx_under_jit():
    model = WithEquinox(jax.random.key(0))
    traces = []

    @treemode.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    x = jnp.ones(2)
    np.testing.assert_allclose(f(model, x), model.mlp(x), rtol=1e-6)
    f(model, x)
    assert int(model.steps[...]) == 2
    assert len(traces) == 1  # the activation function is static, hashed once


def test_nnx_inside_equinox_under_jit():
    holder = Holder(Counter(), eqx.nn.Linear(2, 2, key=jax.random.key(0)))

    @treemode.jit
    def f(h, x):
        return h(x)

    y = f(holder, jnp.ones(2))
    np.testing.assert_allclose(y, holder.linear(jnp.full(2, 2.0)), rtol=1e-6)
    assert int(holder.inner.count[...]) == 1


def test_mixed_model_under_eval_shape():
    model = WithEquinox(jax.random.key(0))
    out = treemode.eval_shape(lambda m, x: m(x), model, jnp.ones(2))
    assert out.shape == (2,)
    assert int(model.steps[...]) == 0


def test_no_tracer_left_in_variables_after_nesting(tracer_leaks):
    model = Counter()

    @jax.jit
    def outer(m, x):
        return treemode.jit(lambda m, x: m(x))(m, x), m

    y, new_model = outer(model, jnp.ones(2))
    assert isinstance(new_model.count.get_raw_value(), jax.Array)
    assert int(new_model.count[...]) == 1
    assert int(model.count[...]) == 0  # jax.jit is functional: the input is unchanged
    assert isinstance(model.count.get_raw_value(), jax.Array)
