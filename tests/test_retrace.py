"""With ``jax_explain_cache_misses`` on, a retrace of `treemode.jit` says what changed
(``treemode._pipeline._retrace``)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import treemode
from treemode import _compat


@pytest.fixture
def explain(caplog):
    caplog.set_level(logging.WARNING)
    with jax.explain_cache_misses(True):
        yield caplog


def _treemode_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "treemode"]


def _retrace_messages(caplog) -> list[str]:
    """Every explanation of a retrace, treemode's and JAX's."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "treemode" or "TRACING CACHE MISS" in r.getMessage()
    ]


def _names_only_user_paths(message: str) -> None:
    assert "flat_args" not in message and "args[" not in message, message
    assert "donated_args" not in message and "kept_args" not in message, message


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
    assert _retrace_messages(explain) == []  # the first trace is no retrace
    f(model, {"x": jnp.ones((3, 2))})
    # One message (JAX's where it takes treemode's names, else treemode's), naming
    # the user's parameter and path.
    (message,) = _retrace_messages(explain)
    assert "test_retrace.py" in message
    _names_only_user_paths(message)
    if _compat.NAMES_ARGUMENTS:
        assert "* at batch['x'], now f32[3,2] and before f32[1,2]" in message
    else:
        assert "batch['x']: float32[3,2] (before float32[1,2])" in message


@pytest.mark.parametrize("donate", [False, True])
def test_variable_dtype_change_names_the_variable(explain, donate):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(m):
        m.bias[...] += 1
        return m.kernel[...].sum()

    f = treemode.jit(step, donate_argnums=0 if donate else ())
    f(model)
    model.kernel.set_value(model.kernel[...].astype(jnp.float16))
    f(model)
    (message,) = _retrace_messages(explain)
    _names_only_user_paths(message)
    if _compat.NAMES_ARGUMENTS:
        assert "* at m.kernel, now f16[2,2] and before f32[2,2]" in message
    else:
        assert "m.kernel: float16[2,2] (before float32[2,2])" in message


def test_python_number_type_change(explain):
    f = treemode.jit(lambda x, n: x * n)
    f(jnp.ones(2), 1)
    f(jnp.ones(2), 2)  # same type: no retrace
    assert _retrace_messages(explain) == []
    f(jnp.ones(2), 2.0)
    (message,) = _retrace_messages(explain)
    _names_only_user_paths(message)
    if _compat.NAMES_ARGUMENTS:
        assert "* at n, now f32[] and before i32[]" in message
    else:
        assert "n: float32[] (weakly typed) (before int32[] (weakly typed))" in message


def test_a_shape_retrace_compares_with_the_closest_call(explain):
    f = treemode.jit(lambda x, y: x.sum() + y.sum())
    f(jnp.ones(1), jnp.ones(1))
    f(jnp.ones(2), jnp.ones(5))
    f(jnp.ones(1), jnp.ones(5))  # the second call differs in x only, the first in y
    *_, message = _retrace_messages(explain)
    _names_only_user_paths(message)
    assert "x" in message and " y" not in message and "at y" not in message, message


def test_a_structure_retrace_on_a_tie_compares_with_the_latest_call(explain):
    f = treemode.jit(lambda a, b: 0.0, static_argnums=(0, 1))
    f(1, 1)
    f(2, 2)
    f(3, 2)  # one change from the latest call (a), two from the first
    f(4, 3)  # two changes from each earlier call: compared with (3, 2)
    message = _treemode_messages(explain)[-1]
    assert "a: static argument 3 -> 4" in message
    assert "b: static argument 2 -> 3" in message


def test_static_attribute_change_old_and_new(explain):
    f = treemode.jit(lambda m: m.w[...] * m.factor)
    f(Scaled(1))
    f(Scaled(2))
    (message,) = _treemode_messages(explain)
    assert "m.factor: static attribute 1 -> 2" in message
    # JAX's own explanation (a new flat function "never seen") is not shown.
    jax_messages = [r.getMessage() for r in explain.records if r.name != "treemode"]
    assert not any("_call_flat" in m and "never seen" in m for m in jax_messages)


def test_static_argument_change(explain):
    f = treemode.jit(lambda x, mode: x * (2 if mode == "double" else 1), static_argnums=1)
    f(jnp.ones(2), "double")
    f(jnp.ones(2), "same")
    (message,) = _treemode_messages(explain)
    assert "mode: static argument 'double' -> 'same'" in message


def test_structure_change(explain):
    f = treemode.jit(lambda tree: sum(jnp.sum(v) for v in tree.values()))
    f({"a": jnp.ones(2)})
    f({"a": jnp.ones(2), "b": jnp.ones(2)})
    (message,) = _treemode_messages(explain)
    assert "tree['b']: a new entry" in message


def test_variable_type_and_metadata_change(explain):
    f = treemode.jit(lambda v: v[...] * 2)
    f(nnx.Param(jnp.ones(2)))
    f(nnx.Param(jnp.ones(2), tag="x"))
    f(nnx.BatchStat(jnp.ones(2), tag="x"))
    first, second = _treemode_messages(explain)
    assert "v: the Variable's metadata 'tag' changed from '(absent)' to 'x'" in first
    assert "v: the Variable type changed from Param to BatchStat" in second


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
