"""The calls real loops make: donation by effect, several models through one
wrapper, wrappers made inline (docs/guides/jit.md, "Donation")."""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Decoder(nnx.Module):
    """A decode step's state: weights read every token, caches written every token."""

    def __init__(self, layers: int, width: int = 4):
        self.w = nnx.List([nnx.Param(jnp.full((width,), float(i + 1))) for i in range(layers)])
        self.cache = nnx.List([nnx.Cache(jnp.zeros((width,))) for _ in range(layers)])


def decode(m: Decoder, token: jax.Array) -> jax.Array:
    h = token
    for w, c in zip(m.w, m.cache, strict=True):
        c[...] = c[...] + h * w[...]
        h = jnp.tanh(c[...])
    return h.sum()


def decode_flat(weights, caches, token):
    new = []
    h = token
    for w, c in zip(weights, caches, strict=True):
        c = c + h * w
        new.append(c)
        h = jnp.tanh(c)
    return h.sum(), tuple(new)


def _buffers(vs):
    return [v.get_raw_value() for v in vs]


def test_a_donated_model_keeps_its_read_only_buffers(implementation):
    """Read-only Variables of a donated argument keep their buffers, valid after the
    call; written ones get new buffers and their old ones are deleted (jax.jit's rule)."""
    model = Decoder(3)
    step = treemode.jit(decode, donate_argnums=0)
    for _ in range(3):  # the cold call, the memo's, the fast path's
        weights, caches = _buffers(model.w), _buffers(model.cache)
        step(model, jnp.ones(4))
        assert [v.get_raw_value() for v in model.w] == weights
        assert all(not w.is_deleted() for w in weights)
        assert all(c.is_deleted() for c in caches)
        assert all(not v.get_raw_value().is_deleted() for v in model.cache)
    expected = Decoder(3)
    for _ in range(3):
        decode(expected, jnp.ones(4))
    for got, want in zip(model.cache, expected.cache, strict=True):
        np.testing.assert_allclose(got[...], want[...], rtol=1e-6)


def test_the_donated_decode_program_has_the_hand_written_outputs():
    """The compiled program returns the written Variables only: as many outputs, and
    as many donated (aliased) inputs, as the hand-written program over flat tuples."""
    model = Decoder(5)
    token = jnp.ones(4)
    ours = treemode.jit(decode, donate_argnums=0).lower(model, token).compile()
    weights = tuple(_buffers(model.w))
    caches = tuple(_buffers(model.cache))
    floor = jax.jit(decode_flat, donate_argnums=1).lower(weights, caches, token).compile()
    assert len(jax.tree_util.tree_leaves(ours.out_info)) == 1 + 5
    assert len(jax.tree_util.tree_leaves(ours.out_info)) == len(
        jax.tree_util.tree_leaves(floor.out_info)
    )
    ours_memory, floor_memory = ours.memory_analysis(), floor.memory_analysis()
    assert ours_memory is not None and floor_memory is not None
    assert ours_memory.alias_size_in_bytes == floor_memory.alias_size_in_bytes
    assert ours_memory.output_size_in_bytes == floor_memory.output_size_in_bytes


def test_a_trace_that_writes_another_set_gets_its_own_donation(implementation):
    """What is donated follows each signature's trace: a trace for new shapes that
    writes other Variables donates those, and the first set is still right."""
    traces = [0]

    class M(nnx.Module):
        def __init__(self, n: int):
            self.a = nnx.Variable(jnp.zeros(n))
            self.b = nnx.Variable(jnp.zeros(n))

    def f(m, x):
        traces[0] += 1
        if x.shape[0] == 2:
            m.a[...] += x
        else:
            m.b[...] += x
        return x.sum()

    step = treemode.jit(f, donate_argnums=0)
    small, large = M(2), M(3)
    for _ in range(2):
        for m, n in ((small, 2), (large, 3)):
            a, b = m.a.get_raw_value(), m.b.get_raw_value()
            step(m, jnp.ones(n))
            assert a.is_deleted() == (n == 2) and b.is_deleted() == (n == 3)
            assert (m.a.get_raw_value() is a) == (n == 3)
            assert (m.b.get_raw_value() is b) == (n == 2)
    assert traces[0] == 2  # once per signature: the donated executables reuse JAX's traces
    np.testing.assert_allclose(small.a[...], [2.0, 2.0])
    np.testing.assert_allclose(large.b[...], [2.0, 2.0, 2.0])
    np.testing.assert_allclose(small.b[...], [0.0, 0.0])


