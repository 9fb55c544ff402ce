"""The call-site memo (``treemode._pipeline._callsite``): a jitted function called again with
the same objects skips ``prepare``, and gives exactly what the full path gives.

Each test makes a first call (the full path, which records the memo), then a
second call that either reuses it or must not, and checks what users see:
values, which Variables changed, traces, errors and object lifetimes.
"""

from __future__ import annotations

import collections
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import IMPLEMENTATIONS, python_executor
from flax import nnx

import treemode
from treemode._pipeline import _callsite


class Counter(nnx.Module):
    def __init__(self, scale: float = 1.0):
        self.w = nnx.Param(jnp.ones(3) * scale)
        self.count = nnx.BatchStat(jnp.array(0))


def _step(m: Counter, x: jax.Array) -> jax.Array:
    m.count[...] += 1
    m.w[...] = m.w[...] + x
    return jnp.sum(m.w[...])


MATCHERS = ["record", "python"] if "compiled" in IMPLEMENTATIONS else ["python"]


@pytest.fixture(autouse=True, params=MATCHERS)
def matcher(request, monkeypatch):
    """How a repeated call runs: by the fast-path record, executed by the extension's
    executor (``FastCall``) or by its Python twin (`treemode._pipeline._executor`)."""
    if request.param != "record":
        with python_executor(monkeypatch):
            yield request.param
        return
    yield request.param


@pytest.fixture
def prepares(hooks):
    """The transforms of the calls that went through the full ``prepare`` (no memo)."""
    return hooks.calls("prepare")


def test_repeated_call_skips_prepare_and_writes_back(prepares):
    f = treemode.jit(_step)
    m = Counter()
    for i in range(3):
        out = f(m, jnp.full(3, 1.0))
        np.testing.assert_allclose(out, 3 * (2.0 + i))
    assert prepares == ["jit"]  # only the first call prepared
    assert m.count[...] == 3
    np.testing.assert_allclose(m.w[...], np.full(3, 4.0))


def test_keyword_arguments_and_jit_partial_use_the_memo(prepares):
    m = Counter()
    f = treemode.jit(_step)
    f(m, x=jnp.ones(3))
    f(m, x=jnp.ones(3))
    g = treemode.jit_partial(_step, m)
    g(jnp.ones(3))
    g(jnp.ones(3))
    assert prepares == ["jit", "jit"]
    assert m.count[...] == 4
    # other keyword names: the full path, with the right result
    with pytest.raises(TypeError, match="unexpected keyword"):
        f(m, y=jnp.ones(3))


def test_another_object_of_the_same_structure_is_written_not_the_first(prepares):
    f = treemode.jit(_step)
    a, b = Counter(), Counter(scale=10.0)
    f(a, jnp.ones(3))
    np.testing.assert_allclose(f(b, jnp.ones(3)), 33.0)
    assert (a.count[...], b.count[...]) == (1, 1)
    np.testing.assert_allclose(a.w[...], np.full(3, 2.0))
    assert prepares == ["jit", "jit"]


def test_an_array_of_another_type_where_an_array_was_uses_the_memo(prepares):
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    out = f(m, np.ones(3, np.float32))  # a NumPy array: still an array, still traced
    np.testing.assert_allclose(out, 9.0)
    # An array type the executor has not seen yet is a miss once (the pipeline
    # learns it), then the record runs it.
    f(m, np.ones(3, np.float32))
    assert len(prepares) <= 2 and m.count[...] == 3
    f(m, np.ones(3, np.float32))
    assert len(prepares) <= 2 and m.count[...] == 4


class Mixed(nnx.Module):
    """Variables in an OrderedDict (no compiled guard) and a bare array attribute."""

    def __init__(self):
        self.table = nnx.data(collections.OrderedDict(w=nnx.Param(jnp.ones(3))))
        self.offset = nnx.data(jnp.zeros(3))
        self.count = nnx.BatchStat(jnp.array(0))


