"""Thread safety: concurrent calls of one transform give the sequential results.

The shared state is the flatten cache (``treemode._tree._flatten._cache``), the
compiled-entry cache of each wrapper, the thread-local ``Call`` that
``PureFunction.bind`` sets, and the recursion-limit headroom.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import treemode

THREADS = 4
CALLS = 6


class Model(nnx.Module):
    def __init__(self, seed: int):
        self.w = nnx.Param(jnp.full((3,), float(seed)))
        self.steps = nnx.BatchStat(jnp.array(0))
        self.rngs = nnx.Rngs(seed)


class Shared(nnx.Module):
    """Read by every thread, written by none."""

    def __init__(self):
        self.scale = nnx.Param(jnp.array([1.0, 2.0, 3.0]))


def step(m: Model, shared: Shared, x: jax.Array) -> jax.Array:
    m.steps[...] += 1
    m.w[...] = m.w[...] * 0.5 + x * shared.scale[...]
    return jnp.sum(m.w[...]) + jax.random.uniform(m.rngs(), ())


def step_unbatched(m: Model, shared: Shared, x: jax.Array) -> jax.Array:
    """Like ``step``, but the writes do not depend on ``x`` (for vmap)."""
    m.steps[...] += 1
    m.w[...] = m.w[...] * 0.5 + shared.scale[...]
    return jnp.sum(m.w[...] * x)


def _state(m: Model) -> list[np.ndarray]:
    leaves = jax.tree_util.tree_leaves(m, is_leaf=lambda v: isinstance(v, nnx.Variable))
    out = []
    for v in leaves:
        value = v.get_raw_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out.append(np.asarray(value))
    return out


def _run_concurrently(work: Callable[[int], Any]) -> list[Any]:
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _sequential(f: Callable[..., Any], shared: Shared) -> tuple[list[Any], list[Model]]:
    models = [Model(i) for i in range(THREADS)]
    outs = []
    for i, m in enumerate(models):
        outs.append([f(m, shared, jnp.full((3,), float(k + i))) for k in range(CALLS)])
    return outs, models


def _assert_same(sequential, concurrent) -> None:
    (seq_outs, seq_models), (con_outs, con_models) = sequential, concurrent
    for a, b in zip(seq_outs, con_outs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(seq_models, con_models, strict=True):
        for x, y in zip(_state(a), _state(b), strict=True):
            np.testing.assert_array_equal(x, y)


def _concurrent(f: Callable[..., Any], shared: Shared) -> tuple[list[Any], list[Model]]:
    models = [Model(i) for i in range(THREADS)]

    def work(i: int) -> list[Any]:
        return [f(models[i], shared, jnp.full((3,), float(k + i))) for k in range(CALLS)]

    return _run_concurrently(work), models


def test_one_jit_function_from_several_threads():
    shared = Shared()
    f = treemode.jit(step)
    expected = _sequential(treemode.jit(step), shared)
    _assert_same(expected, _concurrent(f, shared))  # first calls trace concurrently
    _assert_same(expected, _concurrent(f, shared))  # then the compiled entry is shared


def test_graph_mode_jit_from_several_threads():
    shared = Shared()
    f = treemode.jit(step, graph=True)
    _assert_same(_sequential(treemode.jit(step), shared), _concurrent(f, shared))


def test_other_transforms_from_several_threads():
    shared = Shared()
    for make in [
        lambda: treemode.vmap(step_unbatched, in_axes=(None, None, 0)),
        lambda: treemode.grad(lambda m, s, x: step(m, s, x)),
        lambda: treemode.remat(step),
    ]:
        f = make()

        def call(m, s, x, f=f):
            x2 = jnp.stack([x, x]) if isinstance(f, treemode._transforms._vmap.VmapWrapped) else x
            return jax.tree_util.tree_map(np.asarray, f(m, s, x2))

        expected = _sequential(call, shared)
        got = _concurrent(call, shared)
        for a, b in zip(expected[1], got[1], strict=True):
            for want, have in zip(_state(a), _state(b), strict=True):
                np.testing.assert_array_equal(have, want)


def test_structure_change_of_a_shared_module_between_concurrent_calls():
    """Every thread finds the same stale flatten-cache entry and replaces it."""
    shared = Shared()
    f = treemode.jit(step)
    models = [Model(i) for i in range(THREADS)]
    for round_ in range(5):
        setattr(shared, f"extra{round_}", nnx.BatchStat(jnp.zeros(())))  # invalidates the cache

        def work(i: int, round_: int = round_) -> Any:
            return f(models[i], shared, jnp.full((3,), float(round_)))

        _run_concurrently(work)
    assert all(int(m.steps[...]) == 5 for m in models)


def test_concurrent_failures_do_not_leak_into_other_threads():
    """A thread whose call raises leaves the other threads' calls intact."""
    shared = Shared()

    def maybe_fail(m, s, x):
        out = step(m, s, x)
        if m.w.shape != (3,):
            raise AssertionError
        return out

    f = treemode.jit(maybe_fail)
    models = [Model(i) for i in range(THREADS)]
    bad = Model(99)
    bad.w = nnx.Param(jnp.ones((4,)))  # a shape error inside the trace for this one

    def work(i: int) -> Any:
        if i == 0:
            try:
                f(bad, shared, jnp.ones(3))
            except TypeError:
                return "failed"
            return "ran"
        return [f(models[i], shared, jnp.ones(3)) for _ in range(3)]

    results = _run_concurrently(work)
    assert results[0] == "failed"
    assert all(int(m.steps[...]) == 3 for m in models[1:])
    np.testing.assert_array_equal(bad.w[...], jnp.ones(4))


