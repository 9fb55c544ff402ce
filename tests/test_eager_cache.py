"""Eager (un-jitted) transforms trace the user function once per call structure.

`jax.lax.scan`, `while_loop`, `fori_loop`, `cond` and `switch` cache their
traces on the identity of the function handed to them; treemode hands them the
same callables for every call with the same structure, so a repeated eager call
neither traces nor compiles again. `jax.vmap` and `jax.grad` run the function on
every eager call (plain JAX too): treemode adds no trace of its own there.

A Python counter inside the user function counts its traces.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Counter:
    """Counts how often a function runs (i.e. is traced, for the loop transforms)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


class Acc(nnx.Module):
    def __init__(self, scale: float = 1.0):
        self.scale = nnx.Param(jnp.array([scale, 2 * scale]))
        self.total = nnx.BatchStat(jnp.zeros(2))
        self.steps = nnx.BatchStat(jnp.array(0))


def _stack(n: int, seed: int = 0) -> nnx.Linear:
    @treemode.vmap
    def create(rngs):
        return nnx.Linear(3, 3, rngs=rngs)

    return create(treemode.split_rngs(nnx.Rngs(seed), splits=n))


# -- scan ------------------------------------------------------------------------------


def test_scan_traces_once_for_new_values_of_the_same_structure():
    traces = Counter()

    def body(h, layer):
        traces()
        return jnp.tanh(layer(h))

    forward = treemode.scan(body, in_axes=(treemode.Carry, 0), out_axes=treemode.Carry)
    stack = _stack(4)
    for k in range(3):
        h = jnp.full((2, 3), float(k))
        stack.kernel[...] = stack.kernel[...] * 0.5  # new values between calls
        got = forward(h, stack)
        want = jax.lax.scan(
            lambda c, p: (jnp.tanh(c @ p[0] + p[1]), None),
            h,
            (stack.kernel[...], stack.bias[...]),
        )[0]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert traces.n == 1


def test_scan_broadcast_and_state_variables_take_each_calls_values():
    """Read-only broadcast Variables are loop constants: never baked into the trace."""
    traces = Counter()

    def body(acc, x):
        traces()
        acc.total[...] += x * acc.scale[...]
        acc.steps[...] += 1
        return acc, acc.total[...].sum()

    scanned = treemode.scan(body)
    acc = Acc()
    xs = jnp.arange(3.0)[:, None] * jnp.ones((3, 2))
    _, ys1 = scanned(acc, xs)
    acc.scale[...] = jnp.array([10.0, 20.0])
    _, ys2 = scanned(acc, xs)
    assert traces.n == 2  # one abstract probe (which Variables change) + one trace
    np.testing.assert_allclose(ys1, [0.0, 3.0, 9.0])
    np.testing.assert_allclose(ys2, [9.0, 39.0, 99.0])
    np.testing.assert_allclose(acc.total[...], [33.0, 66.0])
    assert int(acc.steps[...]) == 6


def test_scan_short_form_traces_once():
    traces = Counter()

    def cumsum(c, x):
        traces()
        return c + x, c + x

    for k in range(3):
        total, ys = treemode.scan(cumsum, jnp.array(float(k)), jnp.arange(4.0))
        assert float(total) == k + 6.0
        np.testing.assert_allclose(ys, k + np.cumsum(np.arange(4.0)))
    assert traces.n == 1


def test_scan_structure_change_retraces():
    traces = Counter()

    def body(acc, x):
        traces()
        acc.total[...] += x
        return acc, x

    scanned = treemode.scan(body)
    acc = Acc()
    scanned(acc, jnp.ones((2, 2)))
    scanned(acc, jnp.ones((2, 2)))
    first = traces.n
    acc.extra = nnx.BatchStat(jnp.zeros(()))  # a new attribute
    scanned(acc, jnp.ones((2, 2)))
    assert traces.n > first
    second = traces.n
    acc.total = nnx.Param(acc.total[...])  # another Variable type
    scanned(acc, jnp.ones((2, 2)))
    assert traces.n > second
    third = traces.n
    scanned(acc, jnp.ones((5, 2)))  # another shape
    assert traces.n > third
    np.testing.assert_allclose(acc.total[...], [13.0, 13.0])  # 4 calls of 2 steps, one of 5


# -- while_loop / fori_loop -------------------------------------------------------------


