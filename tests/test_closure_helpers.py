"""Closure lifting follows helper functions held in closure cells and globals.

A module that a *helper* closes over (and mutates) is lifted like one the
transformed function names itself: its Variables are written back, no tracer
leaks into it, and Flax never sees a write from another trace level.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter

import treemode
from treemode._tree._closure import MAX_DEPTH, closure_objects
from treemode._tree._closure_code import code_plan

GLOBAL_STATS = Counter()


@pytest.fixture(autouse=True)
def reads_check(implementation, monkeypatch):
    """Whether cached answers are revalidated by the compiled ``reads_hold`` or in Python."""
    from treemode._tree import _closure, _closure_code

    # Each run starts with empty caches (the per-code-object counts are kept there).
    monkeypatch.setattr(_closure_code, "plans", {})
    monkeypatch.setattr(_closure, "_snapshots", {})
    return implementation


def record_global(x):
    """A global helper that mutates a global module."""
    GLOBAL_STATS(x)
    return x * 2


def through_two_globals(x):
    return record_global(x) + 1


def _no_tracers(module):
    leaves = jax.tree_util.tree_leaves(module, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return all(not isinstance(v.get_raw_value(), jax.core.Tracer) for v in leaves)


def test_helper_in_a_closure_cell_under_jit(tracer_leaks):
    stats = Counter()

    def record(x):  # a helper closing over a module and mutating it
        stats(x)
        return x * 2

    @treemode.jit
    def step(x):
        return record(x) + 1

    np.testing.assert_allclose(step(jnp.ones(2)), 3.0)
    np.testing.assert_allclose(step(jnp.ones(2)), 3.0)
    assert int(stats.count[...]) == 2
    assert float(stats.total[...]) == 4.0
    assert _no_tracers(stats)
    stats.count[...] = 10  # reads are fresh: the helper's module is an input, not a constant
    step(jnp.ones(2))
    assert int(stats.count[...]) == 11


def test_global_helpers_two_levels_deep_under_jit(tracer_leaks):
    before = int(GLOBAL_STATS.count[...])
    np.testing.assert_allclose(treemode.jit(through_two_globals)(jnp.ones(2)), 3.0)
    assert int(GLOBAL_STATS.count[...]) == before + 1
    assert _no_tracers(GLOBAL_STATS)


def test_helper_called_in_a_scan_body(tracer_leaks):
    stats = Counter()

    def record(x):
        stats(x)
        return x

    def body(carry, x):
        return carry + record(x), x * 2

    total, ys = treemode.scan(body)(jnp.zeros(()), jnp.arange(3.0))
    np.testing.assert_allclose(total, 3.0)
    np.testing.assert_allclose(ys, [0.0, 2.0, 4.0])
    assert int(stats.count[...]) == 3
    assert float(stats.total[...]) == 3.0
    assert _no_tracers(stats)


def test_helper_called_in_a_loop_inside_jit(tracer_leaks):
    stats = Counter()

    def record(x):
        stats(x)
        return x + 1

    @treemode.jit
    def step(x):
        return treemode.fori_loop(0, 4, lambda i, x: record(x), x)

    np.testing.assert_allclose(step(jnp.zeros(())), 4.0)
    assert int(stats.count[...]) == 4
    assert _no_tracers(stats)


def test_helper_under_grad(tracer_leaks):
    stats = Counter()
    scale = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    scale.kernel[...] = jnp.full((1, 1), 3.0)

    def apply(x):  # reads one closed-over module, mutates another
        stats(x)
        return scale(x[None])[0, 0]

    def loss(m, x):
        return apply(m.kernel[...][0] * x) ** 2

    m = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(1))
    m.kernel[...] = jnp.full((1, 1), 2.0)
    grads = treemode.grad(loss)(m, jnp.ones(1))
    # loss = (3 * 2 * x)^2 with x = 1: d/dk (3 k)^2 = 18 k = 36
    np.testing.assert_allclose(grads.kernel[...], [[36.0]])
    assert int(stats.count[...]) == 1
    assert float(stats.total[...]) == 2.0  # the helper saw k * x = 2
    assert _no_tracers(stats) and _no_tracers(scale)


def test_without_following_the_write_was_refused():
    """What the helper case did before: Flax refused the write from the trace."""
    stats = Counter()

    def record(x):
        stats(x)
        return x

    @jax.jit  # plain JAX: no lifting at all
    def step(x):
        return record(x)

    with pytest.raises(Exception, match="trace level|different trace"):
        step(jnp.ones(2))
    assert int(stats.count[...]) == 0


def test_recursive_and_mutually_recursive_helpers_terminate():
    stats = Counter()

    def a(n, x):
        return x if n == 0 else b(n - 1, stats(x))

    def b(n, x):
        return a(n, x)

    found = closure_objects(lambda x: a(3, x))
    assert [obj for _, obj in found] == [stats]


def test_depth_limit():
    stats = Counter()

    def level0(x):
        return stats(x)

    chain = level0
    for _ in range(MAX_DEPTH + 2):
        chain = (lambda inner: lambda x: inner(x))(chain)
    assert closure_objects(chain) == []  # too deep: not followed
    assert [obj for _, obj in closure_objects(lambda x: level0(x))] == [stats]


def test_library_functions_and_builtins_are_not_followed():
    # JAX, the standard library, builtins: they cannot close over the user's modules
    def f(x):
        return jnp.sum(x) + len(x) + functools.reduce(lambda a, b: a + b, [1, 2])

    assert closure_objects(f) == []
    assert not code_plan(jax.tree_util.tree_map.__code__).user_code
    assert not code_plan(os.path.join.__code__).user_code
    assert code_plan(record_global.__code__).user_code


def test_rebinding_a_helper_between_calls_is_seen():
    first, second = Counter(), Counter()

    def use_first(x):
        first(x)
        return x

    def use_second(x):
        second(x)
        return x

    helper = use_first

    @treemode.jit
    def step(x):
        return helper(x)

    step(jnp.ones(2))
    helper = use_second  # the cell now holds another helper, closing over another module
    step(jnp.ones(2))
    assert int(first.count[...]) == 1
    assert int(second.count[...]) == 1


def test_module_reached_through_a_helper_and_as_argument_is_the_argument():
    stats = Counter()

    def record(x):
        stats(x)
        return x

    @treemode.jit
    def step(c, x):
        return record(x) + c(x)

    step(stats, jnp.ones(2))
    assert int(stats.count[...]) == 2  # the helper's update and the argument's, as eagerly


def test_bound_method_and_partial_in_a_cell_are_followed():
    stats, other = Counter(), Counter()
    method = stats.__call__
    part = functools.partial(lambda c, x: c(x), other)

    @treemode.jit
    def step(x):
        return method(x) + part(x)

    step(jnp.ones(2))
    assert int(stats.count[...]) == 1 and int(other.count[...]) == 1


# -- the per-function cache: values in cells and globals can change between calls ----------

HELPER = None


def calls_the_global_helper(x):
    return HELPER(x) if HELPER is not None else x


def test_cached_answer_sees_rebound_globals_and_cells():
    global HELPER
    stats = Counter()

    def record(x):
        stats(x)
        return x

    HELPER = None
    assert closure_objects(calls_the_global_helper) == []
    assert closure_objects(calls_the_global_helper) == []  # from the cache
    HELPER = record  # a global rebound to a helper that closes over a module
    try:
        assert [obj for _, obj in closure_objects(calls_the_global_helper)] == [stats]
        other = Counter()
        stats = other  # the helper's cell rebound to another module
        assert [obj for _, obj in closure_objects(calls_the_global_helper)] == [other]
    finally:
        HELPER = None
    assert closure_objects(calls_the_global_helper) == []

    held = 1.0

    def reads_a_cell(x):
        return held(x) if callable(held) else x

    assert closure_objects(reads_a_cell) == []
    held = Counter()  # the cell now holds a module
    assert [obj for _, obj in closure_objects(reads_a_cell)] == [held]
    held = 2.0
    assert closure_objects(reads_a_cell) == []


def test_cache_keeps_neither_ignored_values_nor_dead_functions_alive():
    import gc
    import weakref

    from treemode._tree import _closure

    big = np.ones(3)
    big_ref = weakref.ref(big)

    def f(x):
        return x + big

    closure_objects(f)
    big = np.zeros(3)  # the cell is rebound: the old array must not be kept by the cache
    gc.collect()
    assert big_ref() is None
    assert closure_objects(f) == []

    key = id(f)
    assert key in _closure._snapshots
    del f
    gc.collect()
    assert key not in _closure._snapshots


def test_functions_made_per_call_stop_being_cached():
    from treemode._tree import _closure

    stats = Counter()
    makers = [lambda x, i=i: stats(x) + i for i in range(_closure._MAX_SNAPSHOTS + 4)]
    for f in makers:  # one code object, many function objects: all found correctly
        assert [obj for _, obj in closure_objects(f)] == [stats]
    code = makers[0].__code__
    assert code_plan(code).snapshots == _closure._MAX_SNAPSHOTS
    cached = sum(1 for f in makers if id(f) in _closure._snapshots)
    assert cached == _closure._MAX_SNAPSHOTS


def test_cache_does_not_keep_a_module_or_a_recursive_function_alive():
    import gc
    import weakref

    from treemode._tree import _closure

    module = Counter()  # a callable module as the transformed function
    assert [obj for _, obj in closure_objects(module)] == [module]
    assert [obj for _, obj in closure_objects(module)] == [module]  # from the cache
    module_ref = weakref.ref(module)

    def make():
        stats = Counter()

        def recurse(n, x):  # its own cell holds it
            return stats(x) if n == 0 else recurse(n - 1, x)

        return recurse

    recurse = make()
    assert len(closure_objects(recurse)) == 1
    assert len(closure_objects(recurse)) == 1
    recurse_ref = weakref.ref(recurse)
    keys = {id(module), id(recurse)}
    del module, recurse
    gc.collect()
    assert module_ref() is None and recurse_ref() is None
    assert not keys & set(_closure._snapshots)


def test_cached_answer_sees_a_new_code_object_an_empty_cell_filled_and_a_new_call_method():
    def plain(x):
        return x

    def lifting(x):
        GLOBAL_STATS(x)
        return x

    assert closure_objects(plain) == []
    plain.__code__ = lifting.__code__  # now reads the global module
    assert [obj for _, obj in closure_objects(plain)] == [GLOBAL_STATS]

    def later(x):
        return filled(x)  # noqa: F821 - bound below, after the first search

    assert closure_objects(later) == []  # the cell is still empty
    filled = Counter()
    assert [obj for _, obj in closure_objects(later)] == [filled]

    class Step(nnx.Module):
        def __call__(self, x):
            return x

    step = Step()
    assert [obj for _, obj in closure_objects(step)] == [step]
    other = Counter()

    def call_with_other(self, x):
        other(x)
        return x

    Step.__call__ = call_with_other  # the class's method replaced: searched again
    assert [obj for _, obj in closure_objects(step)] == [step, other]
