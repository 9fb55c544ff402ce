"""Variables reached through the closure are lifted: fresh reads, written-back writes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter

import treemode

GLOBAL_COUNTER = Counter()


def test_closure_reads_are_never_stale():
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    traces = []

    @treemode.jit
    def forward(x):
        traces.append(1)
        return m(x)

    x = jnp.ones((1, 2))
    np.testing.assert_allclose(forward(x), m(x))
    m.kernel[...] = m.kernel[...] * 3
    np.testing.assert_allclose(forward(x), m(x))
    assert len(traces) == 1


def test_closure_writes_are_written_back():
    counter = Counter()

    @treemode.jit
    def step(x):
        return counter(x)

    step(jnp.ones(2))
    step(jnp.ones(2))
    assert int(counter.count[...]) == 2
    assert float(counter.total[...]) == 4.0


def test_global_module_is_lifted():
    def step(x):
        return GLOBAL_COUNTER(x)

    before = int(GLOBAL_COUNTER.count[...])
    treemode.jit(step)(jnp.ones(2))
    assert int(GLOBAL_COUNTER.count[...]) == before + 1


def test_bound_method_and_callable_module():
    counter = Counter()
    treemode.jit(counter.__call__)(jnp.ones(2))
    treemode.jit(counter)(jnp.ones(2))
    treemode.jit(functools.partial(lambda c, x: c(x), counter))(jnp.ones(2))
    assert int(counter.count[...]) == 3


def test_module_both_argument_and_closure_is_an_error():
    counter = Counter()

    @treemode.jit
    def step(c, x):
        return counter(x) + c(x)

    with pytest.raises(treemode.ClosureError, match=r"closure counter\.count.*args\[0\]\.count"):
        step(counter, jnp.ones(2))
    assert int(counter.count[...]) == 0


def test_closure_restored_after_error():
    counter = Counter()
    before = counter.count.get_raw_value()

    @treemode.jit
    def step(x):
        counter(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        step(jnp.ones(2))
    assert counter.count.get_raw_value() is before
    assert isinstance(counter.count.get_raw_value(), jax.Array)
    counter(jnp.ones(2))  # still usable eagerly
    assert int(counter.count[...]) == 1


def test_closed_over_module_mutated_inside_jax_jit_is_reported(tracer_leaks):
    counter = Counter()

    @jax.jit
    def outer(x):
        return treemode.jit(lambda x: x + 1)(x), counter.count[...]

    outer(jnp.ones(2))  # reading an outer Variable inside jax.jit is fine

    @jax.jit
    def outer_mutating(x):
        return treemode.jit(lambda x: counter(x))(x)

    with pytest.raises(treemode.TraceContextError, match=r"closure counter\.count"):
        outer_mutating(jnp.ones(2))
    assert isinstance(counter.count.get_raw_value(), jax.Array)
    assert int(counter.count[...]) == 0


c = Counter()  # a global whose name is also used as an attribute name below


def test_attribute_names_are_not_mistaken_for_globals():
    class Holder(nnx.Module):
        def __init__(self):
            self.c = Counter()

    holder = Holder()

    @treemode.jit
    def step(h, x):
        return h.c(x)  # `.c` is an attribute access, not the global `c`

    step(holder, jnp.ones(2))
    assert int(holder.c.count[...]) == 1
    assert int(c.count[...]) == 0


def test_globals_used_in_nested_comprehension_are_lifted():
    def step(x):
        return [GLOBAL_COUNTER(x) for _ in range(2)][-1]

    before = int(GLOBAL_COUNTER.count[...])
    treemode.jit(step)(jnp.ones(2))
    assert int(GLOBAL_COUNTER.count[...]) == before + 2