def test_a_donated_function_is_traced_once_per_signature(implementation):
    traces = [0]

    def f(m, x):
        traces[0] += 1
        return decode(m, x)

    step = treemode.jit(f, donate_argnums=0)
    model = Decoder(2)
    for _ in range(4):
        step(model, jnp.ones(4))
    assert traces[0] == 1
    assert step._cache_size() == 1


def test_a_donated_function_writing_nothing_donates_nothing(implementation):
    model = Decoder(2)
    step = treemode.jit(lambda m, x: m.w[0][...].sum() * x, donate_argnums=0)
    before = _buffers(model.w) + _buffers(model.cache)
    step(model, 2.0)
    step(model, 2.0)
    assert _buffers(model.w) + _buffers(model.cache) == before
    assert not any(b.is_deleted() for b in before)


def test_donated_plain_arrays_are_donated_as_jax_jit_does():
    """A donated argument's arrays that are not Variable values are donated whether
    or not they are returned, as jax.jit donates every array of a donated argument."""
    x = jnp.ones(3)
    y = treemode.jit(lambda a: a * 2, donate_argnums=0)(x)
    np.testing.assert_allclose(y, 2.0)
    assert x.is_deleted()


def test_two_models_through_one_wrapper_stay_on_the_fast_path(implementation):
    """One wrapper called on two models in turn (a model and its EMA copy, a teacher
    and a student): each set of objects keeps its record in the executor's table,
    so no call after the first of each goes back to the pipeline."""

    def f(m, x):
        return decode(m, x)

    models = [Decoder(2), Decoder(2)]
    step = treemode.jit(f, donate_argnums=0)
    for m in models:
        step(m, jnp.ones(4))
        step(m, jnp.ones(4))
    assert len(step._records) == 2
    misses: list[object] = []
    real: Any = step._miss
    wrapper: Any = step
    wrapper._miss = lambda w, e, a, k: misses.append(e) or real(w, e, a, k)
    for _ in range(5):
        for m in models:
            step(m, jnp.ones(4))
    assert misses == []  # every call ran by its own record
    expected = Decoder(2)
    for _ in range(7):
        decode(expected, jnp.ones(4))
    for m in models:
        np.testing.assert_allclose(m.cache[1][...], expected.cache[1][...], rtol=1e-6)


def test_the_executors_table_is_bounded(implementation):
    step = treemode.jit(lambda m, x: decode(m, x))
    models = [Decoder(1) for _ in range(12)]
    for m in models:
        step(m, jnp.ones(4))
    assert len(step._records) == 8
    misses: list[object] = []
    real: Any = step._miss
    wrapper: Any = step
    wrapper._miss = lambda w, e, a, k: misses.append(e) or real(w, e, a, k)
    step(models[-1], jnp.ones(4))  # the most recent: in the table
    assert misses == []
    step(models[0], jnp.ones(4))  # the oldest: dropped
    assert misses == [None]


