"""Python numbers passed to a transform are traced as JAX traces them.

`int`, `float`, `bool` and `complex` arguments, alone or inside plain
containers, are traced (weakly typed), static only through `static_argnums` /
`static_argnames`. NNX static attributes stay static (as in NNX), and every
non-array field of an Equinox module stays static (as in `eqx.filter_jit`).
Each test compares with the plain JAX transform.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


def assert_same_array(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.weak_type == b.weak_type, (a.weak_type, b.weak_type)
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_loop_passing_the_step_number_traces_once():
    traces = []
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    @treemode.jit
    def step(model, step_number, lr):
        traces.append(1)
        model.kernel[...] -= lr * step_number
        return step_number + 1

    for n in range(5):
        out = step(model, n, 0.1)
    assert len(traces) == 1
    assert_same_array(out, jax.jit(lambda n: n + 1)(4))


def test_jit_traces_every_python_number_once_like_jax():
    for value, other in [(1, 2), (1.5, 2.5), (True, False), (1 + 2j, 3 - 1j)]:
        traces: list[int] = []

        def f(x, traces=traces):
            traces.append(1)
            return x * 2

        jitted = treemode.jit(f)
        jitted(value)
        out = jitted(other)
        assert len(traces) == 1, value
        assert_same_array(out, jax.jit(lambda x: x * 2)(other))


def test_numbers_in_plain_containers_are_traced():
    traces = []

    @treemode.jit
    def f(tree):
        traces.append(1)
        return tree["a"][0] + tree["a"][1] * tree["b"] + (0 if tree["c"] is None else 1)

    for k in range(3):
        out = f({"a": [k, 2.0], "b": (k + 1), "c": None})
    assert len(traces) == 1
    expected = jax.jit(
        lambda tree: tree["a"][0] + tree["a"][1] * tree["b"] + (0 if tree["c"] is None else 1)
    )({"a": [2, 2.0], "b": 3, "c": None})
    assert_same_array(out, expected)


def test_keyword_numbers_are_traced_too():
    traces = []

    @treemode.jit
    def f(x, *, scale):
        traces.append(1)
        return x * scale

    f(jnp.ones(2), scale=2.0)
    np.testing.assert_array_equal(f(jnp.ones(2), scale=3.0), 3 * jnp.ones(2))
    assert len(traces) == 1


def test_static_only_through_static_argnums_and_argnames():
    traces = []

    @treemode.jit(static_argnums=1, static_argnames="mode")
    def f(x, n, mode=1):
        traces.append((n, mode))
        return x * n * mode

    f(jnp.ones(2), 2)
    f(jnp.ones(2), 3)
    f(jnp.ones(2), 3, mode=2)
    assert traces == [(2, 1), (3, 1), (3, 2)]
    for n, mode in traces:
        assert type(n) is int and type(mode) is int  # concrete inside the function


def test_nnx_static_attributes_stay_static():
    class Scaled(nnx.Module):
        def __init__(self, factor):
            self.factor = factor  # a static attribute, as in NNX
            self.w = nnx.Param(jnp.ones(2))

    seen = []

    @treemode.jit
    def f(m):
        seen.append(m.factor)
        return m.w[...] * m.factor

    np.testing.assert_array_equal(f(Scaled(2)), 2 * jnp.ones(2))
    np.testing.assert_array_equal(f(Scaled(3)), 3 * jnp.ones(2))
    assert seen == [2, 3]  # concrete Python ints: one trace per value, as nnx.jit


def test_equinox_fields_stay_static_like_filter_jit():
    class Block(eqx.Module):
        w: jax.Array
        repeat: int

    seen, eqx_seen = [], []

    @treemode.jit
    def f(block, x):
        seen.append(block.repeat)
        for _ in range(block.repeat):
            x = x * block.w
        return x

    @eqx.filter_jit
    def g(block, x):
        eqx_seen.append(block.repeat)
        for _ in range(block.repeat):
            x = x * block.w
        return x

    for repeat in [1, 2, 2]:
        block = Block(2 * jnp.ones(2), repeat)
        np.testing.assert_array_equal(f(block, jnp.ones(2)), g(block, jnp.ones(2)))
    assert seen == eqx_seen == [1, 2]


def test_numbers_next_to_an_equinox_module_are_traced():
    class Block(eqx.Module):
        w: jax.Array
        repeat: int

    traces = []

    @treemode.jit
    def f(block, scale):
        traces.append(1)
        return block.w * block.repeat * scale

    f(Block(jnp.ones(2), 2), 1.0)
    np.testing.assert_array_equal(f(Block(jnp.ones(2), 2), 3.0), 6 * jnp.ones(2))
    assert len(traces) == 1


def test_eval_shape_of_a_number_is_weakly_typed_like_jax():
    out = treemode.eval_shape(lambda x: x * 2, 3)
    expected = jax.eval_shape(lambda x: x * 2, 3)
    assert out == expected and out.weak_type


def test_vmap_broadcasts_a_number_like_jax():
    f = lambda x, n: x * n  # noqa: E731
    out = treemode.vmap(f, in_axes=(0, None))(jnp.arange(3), 2)
    assert_same_array(out, jax.vmap(f, in_axes=(0, None))(jnp.arange(3), 2))


def test_vmap_cannot_map_a_number_like_jax():
    f = lambda x, n: x * n  # noqa: E731
    with pytest.raises(ValueError):
        jax.vmap(f, in_axes=(0, 0))(jnp.arange(3), 2)
    with pytest.raises(ValueError, match="args\\[1\\]"):
        treemode.vmap(f, in_axes=(0, 0))(jnp.arange(3), 2)


def test_grad_of_a_function_of_a_float_like_jax():
    f = lambda x, n: x**2 * n  # noqa: E731
    assert_same_array(treemode.grad(f)(3.0, 2), jax.grad(f)(3.0, 2))
    value, g = treemode.value_and_grad(f)(3.0, 2)
    jvalue, jg = jax.value_and_grad(f)(3.0, 2)
    assert_same_array(value, jvalue)
    assert_same_array(g, jg)
    with pytest.raises(TypeError):
        jax.grad(f)(3, 2)
    with pytest.raises(TypeError):
        treemode.grad(f)(3, 2)


def test_scan_carry_holding_a_python_int_like_jax():
    def f(carry, x):
        count, total = carry
        return (count + 1, total + x), count

    xs = jnp.arange(3.0)
    (count, total), ys = treemode.scan(f, (0, 0.0), xs)
    (jcount, jtotal), jys = jax.lax.scan(f, (0, 0.0), xs)
    assert_same_array(count, jcount)
    assert_same_array(total, jtotal)
    assert_same_array(ys, jys)


def test_scan_decorator_with_a_python_int_carry():
    counter = nnx.Variable(jnp.zeros(()))

    @treemode.scan(in_axes=(treemode.Carry, None, 0), out_axes=(treemode.Carry, 0))
    def f(c, counter, x):
        counter[...] += x
        return c + 1, c

    c, ys = f(0, counter, jnp.arange(3.0))
    jc, jys = jax.lax.scan(lambda c, x: (c + 1, c), 0, jnp.arange(3.0))
    assert_same_array(c, jc)
    assert_same_array(ys, jys)
    assert float(counter[...]) == 3.0


def test_cond_and_switch_with_number_operands_like_jax():
    branches = [lambda x, n: x * n, lambda x, n: x + n]
    for pred in [True, False]:
        out = treemode.cond(pred, *branches, 2.0, 3)
        assert_same_array(out, jax.lax.cond(pred, *branches, 2.0, 3))
    for index in [0, 1]:
        out = treemode.switch(index, branches, 2.0, 3)
        assert_same_array(out, jax.lax.switch(index, branches, 2.0, 3))


def test_while_and_fori_loop_with_number_state_like_jax():
    cond_fun = lambda v: v[0] < 5  # noqa: E731
    body = lambda v: (v[0] + 1, v[1] * 2.0)  # noqa: E731
    out = treemode.while_loop(cond_fun, body, (0, 1.0))
    expected = jax.lax.while_loop(cond_fun, body, (0, 1.0))
    for a, b in zip(out, expected, strict=True):
        assert_same_array(a, b)
    fori_body = lambda i, v: v + i  # noqa: E731
    assert_same_array(treemode.fori_loop(0, 4, fori_body, 0), jax.lax.fori_loop(0, 4, fori_body, 0))


def test_jit_partial_loop_over_step_numbers_traces_once():
    traces = []
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(model, n):
        traces.append(1)
        return model(jnp.ones((1, 2))) * n

    jitted = treemode.jit_partial(step, model)
    for n in range(4):
        jitted(n)
    assert len(traces) == 1


def test_vjp_jvp_of_python_numbers_like_jax():
    f = lambda x, y: x * y  # noqa: E731
    out, vjp_fn = treemode.vjp(f, 2.0, 3.0)
    jout, jvjp_fn = jax.vjp(f, 2.0, 3.0)
    assert_same_array(out, jout)
    for a, b in zip(vjp_fn(1.0), jvjp_fn(1.0), strict=True):
        assert_same_array(a, b)
    (out, tangent), (jout, jtangent) = (
        treemode.jvp(f, (2.0, 3.0), (1.0, 0.0)),
        jax.jvp(f, (2.0, 3.0), (1.0, 0.0)),
    )
    assert_same_array(out, jout)
    assert_same_array(tangent, jtangent)


def test_remat_and_checkify_of_python_numbers_like_jax():
    f = lambda x, n: jnp.sin(x) * n  # noqa: E731
    assert_same_array(treemode.remat(f)(1.0, 2), jax.checkpoint(f)(1.0, 2))
    assert_same_array(
        jax.grad(lambda x: treemode.remat(f)(x, 2))(1.0),
        jax.grad(lambda x: jax.checkpoint(f)(x, 2))(1.0),
    )
    from jax.experimental import checkify

    err, out = treemode.checkify(f)(1.0, 2)
    jerr, jout = checkify.checkify(f)(1.0, 2)
    assert err.get() is None and jerr.get() is None
    assert_same_array(out, jout)


def test_pmap_broadcasts_a_number_like_jax():
    n = jax.local_device_count()
    f = lambda x, k: x * k  # noqa: E731
    out = treemode.pmap(f, in_axes=(0, None))(jnp.ones(n), 3)
    assert_same_array(out, jax.pmap(f, in_axes=(0, None))(jnp.ones(n), 3))
