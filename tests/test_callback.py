"""A module mutated from inside a host callback (issue 8, hostile inputs).

Inside a transform the function sees trace-time copies of its arguments. A
``jax.debug.callback`` runs on the host while the compiled function executes,
after tracing, so a write it makes to such a copy could never reach the
caller's module: it is a `treemode.MutationError` naming the transform, the
Variable's path and the fix, and the caller's module is left as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Counter(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.count = nnx.BatchStat(jnp.array(0))


def _raw_values(tree):
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return [v.get_raw_value() for v in leaves]


def _assert_stale_write(excinfo, transform, path):
    message = str(excinfo.value)
    assert message.startswith(f"treemode.{transform}: the BatchStat at {path} was written outside")
    assert "jax.debug.callback" in message
    assert "return the value from the function" in message


def test_callback_writing_an_argument_module_under_jit():
    models = {"a": [Counter(), Counter()]}
    before = _raw_values(models)

    @treemode.jit
    def step(models, x):
        jax.debug.callback(lambda v: models["a"][1].count.set_value(v), x)
        return x * 2

    # The callback keeps the trace-time module (and its tracers) alive: a leak
    # of the user's own making, so leak checking is off here even under --tracer-leaks.
    with jax.check_tracer_leaks(False):
        with pytest.raises(treemode.MutationError) as excinfo:
            step(models, jnp.array(5))
            jax.effects_barrier()
    _assert_stale_write(excinfo, "jit", "args[0]['a'][1].count")
    assert all(a is b for a, b in zip(_raw_values(models), before, strict=True))
    assert int(models["a"][1].count[...]) == 0


@pytest.mark.parametrize("transform", ["vmap", "scan"])
def test_callback_writing_an_argument_module_under_vmap_and_scan(transform):
    m = Counter()
    before = _raw_values(m)

    def body(m, x):
        jax.debug.callback(lambda v: m.count.set_value(v), x)
        return m, x * 2

    with jax.check_tracer_leaks(False):
        with pytest.raises(treemode.MutationError) as excinfo:
            if transform == "vmap":
                treemode.vmap(lambda m, x: body(m, x)[1], in_axes=(None, 0))(m, jnp.arange(2))
            else:
                treemode.scan(body)(m, jnp.arange(2))
            jax.effects_barrier()
    _assert_stale_write(excinfo, transform, "args[0].count")
    assert all(a is b for a, b in zip(_raw_values(m), before, strict=True))


def test_a_trace_time_module_kept_after_the_call_cannot_be_written():
    kept = []

    @treemode.jit
    def step(m):
        kept.append(m)
        return m.w[...].sum()

    with jax.check_tracer_leaks(False):  # keeping the copy is the point
        step(Counter())
        with pytest.raises(treemode.MutationError) as excinfo:
            kept[0].count.set_value(jnp.array(3))
    _assert_stale_write(excinfo, "jit", "args[0].count")


def test_the_documented_fixes_work(tracer_leaks):
    m = Counter()
    seen = []

    @treemode.jit
    def step(m, x):
        m.count[...] = x  # update inside the traced function: written back
        jax.debug.callback(lambda v: seen.append(int(v)), x)  # the callback gets values
        return x * 2

    step(m, jnp.array(5))
    jax.effects_barrier()
    assert int(m.count[...]) == 5
    assert seen == [5]


def test_writes_inside_the_trace_are_unaffected():
    m = Counter()

    @treemode.jit
    def step(m):
        inner = treemode.grad(lambda m: (m.w[...] ** 2).sum())
        g = inner(m)
        m.count[...] += 1  # the copy is written within its own trace, after an inner one
        return g

    g = step(m)
    np.testing.assert_allclose(g.w[...], 2.0)
    assert int(m.count[...]) == 1


def test_a_write_from_a_nested_plain_jax_transform():
    m = Counter()
    before = _raw_values(m)

    @treemode.jit
    def step(m):
        def body(i, c):
            m.count.set_value(c)  # the copy belongs to the jit trace, not fori_loop's
            return c + 1

        return jax.lax.fori_loop(0, 2, body, jnp.array(0))

    with pytest.raises(treemode.MutationError) as excinfo:
        step(m)
    _assert_stale_write(excinfo, "jit", "args[0].count")
    assert "treemode.scan" in str(excinfo.value)
    assert all(a is b for a, b in zip(_raw_values(m), before, strict=True))