@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
def test_two_write_sets_in_turn_stay_on_the_fast_path(implementation, donate):
    """A function whose write set depends on the input's shape, called with the two
    shapes in turn: each signature keeps its executable and its record (which
    checks the arrays that tell the signatures apart), so after the first call of
    each no call goes back to the pipeline or traces again."""
    traces = [0]

    class M(nnx.Module):
        def __init__(self):
            self.a = nnx.BatchStat(jnp.zeros(2))
            self.b = nnx.BatchStat(jnp.zeros(3))

    def f(m, x):
        traces[0] += 1
        if x.shape[0] == 2:
            m.a[...] += x
        else:
            m.b[...] += x
        return x.sum()

    step = treemode.jit(f, donate_argnums=0 if donate else None)
    model = M()
    xs = [jnp.ones(2), jnp.ones(3)]
    for x in xs * 2:
        step(model, x)
    misses: list[object] = []
    real: Any = step._miss
    wrapper: Any = step
    wrapper._miss = lambda w, e, a, k: misses.append(e) or real(w, e, a, k)
    for x in xs * 3:
        a, b = model.a.get_raw_value(), model.b.get_raw_value()
        step(model, x)
        if donate:  # the written Variable's buffer is donated, the other's kept
            assert a.is_deleted() == (x.shape[0] == 2) and b.is_deleted() == (x.shape[0] == 3)
    assert misses == [] and traces[0] == 2
    np.testing.assert_allclose(model.a[...], np.full(2, 5.0))
    np.testing.assert_allclose(model.b[...], np.full(3, 5.0))


def test_a_wrapper_made_inline_traces_and_compiles_once(implementation):
    """``treemode.jit(step)(model, x)`` written inside a loop: one trace and one
    compilation per function and options, as for ``jax.jit`` made inline."""

    def _inline_step(m, x):
        _inline_step.traces += 1  # type: ignore[attr-defined]
        return decode(m, x)

    _inline_step.traces = 0  # type: ignore[attr-defined]
    model = Decoder(2)
    for _ in range(5):
        treemode.jit(_inline_step, donate_argnums=0)(model, jnp.ones(4))
    assert _inline_step.traces == 1  # type: ignore[attr-defined]
    assert treemode.jit(_inline_step, donate_argnums=0)._cache_size() == 1
    # Other options are another wrapper: traced again.
    treemode.jit(_inline_step)(model, jnp.ones(4))
    assert _inline_step.traces == 2  # type: ignore[attr-defined]
    expected = Decoder(2)
    for _ in range(6):
        decode(expected, jnp.ones(4))
    np.testing.assert_allclose(model.cache[1][...], expected.cache[1][...], rtol=1e-6)


def test_the_shared_state_lives_as_long_as_the_function():
    def make():
        def f(m, x):
            return decode(m, x)

        return f

    f = make()
    model = Decoder(1)
    treemode.jit(f)(model, jnp.ones(4))
    treemode.jit(f)(model, jnp.ones(4))
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


def test_nothing_is_stored_on_the_function_and_it_still_pickles(implementation):
    """The shared state lives in treemode, not in ``f.__dict__``: cloudpickle (which
    serialises a function's ``__dict__``) still ships ``f`` after a call, as after
    ``jax.jit``."""
    cloudpickle = pytest.importorskip("cloudpickle")

    def f(m, x):
        return decode(m, x)

    treemode.jit(f, donate_argnums=0)(Decoder(1), jnp.ones(4))
    treemode.jit(f)(Decoder(1), jnp.ones(4))
    assert vars(f) == {}
    loaded = cloudpickle.loads(cloudpickle.dumps(f))
    np.testing.assert_allclose(loaded(Decoder(1), jnp.ones(4)), decode(Decoder(1), jnp.ones(4)))


def _closure_holding(array: jax.Array):
    def f(m, x):
        return decode(m, x) + array[0]

    return f