def test_modules_the_executor_does_not_match_take_the_pipeline(prepares):
    """Variables in an OrderedDict, a bare array attribute: no record is made (the
    executor matches flattenings of Variable values only); every call is prepared,
    with the values eager code gives."""

    @treemode.jit
    def f(m, x):
        m.count[...] += 1
        m.table["w"][...] = m.table["w"][...] * x
        return m.table["w"][...] + m.offset

    m = Mixed()
    for _ in range(3):
        out = f(m, jnp.full(3, 2.0))
    np.testing.assert_allclose(out, np.full(3, 8.0))
    assert prepares == ["jit"] * 3 and m.count[...] == 3 and f._records == []
    m.offset = jnp.ones(3)  # a new array: the flattening is renewed, the new value used
    np.testing.assert_allclose(f(m, jnp.ones(3)), np.full(3, 9.0))
    m.table.move_to_end("w")  # same single key: nothing changed
    f(m, jnp.ones(3))
    assert m.count[...] == 5


def test_a_non_array_where_an_array_was_takes_the_full_path():
    f = treemode.jit(lambda m, x: m.w[...] * x)
    m = Counter()
    f(m, jnp.float32(2.0))
    np.testing.assert_allclose(f(m, 3.0), np.full(3, 3.0))  # static now, not traced


def test_structure_change_between_calls_is_seen(prepares):
    traces: list[int] = [0]  # not empty: an empty list is searched again every call

    @treemode.jit
    def f(m, x):
        traces.append(1)
        return sum(v[...].sum() for v in nnx.state(m, nnx.Param).values()) * x

    m, one = Counter(), jnp.float32(1.0)
    f(m, one)
    f(m, one)
    m.extra = nnx.Param(jnp.ones(2))
    np.testing.assert_allclose(f(m, one), 5.0)
    assert len(traces) == 3 and len(prepares) == 2


def test_replaced_variable_receives_the_update():
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    old = m.count
    m.count = nnx.BatchStat(jnp.array(10))
    f(m, jnp.ones(3))
    assert m.count[...] == 11 and old[...] == 1


def test_retrace_for_new_shapes_through_the_memo(prepares):
    traces: list[tuple[int, ...]] = []

    @treemode.jit
    def f(m, x):
        traces.append(x.shape)
        m.count[...] += 1
        return m.w[...].sum() * x

    m = Counter()
    f(m, jnp.ones(4))
    # A new trace, of the memo's call (where a record was emitted, the executor
    # misses: the trace needs the pipeline's binding, and the pipeline runs it).
    out = f(m, jnp.ones(2))
    np.testing.assert_allclose(out, np.full(2, 3.0))
    assert traces == [(4,), (2,)]
    assert m.count[...] == 2
    assert len(prepares) == 2  # the retrace prepared the full call once
    f(m, jnp.ones(2))  # the new shape's executable, without another trace
    assert traces == [(4,), (2,)] and m.count[...] == 3 and len(prepares) == 2


def test_closure_rebinding_is_seen():
    holder = {"m": Counter()}
    model = holder["m"]

    def make(target):
        def f(x):
            target.count[...] += 1
            return target.w[...].sum() * x

        return treemode.jit(f)

    f = make(model)
    f(1.0)
    f(1.0)
    assert model.count[...] == 2

    global _GLOBAL_MODEL
    _GLOBAL_MODEL = Counter()
    g = treemode.jit(_reads_global)
    first = _GLOBAL_MODEL
    g(1.0)
    _GLOBAL_MODEL = Counter(scale=2.0)
    np.testing.assert_allclose(g(1.0), 6.0)
    assert first.count[...] == 1 and _GLOBAL_MODEL.count[...] == 1


_GLOBAL_MODEL: Counter | None = None


