"""treemode.capture: sow / perturb without graph updates (FLIP 5310 examples)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import treemode

X = jnp.array([[0.5, -1.0], [1.5, 0.25], [-0.3, 0.8]])
Y = jnp.array([[1.0], [0.0], [-1.0]])


class Foo(nnx.Module):
    def __call__(self, x):
        self.sow(nnx.Intermediate, "y_mean", jnp.mean(x))
        return x


class Model(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(2, 3, rngs=rngs)
        self.l2 = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        h = self.perturb("grad_of_h", self.l1(x))
        self.sow(nnx.Intermediate, "h", h)
        return self.l2(jnp.tanh(h))


def test_flip_sow_example_eager_and_in_jit():
    model = Foo()
    x = jnp.arange(4.0)
    result, intermediates = treemode.capture(model, nnx.Intermediate)(x)
    np.testing.assert_allclose(result, x)
    assert isinstance(intermediates, nnx.State)
    assert type(intermediates["y_mean"]) is nnx.Intermediate
    assert intermediates["y_mean"].get_value() == (1.5,)

    @treemode.jit
    def forward(model, x):
        return treemode.capture(model, nnx.Intermediate)(x)

    for _ in range(2):
        result, intermediates = forward(model, x)
        np.testing.assert_allclose(intermediates["y_mean"].get_value()[0], 1.5)
    assert "__captures__" not in vars(model)  # no graph update


def test_paths_multiple_types_and_repeated_sows():
    class Inner(nnx.Module):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "x", x)
            return x * 2

    class Outer(nnx.Module):
        def __init__(self):
            self.inner = Inner()
            self.blocks = nnx.List([Inner(), Inner()])

        def __call__(self, x):
            x = self.inner(self.inner(x))  # sown twice: a tuple of two values
            for b in self.blocks:
                x = b(x)
            self.sow(nnx.Perturbation, "out", x)
            return x

    model = Outer()
    out, inter, pert = treemode.capture(model, nnx.Intermediate, nnx.Perturbation)(jnp.ones(2))
    np.testing.assert_allclose(out, 16.0)
    assert len(inter["inner"]["x"].get_value()) == 2
    np.testing.assert_allclose(inter["inner"]["x"].get_value()[1], 2.0)
    np.testing.assert_allclose(inter["blocks"][1]["x"].get_value()[0], 8.0)
    np.testing.assert_allclose(pert["out"].get_value()[0], 16.0)
    # without var_types: only the output
    np.testing.assert_allclose(treemode.capture(model)(jnp.ones(2)), 16.0)


def test_function_and_bound_method_and_decorator_forms():
    model = Foo()
    x = jnp.arange(3.0)
    _, a = treemode.capture(lambda m, x: m(x), nnx.Intermediate)(model, x)
    _, b = treemode.capture(model.__call__, nnx.Intermediate)(x)

    @treemode.capture(nnx.Intermediate)
    def run(m, x):
        return m(x)

    _, c = run(model, x)
    for s in (a, b, c):
        np.testing.assert_allclose(s["y_mean"].get_value()[0], 1.0)


def test_method_outputs():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)

        def features(self, x):
            return self.linear(x)

        def __call__(self, x):
            return jnp.tanh(self.features(x))

    net = Net(nnx.Rngs(0))
    out, inter = treemode.capture(net, method_outputs=nnx.Intermediate)(X)
    np.testing.assert_allclose(inter["features"].get_value()[0], net.linear(X), rtol=1e-6)
    np.testing.assert_allclose(inter["__call__"].get_value()[0], out)
    np.testing.assert_allclose(inter["linear"]["__call__"].get_value()[0], net.linear(X), rtol=1e-6)
    assert not getattr(Net.features, "_treemode_sows", False)  # methods restored


def test_flip_perturb_train_step_in_jit_gives_intermediate_gradients():
    model = Model(nnx.Rngs(0))
    reference = treemode.clone(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @treemode.jit
    def train_step(model, optimizer, x, y):
        _, perturbs = treemode.capture(model, nnx.Perturbation)(x)  # init perturbations

        def loss_fn(model, perturbs):
            y_pred = treemode.capture(model, init=perturbs)(x)
            return jnp.mean((y_pred - y) ** 2)

        grads, interm_grads = treemode.grad(loss_fn, argnums=(0, 1))(model, perturbs)
        optimizer.update(model, grads)
        return interm_grads

    interm_grads = train_step(model, optimizer, X, Y)

    # hand-written: d loss / d h, with h = x @ W1 + b1
    r1, r2 = reference.l1, reference.l2
    h = X @ r1.kernel[...] + r1.bias[...]

    def loss_of_h(h):
        return jnp.mean((jnp.tanh(h) @ r2.kernel[...] + r2.bias[...] - Y) ** 2)

    assert type(interm_grads["grad_of_h"]) is nnx.Perturbation
    np.testing.assert_allclose(interm_grads["grad_of_h"][...], jax.grad(loss_of_h)(h), rtol=1e-5)

    # the parameter update is the plain gradient step (perturbations are zero)
    def raw_loss(w1):
        h = X @ w1 + r1.bias[...]
        return jnp.mean((jnp.tanh(h) @ r2.kernel[...] + r2.bias[...] - Y) ** 2)

    g_w1 = jax.grad(raw_loss)(r1.kernel[...])
    np.testing.assert_allclose(model.l1.kernel[...], r1.kernel[...] - 0.1 * g_w1, rtol=1e-5)
    assert "__captures__" not in vars(model) and "__captures__" not in vars(model.l1)


def test_perturb_gradients_with_has_aux_and_intermediates():
    model = Model(nnx.Rngs(1))
    _, perturbs = treemode.capture(model, nnx.Perturbation)(X)
    assert np.all(perturbs["grad_of_h"][...] == 0)

    def loss_fn(model, perturbs):
        y, inter = treemode.capture(model, nnx.Intermediate, init=perturbs)(X)
        return jnp.sum(y), inter

    (_, g_pert), inter = treemode.grad(loss_fn, argnums=(0, 1), has_aux=True)(model, perturbs)
    h = model.l1(X)
    np.testing.assert_allclose(inter["h"].get_value()[0], h, rtol=1e-6)
    expected = jax.grad(lambda h: jnp.sum(model.l2(jnp.tanh(h))))(h)
    np.testing.assert_allclose(g_pert["grad_of_h"][...], expected, rtol=1e-5)


def test_closed_over_module_inside_a_transform():
    model = Model(nnx.Rngs(0))
    _, perturbs = treemode.capture(model, nnx.Perturbation)(X)

    def loss_fn(perturbs):
        return jnp.sum(treemode.capture(model, init=perturbs)(X))

    g = treemode.jit(treemode.grad(loss_fn))(perturbs)
    assert g["grad_of_h"].shape == (3, 3)
    assert "__captures__" not in vars(model)


def test_aliases_rejected_unless_graph():
    class Twice(nnx.Module):
        def __init__(self):
            self.a = Foo()
            self.b = self.a
            self.w = nnx.Param(jnp.ones(2))
            self.w2 = self.w

        def __call__(self, x):
            return self.b(self.a(x))

    with pytest.raises(treemode.AliasError, match=r"treemode\.capture.*module\.w"):
        treemode.capture(Twice(), nnx.Intermediate)(jnp.ones(2))
    _, inter = treemode.capture(Twice(), nnx.Intermediate, graph=True)(jnp.ones(2))
    assert len(inter["a"]["y_mean"].get_value()) == 2


def test_errors_leave_modules_clean():
    model = Model(nnx.Rngs(0))

    class Boom(nnx.Module):
        def __init__(self):
            self.inner = Foo()

        def __call__(self, x):
            self.inner(x)
            raise RuntimeError("boom")

    boom = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        treemode.capture(boom, nnx.Intermediate)(jnp.ones(2))
    assert "__captures__" not in vars(boom) and "__captures__" not in vars(boom.inner)
    with pytest.raises(treemode.TreemodeError, match=r"init has values for module path"):
        treemode.capture(model, init=nnx.State({"nope": {"x": nnx.Perturbation(1.0)}}))(X)
    with pytest.raises(TypeError, match=r"first argument must be the Module"):
        treemode.capture(lambda x: x, nnx.Intermediate)(jnp.ones(2))
    with pytest.raises(TypeError, match=r"var_types must be nnx.Variable subclasses"):
        treemode.capture(model, "intermediates")
    assert "__captures__" not in vars(model)


def test_sows_inside_nested_transforms_are_collected():
    class Double(nnx.Module):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "y_mean", jnp.mean(x))
            return x * 2

    model = Double()
    x = jnp.arange(4.0)
    jitted = lambda m, x: treemode.jit(lambda m, x: m(x))(m, x)
    out, inter = treemode.capture(jitted, nnx.Intermediate)(model, x)
    np.testing.assert_allclose(out, 2 * x)
    np.testing.assert_allclose(inter["y_mean"].get_value()[0], 1.5)
    grad_x = lambda m, x: treemode.grad(lambda m, x: jnp.sum(m(x)), argnums=1)(m, x)
    g, inter = treemode.capture(grad_x, nnx.Intermediate)(model, x)
    np.testing.assert_allclose(g, 2.0)
    np.testing.assert_allclose(inter["y_mean"].get_value()[0], 1.5)
    assert "__captures__" not in vars(model)


class _Sower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x, a):
        x = self.linear(x + a)
        self.sow(nnx.Intermediate, "data", x)
        return x, None


@pytest.mark.parametrize("graph", [False, True])
def test_capture_around_a_scan_of_a_sowing_module(graph):
    """The capture buffer holds no array when the scan starts; its value comes back stacked."""
    create = treemode.vmap(lambda r: _Sower(r), in_axes=0, axis_size=5, graph=graph)
    layers = create(treemode.split_rngs(nnx.Rngs(0), splits=5))

    @treemode.scan(in_axes=(0, treemode.Carry, 0), graph=graph)
    def forward(layer, x, a):
        return layer(x, a)

    x, a = jnp.ones((1, 3)), jnp.ones((5, 1, 3))
    (y, out), inter = treemode.capture(forward, nnx.Intermediate)(layers, x, a)
    assert y.shape == (1, 3) and out is None
    (data,) = inter["data"].get_value()
    assert data.shape == (5, 1, 3)
    # step i sowed the carry after layer i: the last entry is the final carry
    np.testing.assert_allclose(data[-1], y, rtol=1e-6)
    assert "__captures__" not in vars(layers)


class _Buffer(nnx.Module):
    def __init__(self):
        self.buf = nnx.Intermediate({})  # no array yet
        self.w = nnx.Param(jnp.ones(2))


@pytest.mark.parametrize("graph", [False, True])
def test_vmap_writes_an_empty_variable_back_with_its_batch_axis(graph):
    def fill(m, x):
        m.buf.set_value({"h": x * m.w[...]})
        return x

    stack = treemode.vmap(lambda _: _Buffer(), graph=graph)(jnp.arange(3))
    assert stack.buf.get_value() == {} and stack.w.shape == (3, 2)
    treemode.vmap(fill, in_axes=(0, 0), graph=graph)(stack, jnp.ones((3, 2)))
    assert stack.buf.get_value()["h"].shape == (3, 2)  # one value per example
    # as nnx.vmap in tree mode does
    flax_stack = nnx.vmap(lambda _: _Buffer(), graph=False)(jnp.arange(3))
    nnx.vmap(fill, in_axes=(0, 0), graph=False)(flax_stack, jnp.ones((3, 2)))
    assert flax_stack.buf.get_value()["h"].shape == (3, 2)

    # out_axes=1 for the mapped argument: the value comes back on axis 1
    stack = treemode.vmap(lambda _: _Buffer(), graph=graph)(jnp.arange(3))
    axes = treemode.prefix(stack, {nnx.Intermediate: 1, ...: 0})
    treemode.vmap(fill, in_axes=(axes, 0), graph=graph)(stack, jnp.ones((3, 2)))
    assert stack.buf.get_value()["h"].shape == (2, 3)


def test_vmap_broadcast_empty_variable_keeps_in_axes_none():
    # A broadcast buffer (in_axes None) set to a per-example value is refused with
    # its path and in_axes None, and left as it was.
    single = _Buffer()
    axes = treemode.prefix(single, {nnx.Intermediate: None, ...: None})

    def fill(m, x):
        m.buf.set_value({"h": x})
        return x

    with pytest.raises(treemode.AxisError, match=r"Intermediate at args\[0\]\.buf is broadcast"):
        treemode.vmap(fill, in_axes=(axes, 0))(single, jnp.ones((3, 2)))
    assert single.buf.get_value() == {}
    # the same value for every example is fine
    treemode.vmap(lambda m, x: (m.buf.set_value({"h": m.w[...]}), x)[1], in_axes=(axes, 0))(
        single, jnp.ones((3, 2))
    )
    assert single.buf.get_value()["h"].shape == (2,)


class _PerturbedDot(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([1.0, -2.0, 3.0, 0.5]))

    def __call__(self, x):
        x = self.perturb("grad_of_x", x)
        self.sow(nnx.Intermediate, "y", jnp.dot(x, self.w[...]))
        return jnp.dot(x, self.w[...])


@pytest.mark.parametrize("graph", [False, True])
def test_perturbations_created_inside_vmap_get_the_batch_axis(graph):
    # Flax's module_test TestCapture::test_vmap: the captured (empty) Perturbation
    # holder is split off and mapped; the perturbation perturb creates per example
    # comes back stacked, so it can be mapped again in the training step.
    class Foo(_PerturbedDot):
        def pre_run(self, x):
            graphdef, intms, params = nnx.split(self, nnx.Intermediate, nnx.Param)

            def run(intms, params, x):
                return nnx.merge(graphdef, intms, params)(x)

            treemode.vmap(run, in_axes=(0, None, 0), graph=graph)(intms, params, x)

    model = Foo()
    x = jnp.ones((3, 4))
    _, perturbations = treemode.capture(model.pre_run, nnx.Perturbation)(x)
    assert perturbations["grad_of_x"].get_value().shape == (3, 4)

    @treemode.jit(graph=graph)
    def train_step(model, perturbations, x):
        def loss_grad(model, perturbations, x):
            def loss(model, perturbations, x):
                return treemode.capture(model, nnx.Intermediate, init=perturbations)(x)

            (_, perturb_grads), sowed = treemode.grad(
                loss, argnums=(0, 1), has_aux=True, graph=graph
            )(model, perturbations, x)
            return nnx.merge_state(perturb_grads, sowed)

        return treemode.vmap(loss_grad, in_axes=(None, 0, 0), graph=graph)(model, perturbations, x)

    intermediates = train_step(model, perturbations, x)
    np.testing.assert_allclose(
        intermediates["grad_of_x"].get_value(), jnp.broadcast_to(model.w[...], (3, 4))
    )
    assert intermediates["y"].get_value()[0].shape == (3,)
