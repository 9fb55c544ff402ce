"""Choosing what to differentiate: ``wrt=`` and ``nnx.DiffState`` in the grad family.

``treemode.grad``/``value_and_grad`` (``wrt=``, ``argnums=nnx.DiffState(i, F)``),
``treemode.vjp`` (``wrt=``) and ``treemode.custom_vjp`` (``nnx.DiffState`` in
``nondiff_argnums``) differentiate only the Variables a Flax filter selects. The
LoRA fine-tune is compared with the same program under Flax's graph mode
(``nnx.grad`` with ``nnx.DiffState``), eager, under ``jit`` and with donation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import treemode

X = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
Y = jnp.linspace(0.5, -0.5, 20).reshape(5, 4)


class LoRAModel(nnx.Module):
    """A frozen base layer with a LoRA adapter, and a counter the call writes."""

    def __init__(self, rngs: nnx.Rngs):
        self.base = nnx.Linear(3, 4, rngs=rngs)
        self.lora = nnx.LoRA(3, 2, 4, rngs=rngs)
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.base(x) + self.lora(x)


def loss_fn(model, x=X, y=Y):
    return jnp.mean((model(x) - y) ** 2)


def _arrays(model) -> dict:
    return {
        "/".join(map(str, path)): np.asarray(v)
        for path, v in nnx.to_flat_state(nnx.state(model))
        if not jax.dtypes.issubdtype(np.asarray(v).dtype, jax.dtypes.prng_key)
    }


def _flax_run(steps: int, jit: bool) -> tuple[list[float], dict]:
    """The graph-mode program: nnx.grad with nnx.DiffState, nnx.Optimizer(wrt=)."""
    model = LoRAModel(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.LoRAParam)

    def step(model, opt):
        loss, grads = nnx.value_and_grad(
            loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), graph=True, graph_updates=True
        )(model)
        opt.update(model, grads)
        return loss

    if jit:
        step = nnx.jit(step, graph=True, graph_updates=True)
    losses = [float(step(model, opt)) for _ in range(steps)]
    return losses, _arrays(model)


def _treemode_step(how: str):
    if how == "diffstate":
        return treemode.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
    if how == "diffstate-graph":
        return treemode.value_and_grad(
            loss_fn, argnums=(nnx.DiffState(0, nnx.LoRAParam),), graph=True
        )
    return treemode.value_and_grad(loss_fn, wrt=nnx.LoRAParam)


@pytest.mark.parametrize("how", ["wrt", "diffstate", "diffstate-graph"])
@pytest.mark.parametrize("mode", ["eager", "jit", "donate"])
def test_lora_fine_tune_matches_flax_graph_mode(how, mode):
    steps = 3
    flax_losses, flax_state = _flax_run(steps, jit=mode != "eager")

    model = LoRAModel(nnx.Rngs(0))
    base_before = _arrays(model.base)
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.LoRAParam)
    value_and_grad = _treemode_step(how)

    def step(model, opt):
        loss, grads = value_and_grad(model)
        if how == "diffstate-graph":
            (grads,) = grads
        opt.update(model, grads)
        return loss

    if mode == "jit":
        step = treemode.jit(step)
    elif mode == "donate":
        step = treemode.jit(step, donate_argnums=(0, 1))
    losses = [float(step(model, opt)) for _ in range(steps)]

    np.testing.assert_allclose(losses, flax_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    state = _arrays(model)
    assert state.keys() == flax_state.keys()
    for key, value in flax_state.items():
        np.testing.assert_allclose(state[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    # the base is frozen (bit for bit), the adapters trained, the counter written back
    after = _arrays(model.base)
    for key, value in base_before.items():
        np.testing.assert_array_equal(after[key], value)
    assert int(model.calls[...]) == steps
    assert not np.array_equal(np.asarray(model.lora.lora_b[...]), 0.0)


def test_gradient_holds_float0_at_unselected_variables():
    model = LoRAModel(nnx.Rngs(0))
    grads = treemode.grad(loss_fn, wrt=nnx.LoRAParam)(model)
    assert type(grads) is LoRAModel
    for v in (grads.base.kernel, grads.base.bias):
        assert v[...].dtype == jax.dtypes.float0
        assert v[...].nbytes == 0  # the hand split's memory: nothing for the base
    assert grads.base.kernel[...].shape == model.base.kernel[...].shape
    assert grads.lora.lora_a[...].dtype == jnp.float32
    # the selected entries are the gradient of the whole-module grad
    full = treemode.grad(loss_fn)(LoRAModel(nnx.Rngs(0)))
    np.testing.assert_allclose(grads.lora.lora_b[...], full.lora.lora_b[...], rtol=1e-6)
    # the optimizer takes exactly the selected entries
    assert jax.tree.structure(nnx.state(grads, nnx.LoRAParam)) == jax.tree.structure(
        nnx.state(model, nnx.LoRAParam)
    )


def _explodes_if_differentiated():
    @jax.custom_jvp
    def f(x):
        return x

    @f.defjvp
    def f_jvp(primals, tangents):
        raise AssertionError("a Variable left out by wrt was differentiated")

    return f


def test_unselected_variables_get_no_cotangent_work():
    ident = _explodes_if_differentiated()

    class Model(nnx.Module):
        def __init__(self):
            self.frozen = nnx.Param(jnp.array([1.0, 2.0]))
            self.tuned = nnx.LoRAParam(jnp.array([3.0, 4.0]))

        def __call__(self):
            return jnp.sum(ident(self.frozen[...]) * self.tuned[...])

    model = Model()
    with pytest.raises(AssertionError, match="was differentiated"):
        treemode.grad(lambda m: m())(model)
    for grad in (
        treemode.grad(lambda m: m(), wrt=nnx.LoRAParam),
        treemode.grad(lambda m: m(), argnums=nnx.DiffState(0, nnx.LoRAParam)),
        treemode.jit(treemode.grad(lambda m: m(), wrt=nnx.LoRAParam)),
    ):
        g = grad(model)
        np.testing.assert_array_equal(g.tuned[...], [1.0, 2.0])
        assert g.frozen[...].dtype == jax.dtypes.float0


@pytest.mark.parametrize(
    "wrt, selected",
    [
        (nnx.LoRAParam, {"lora_a", "lora_b"}),
        ((nnx.LoRAParam, nnx.Param), {"lora_a", "lora_b", "kernel", "bias"}),
        (nnx.Not(nnx.LoRAParam), {"kernel", "bias"}),
        (nnx.PathContains("base"), {"kernel", "bias"}),
        (nnx.All(nnx.Param, nnx.PathContains("bias")), {"bias"}),
        (lambda path, v: path[-1] == "lora_b", {"lora_b"}),
        (..., {"lora_a", "lora_b", "kernel", "bias"}),
        (None, set()),
    ],
    ids=["type", "tuple", "not", "path", "all", "callable", "everything", "nothing"],
)
def test_every_flax_filter_form(wrt, selected):
    model = LoRAModel(nnx.Rngs(0))
    grads = treemode.grad(loss_fn, wrt=wrt)(model)
    got = {
        str(path[-1])
        for path, v in nnx.to_flat_state(nnx.state(grads))
        if np.asarray(v).dtype == np.float32
    }
    assert got == selected
    # Flax's graph mode selects the same Variables
    # (its integer counter, selected by some filters, needs allow_int there)
    flax = nnx.grad(
        loss_fn,
        argnums=nnx.DiffState(0, wrt),
        allow_int=True,
        graph=True,
        graph_updates=True,
    )(LoRAModel(nnx.Rngs(0)))
    flax_selected = {
        str(p[-1]) for p, v in nnx.to_flat_state(flax) if np.asarray(v).dtype == np.float32
    }
    assert flax_selected == selected


def test_argnums_mixes_ints_and_diffstates_as_flax_does():
    def f(model, x):
        return jnp.mean((model(x) - Y) ** 2)

    argnums = (nnx.DiffState(0, nnx.LoRAParam), 1)
    g_model, g_x = treemode.grad(f, argnums=argnums)(LoRAModel(nnx.Rngs(0)), X)
    f_model, f_x = nnx.grad(f, argnums=argnums, graph=True, graph_updates=True)(
        LoRAModel(nnx.Rngs(0)), X
    )
    np.testing.assert_allclose(g_x, f_x, rtol=1e-6)
    np.testing.assert_allclose(g_model.lora.lora_b[...], f_model["lora"]["lora_b"][...], rtol=1e-6)
    assert g_model.base.kernel[...].dtype == jax.dtypes.float0
    # a DiffState's filter overrides wrt= for its argument; wrt= applies to the others
    two = treemode.grad(
        lambda a, b: loss_fn(a) + loss_fn(b),
        argnums=(nnx.DiffState(0, nnx.PathContains("bias")), 1),
        wrt=nnx.LoRAParam,
    )(LoRAModel(nnx.Rngs(0)), LoRAModel(nnx.Rngs(1)))
    assert two[0].base.bias[...].dtype == jnp.float32
    assert two[0].lora.lora_a[...].dtype == jax.dtypes.float0
    assert two[1].lora.lora_a[...].dtype == jnp.float32
    assert two[1].base.bias[...].dtype == jax.dtypes.float0


def test_has_aux_and_write_back_with_diffstate():
    model = LoRAModel(nnx.Rngs(0))

    def f(m):
        return loss_fn(m), {"calls": m.calls[...]}

    (loss, aux), grads = treemode.value_and_grad(
        f, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True
    )(model)
    assert int(aux["calls"]) == 1
    assert int(model.calls[...]) == 1
    np.testing.assert_allclose(loss, loss_fn(LoRAModel(nnx.Rngs(0))), rtol=1e-6)
    assert grads.base.kernel[...].dtype == jax.dtypes.float0


def test_graph_true_with_a_variable_shared_between_the_adapter_and_another_argument():
    # graph=True: a Variable shared by two arguments must get one answer
    shared = nnx.LoRAParam(jnp.ones((3,)))

    class A(nnx.Module):
        def __init__(self):
            self.w = shared
            self.b = nnx.Param(jnp.ones((3,)))

    a, other = A(), nnx.Dict(w=shared)

    def f(a, other):
        return jnp.sum(a.w[...] * a.b[...]) + jnp.sum(other["w"][...])

    # the shared LoRAParam is selected in the differentiated argument, not in the other
    with pytest.raises(treemode.AliasError, match="differentiated"):
        treemode.grad(f, argnums=nnx.DiffState(0, nnx.LoRAParam), graph=True)(a, other)
    # a filter that leaves the shared Variable out in both places is consistent
    g = treemode.grad(f, argnums=nnx.DiffState(0, nnx.Not(nnx.LoRAParam)), graph=True)(a, other)
    assert g.w[...].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(g.b[...], [1.0, 1.0, 1.0])


def test_invalid_filters_and_repeated_argnums_are_named():
    with pytest.raises(TypeError, match=r"treemode.grad: wrt=42 is not a Flax filter"):
        treemode.grad(loss_fn, wrt=42)
    with pytest.raises(ValueError, match=r"treemode.value_and_grad: argnum 0 is repeated"):
        treemode.value_and_grad(loss_fn, argnums=(0, nnx.DiffState(0, nnx.Param)))
    with pytest.raises(TypeError, match=r"treemode.vjp: wrt=1.5 is not a Flax filter"):
        treemode.vjp(loss_fn, LoRAModel(nnx.Rngs(0)), wrt=1.5)


def test_a_failing_call_with_wrt_leaves_the_model_untouched():
    model = LoRAModel(nnx.Rngs(0))
    before = _arrays(model)

    def bad(m):
        m(X)
        return m(X)  # not a scalar

    with pytest.raises(TypeError, match="treemode.grad: the function must return a scalar"):
        treemode.grad(bad, wrt=nnx.LoRAParam)(model)
    after = _arrays(model)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value)


def test_vjp_wrt():
    model = LoRAModel(nnx.Rngs(0))
    out, vjp_fn = treemode.vjp(lambda m, x: m(x), model, X, wrt=nnx.LoRAParam)
    m_ct, x_ct = vjp_fn(jnp.ones_like(out))
    assert m_ct.base.kernel[...].dtype == jax.dtypes.float0
    assert m_ct.lora.lora_b[...].shape == (2, 4)
    # the input x is an array outside Variables: differentiated as without wrt
    _, full_fn = treemode.vjp(lambda m, x: m(x), LoRAModel(nnx.Rngs(0)), X)
    full_m, full_x = full_fn(jnp.ones_like(out))
    np.testing.assert_allclose(x_ct, full_x, rtol=1e-6)
    np.testing.assert_allclose(m_ct.lora.lora_b[...], full_m.lora.lora_b[...], rtol=1e-6)


def test_custom_vjp_diffstate_in_nondiff_argnums():
    # Flax's own example: only the x attribute is differentiable
    class Foo(nnx.Module):
        def __init__(self):
            self.x = nnx.Param(jnp.array(1.0))
            self.y = nnx.Param(jnp.array(2.0))

    x_attribute = nnx.PathContains("x")

    @treemode.custom_vjp(nondiff_argnums=(nnx.DiffState(0, x_attribute),))
    def f(m):
        return jnp.sin(m.x[...]) * m.y[...]

    def f_fwd(m):
        return f(m), (jnp.cos(m.x[...]), m)

    def f_bwd(res, g):
        cos_x, m = res
        m_g = nnx.clone(m)
        m_g.x[...] = cos_x * g * m.y[...]
        m_g.y[...] = 1e9  # ignored: y is not differentiated
        return (m_g,)

    f.defvjp(f_fwd, f_bwd)
    grads = treemode.grad(f, argnums=nnx.DiffState(0, x_attribute))(Foo())
    np.testing.assert_allclose(grads.x[...], jnp.cos(1.0) * 2.0, rtol=1e-6)
    assert grads.y[...].dtype == jax.dtypes.float0
    # the whole-module grad sees a zero cotangent for y, not bwd's value
    whole = treemode.grad(f)(Foo())
    np.testing.assert_array_equal(whole.y[...], 0.0)
    # Flax's graph mode gives the same gradient for x
    flax_grads = _flax_custom_vjp_grad()
    np.testing.assert_allclose(grads.x[...], flax_grads["x"][...], rtol=1e-6)


def _flax_custom_vjp_grad():
    class Foo(nnx.Module):
        def __init__(self):
            self.x = nnx.Param(jnp.array(1.0))
            self.y = nnx.Param(jnp.array(2.0))

    x_attribute = nnx.PathContains("x")

    @nnx.custom_vjp(nondiff_argnums=(nnx.DiffState(0, x_attribute),), graph_updates=True)
    def f(m):
        return jnp.sin(m.x) * m.y

    def f_fwd(m):
        return f(m), (jnp.cos(m.x), m)

    def f_bwd(res, g):
        (m_updates_g,), out_g = g
        cos_x, m = res
        m_g = jax.tree.map(lambda x: x, m_updates_g)
        m_g.x[...] = cos_x * out_g * m.y
        del m_g["y"]
        return (m_g,)

    f.defvjp(f_fwd, f_bwd)
    return nnx.grad(f, argnums=nnx.DiffState(0, x_attribute), graph=True, graph_updates=True)(Foo())


def test_custom_vjp_may_change_a_variable_its_diffstate_leaves_out():
    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array(2.0))
            self.ema = nnx.Param(jnp.array(0.0))  # floating, but not differentiated

    @treemode.custom_vjp(nondiff_argnums=(nnx.DiffState(0, nnx.PathContains("w")),))
    def f(m):
        m.ema[...] = 0.5 * m.ema[...] + 0.5 * m.w[...]
        return m.w[...] ** 2

    def f_bwd(m, g):
        m_g = nnx.clone(m)
        m_g.w[...] = 2 * m.w[...] * g
        m_g.ema[...] = 123.0  # ignored
        return (m_g,)

    f.defvjp(lambda m: (f(m), m), f_bwd)
    m = M()
    g = treemode.grad(f, argnums=nnx.DiffState(0, nnx.PathContains("w")))(m)
    np.testing.assert_allclose(g.w[...], 4.0)
    assert g.ema[...].dtype == jax.dtypes.float0
    np.testing.assert_allclose(m.ema[...], 1.0)  # written back

    # without the DiffState, changing ema (a differentiable Variable) is refused
    @treemode.custom_vjp
    def h(m):
        m.ema[...] = 0.5 * m.ema[...] + 0.5 * m.w[...]
        return m.w[...] ** 2

    h.defvjp(lambda m: (h(m), m), f_bwd)
    with pytest.raises(treemode.MutationError, match="ema"):
        treemode.grad(h)(M())


def test_diffstate_repeated_in_custom_vjp_nondiff_argnums():
    with pytest.raises(ValueError, match="treemode.custom_vjp: argnum 0 is repeated"):
        treemode.custom_vjp(nondiff_argnums=(0, nnx.DiffState(0, nnx.Param)))
