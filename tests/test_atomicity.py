"""A transform that raises leaves its inputs exactly as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Stateful, state_arrays, variable_buffers

import treemode


def snapshot(model):
    return variable_buffers(model), [np.array(a) for a in state_arrays(model)]


def assert_unchanged(model, snap):
    buffers, values = snap
    assert all(a is b for a, b in zip(variable_buffers(model), buffers, strict=True))
    for a, b in zip(state_arrays(model), values, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mutate_then_raise_in_user_function():
    model = Stateful(nnx.Rngs(0))
    snap = snapshot(model)

    @treemode.jit
    def f(m, x):
        m(x)  # advances BatchNorm stats and the Rngs counter
        raise ValueError("user error")

    with pytest.raises(ValueError, match="user error"):
        f(model, jnp.ones((2, 3)))
    assert_unchanged(model, snap)
    model(jnp.ones((2, 3)))  # still usable


def test_interrupt_between_writes_rolls_back(hooks):
    model = Stateful(nnx.Rngs(0))
    snap = snapshot(model)
    f = treemode.jit(lambda m, x: m(x))
    real_store = hooks.real_store
    writes = []

    class Interrupt(BaseException):  # like KeyboardInterrupt
        pass

    def interrupted_store(var, value, metadata=None):
        writes.append(var)
        if len(writes) == 3:
            raise Interrupt
        real_store(var, value, metadata)

    hooks.store(interrupted_store)
    with pytest.raises(Interrupt):
        f(model, jnp.ones((2, 3)))
    hooks.undo()
    assert len(writes) == 3  # two Variables were written before the interrupt
    assert_unchanged(model, snap)
    f(model, jnp.ones((2, 3)))  # and the model still works afterwards
    assert int(model.dropout.rngs.count[...]) == 1


def test_failure_in_alias_check_leaves_inputs():
    model = Stateful(nnx.Rngs(0))
    snap = snapshot(model)
    with pytest.raises(treemode.AliasError):
        treemode.jit(lambda a, b, x: a(x))(model, model, jnp.ones((2, 3)))
    assert_unchanged(model, snap)


def test_failure_during_tracing_leaves_inputs():
    model = Stateful(nnx.Rngs(0))
    snap = snapshot(model)

    @treemode.jit
    def f(m, x):
        y = m(x)
        return y @ jnp.ones((7, 7))  # shape error while tracing

    with pytest.raises(TypeError):
        f(model, jnp.ones((2, 3)))
    assert_unchanged(model, snap)
    assert all(isinstance(b, jax.Array) for b in variable_buffers(model))
