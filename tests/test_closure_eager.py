"""Closures keep eager semantics: real globals during the trace, every unlifted module
reported, `Pytree` proxies usable after a transform read them through a closure."""

from __future__ import annotations

import builtins
import collections
import functools
import sys
import threading
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode

MODEL = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
FLAG = 1.0


def _reset_flag(value: float = 1.0) -> None:
    global FLAG
    FLAG = value


def _set_flag_to_three() -> None:
    global FLAG
    FLAG = 3.0


def _read_flag() -> float:
    return FLAG


def _zero_times_model(x):
    return MODEL(x).sum() * 0.0


# -- 1. the function runs with its real globals ---------------------------------


def test_a_global_a_helper_sets_during_the_trace_is_read_by_the_function():
    _reset_flag()

    def f(x):
        _set_flag_to_three()
        return _zero_times_model(x) + FLAG + MODEL(x).sum() * 0.0

    assert float(treemode.jit(f)(jnp.ones(2))) == 3.0
    assert FLAG == 3.0


def test_a_global_the_function_sets_is_read_by_a_helper():
    _reset_flag()

    def f(x):
        global FLAG
        FLAG = 5.0
        return MODEL(x).sum() * 0.0 + _read_flag()

    assert float(treemode.jit(f)(jnp.ones(2))) == 5.0
    assert FLAG == 5.0


def test_a_global_read_back_through_sys_modules():
    _reset_flag()

    def f(x):
        global FLAG
        FLAG = 11.0
        return MODEL(x).sum() * 0.0 + sys.modules[__name__].FLAG

    assert float(treemode.jit(f)(jnp.ones(2))) == 11.0


def test_global_writes_match_eager_under_every_transform():
    def f(x):
        _set_flag_to_three()
        return MODEL(x).sum() * 0.0 + FLAG

    for transform in (treemode.jit, treemode.grad, treemode.vmap):
        _reset_flag()
        x = jnp.ones((3, 2)) if transform is treemode.vmap else jnp.ones(2)
        out = transform(f)(x)
        if transform is not treemode.grad:  # grad: the derivative of a constant
            np.testing.assert_allclose(np.asarray(out), 3.0)
        assert FLAG == 3.0, transform


def test_a_lifted_global_is_still_lifted_and_written_back():
    counter = nnx.Variable(jnp.array(0))
    globals()["COUNTER_HOLDER"] = nnx.Dict(count=counter)

    def f(x):
        COUNTER_HOLDER["count"][...] += 1  # noqa: F821 - set above
        return MODEL(x)

    step = treemode.jit(f)
    x = jnp.ones(2)
    step(x)
    MODEL.bias[...] = MODEL.bias[...] + 1.0
    np.testing.assert_allclose(step(x), MODEL(x), rtol=1e-6)
    assert int(counter[...]) == 2


def test_a_global_used_as_an_attribute_name_too_falls_back_correctly():
    """``MODEL`` is also an attribute name in this function: its code cannot rename the
    global alone, so that function runs on a copy of its globals (the old route)."""
    holder = types.SimpleNamespace(MODEL=3.0)

    def f(x):
        return MODEL(x).sum() * 0.0 + holder.MODEL

    step = treemode.jit(f)
    x = jnp.ones(2)
    assert float(step(x)) == 3.0
    MODEL.bias[...] = MODEL.bias[...] + 1.0
    assert float(step(x)) == 3.0