def test_while_loop_traces_once_and_reads_each_calls_closure():
    body_traces, cond_traces = Counter(), Counter()
    limit = Acc(scale=100.0)  # read by cond_fun through its closure

    def cond(val):
        cond_traces()
        return val[1] < limit.scale[...][0]

    def body(val):
        body_traces()
        acc, x = val
        acc.steps[...] += 1
        return acc, x * 2

    acc = Acc()
    _, x = treemode.while_loop(cond, body, (acc, jnp.array(1.0)))
    assert float(x) == 128.0 and int(acc.steps[...]) == 7
    limit.scale[...] = jnp.array([10.0, 0.0])
    _, x = treemode.while_loop(cond, body, (acc, jnp.array(3.0)))
    assert float(x) == 12.0 and int(acc.steps[...]) == 9
    assert cond_traces.n == 1
    assert body_traces.n == 2  # one abstract probe + one trace


@pytest.mark.parametrize("traced_bounds", [False, True])
def test_fori_loop_traces_once(traced_bounds: bool):
    traces = Counter()

    def body(i, acc):
        traces()
        acc.total[...] += i * acc.scale[...]
        return acc

    acc = Acc()
    for k, scale in enumerate([1.0, 3.0]):
        acc.scale[...] = jnp.array([scale, scale])
        lower, upper = (jnp.array(0), jnp.array(4)) if traced_bounds else (0, 4)
        assert treemode.fori_loop(lower, upper, body, acc) is acc
        assert float(acc.total[...][0]) == 6.0 * (1.0 + 3.0 * k)
    assert traces.n == 2  # one abstract probe + one trace


def test_fori_loop_new_bounds_reuse_the_trace():
    traces = Counter()

    def body(i, x):
        traces()
        return x + i

    assert float(treemode.fori_loop(0, 3, body, jnp.array(0.0))) == 3.0
    assert float(treemode.fori_loop(0, 5, body, jnp.array(0.0))) == 10.0
    assert traces.n == 1


# -- cond / switch --------------------------------------------------------------------------


def test_cond_traces_each_branch_once():
    true_traces, false_traces = Counter(), Counter()

    def bump(acc, x):
        true_traces()
        acc.steps[...] += 1
        return x * acc.scale[...]

    def keep(acc, x):
        false_traces()
        return x

    acc = Acc()
    for k in range(4):
        acc.scale[...] = jnp.array([float(k), 1.0])
        y = treemode.cond(jnp.array(k % 2 == 0), bump, keep, acc, jnp.ones(2))
        want = [float(k), 1.0] if k % 2 == 0 else [1.0, 1.0]
        np.testing.assert_allclose(y, want)
    assert int(acc.steps[...]) == 2
    assert true_traces.n == 2 and false_traces.n == 2  # one probe + one trace each


def test_switch_traces_each_branch_once():
    traces = [Counter() for _ in range(3)]
    acc = Acc()

    def branch(k: int):
        def f(x):
            traces[k]()
            acc.total[...] += k  # a closure Variable
            return x + k

        return f

    branches = [branch(k) for k in range(3)]
    for i in [0, 2, 1, 2]:
        assert float(treemode.switch(jnp.array(i), branches, jnp.array(1.0))) == 1.0 + i
    np.testing.assert_allclose(acc.total[...], [5.0, 5.0])
    assert [t.n for t in traces] == [2, 2, 2]


# -- vmap / grad: no trace cache in JAX, none added by treemode ---------------------------------


def test_vmap_runs_the_function_once_per_call_like_jax_vmap():
    traces = Counter()

    def f(acc, x):
        traces()
        acc.steps[...] += 1
        return x * acc.scale[...]

    acc = Acc()
    for k in range(3):
        y = treemode.vmap(f, in_axes=(None, 0))(acc, jnp.full((4, 2), float(k)))
        np.testing.assert_allclose(y, k * np.array([[1.0, 2.0]] * 4))
    assert traces.n == 3
    assert int(acc.steps[...]) == 3


def test_grad_runs_the_function_once_per_call_like_jax_grad():
    traces = Counter()

    def loss(acc, x):
        traces()
        acc.steps[...] += 1
        return jnp.sum(acc.scale[...] * x)

    acc = Acc()
    for k in range(3):
        g = treemode.grad(loss)(acc, jnp.full((2,), float(k)))
        np.testing.assert_allclose(g.scale[...], [k, k])
    assert traces.n == 3
    assert int(acc.steps[...]) == 3


# -- hygiene ----------------------------------------------------------------------------------


def _every_transform(acc: Acc, x: jax.Array) -> list[Any]:
    """One call of each cached transform (module-level functions: cached across calls)."""
    return [
        _scan(acc, jnp.stack([x, x]))[1],
        treemode.while_loop(_small, _double, (acc, x))[1],
        treemode.fori_loop(0, 2, _add_index, acc).total[...],
        treemode.cond(x[0] > 0, _bump, _keep, acc, x),
        treemode.switch(jnp.array(1), [_keep, _bump], acc, x),
    ]


def _scan_body(acc, x):
    acc.total[...] += x
    return acc, x * acc.scale[...]


_scan = treemode.scan(_scan_body)