def test_dropped_closures_are_freed_with_the_collector_paused(implementation):
    """A closure wrapped and called once, then dropped, frees its executables and the
    constants it closed over by reference counting (no cycle), as ``jax.jit``'s do:
    what a server that pauses the collector (``gc.disable``, ``gc.freeze``) relies on."""
    model = Decoder(1)
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    refs = []
    gc.disable()
    try:
        for i in range(5):
            f = _closure_holding(jnp.full((256, 256), float(i)))
            refs.append(weakref.ref(f))
            treemode.jit(f, donate_argnums=0 if i % 2 else None)(model, jnp.ones(4))
            del f
        assert [r() for r in refs] == [None] * 5
        assert sum(a.nbytes for a in jax.live_arrays()) - before <= 0
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["partial", "instance"])
def test_an_inline_wrapper_of_another_callable_traces_once(implementation, kind):
    """The same ``functools.partial`` object or callable instance wrapped inline shares
    its traces, as ``jax.jit`` does: one trace per callable and options."""
    traces = [0]

    def f(m, x, scale):
        traces[0] += 1
        return decode(m, x) * scale

    class Step:
        def __call__(self, m, x):
            return f(m, x, 2.0)

    fn = functools.partial(f, scale=2.0) if kind == "partial" else Step()
    model = Decoder(1)
    for _ in range(5):
        treemode.jit(fn)(model, jnp.ones(4))
    assert traces[0] == 1


def test_a_function_wrapping_another_does_not_share_its_entries():
    """``functools.wraps`` copies the wrapped function's ``__dict__``: the copy of
    treemode's table must not make the wrapper run the wrapped function's program."""

    def f(m, x):
        return x + 1.0

    treemode.jit(f)(Decoder(1), jnp.ones(4))

    @functools.wraps(f)
    def g(m, x):
        return x + 2.0

    np.testing.assert_allclose(treemode.jit(g)(Decoder(1), jnp.ones(4)), 3.0)
    np.testing.assert_allclose(treemode.jit(f)(Decoder(1), jnp.ones(4)), 2.0)


def test_unhashable_options_are_not_shared():
    def f(x):
        return x * 2

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())]
    a = treemode.jit(f, in_shardings=shardings)
    b = treemode.jit(f, in_shardings=shardings)
    np.testing.assert_allclose(a(jnp.ones(2)), b(jnp.ones(2)))
    assert a._cache is not b._cache


@pytest.mark.parametrize("donate", [False, True])
def test_clear_caches_clears_shared_entries(donate):
    traces = [0]

    def f(m, x):
        traces[0] += 1
        return decode(m, x)

    donated = 0 if donate else None
    model = Decoder(1)
    treemode.jit(f, donate_argnums=donated)(model, jnp.ones(4))
    treemode.clear_caches()
    treemode.jit(f, donate_argnums=donated)(model, jnp.ones(4))
    assert traces[0] == 2


@pytest.mark.parametrize("donate", [False, True])
def test_a_retrace_on_the_fast_path_leaves_jax_dispatching_in_cpp(implementation, donate):
    """A value that changes type after the first call (weakly typed, then not) makes
    the next call trace again. When that trace started in JAX's C++ dispatch and was
    retried through the pipeline, JAX kept an entry that sent every later call of
    that signature through its Python path; treemode clears it, so later calls
    dispatch in C++ again, as for a function whose first trace did not fail."""
    from jax._src import pjit  # JAX's private dispatch: only counted here

    python_path = getattr(pjit, "_run_python_pjit", None)
    if python_path is None:
        pytest.skip("this JAX has no _run_python_pjit to count its Python dispatch by")
    calls: list[str] = []

    def counted(p: Any, args_flat: Any, fun: Any, *rest: Any) -> Any:
        calls.append(getattr(fun, "__name__", ""))
        return python_path(p, args_flat, fun, *rest)

    class Weak(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((3,), 0.5))  # weakly typed until written

    def weak_step(m, x):
        m.w[...] = m.w[...] * 0.5 + x
        return m.w[...].sum()

    model = Weak()
    assert jax.typeof(model.w.get_raw_value()).weak_type
    step = treemode.jit(weak_step, donate_argnums=0 if donate else None)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(pjit, "_run_python_pjit", counted)
    try:
        for _ in range(3):
            step(model, jnp.ones(3))  # the third call traces again: a strong type now
        calls.clear()
        for _ in range(5):
            step(model, jnp.ones(3))
    finally:
        monkey.undo()
    assert calls.count("weak_step") <= 1, calls