def test_no_alias_is_left_in_builtins_even_when_the_function_raises():
    def f(x):
        MODEL(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        treemode.jit(f)(jnp.ones(2))
    treemode.jit(lambda x: MODEL(x))(jnp.ones(2))
    assert not [k for k in vars(builtins) if k.startswith("<treemode")]


def test_threads_never_see_a_tracer_and_their_global_writes_are_kept():
    """A thread reads the lifted global module and writes globals while another traces."""
    stop = threading.Event()
    seen: list[str] = []
    writes = 0

    def reader():
        nonlocal writes
        while not stop.is_set():
            value = MODEL.kernel[...]
            if isinstance(value, jax.core.Tracer):
                seen.append("tracer")
            globals()["THREAD_GLOBAL"] = writes
            writes += 1

    def slow(x):
        time.sleep(0.05)  # the trace lasts long enough for the reader to run
        return MODEL(x) + FLAG

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(5):
            treemode.jit(slow)(jnp.ones(2) * i)
    finally:
        stop.set()
        thread.join()
    assert seen == []
    assert globals()["THREAD_GLOBAL"] == writes - 1


# -- 2. every module the search does not lift is reported -----------------------


class _Slotted:
    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model


def _linear():
    return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


class _Config:
    model = _linear()


SLOTTED = _Slotted(_linear())
BIG = [0] * 1000
BIG[600] = _linear()
ORDERED = collections.OrderedDict(m=_linear())
NAMESPACE = types.SimpleNamespace(m=_linear())
FROZEN = frozenset([_linear()])
DEEP = _linear()


@functools.cache
def _cached_model():
    return _linear()


_cached_model()  # built eagerly, as a getter's result usually is


def _h6(x):
    return DEEP(x)


def _h5(x):
    return _h6(x)


def _h4(x):
    return _h5(x)


def _h3(x):
    return _h4(x)


def _h2(x):
    return _h3(x)


def _h1(x):
    return _h2(x)


UNLIFTED_CASES = {
    "SLOTTED.model": (lambda x: SLOTTED.model(x), lambda: SLOTTED.model),
    "_Config.model": (lambda x: _Config.model(x), lambda: _Config.model),
    "BIG[600]": (lambda x: BIG[600](x), lambda: BIG[600]),
    "ORDERED['m']": (lambda x: ORDERED["m"](x), lambda: ORDERED["m"]),
    "NAMESPACE.m": (lambda x: NAMESPACE.m(x), lambda: NAMESPACE.m),
    "FROZEN": (lambda x: next(iter(FROZEN))(x), lambda: next(iter(FROZEN))),
    "_cached_model() (lru_cache)": (lambda x: _cached_model()(x), _cached_model),
    "DEEP": (_h1, lambda: DEEP),
}


# What each warning says about its route: why the search left it out, what to do there.
UNLIFTED_ADVICE = {
    "SLOTTED.model": "a __slots__ attribute of _Slotted (the search reads an object's __dict__)",
    "_Config.model": "a class attribute of _Config",
    "BIG[600]": "in a list of 1000 entries (the search enters holders of up to 256)",
    "ORDERED['m']": "in an OrderedDict, which the search does not enter",
    "NAMESPACE.m": "in a SimpleNamespace, which the search does not enter",
    "FROZEN": "in a frozenset, which the search does not enter",
    "_cached_model() (lru_cache)": "a result _cached_model keeps (functools.lru_cache",
    "DEEP": "DEEP (Linear), a global that _h6 reads, 5 helpers deep (the search follows",
}


@pytest.mark.parametrize("route", list(UNLIFTED_CASES))
def test_a_module_the_search_does_not_lift_is_named_in_a_warning(route):
    fn, module = UNLIFTED_CASES[route]
    step = treemode.jit(fn)
    with pytest.warns(treemode.ClosureWarning) as record:
        step(jnp.ones(2))
    messages = [str(w.message) for w in record if w.category is treemode.ClosureWarning]
    assert len(messages) == 1
    assert messages[0].startswith("treemode.jit: the function reaches NNX objects")
    assert route in messages[0] and "(Linear)" in messages[0]
    assert "Pass them as arguments" in messages[0]
    assert UNLIFTED_ADVICE[route] in messages[0]
    assert "a closure cell, a global" not in messages[0]  # the one advice for every route
    # Passed as an argument instead, the module is read fresh and no word is said.
    with warnings.catch_warnings():
        warnings.simplefilter("error", treemode.ClosureWarning)
        m = module()
        fixed = treemode.jit(lambda m, x: m(x))
        fixed(m, jnp.ones(2))
        m.bias[...] = m.bias[...] + 1.0
        np.testing.assert_allclose(fixed(m, jnp.ones(2)), m(jnp.ones(2)), rtol=1e-6)
        m.bias[...] = m.bias[...] - 1.0


def test_lifted_closures_are_not_reported():
    local = _linear()
    table = {"m": _linear()}

    def f(x):
        return local(x) + table["m"](x) + MODEL(x) + _h4(x) * 0.0  # _h4 reaches DEEP: 3 hops

    with warnings.catch_warnings():
        warnings.simplefilter("error", treemode.ClosureWarning)
        treemode.jit(f)(jnp.ones(2))
        treemode.vmap(f)(jnp.ones((3, 2)))
        treemode.grad(lambda x: f(x).sum())(jnp.ones(2))


def test_the_report_is_made_at_trace_time_only():
    step = treemode.jit(lambda x: SLOTTED.model(x))
    with pytest.warns(treemode.ClosureWarning):
        step(jnp.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", treemode.ClosureWarning)
        step(jnp.ones(2))  # no new trace, no new search


# -- 3. Pytree proxies survive being read through a closure ----------------------


def _jax_scan(fn):
    def run(x):
        def body(carry, row):
            return carry + fn(row[None]), None

        return jax.lax.scan(body, jnp.zeros(()), x)[0]

    return run


@pytest.mark.parametrize(
    "transform",
    [jax.jit, treemode.jit, jax.vmap, _jax_scan],
    ids=["jax.jit", "treemode.jit", "jax.vmap", "jax.lax.scan"],
)
def test_a_proxy_read_through_a_closure_stays_usable(transform):
    linear = treemode.Pytree(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    batchnorm = treemode.Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))

    def read(x):
        return linear(x).sum() + batchnorm(x, use_running_average=True).sum()

    transform(read)(jnp.ones((3, 2)))
    with linear as m:
        m.bias[...] = m.bias[...] + 1.0
    np.testing.assert_allclose(linear.bias[...], 1.0)
    before = np.asarray(batchnorm.mean[...])
    batchnorm(jnp.full((3, 2), 4.0))  # an eager training call updates the statistics
    assert not np.allclose(batchnorm.mean[...], before)
    # A second read through the closure sees the edits.
    out = transform(lambda x: linear(x).sum())(jnp.ones((3, 2)))
    expected = (jnp.ones((3, 2)) @ linear.kernel[...] + 1.0).sum()
    if transform is jax.vmap:
        expected = jax.vmap(lambda r: (r @ linear.kernel[...] + 1.0).sum())(jnp.ones((3, 2)))
    np.testing.assert_allclose(out, expected, rtol=1e-6)