# -- tracing never writes the caller's objects (closure lifting) ----------------------


class Tally(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.array(0))
        self.w = nnx.Param(jnp.ones(3))


def test_tracing_a_closure_leaves_the_module_alone_for_other_threads():
    """While one thread traces functions that close over ``tally`` (each a new
    trace), another increments the module eagerly: it never sees a tracer and
    none of its increments is lost."""
    tally = Tally()
    seen: list[Any] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    done = [0]

    def writer() -> None:
        try:
            while not stop.is_set():
                value = tally.count[...]
                if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
                    seen.append(value)
                tally.count[...] = value + 1
                done[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for i in range(40):
            scale = float(i)  # a new default each time: a new function, a new trace
            out = treemode.jit(lambda x, s=scale: tally.w[...] * s + x)(jnp.zeros(3))
            np.testing.assert_allclose(out, np.full(3, scale))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert not seen, f"the writer thread saw {seen[:3]}"
    assert done[0] > 0 and int(tally.count[...]) == done[0]
    assert isinstance(tally.w[...], jax.Array)
    assert not isinstance(tally.w[...], jax.core.Tracer)


def test_read_only_closures_traced_from_several_threads_leave_no_tracer():
    tally = Tally()

    def trace_many(seed: int) -> None:
        for i in range(CALLS):
            f = treemode.jit(lambda x, k=float(seed * 100 + i): tally.w[...] * k + x)
            np.testing.assert_allclose(f(jnp.zeros(3)), np.full(3, seed * 100 + i))

    _run_concurrently(trace_many)  # raises the first error a thread hit
    for value in (tally.w[...], tally.count[...]):
        assert isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)


def test_a_closure_write_is_written_back_and_the_module_never_holds_a_tracer():
    """The function sees rebuilt objects while it is traced: during the trace the
    caller's Variable still holds its concrete value."""
    tally = Tally()
    caller_tally = weakref.ref(tally)  # not searched: the caller's object itself
    during: list[Any] = []

    @treemode.jit
    def step(x):
        assert caller_tally() is not tally  # the function sees a rebuilt module
        during.append(type(_raw(caller_tally().count)))
        tally.count[...] += 1
        return x + tally.w[...]

    step(jnp.zeros(3))
    step(jnp.zeros(3))
    assert int(tally.count[...]) == 2
    assert during and all(not issubclass(t, jax.core.Tracer) for t in during)


def _raw(variable: Any) -> Any:
    # What another thread would read from the caller's Variable at this moment.
    return object.__getattribute__(variable, "_raw_value")
