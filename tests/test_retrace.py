"""With ``jax_explain_cache_misses`` on, a retrace of `treemode.jit` says what changed
(``treemode._pipeline._retrace``)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import treemode


@pytest.fixture
def explain(caplog):
    caplog.set_level(logging.WARNING)
    with jax.explain_cache_misses(True):
        yield caplog


def _treemode_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "treemode"]


class Scaled(nnx.Module):
    def __init__(self, factor):
        self.factor = factor
        self.w = nnx.Param(jnp.ones(2))


def test_shape_change_names_the_argument_path(explain):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    @treemode.jit
    def f(model, batch):
        return model(batch["x"])

    f(model, {"x": jnp.ones((1, 2))})
    assert _treemode_messages(explain) == []  # the first trace is no retrace
    f(model, {"x": jnp.ones((3, 2))})
    (message,) = _treemode_messages(explain)
    assert "treemode.jit: tracing" in message and "test_retrace.py" in message
    assert "args[1]['x']: float32[3,2] (before float32[1,2])" in message


def test_variable_dtype_change_names_the_variable(explain):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = treemode.jit(lambda m: m.kernel[...].sum())
    f(model)
    model.kernel.set_value(model.kernel[...].astype(jnp.float16))
    f(model)
    (message,) = _treemode_messages(explain)
    assert "args[0].kernel: float16[2,2] (before float32[2,2])" in message


def test_python_number_type_change(explain):
    f = treemode.jit(lambda x, n: x * n)
    f(jnp.ones(2), 1)
    f(jnp.ones(2), 2)  # same type: no retrace
    assert _treemode_messages(explain) == []
    f(jnp.ones(2), 2.0)
    (message,) = _treemode_messages(explain)
    assert "args[1]: float32[] (weakly typed) (before int32[] (weakly typed))" in message


def test_static_attribute_change_old_and_new(explain):
    f = treemode.jit(lambda m: m.w[...] * m.factor)
    f(Scaled(1))
    f(Scaled(2))
    (message,) = _treemode_messages(explain)
    assert "args[0].factor: static attribute 1 -> 2" in message
    # JAX's own explanation (a new flat function "never seen") is not shown.
    jax_messages = [r.getMessage() for r in explain.records if r.name != "treemode"]
    assert not any("_call_flat" in m and "never seen" in m for m in jax_messages)


def test_static_argument_change(explain):
    f = treemode.jit(lambda x, mode: x * (2 if mode == "double" else 1), static_argnums=1)
    f(jnp.ones(2), "double")
    f(jnp.ones(2), "same")
    (message,) = _treemode_messages(explain)
    assert "args[1]: static argument 'double' -> 'same'" in message


def test_structure_change(explain):
    f = treemode.jit(lambda tree: sum(jnp.sum(v) for v in tree.values()))
    f({"a": jnp.ones(2)})
    f({"a": jnp.ones(2), "b": jnp.ones(2)})
    (message,) = _treemode_messages(explain)
    assert "args[0]['b']: a new entry" in message


def test_variable_type_and_metadata_change(explain):
    f = treemode.jit(lambda v: v[...] * 2)
    f(nnx.Param(jnp.ones(2)))
    f(nnx.BatchStat(jnp.ones(2)))
    f(nnx.Param(jnp.ones(2), tag="x"))
    first, second = _treemode_messages(explain)
    assert "args[0]: the Variable type changed from Param to BatchStat" in first
    assert "args[0]: the Variable's metadata 'tag' changed from '(absent)' to 'x'" in second


def test_closure_module_static_attribute_change(explain):
    m = Scaled(1)
    f = treemode.jit(lambda: m.w[...] * m.factor)
    f()
    m.factor = 2
    f()
    (message,) = _treemode_messages(explain)
    assert "a module read through the function's closure changed its class" in message


def test_nothing_is_logged_with_the_switch_off(caplog):
    caplog.set_level(logging.WARNING)
    f = treemode.jit(lambda m: m.w[...] * m.factor)
    f(Scaled(1))
    f(Scaled(2))
    f(Scaled(2))
    assert _treemode_messages(caplog) == []