def test_a_cleared_closure_cache_does_not_stale_the_memo():
    from treemode._tree import _closure

    global _GLOBAL_MODEL
    _GLOBAL_MODEL = first = Counter()
    g = treemode.jit(_reads_global)
    one = jnp.float32(1.0)
    g(one)
    g(one)
    _closure._snapshots.clear()  # the closure cache forgets the function
    np.testing.assert_allclose(g(one), 3.0)  # the memo's reads still hold: same answer
    _GLOBAL_MODEL = Counter(scale=2.0)
    np.testing.assert_allclose(g(one), 6.0)  # and a rebinding is still seen
    assert first.count[...] == 3 and _GLOBAL_MODEL.count[...] == 1


def _reads_global(x):
    assert _GLOBAL_MODEL is not None
    _GLOBAL_MODEL.count[...] += 1
    return _GLOBAL_MODEL.w[...].sum() * x


def test_memo_does_not_keep_the_model_alive():
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    f(m, jnp.ones(3))
    assert f._records
    ref = weakref.ref(m)
    kernel_ref = weakref.ref(m.w[...])  # the array: Variables are not weakly referenceable
    del m
    gc.collect()
    assert ref() is None and kernel_ref() is None
    n = Counter()
    f(n, jnp.ones(3))  # a dead record is simply not matched
    assert n.count[...] == 1


def test_shared_donated_buffer_is_named_on_the_memo_path():
    def f(a, b):
        a.w[...] += 1.0
        return a.w[...] + b.w[...]

    f = treemode.jit(f, donate_argnums=(0,))
    a, b = Counter(), Counter()
    f(a, b)
    f(a, b)
    b.w[...] = a.w[...]  # the same buffer, same structure: the memo matches
    before = a.w[...]
    with pytest.raises(treemode.DonationError, match=r"args\[0\]\.w.*args\[1\]\.w"):
        f(a, b)
    assert a.w[...] is before and not before.is_deleted()


def test_write_back_failure_on_the_memo_path_leaves_inputs(hooks, monkeypatch):
    # The pipeline's memo path (the executor's write: tests/test_faults.py).
    monkeypatch.setattr(_callsite, "fast_record", lambda *args: None)
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    w, count = m.w[...], m.count[...]

    def failing(var, value, metadata=None):
        raise RuntimeError("injected")

    hooks.store(failing)
    with pytest.raises(RuntimeError, match="injected"):
        f(m, jnp.ones(3))
    assert m.w[...] is w and m.count[...] is count


def test_threads_write_only_into_their_own_models():
    f = treemode.jit(_step)
    models = [Counter() for _ in range(4)]
    f(models[0], jnp.ones(3))
    models[0].count[...] = 0
    errors: list[BaseException] = []

    def work(m: Counter) -> None:
        try:
            for _ in range(25):
                f(m, jnp.ones(3))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [int(m.count[...]) for m in models] == [25] * 4


def test_traces_of_one_structure_that_update_different_variables():
    # Whether a call writes is fixed per trace: a trace without updates must not
    # hide the updates of another trace of the same compiled structure.
    @treemode.jit
    def f(m, x):
        if x.shape[0] == 2:
            m.count[...] += 1
        return x

    m = Counter()
    f(m, jnp.ones(4))
    f(m, jnp.ones(4))
    assert m.count[...] == 0
    f(m, jnp.ones(2))
    assert m.count[...] == 1
    f(m, jnp.ones(4))
    f(m, jnp.ones(2))
    assert m.count[...] == 2


def test_a_trace_without_updates_returns_no_update_tuple():
    # The compiled entry of a forward pass returns (out, None): one output tree
    # node less per call, and no write-back to decide.
    forward = treemode.jit(lambda m, x: m.w[...] * x)
    m = Counter()
    forward(m, jnp.ones(3))
    call = forward._prepare((m, jnp.ones(3)), {}, abstract=False)
    entry = forward._entry(call)
    assert entry.jitted(*entry.args(call.dynamic))[1] is None
    step = treemode.jit(_step)
    step(m, jnp.ones(3))
    call = step._prepare((m, jnp.ones(3)), {}, abstract=False)
    entry = step._entry(call)
    updates = entry.jitted(*entry.args(call.dynamic))[1]
    assert isinstance(updates, tuple) and len(updates) == 2  # one per Variable of m


