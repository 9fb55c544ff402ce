"""treemode.grad / value_and_grad: module-typed gradients, write-back, Rngs, optax."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Counter, Stateful, assert_same_state, state_arrays

import treemode

X = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
Y = jnp.array([[1.0, 0.0], [0.0, 1.0]])


def is_float0(x) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


class BNModel(nnx.Module):
    def __init__(self, rngs, use_running_average=False):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, use_running_average=use_running_average, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


# -- analytic gradients ------------------------------------------------------


def test_linear_grad_matches_jax_grad_of_hand_written_function():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def loss_fn(m):
        return jnp.mean((m(X) - Y) ** 2)

    def raw_loss(kernel, bias):
        return jnp.mean((X @ kernel + bias - Y) ** 2)

    grads = treemode.grad(loss_fn)(model)
    gk, gb = jax.grad(raw_loss, argnums=(0, 1))(model.kernel[...], model.bias[...])
    assert type(grads) is nnx.Linear
    assert type(grads.kernel) is nnx.Param
    np.testing.assert_allclose(grads.kernel[...], gk, rtol=1e-6)
    np.testing.assert_allclose(grads.bias[...], gb, rtol=1e-6)


def test_batchnorm_grads_are_module_typed_including_batch_stats():
    model = BNModel(nnx.Rngs(0), use_running_average=True)
    model.bn.mean[...] = jnp.array([0.1, -0.2])
    model.bn.var[...] = jnp.array([2.0, 0.5])
    eps = model.bn.epsilon

    def raw(kernel, bias, scale, shift, mean, var):
        h = X @ kernel + bias
        y = (h - mean) / jnp.sqrt(var + eps) * scale + shift
        return jnp.sum(jnp.sin(y))

    grads = treemode.grad(lambda m: jnp.sum(jnp.sin(m(X))))(model)
    lin, bn = model.linear, model.bn
    expected = jax.grad(raw, argnums=tuple(range(6)))(
        lin.kernel[...], lin.bias[...], bn.scale[...], bn.bias[...], bn.mean[...], bn.var[...]
    )
    assert type(grads) is BNModel and type(grads.bn) is nnx.BatchNorm
    assert type(grads.bn.mean) is nnx.BatchStat and type(grads.bn.var) is nnx.BatchStat
    got = (
        grads.linear.kernel,
        grads.linear.bias,
        grads.bn.scale,
        grads.bn.bias,
        grads.bn.mean,
        grads.bn.var,
    )
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g[...], e, rtol=1e-5, atol=1e-6)


def test_argnums_tuple_and_plain_array_argument():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def loss_fn(m, x):
        return jnp.sum(m(x) ** 2)

    g_model, g_x = treemode.grad(loss_fn, argnums=(0, 1))(model, X)
    gk, gx = jax.grad(lambda k, x: jnp.sum((x @ k + model.bias[...]) ** 2), argnums=(0, 1))(
        model.kernel[...], X
    )
    np.testing.assert_allclose(g_model.kernel[...], gk, rtol=1e-6)
    np.testing.assert_allclose(g_x, gx, rtol=1e-6)
    # argnums=1 alone differentiates only x
    np.testing.assert_allclose(treemode.grad(loss_fn, argnums=1)(model, X), gx, rtol=1e-6)


def test_python_scalar_argument_like_jax():
    f = lambda x, y: jnp.sin(x) * y
    assert treemode.grad(f)(1.0, 2.0) == jax.grad(f)(1.0, 2.0)


def test_value_and_grad_and_has_aux():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def loss_fn(m):
        y = m(X)
        return jnp.mean(y**2), {"y": y}

    (loss, aux), grads = treemode.value_and_grad(loss_fn, has_aux=True)(model)
    grads2, aux2 = treemode.grad(loss_fn, has_aux=True)(model)
    np.testing.assert_allclose(loss, jnp.mean(model(X) ** 2), rtol=1e-6)
    np.testing.assert_allclose(aux["y"], model(X), rtol=1e-6)
    np.testing.assert_allclose(aux2["y"], model(X), rtol=1e-6)
    np.testing.assert_allclose(grads.kernel[...], grads2.kernel[...])


# -- write-back ------------------------------------------------------------------


def test_has_aux_with_mutation_is_written_back():
    counter = Counter()
    w = nnx.Param(jnp.array([1.0, 2.0]))

    def loss_fn(w, c):
        y = c(w[...])  # count += 1, total += sum(w)
        return jnp.sum(y**2), c.count[...]

    g, seen = treemode.grad(loss_fn, has_aux=True)(w, counter)
    np.testing.assert_allclose(g[...], 2 * (w[...] + 1))
    assert int(seen) == 1
    assert int(counter.count[...]) == 1
    np.testing.assert_allclose(counter.total[...], 3.0)
    treemode.grad(loss_fn, has_aux=True)(w, counter)
    assert int(counter.count[...]) == 2


def test_batch_stats_written_back_like_eager():
    model = BNModel(nnx.Rngs(0))
    eager = treemode.clone(model)
    treemode.grad(lambda m: jnp.sum(m(X)))(model)
    eager(X)
    assert_same_state(model, eager)
    assert not np.allclose(model.bn.mean[...], 0.0)


def test_rngs_and_dropout_need_no_allow_int_and_counter_advances():
    model = Stateful(nnx.Rngs(0))
    x = jnp.arange(12.0).reshape(4, 3)

    def loss_fn(m):
        y = m(x)
        return jnp.sum(y**2), y

    grads, y1 = treemode.grad(loss_fn, has_aux=True)(model)
    _, y2 = treemode.grad(loss_fn, has_aux=True)(model)
    # the dropout masks differ between the two steps: the stream's counter advanced
    assert not np.array_equal(np.asarray(y1) == 0, np.asarray(y2) == 0)
    assert int(model.dropout.rngs.count[...]) == 2
    # integer/key Variables get float0 gradients; the structure is the model's
    assert type(grads) is Stateful
    assert is_float0(grads.dropout.rngs.count[...])
    assert is_float0(grads.dropout.rngs.key[...])
    assert grads.linear.kernel[...].dtype == jnp.float32
    assert jax.tree.structure(grads) == jax.tree.structure(model)


def test_closure_module_is_updated_and_differentiated_argument_is_not_closure():
    model = BNModel(nnx.Rngs(0))
    before = np.asarray(model.bn.mean[...])

    def loss_fn(x):
        return jnp.sum(model(x) ** 2)

    gx = treemode.grad(loss_fn)(X)
    assert gx.shape == X.shape
    assert not np.allclose(model.bn.mean[...], before)  # closure Variable written back


def test_raising_function_leaves_inputs_unchanged():
    model = Stateful(nnx.Rngs(0))
    before = state_arrays(model)

    def loss_fn(m):
        m(jnp.ones((2, 3)))  # advances rngs, updates batch stats
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        treemode.grad(loss_fn)(model)
    for a, b in zip(before, state_arrays(model), strict=True):
        np.testing.assert_array_equal(a, b)


# -- split/merge and optax ---------------------------------------------------------


def test_split_merge_pattern_differentiates_params_only():
    model = BNModel(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest):
        m = nnx.merge(graphdef, params, rest)
        return jnp.sum(m(X) ** 2)

    grads = treemode.grad(loss_fn)(params, rest)
    assert type(grads) is type(params)
    leaves = jax.tree.leaves(grads, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert leaves and all(type(v) is nnx.Param for v in leaves)
    full = treemode.grad(lambda m: jnp.sum(m(X) ** 2))(treemode.clone(model))
    np.testing.assert_allclose(grads["linear"]["kernel"][...], full.linear.kernel[...], rtol=1e-6)
    # the batch statistics in `rest` were updated and written back
    assert not np.allclose(rest["bn"]["mean"][...], 0.0)


class TwoLayer(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def test_optax_train_step_matches_raw_arrays():
    model = TwoLayer(nnx.Rngs(0))
    tx = optax.adam(1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = {
        "w1": model.l1.kernel[...],
        "b1": model.l1.bias[...],
        "w2": model.l2.kernel[...],
        "b2": model.l2.bias[...],
    }
    opt_state = tx.init(params)

    @treemode.jit
    def step(model, optimizer, x, y):
        loss, grads = treemode.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    @jax.jit
    def raw_step(params, opt_state, x, y):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    for _ in range(3):
        loss = step(model, optimizer, X, Y)
        raw_loss, params, opt_state = raw_step(params, opt_state, X, Y)
        np.testing.assert_allclose(loss, raw_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.l1.kernel[...], params["w1"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.l1.bias[...], params["b1"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.l2.kernel[...], params["w2"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.l2.bias[...], params["b2"], rtol=1e-6, atol=1e-6)
    assert int(optimizer.step[...]) == 3


# -- higher order, Equinox, graph mode --------------------------------------------------


def test_grad_of_grad():
    class W(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array([0.3, -1.2]))

    x = jnp.array([2.0, 0.5])
    f = lambda m: jnp.sum(jnp.sin(m.w[...] * x))
    second = treemode.grad(lambda m: jnp.sum(treemode.grad(f)(m).w[...]))(W())
    expected = jax.grad(lambda w: jnp.sum(jax.grad(lambda v: jnp.sum(jnp.sin(v * x)))(w)))(
        jnp.array([0.3, -1.2])
    )
    np.testing.assert_allclose(second.w[...], expected, rtol=1e-6)


def test_equinox_module_gradient_has_its_type():
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))
    loss = lambda m: jnp.sum(jax.vmap(m)(X) ** 2)
    grads = treemode.grad(loss)(model)
    expected = eqx.filter_grad(loss)(model)
    assert type(grads) is eqx.nn.MLP
    assert grads.activation is jax.nn.tanh  # non-array leaves are kept as they are
    arrays = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    for g, e in zip(arrays, jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6)


def test_graph_mode_shared_submodule():
    class Shared(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 3, rngs=rngs)
            self.b = self.a

        def __call__(self, x):
            return self.b(self.a(x))

    model = Shared(nnx.Rngs(0))
    grads = treemode.grad(lambda m: jnp.sum(m(X)), graph=True)(model)
    assert grads.a is grads.b
    k, b = model.a.kernel[...], model.a.bias[...]
    gk = jax.grad(lambda k: jnp.sum((X @ k + b) @ k + b))(k)
    np.testing.assert_allclose(grads.a.kernel[...], gk, rtol=1e-5)


# -- errors -------------------------------------------------------------------------


def test_aliases_rejected():
    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 2, rngs=rngs)
            self.b = self.a

    with pytest.raises(treemode.AliasError, match=r"treemode\.grad.*args\[0\]\.a"):
        treemode.grad(lambda m: jnp.sum(m.a.kernel[...]))(Twice(nnx.Rngs(0)))
    v = nnx.Param(jnp.ones(2))
    with pytest.raises(treemode.AliasError, match=r"value_and_grad.*args\[0\].*args\[1\]"):
        treemode.value_and_grad(lambda a, b: jnp.sum(a[...] * b[...]))(v, v)


def test_non_scalar_output_error():
    with pytest.raises(TypeError, match=r"treemode\.grad: .*scalar.*shape \(2,\)"):
        treemode.grad(lambda x: x * 2)(jnp.ones(2))


def test_argnums_out_of_range_error():
    with pytest.raises(TypeError, match=r"treemode\.grad: argnums contains 2"):
        treemode.grad(lambda a, b: a * b, argnums=2)(1.0, 2.0)


def test_bare_int_argument_needs_allow_int():
    f = lambda n, x: jnp.sum(x * n)
    with pytest.raises(TypeError, match=r"treemode\.grad: args\[0\] has dtype int32.*allow_int"):
        treemode.grad(f)(jnp.int32(3), jnp.ones(2))
    assert is_float0(treemode.grad(f, allow_int=True)(jnp.int32(3), jnp.ones(2)))


def test_has_aux_requires_pair():
    with pytest.raises(TypeError, match=r"has_aux=True.*pair"):
        treemode.grad(lambda x: jnp.sum(x), has_aux=True)(jnp.ones(2))


def test_decorator_form():
    @treemode.grad(argnums=1)
    def g(a, b):
        return a * b

    assert g(3.0, 2.0) == 3.0


def test_no_tracer_leak_and_no_retrace_inside_jit(tracer_leaks):
    model = Stateful(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    traces = []

    @treemode.jit
    def step(model, optimizer, x):
        traces.append(1)
        loss, grads = treemode.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jnp.arange(6.0).reshape(2, 3)
    for _ in range(3):
        step(model, optimizer, x)
    assert len(traces) == 1
    assert int(optimizer.step[...]) == 3
    assert int(model.dropout.rngs.count[...]) == 3


class PythonScale(nnx.Module):
    def __init__(self):
        self.scale = nnx.Param(1.0)  # a Python float, as NNX allows


def _scale_loss(m):
    return (m.scale * 3.0 - 6.0) ** 2


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_grad_of_a_variable_holding_a_python_float(jitted):
    grad = treemode.grad(_scale_loss)
    if jitted:
        grad = treemode.jit(grad)
    g = grad(PythonScale())
    assert not is_float0(g.scale[...])
    np.testing.assert_allclose(g.scale[...], -18.0)
    np.testing.assert_allclose(nnx.grad(_scale_loss)(PythonScale()).scale[...], -18.0)
    value, g = treemode.value_and_grad(_scale_loss)(PythonScale())
    np.testing.assert_allclose((value, g.scale[...]), (9.0, -18.0))


def test_optimizer_step_on_a_python_float_variable_eager_and_jitted_agree():
    def step(model, optimizer):
        loss, grads = treemode.value_and_grad(_scale_loss)(model)
        optimizer.update(model, grads)
        return loss

    results = []
    for run in (step, treemode.jit(step)):
        model = PythonScale()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        losses = [float(run(model, optimizer)) for _ in range(3)]
        results.append((losses, float(model.scale[...])))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6)
    np.testing.assert_allclose(results[0][0], [9.0, 5.76, 3.6864], rtol=1e-5)
    np.testing.assert_allclose(results[0][1], 2.512, rtol=1e-5)  # 1 -> 2.8 -> 1.36 -> 2.512


def test_vjp_and_jvp_of_a_variable_holding_a_python_float():
    m = PythonScale()
    out, pullback = treemode.vjp(_scale_loss, m)
    (cot,) = pullback(jnp.ones(()))
    np.testing.assert_allclose((out, cot.scale[...]), (9.0, -18.0))
    tangent = PythonScale()
    _, t_out = treemode.jvp(_scale_loss, (m,), (tangent,))
    np.testing.assert_allclose(t_out, -18.0)