def _small(val):
    return jnp.sum(val[1]) < 10.0


def _double(val):
    val[0].steps[...] += 1
    return val[0], val[1] * 2


def _add_index(i, acc):
    acc.total[...] += i
    return acc


def _bump(acc, x):
    acc.steps[...] += 1
    return x * acc.scale[...]


def _keep(acc, x):
    return x


def test_no_tracer_leaks_eagerly_and_under_jit(tracer_leaks):
    acc = Acc()
    first = _every_transform(acc, jnp.ones(2))
    again = _every_transform(acc, jnp.ones(2))  # cache hits
    assert len(first) == len(again)

    @treemode.jit
    def inside(acc, x):
        return _every_transform(acc, x)

    inside(acc, jnp.ones(2))
    steps = int(acc.steps[...])
    inside(acc, jnp.ones(2))
    assert int(acc.steps[...]) == steps + 5  # 3 doublings + cond + switch


def test_cached_entries_are_right_inside_jax_jit():
    """The eager entries are reused with tracers as inputs; values stay the call's own."""
    acc = Acc()
    eager = _every_transform(acc, jnp.full(2, 2.0))

    @jax.jit
    def traced(x):
        local = Acc()
        return _every_transform(local, x), local.steps[...]

    out, steps = traced(jnp.full(2, 2.0))
    for a, b in zip(out, eager, strict=True):
        np.testing.assert_allclose(a, b)
    assert int(steps) == int(acc.steps[...])
    again = _every_transform(Acc(), jnp.full(2, 2.0))  # eager again after the traced use
    for a, b in zip(again, eager, strict=True):
        np.testing.assert_allclose(a, b)


def test_cache_does_not_keep_arguments_alive():
    def body(acc, x):
        acc.total[...] += x
        return acc, x

    scanned = treemode.scan(body)
    acc = Acc()
    scanned(acc, jnp.ones((2, 2)))
    treemode.fori_loop(0, 2, _add_index, acc)
    treemode.cond(jnp.array(True), _bump, _keep, acc, jnp.ones(2))
    treemode.vmap(_keep, in_axes=(None, 0))(acc, jnp.ones((3, 2)))
    ref = weakref.ref(acc)
    del acc
    gc.collect()
    assert ref() is None


class _Stepper(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.array(0))

    def step(self, i, x):
        self.count[...] += 1
        return x + i


def _use_and_forget() -> list[weakref.ref[Any]]:
    """Cached calls of a bound method and of a closure; weak references to both."""
    stepper = _Stepper()
    assert float(treemode.fori_loop(0, 3, stepper.step, jnp.array(0.0))) == 3.0
    assert float(treemode.fori_loop(0, 3, stepper.step, jnp.array(0.0))) == 3.0
    assert int(stepper.count[...]) == 6

    def body(c, x):
        return c + x * stepper.count[...], None

    treemode.scan(body, jnp.array(0.0), jnp.ones(3))
    return [weakref.ref(stepper), weakref.ref(body)]


def test_cache_does_not_keep_the_function_or_its_module_alive():
    refs = _use_and_forget()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_bound_methods_of_two_instances_do_not_share_a_trace():
    class Scaled(nnx.Module):
        def __init__(self, factor: float):
            self.factor = factor  # static: not part of the call structure

        def step(self, i, x):
            return x * self.factor

    a, b = Scaled(2.0), Scaled(3.0)
    assert float(treemode.fori_loop(0, 2, a.step, jnp.array(1.0))) == 4.0
    assert float(treemode.fori_loop(0, 2, b.step, jnp.array(1.0))) == 9.0


def test_concurrent_eager_calls_match_sequential_ones():
    threads, calls = 4, 5
    traces = Counter()
    lock = threading.Lock()

    def body(acc, x):
        with lock:
            traces()
        acc.total[...] += x * acc.scale[...]
        acc.steps[...] += 1
        return acc, acc.total[...].sum()

    scanned = treemode.scan(body)

    def run(i: int, acc: Acc) -> list[np.ndarray]:
        return [np.asarray(scanned(acc, jnp.full((3, 2), float(i + k)))[1]) for k in range(calls)]

    expected_accs = [Acc(scale=float(i)) for i in range(threads)]
    expected = [run(i, expected_accs[i]) for i in range(threads)]
    accs = [Acc(scale=float(i)) for i in range(threads)]
    results: list[Any] = [None] * threads
    barrier = threading.Barrier(threads)

    def target(i: int) -> None:
        barrier.wait()
        results[i] = run(i, accs[i])

    workers = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for want, got in zip(expected, results, strict=True):
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
    for want, got in zip(expected_accs, accs, strict=True):
        np.testing.assert_array_equal(want.total[...], got.total[...])
        assert int(got.steps[...]) == 3 * calls