def test_many_variables_through_the_memo(matcher):
    # More arrays than the compiled match gathers on the C stack (32), and
    # more than its first heap buffer holds (64).
    class Many(nnx.Module):
        def __init__(self, n: int):
            self.ws = nnx.List([nnx.Param(jnp.full((2,), float(i))) for i in range(n)])
            self.count = nnx.BatchStat(jnp.array(0))

    @treemode.jit
    def f(m, x):
        m.count[...] += 1
        for w in m.ws:
            w[...] = w[...] + x
        return sum(w[...] for w in m.ws)

    m = Many(70)
    for i in range(3):
        out = f(m, jnp.ones(2))
        total = sum(range(70)) + 70 * (i + 1)
        np.testing.assert_allclose(out, np.full(2, float(total)))
    assert int(m.count[...]) == 3
    np.testing.assert_allclose(m.ws[69][...], np.full(2, 72.0))


def _no_miss(wrapper, error, args, kwargs):
    raise AssertionError(f"missed: {error!r}")


def test_the_record_is_executed(matcher):
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    assert f._records
    f._miss = _no_miss  # the executor runs it: the pipeline (the miss) does not
    f(m, jnp.ones(3))
    assert m.count[...] == 2
    np.testing.assert_allclose(m.w[...], np.full(3, 3.0))


def test_donated_calls_take_the_compiled_path_and_get_fresh_buffers(matcher):
    f = treemode.jit(_step, donate_argnums=0)
    m = Counter()
    f(m, jnp.ones(3))
    f(m, jnp.ones(3))
    assert f._records
    f._miss = _no_miss
    for i in range(3):
        before = m.w[...]
        out = f(m, jnp.ones(3))
        assert before.is_deleted()  # donated to XLA
        assert not m.w[...].is_deleted()
        np.testing.assert_allclose(out, 3 * (2.0 + 2 + i))
    assert m.count[...] == 5


def test_harmless_shared_objects_in_donated_arguments_are_allowed(matcher, hooks):
    # Two Variables holding the same Python int: a number is copied to the
    # device, so nothing is donated twice. A Variable holding a Python number is
    # not matched by the executor: those calls take the pipeline and its check.
    checks = hooks.calls("donation_check")

    class Ints(nnx.Module):
        def __init__(self):
            self.a = nnx.Variable(0)
            self.b = nnx.Variable(0)
            self.w = nnx.Param(jnp.ones(2))

    @treemode.jit(donate_argnums=0)
    def f(m, x):
        m.w[...] = m.w[...] + x
        return m.a[...] + m.b[...]

    m = Ints()
    for i in range(3):
        shared = 1000 + i  # one int object in both Variables
        m.a.set_raw_value(shared)
        m.b.set_raw_value(shared)
        assert f(m, jnp.ones(2)) == 2 * shared
    np.testing.assert_allclose(m.w[...], np.full(2, 4.0))
    assert len(checks) == 3  # every call has the shared int

    g = treemode.jit(_step, donate_argnums=0)
    n = Counter()
    for _ in range(3):
        g(n, jnp.ones(3))
    # Nothing is shared there: after the first (full) call, the executor decides
    # alone (the pipeline's check runs on the first call only).
    assert len(checks) == 3 + 1


