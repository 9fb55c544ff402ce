"""Donation: Variables get the fresh output buffers; shared buffers are reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import MLP, variable_buffers

import treemode


def test_donated_module_stays_usable_and_holds_fresh_buffers():
    model = MLP(2, 4, nnx.Rngs(0))
    old = variable_buffers(model)
    expected = model(jnp.ones(4))

    @treemode.jit(donate_argnums=0)
    def forward(m, x):
        for layer in m.layers:
            layer.bias[...] = layer.bias[...] * 1.0
        return m(x)

    np.testing.assert_allclose(forward(model, jnp.ones(4)), expected, rtol=1e-6)
    # The written Variables (the biases) hold fresh buffers, the old ones donated;
    # the read-only ones (the kernels) keep theirs, as under jax.jit.
    for (path, a), b in zip(nnx.to_flat_state(nnx.state(model)), old, strict=True):
        if path[-1] == "bias":
            assert a.get_raw_value() is not b and b.is_deleted()
        else:
            assert a.get_raw_value() is b and not b.is_deleted()
    assert all(not b.is_deleted() for b in variable_buffers(model))
    # The model keeps working (and can be donated again).
    np.testing.assert_allclose(forward(model, jnp.ones(4)), expected, rtol=1e-6)
    np.testing.assert_allclose(model(jnp.ones(4)), expected, rtol=1e-6)


def test_donate_argnames():
    model = MLP(1, 2, nnx.Rngs(0))

    @treemode.jit(donate_argnames="m")
    def forward(x, m):
        return m(x)

    forward(jnp.ones(2), m=model)
    assert all(not b.is_deleted() for b in variable_buffers(model))


def test_two_donated_arguments_sharing_a_buffer_name_both_paths():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    copy = treemode.clone(model)  # new Variables, same buffers

    @treemode.jit(donate_argnums=(0, 1))
    def f(a, b):
        a.kernel[...] += 1.0
        b.kernel[...] += 1.0
        return a.kernel[...] + b.kernel[...]

    with pytest.raises(treemode.DonationError) as info:
        f(model, copy)
    message = str(info.value)
    assert "args[0]" in message and "args[1]" in message
    assert "clone(module, arrays=True)" in message

    independent = treemode.clone(model, arrays=True)
    out = f(model, independent)
    np.testing.assert_allclose(out, model.kernel[...] + independent.kernel[...])


def test_donated_and_not_donated_sharing_a_buffer():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    copy = treemode.clone(model)

    def f(a, b):
        a.bias[...] += 1.0
        return a.kernel[...] + b.kernel[...]

    f = treemode.jit(f, donate_argnums=0)
    with pytest.raises(treemode.DonationError, match=r"args\[0\]\.bias and args\[1\]\.bias"):
        f(model, copy)
    assert not model.bias.get_raw_value().is_deleted()


def test_read_only_variables_of_a_donated_argument_may_share_buffers():
    """Only what the function writes is donated: a read-only Variable may share its
    buffer with another argument (jax.jit donates nothing it does not write either)."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    copy = treemode.clone(model)

    f = treemode.jit(lambda a, b: a.kernel[...] + b.kernel[...], donate_argnums=0)
    np.testing.assert_allclose(f(model, copy), 2 * copy.kernel[...])
    assert not model.kernel.get_raw_value().is_deleted()
    assert model.kernel.get_raw_value() is copy.kernel.get_raw_value()


def test_static_and_donated_argument():
    with pytest.raises(treemode.DonationError, match="both static and donated"):
        treemode.jit(lambda x, n: x, static_argnums=1, donate_argnums=1)


def test_donation_memory_matches_hand_written():
    model = MLP(2, 8, nnx.Rngs(0))
    arrays = tuple(variable_buffers(model))

    def step(m, x):
        for layer in m.layers:
            layer.kernel[...] = layer.kernel[...] - 0.1 * x.sum()
        return m(x)

    def step_flat(kernels, biases, x):
        # The hand-written program donates exactly what it writes (the kernels).
        new = tuple(kernel - 0.1 * x.sum() for kernel in kernels)
        y = x
        for kernel, bias in zip(new, biases, strict=True):
            y = jax.nn.relu(y @ kernel + bias)
        return y, new

    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    kernels, biases = arrays[1::2], arrays[0::2]
    ours = treemode.jit(step, donate_argnums=0).lower(model, x).compile().memory_analysis()
    floor = jax.jit(step_flat, donate_argnums=0).lower(kernels, biases, x).compile()
    floor = floor.memory_analysis()
    assert ours is not None and floor is not None
    assert ours.argument_size_in_bytes == floor.argument_size_in_bytes
    assert ours.temp_size_in_bytes <= floor.temp_size_in_bytes
    assert ours.alias_size_in_bytes == floor.alias_size_in_bytes


def test_python_numbers_in_donated_variables_are_not_shared_buffers():
    # Two Variables holding the int 0 hold the same Python object, but a number
    # is copied to the device: no buffer is donated twice.
    class Counters(nnx.Module):
        def __init__(self):
            self.a = nnx.Variable(0)
            self.b = nnx.Variable(0)
            self.w = nnx.Param(jnp.ones(2))

    f = treemode.jit(lambda m: m.w[...] * 2, donate_argnums=0)
    m = Counters()
    np.testing.assert_allclose(f(m), np.full(2, 2.0))
    np.testing.assert_allclose(f(m), np.full(2, 2.0))  # the memo path too