def test_metadata_updates_take_the_pipeline_and_the_executor_skips_the_store_hook(matcher, hooks):
    @treemode.jit
    def f(m, x):
        m.count[...] += 1
        m.w.set_metadata("seen", True)  # a metadata update: no record, written in Python
        return x

    m = Counter()
    f(m, jnp.ones(3))
    assert f._records == []  # its trace recorded a metadata update
    for _ in range(2):
        f(m, jnp.ones(3))
    assert m.count[...] == 3 and m.w.get_metadata("seen") is True
    stores: list[object] = []
    real = hooks.real_store
    hooks.store(lambda v, *a: (stores.append(v), real(v, *a)))
    g = treemode.jit(_step)
    n = Counter()
    for _ in range(3):
        g(n, jnp.ones(3))
    # The pipeline writes through the hook; the executor writes Variables directly
    # (faults reach it at the Variable level: tests/test_faults.py).
    assert n.count[...] == 3 and len(stores) == (2 if matcher == "record" else 6)


def test_a_failing_matched_call_names_the_input_and_unbinds(hooks):
    hooks.donation_seen(True)
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    m.w.get_raw_value().delete()  # the memo still matches: the failure is JAX's
    with pytest.raises(treemode.DonationError, match=r"Param at args\[0\]\.w has been deleted"):
        f(m, jnp.ones(3))
    assert f._records
    assert all(getattr(e.pure.binding, "call", None) is None for e in f._cache.values())
    assert m.count[...] == 1  # nothing written


def test_errors_raised_by_the_function_on_a_retrace_pass_through_unchanged():
    class Refused(Exception):
        pass

    @treemode.jit
    def f(m, x):
        if x.shape[0] == 2:
            raise Refused("two")
        m.count[...] += 1
        return x

    m = Counter()
    f(m, jnp.ones(3))
    with pytest.raises(Refused, match="two"):
        f(m, jnp.ones(2))  # matched, then a retrace that raises
    assert m.count[...] == 1
    f(m, jnp.ones(3))
    assert m.count[...] == 2


def test_a_jitted_function_in_a_reference_cycle_is_collected():
    def make():
        @treemode.jit
        def f(m, x):
            return m.w[...] * x if f is not None else x  # f refers to itself

        return f

    f = make()
    m = Counter()
    f(m, jnp.ones(3))
    f(m, jnp.ones(3))
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None


def test_a_shallow_copy_of_a_jitted_function_calls_like_the_original():
    import copy

    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    g = copy.copy(f)
    np.testing.assert_allclose(g(m, jnp.ones(3)), f(m, jnp.ones(3)) - 3.0)
    assert m.count[...] == 3 and g._cache is f._cache


def test_keyword_arguments_and_bound_arguments_run_the_record(matcher):
    f = treemode.jit(_step)
    m, n = Counter(), Counter()
    f(m, x=jnp.ones(3))
    assert f._records
    f._miss = _no_miss  # keyword calls like the recorded one: executed by the record
    for _ in range(2):
        f(m, x=jnp.ones(3))
    assert int(m.count[...]) == 3
    missed: list[object] = []

    def miss(wrapper, error, args, kwargs):
        missed.append(kwargs)
        return wrapper._on_miss(error, args, kwargs)

    f._miss = miss
    f(m, jnp.ones(3))  # positional where the record has a keyword: a miss
    f(n, x=jnp.ones(3))  # another object: a miss
    assert len(missed) == 2 and missed[0] is None and list(missed[1]) == ["x"]
    assert int(m.count[...]) == 4 and int(n.count[...]) == 1
    bound = treemode.jit_partial(_step, n)
    for _ in range(3):
        bound(x=jnp.ones(3))
    assert bound._records
    assert int(n.count[...]) == 4


def test_a_wrapper_with_a_record_is_freed_without_the_garbage_collector(matcher):
    # The executor's miss is held as a function, not a bound method: no cycle.
    f = treemode.jit(_step)
    m = Counter()
    f(m, jnp.ones(3))
    f(m, jnp.ones(3))
    assert f._records
    ref = weakref.ref(f)
    gc.collect()
    gc.disable()
    try:
        del f
        assert ref() is None
    finally:
        gc.enable()
