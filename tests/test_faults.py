"""Atomicity under faults: a transform that fails leaves its inputs exactly as they were.

A failure is injected at every stage of the pipeline, for every transform:
inside the user function (after it mutated Variables), during tracing (a JAX
error), in the alias and structure checks (a natural ``AliasError`` /
``StructureError`` and an injected failure in the check itself), and in the
write-back: an ``Exception`` or a ``KeyboardInterrupt``-like ``BaseException``
raised by the write hook (the `hooks` fixture's ``store``) before each of its writes.
Afterwards every input Variable must hold the very same buffer and metadata as
before (bit for bit) and the inputs must still work: running the transform
again gives the state the eager program gives.
"""

from __future__ import annotations

import linecache
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import treemode
from treemode import _compat
from treemode._pipeline import _callsite


class Model(nnx.Module):
    """Params, an integer counter, a BatchStat and an Rngs stream."""

    def __init__(self, seed: int = 0):
        self.w = nnx.Param(jnp.array([1.0, 2.0]))
        self.steps = nnx.BatchStat(jnp.array(0, jnp.int32))
        self.mean = nnx.BatchStat(jnp.zeros(2))
        self.rngs = nnx.Rngs(seed)


def step(m: Model, x: jax.Array) -> jax.Array:
    """Reads and writes every kind of Variable; the write does not depend on x."""
    m.steps[...] += 1
    m.mean[...] = m.mean[...] + m.w[...]
    m.w[...] = m.w[...] * 2.0
    noise = jax.random.uniform(m.rngs(), (2,))
    return jnp.sum(m.w[...] * x) + jnp.sum(noise)


class Other(nnx.Module):
    """A module reached through a closure (lifted into the transform's inputs)."""

    def __init__(self):
        self.total = nnx.Variable(jnp.array(0.0))


# -- transforms: each runs ``fn(model, x)`` once (or twice for the loops) -------------


_WRAPPED: dict[tuple[str, Any], Any] = {}


def _cached(name: str, fn: Any, make: Callable[[], Any]) -> Any:
    """One wrapper per (transform, function), so its compiled entries are reused."""
    key = (name, fn)
    if key not in _WRAPPED:
        _WRAPPED[key] = make()
    return _WRAPPED[key]


def _jit(fn, m, x):
    return _cached("jit", fn, lambda: treemode.jit(fn))(m, x)


# The model is broadcast on purpose (its writes do not depend on the example), its
# Rngs stream included: a module-shaped None says so (a plain None would warn that
# every example draws the same numbers: treemode.BroadcastRngsWarning).
BROADCAST_MODEL = (treemode.prefix(Model(), {...: None}), 0)


def _vmap(fn, m, x):
    f = _cached("vmap", fn, lambda: treemode.vmap(fn, in_axes=BROADCAST_MODEL))
    return f(m, jnp.stack([x, x]))


def _scan(fn, m, x):
    f = _cached(
        "scan",
        fn,
        lambda: treemode.scan(lambda m, x: (m, fn(m, x)), in_axes=(treemode.Carry, 0)),
    )
    return f(m, jnp.stack([x, x]))[1]


def _grad(fn, m, x):
    return treemode.grad(fn)(m, x)


def _value_and_grad(fn, m, x):
    return treemode.value_and_grad(fn)(m, x)[0]


def _cond(fn, m, x):
    return treemode.cond(jnp.array(True), fn, lambda m, x: jnp.sum(x), m, x)


def _switch(fn, m, x):
    return treemode.switch(jnp.array(0), [fn, lambda m, x: jnp.sum(x)], m, x)


def _while(fn, m, x):
    def body(v):
        m, x, i = v
        fn(m, x)
        return m, x, i + 1

    return treemode.while_loop(lambda v: v[2] < 2, body, (m, x, jnp.array(0)))[2]


def _fori(fn, m, x):
    def body(i, v):
        fn(v[0], v[1])
        return v

    return treemode.fori_loop(0, 2, body, (m, x))[1]


def _remat(fn, m, x):
    return treemode.remat(fn)(m, x)


def _eager_once(fn, m, x):
    return fn(m, x)


def _eager_twice(fn, m, x):
    fn(m, x)
    return fn(m, x)


TRANSFORMS: dict[str, Callable[..., Any]] = {
    "jit": _jit,
    "vmap": _vmap,
    "scan": _scan,
    "grad": _grad,
    "value_and_grad": _value_and_grad,
    "cond": _cond,
    "switch": _switch,
    "while_loop": _while,
    "fori_loop": _fori,
    "remat": _remat,
}
# How often each runs the function: the eager reference does the same.
# (vmap runs the update once: it does not depend on the example.)
TWICE = {"scan", "while_loop", "fori_loop"}
# Transforms that trace with abstract values (bool() of a Variable fails there).
ABSTRACT = {"jit", "scan", "cond", "switch", "while_loop", "fori_loop", "remat"}


def _reference(name: str, fn=step) -> Model:
    m = Model()
    (_eager_twice if name in TWICE else _eager_once)(fn, m, jnp.ones(2))
    return m


# -- snapshots --------------------------------------------------------------------------


def _variables(*nodes: Any) -> list[Any]:
    return [
        v
        for v in jax.tree_util.tree_leaves(nodes, is_leaf=lambda v: isinstance(v, nnx.Variable))
        if isinstance(v, nnx.Variable)
    ]


def _bits(value: Any) -> np.ndarray:
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value).copy()


class Snapshot:
    """Every Variable's object, buffer, bits and metadata, and each node's structure."""

    def __init__(self, *nodes: Any):
        self.nodes = nodes
        self.treedefs = [jax.tree_util.tree_structure(n) for n in nodes]
        self.variables = _variables(*nodes)
        self.buffers = [v.get_raw_value() for v in self.variables]
        self.bits = [_bits(b) for b in self.buffers]
        self.metadata = [dict(v.get_metadata()) for v in self.variables]

    def assert_unchanged(self) -> None:
        assert [jax.tree_util.tree_structure(n) for n in self.nodes] == self.treedefs
        now = _variables(*self.nodes)
        assert len(now) == len(self.variables)
        assert all(a is b for a, b in zip(now, self.variables, strict=True))
        for v, buffer, bits, metadata in zip(
            now, self.buffers, self.bits, self.metadata, strict=True
        ):
            assert v.get_raw_value() is buffer  # the very same buffer...
            np.testing.assert_array_equal(_bits(v.get_raw_value()), bits)  # ...and bits
            assert dict(v.get_metadata()) == metadata
            assert not isinstance(v.get_raw_value(), jax.core.Tracer)


def _assert_states_equal(a: Any, b: Any) -> None:
    xs, ys = _variables(a), _variables(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_allclose(_bits(x.get_raw_value()), _bits(y.get_raw_value()), rtol=1e-6)


def _assert_one_donated_step_written(model: Model, old: list[Any]) -> None:
    """``old`` (the values before a donated jit step) were donated, and ``model`` holds
    the step's new values, live: one step, as eager."""
    assert any(x.is_deleted() for x in old if isinstance(x, jax.Array))
    for v in _variables(model):
        assert not v.get_raw_value().is_deleted()
    _assert_states_equal(model, _reference("jit"))


def _still_usable(name: str, model: Model) -> None:
    """The failed call left ``model`` as new: a clean run gives the reference state."""
    TRANSFORMS[name](step, model, jnp.ones(2))
    _assert_states_equal(model, _reference(name))


# -- faults inside the user function and during tracing ----------------------------------


class UserError(Exception):
    pass


def _raise_after_mutating(m, x):
    step(m, x)
    raise UserError("boom")


def _concretize_after_mutating(m, x):
    step(m, x)
    if m.w[0] > 0:  # bool() of a tracer: a JAX error while tracing
        return jnp.sum(x)
    return jnp.sum(x)


def _shape_error_after_mutating(m, x):
    step(m, x)
    return jnp.sum(x @ jnp.ones((7, 7)))


FUNCTION_FAULTS = {
    "user exception": (_raise_after_mutating, UserError),
    "tracer bool": (_concretize_after_mutating, jax.errors.ConcretizationTypeError),
    "shape error": (_shape_error_after_mutating, TypeError),
}


@pytest.mark.parametrize(
    ("name", "fault"),
    [
        (name, fault)
        for name in sorted(TRANSFORMS)
        for fault in sorted(FUNCTION_FAULTS)
        if fault != "tracer bool" or name in ABSTRACT
    ],
)
def test_failure_in_the_function_leaves_inputs(name, fault):
    fn, error = FUNCTION_FAULTS[fault]
    model = Model()
    snap = Snapshot(model)
    with pytest.raises(error):
        TRANSFORMS[name](fn, model, jnp.ones(2))
    snap.assert_unchanged()
    _still_usable(name, model)


def _closure_cases(other: Other) -> dict[str, Callable[[Model, jax.Array], Any]]:
    """Each transform applied to a function that mutates ``other`` through its closure.

    (The closure is lifted from the function given to the transform itself.)
    """

    def fn(m, x):
        other.total[...] += 1.0
        step(m, x)
        raise UserError("boom")

    def carry_body(m, x):
        other.total[...] += 1.0
        step(m, x)
        raise UserError("boom")

    def while_body(v):
        other.total[...] += 1.0
        step(v[0], v[1])
        raise UserError("boom")

    def fori_body(i, v):
        other.total[...] += 1.0
        step(v[0], v[1])
        raise UserError("boom")

    xs = jnp.ones((2, 2))
    return {
        "jit": lambda m, x: treemode.jit(fn)(m, x),
        "vmap": lambda m, x: treemode.vmap(fn, in_axes=BROADCAST_MODEL)(m, xs),
        "scan": lambda m, x: treemode.scan(carry_body, in_axes=(treemode.Carry, 0))(m, xs),
        "grad": lambda m, x: treemode.grad(fn)(m, x),
        "cond": lambda m, x: treemode.cond(jnp.array(True), fn, fn, m, x),
        "switch": lambda m, x: treemode.switch(jnp.array(0), [fn, fn], m, x),
        "while_loop": lambda m, x: treemode.while_loop(lambda v: True, while_body, (m, x)),
        "fori_loop": lambda m, x: treemode.fori_loop(0, 2, fori_body, (m, x)),
        "remat": lambda m, x: treemode.remat(fn)(m, x),
    }


@pytest.mark.parametrize("name", sorted(_closure_cases(Other())))
def test_failure_in_the_function_leaves_closure_modules(name):
    other = Other()
    model = Model()
    snap = Snapshot(model, other)
    with pytest.raises(UserError):
        _closure_cases(other)[name](model, jnp.ones(2))
    snap.assert_unchanged()


# -- faults in the alias and structure checks -------------------------------------------


def _adds_attribute(m, x):
    step(m, x)
    m.extra = nnx.Param(jnp.ones(2))
    return jnp.sum(x)


def _replaces_variable(m, x):
    step(m, x)
    m.mean = nnx.BatchStat(jnp.ones(2))
    return jnp.sum(x)


@pytest.mark.parametrize("fn", [_adds_attribute, _replaces_variable])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_structure_error_leaves_inputs(name, fn):
    model = Model()
    snap = Snapshot(model)
    with pytest.raises(treemode.StructureError, match=r"treemode\.\w+:.*(args\[0\]|init_val)"):
        TRANSFORMS[name](fn, model, jnp.ones(2))
    snap.assert_unchanged()
    _still_usable(name, model)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_alias_error_leaves_inputs(name):
    model = Model()
    model.alias = model.mean  # one BatchStat reachable twice
    snap = Snapshot(model)
    with pytest.raises(
        treemode.AliasError, match=r"treemode\.\w+: Duplicate BatchStat: the same BatchStat"
    ):
        TRANSFORMS[name](step, model, jnp.ones(2))
    snap.assert_unchanged()
    del model.alias
    _still_usable(name, model)


class CheckFault(Exception):
    pass


@pytest.mark.parametrize("check", ["_check_structure", "_check_outputs", "_collect_updates"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_failure_inside_a_check_leaves_inputs(name, check, hooks):
    def broken(self, *args, **kwargs):
        raise CheckFault(check)

    def fresh(m, x):  # not traced before, so the check runs
        return step(m, x)

    hooks.pure_check(check, broken)
    model = Model()
    snap = Snapshot(model)
    with pytest.raises(CheckFault):
        TRANSFORMS[name](fresh, model, jnp.ones(2))
    hooks.undo()
    snap.assert_unchanged()
    _still_usable(name, model)


def test_failure_in_prepare_leaves_inputs(hooks):
    """A failure while flattening/lifting (before any tracing)."""
    real = hooks.real_prepare

    def broken(*args, **kwargs):
        real(*args, **kwargs)
        raise CheckFault("prepare")

    hooks.prepare(broken)
    _every_transform_raises_and_leaves_inputs(CheckFault)


def _every_transform_raises_and_leaves_inputs(error: type[BaseException]) -> None:
    for name in sorted(TRANSFORMS):
        model = Model()
        snap = Snapshot(model)
        with pytest.raises(error):
            TRANSFORMS[name](step, model, jnp.ones(2))
        snap.assert_unchanged()


# -- faults in the write-back -----------------------------------------------------------


class Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception, so ``except Exception`` misses it."""


def _count_writes(hooks: Any, name: str, fn: Callable[..., Any], *nodes: Any) -> int:
    writes = []
    real = hooks.real_store

    def counting(var, value, metadata=None):
        writes.append(var)
        real(var, value, metadata)

    hooks.store(counting)
    try:
        TRANSFORMS[name](fn, *nodes, jnp.ones(2))
    finally:
        hooks.undo()
    return len(writes)


def _fail_at(hooks: Any, k: int, error: type[BaseException]):
    real = hooks.real_store
    seen = []

    def failing(var, value, metadata=None):
        seen.append(var)
        if len(seen) == k:
            raise error(f"write {k}")
        real(var, value, metadata)

    return failing


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_fault_before_every_write_rolls_back(name, hooks):
    n = _count_writes(hooks, name, step, Model())
    assert n >= 4  # steps, mean, w and the Rngs count are written
    errors = [Interrupt, RuntimeError, KeyboardInterrupt]
    for k in range(1, n + 1):
        error = errors[k % 3]
        model = Model()
        snap = Snapshot(model)
        hooks.store(_fail_at(hooks, k, error))
        with pytest.raises(error, match=f"write {k}"):
            TRANSFORMS[name](step, model, jnp.ones(2))
        hooks.undo()
        snap.assert_unchanged()
    _still_usable(name, model)


def test_fault_in_metadata_write_back_rolls_back(hooks):
    def tag(m, x):
        m.steps[...] += 1
        m.mean.set_metadata("tag", "seen")
        return jnp.sum(x)

    for name in ["jit", "remat", "grad", "vmap"]:
        n = _count_writes(hooks, name, tag, Model())
        for k in range(1, n + 1):
            model = Model()
            snap = Snapshot(model)
            hooks.store(_fail_at(hooks, k, Interrupt))
            with pytest.raises(Interrupt):
                TRANSFORMS[name](tag, model, jnp.ones(2))
            hooks.undo()
            snap.assert_unchanged()
        TRANSFORMS[name](tag, model, jnp.ones(2))
        assert model.mean.get_metadata()["tag"] == "seen"


@pytest.mark.parametrize("name", ["cond", "switch"])
def test_branch_write_back_across_closures_is_atomic(name, hooks):
    """Each branch closes over its own module: all writes commit together or none."""
    first, second = Other(), Other()

    def a(m, x):
        first.total[...] += 1.0
        return step(m, x)

    def b(m, x):
        second.total[...] += 2.0
        return step(m, x)

    def run(model):
        if name == "cond":
            return treemode.cond(jnp.array(True), a, b, model, jnp.ones(2))
        return treemode.switch(jnp.array(0), [a, b], model, jnp.ones(2))

    writes = []
    real = hooks.real_store

    def counting(var, value, metadata=None):
        writes.append(var)
        real(var, value, metadata)

    hooks.store(counting)
    probe_first, probe_second = Other(), Other()
    first, second = probe_first, probe_second
    run(Model())
    hooks.undo()
    n = len(writes)
    # Every position for cond; for switch the last write (in the last branch's call).
    for k in range(1, n + 1) if name == "cond" else [n]:
        first, second = Other(), Other()
        model = Model()
        snap = Snapshot(model, first, second)
        hooks.store(_fail_at(hooks, k, Interrupt))
        with pytest.raises(Interrupt):
            run(model)
        hooks.undo()
        snap.assert_unchanged()
    run(model)
    assert float(first.total[...]) == 1.0 and float(second.total[...]) == 0.0


def test_fault_in_check_writable_leaves_inputs(hooks):
    def broken(call, updates):
        raise CheckFault("check_writable")

    hooks.check_writable(broken)
    _every_transform_raises_and_leaves_inputs(CheckFault)


def test_two_arguments_roll_back_together(hooks):
    def both(a, b, x):
        step(a, x)
        return step(b, x)

    writes = []
    real = hooks.real_store
    hooks.store(lambda v, val, md=None: (writes.append(v), real(v, val, md)))
    f = treemode.jit(both)
    f(Model(), Model(1), jnp.ones(2))
    hooks.undo()
    for k in range(1, len(writes) + 1):
        a, b = Model(), Model(1)
        snap = Snapshot(a, b)
        hooks.store(_fail_at(hooks, k, Interrupt))
        with pytest.raises(Interrupt):
            f(a, b, jnp.ones(2))
        hooks.undo()
        snap.assert_unchanged()


class RefusingParam(nnx.Param):
    """A Param whose new values can be refused: a fault in the middle of a write-back.

    Its ``_raw_value`` is a property over Param's slot, so every write path (the
    compiled one included) writes it with setattr rather than in place, and the
    refusal lands after the Variables before it were written in place.
    """

    refuse = False

    @property
    def _raw_value(self) -> Any:
        return _compat.raw_value_member.__get__(self)

    @_raw_value.setter
    def _raw_value(self, value: Any) -> None:
        member = _compat.raw_value_member
        if type(self).refuse and value is not member.__get__(self):
            raise CheckFault("refused")
        member.__set__(self, value)


class SignallingParam(nnx.Param):
    """A Param whose next write sends the signal ``signum`` (then stops doing so)."""

    signum: int | None = None

    @property
    def _raw_value(self) -> Any:
        return _compat.raw_value_member.__get__(self)

    @_raw_value.setter
    def _raw_value(self, value: Any) -> None:
        cls = type(self)
        if cls.signum is not None and value is not _compat.raw_value_member.__get__(self):
            signum, cls.signum = cls.signum, None
            signal.raise_signal(signum)  # held: its handler runs after the write
        _compat.raw_value_member.__set__(self, value)


class Refusing(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.zeros(2))  # before `b`: written (in place) before the fault
        self.b = RefusingParam(jnp.zeros(2))


def _bump(m: Refusing, x: jax.Array) -> jax.Array:
    m.a[...] += x
    m.b[...] += x
    return jnp.sum(m.a[...])


@pytest.fixture
def refusing():
    yield RefusingParam
    RefusingParam.refuse = False


@pytest.mark.usefixtures("_jax_frames_kept")  # the frames are inspected below
def test_a_fault_inside_the_write_of_a_matched_call_leaves_inputs(implementation, refusing):
    # The write of a call the executor runs (in C where the extension is on: `fast_call`
    # writes without entering Python's write_back) fails at its second Variable:
    # the first is restored and the error is the one raised.
    f = treemode.jit(_bump)
    m = Refusing()
    for _ in range(3):  # record the memo; the first matched write remembers the trace
        f(m, jnp.ones(2))
    assert f._records  # the executor (compiled, or its Python twin) runs the call
    compiled = implementation == "compiled"
    a, b = m.a.get_raw_value(), m.b.get_raw_value()
    refusing.refuse = True
    with pytest.raises(CheckFault, match="refused") as raised:
        f(m, jnp.ones(2))
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert ("write_back" in frames) != compiled, frames
    assert m.a.get_raw_value() is a and m.b.get_raw_value() is b
    refusing.refuse = False
    f(m, jnp.ones(2))
    np.testing.assert_allclose(m.a[...], np.full(2, 4.0))
    np.testing.assert_allclose(m.b[...], np.full(2, 4.0))


@pytest.mark.usefixtures("_jax_frames_kept")  # the frames are inspected below
@pytest.mark.parametrize("record", [True, False], ids=["record", "pipeline"])
def test_a_refused_write_after_a_donated_call_is_finished(
    implementation, refusing, record, monkeypatch
):
    # The call consumed the old buffers: undoing the write would leave deleted
    # arrays behind. The write is finished instead (the refusing Variable's value
    # goes into its slot) and the refusal is raised.
    if not record:
        monkeypatch.setattr(_callsite, "fast_record", lambda *args: None)
    f = treemode.jit(_bump, donate_argnums=0)
    m = Refusing()
    for _ in range(3):
        f(m, jnp.ones(2))
    assert f._records or not record
    executed_in_c = implementation == "compiled" and record
    old = [m.a.get_raw_value(), m.b.get_raw_value()]
    refusing.refuse = True
    with pytest.raises(CheckFault, match="refused") as raised:
        f(m, jnp.ones(2))
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert ("write_back" in frames) != executed_in_c, frames
    assert all(x.is_deleted() for x in old)
    for v in (m.a, m.b):
        assert not v.get_raw_value().is_deleted()
        np.testing.assert_allclose(v[...], np.full(2, 4.0))  # the fourth step, whole
    refusing.refuse = False
    f(m, jnp.ones(2))
    np.testing.assert_allclose(m.b[...], np.full(2, 5.0))


def test_interrupted_donated_write_back_leaves_the_new_values(hooks):
    """A donated call's old buffers are gone once it ran: a failure while writing back
    must leave the new values (the step happened), never deleted buffers."""
    f = treemode.jit(step, donate_argnums=0)
    writes = hooks.calls("store")
    f(Model(), jnp.ones(2))
    n = len(writes)
    hooks.undo()
    assert n >= 4
    for k in range(1, n + 1):
        model = Model()
        old = [v.get_raw_value() for v in _variables(model)]
        hooks.store(_fail_at(hooks, k, Interrupt))
        with pytest.raises(Interrupt):
            f(model, jnp.ones(2))
        hooks.undo()
        _assert_one_donated_step_written(model, old)
        f(model, jnp.ones(2))  # still usable
        twice = Model()
        _eager_twice(step, twice, jnp.ones(2))
        _assert_states_equal(model, twice)


def _ctrl_c() -> None:
    """Deliver SIGINT to this process and run bytecode: an unheld handler fires here."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):
        pass


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers run in the main thread only",
)
def test_ctrl_c_as_a_donated_write_back_starts_arrives_after_the_write(hooks):
    """A Ctrl-C landing between a donated executable's return and the write: the
    interrupt is held until the new values are written, then raised."""
    f = treemode.jit(step, donate_argnums=0)
    model = Model()
    old = [v.get_raw_value() for v in _variables(model)]
    hooks.before_write(_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        f(model, jnp.ones(2))
    hooks.undo()
    _assert_one_donated_step_written(model, old)
    f(model, jnp.ones(2))  # still usable


# -- asynchronous exceptions during donated calls ------------------------------------------
#
# Python runs signal handlers in the main thread, between bytecodes: anywhere in a call.
# A donated call must leave its model whole whatever a handler raises, wherever it lands:
# before the executable consumed the buffers, the exception is raised at once (the old
# values stay); after, it waits for the write-back (the new values are in place).

main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers run in the main thread only",
)


class Alarm(BaseException):
    """What a user's SIGALRM timeout handler raises."""


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # what preemption handlers on clusters do


def _alarm(signum: int, frame: Any) -> None:
    raise Alarm("timeout")


# kind -> (signal, its Python handler, what the handler raises)
INTERRUPT_KINDS = {
    "KeyboardInterrupt": (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt),
    "SystemExit": (signal.SIGTERM, _exit_on_sigterm, SystemExit),
    "Alarm": (signal.SIGALRM, _alarm, Alarm),
}


class Counted(nnx.Module):
    """Two Variables a step changes together: their values tell old, new and torn apart."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros(3))
        self.count = nnx.BatchStat(jnp.array(0, jnp.int32))


def _step_counted(m: Counted, x: jax.Array) -> jax.Array:
    m.count[...] += 1
    m.w[...] = m.w[...] + 1.0
    return jnp.sum(x)


def _step_counted_dict(d: dict[str, Any], x: jax.Array) -> jax.Array:
    d["count"][...] += 1
    d["w"][...] = d["w"][...] + 1.0
    return jnp.sum(x)


def _counted_variables(node: Any) -> tuple[Any, Any]:
    return (node.w, node.count) if isinstance(node, Counted) else (node["w"], node["count"])


def _state(node: Any) -> tuple[int, np.ndarray]:
    """(the step count, ``w``); a pmapped model holds one copy per device."""
    w, count = _counted_variables(node)
    counts = np.asarray(count.get_raw_value()).reshape(-1)
    assert (counts == counts[0]).all(), counts
    return int(counts[0]), np.asarray(w.get_raw_value()).copy()


def _broken(node: Any, before: int) -> str | None:
    """Why ``node`` is not whole, holding its old values (count ``before``) or the
    new ones (``before + 1``), both Variables from the same step; ``None``: whole."""
    for v in _counted_variables(node):
        raw = v.get_raw_value()
        if not isinstance(raw, jax.Array) or raw.is_deleted():
            return f"a deleted buffer: {raw!r}"
    count, w = _state(node)
    if count not in (before, before + 1):
        return f"count {count}, expected {before} or {before + 1}"
    if not np.array_equal(w, np.full(w.shape, float(count))):
        return f"torn: count {count} with w {w}"
    return None


def _per_device(m: Counted) -> Counted:
    """``m`` with a copy of each value per local device (a pmapped argument)."""
    n = jax.local_device_count()
    for v in (m.w, m.count):
        v.set_raw_value(jnp.stack([v.get_raw_value()] * n))
    return m


class _Forms:
    """Each way of making a donated call, as ``call()`` on a fresh or warm model."""

    def __init__(self):
        self.positional = treemode.jit(_step_counted, donate_argnums=0)
        self.keyword = treemode.jit(_step_counted, donate_argnames="m")
        self.batch = treemode.jit(_step_counted_dict, donate_argnums=0)
        self.retraced = treemode.jit(_step_counted, donate_argnums=0)
        self.pmapped = treemode.pmap(_step_counted, donate_argnums=0)
        self.length = 1
        x = jnp.ones(2)
        for f in (self.positional, self.batch, self.retraced):
            f(self.node(f), x)
        self.keyword(m=Counted(), x=x)
        self.pmapped(_per_device(Counted()), jnp.ones((jax.local_device_count(), 2)))

    def node(self, f: Any) -> Any:
        return (
            {"w": nnx.Param(jnp.zeros(3)), "count": nnx.BatchStat(jnp.array(0, jnp.int32))}
            if (f is self.batch)
            else Counted()
        )

    def make(self, form: str) -> tuple[Any, Callable[[], Any]]:
        """A model and the call under test (each call advances it one step)."""
        x = jnp.ones(2)
        if form == "positional (memo hit)":
            m = Counted()
            return m, lambda: self.positional(m, x)
        if form == "keyword arguments":
            m = Counted()
            return m, lambda: self.keyword(m=m, x=x)
        if form == "dict batch":
            d = self.node(self.batch)
            return d, lambda: self.batch(d, x)
        if form == "pmap":
            m = _per_device(Counted())
            xs = jnp.ones((jax.local_device_count(), 2))
            return m, lambda: self.pmapped(m, xs)
        if form == "first call":
            m = Counted()
            fresh = treemode.jit(_step_counted, donate_argnums=0)
            return m, lambda: fresh(m, x)
        assert form == "retrace"  # a new input shape: traced and compiled again
        m = Counted()
        self.length += 1
        longer = jnp.ones(self.length)
        return m, lambda: self.retraced(m, longer)


# The call forms that trace and compile on every call (the others run a cached entry).
TRACING_FORMS = ("first call", "retrace")


def _next_step(form: str, node: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """The step after an interrupted call. As with ``jax.jit``, an interrupt that lands
    inside JAX's tracing caches can leave the entry of the function being traced
    unusable (JAX then raises ``RecursionError: Recursively calling ...`` for those
    argument types: 1 in 300 interrupted first calls of a plain ``jax.jit``), so after
    an interrupted trace the model runs its next step through a new ``treemode.jit``."""
    if form not in TRACING_FORMS:
        return call
    fresh = treemode.jit(_step_counted, donate_argnums=0)
    return lambda: fresh(node, jnp.ones(2))


class _Counting:
    """A signal handler that counts how often it ran, then runs ``handler``."""

    def __init__(self, handler: Callable[[int, Any], Any]):
        self.handler = handler
        self.fired = 0

    def __call__(self, signum: int, frame: Any) -> Any:
        self.fired += 1
        return self.handler(signum, frame)


# JAX's cached comparisons (``_sharding_indices_and_eq``, which ``shard_args`` calls
# as pmap places its arguments) turn an exception raised inside a key's ``__eq__``
# into this ValueError, the exception's traceback in its text.
_JAX_CACHE_KEY_ERROR = "Cache keys should be comparable using __eq__"


def _converted_by_jax(error: Exception, raised: type[BaseException]) -> bool:
    """Whether ``error`` is JAX's ValueError for a handler's exception (of type
    ``raised``) raised inside one of its cached comparisons: a plain ``jax.pmap``
    raises the same. The comparison runs while JAX places the arguments, before
    the executable runs: nothing was consumed, the caller checks the model."""
    text = str(error)
    return (
        isinstance(error, ValueError)
        and _JAX_CACHE_KEY_ERROR in text
        and f"{raised.__name__}: " in text
    )


def _swallowed_by_jax(
    form: str,
    error: Exception,
    handler: _Counting,
    fired: int,
    raised: type[BaseException] = KeyboardInterrupt,
) -> bool:
    """Whether ``error`` is JAX's, raised after JAX swallowed the interrupt.

    JAX catches every exception in a few places while it traces and lowers
    (``jax._src.core.is_constant_dim`` has a bare ``except:``). A handler's exception
    that lands there is dropped, and JAX goes on with a wrong answer and raises an
    unrelated error later (``AttributeError: 'int' object has no attribute
    '_get_vars'`` from ``mlir.lower_jaxpr_to_module``); a plain ``jax.jit`` does
    the same. Only calls that trace can meet it, and nothing was consumed yet: the
    model must still be whole, which the caller checks. In any call, JAX's cached
    comparisons may turn the handler's exception into a ValueError
    (`_converted_by_jax`). (JAX's traceback filtering drops its own frames: the
    tests that call this turn it off.)"""
    if handler.fired == fired:
        return False
    if _converted_by_jax(error, raised):
        return True
    if form not in TRACING_FORMS:
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    parts = os.path.normpath(tb.tb_frame.f_code.co_filename).split(os.sep)
    return "jax" in parts and "treemode" not in parts


# form -> calls tried per kind (the first call and the retrace compile every time)
INTERRUPT_FORMS = {
    "positional (memo hit)": 40,
    "keyword arguments": 40,
    "dict batch": 40,
    "pmap": 20,
    "first call": 6,
    "retrace": 6,
}


class _Sender:
    """Sends a signal to this process after a delay: SIGALRM from an interval timer,
    the others from a thread, with ``os.kill`` (as a terminal or a scheduler does)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.thread: threading.Thread | None = None

    def start(self, delay: float) -> None:
        if self.signum == signal.SIGALRM:
            signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
            return

        def send() -> None:
            time.sleep(delay)
            os.kill(os.getpid(), self.signum)

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def wait(self, delay: float) -> None:
        """Return once the signal was sent (its handler runs here at the latest)."""
        if self.thread is not None:
            self.thread.join()
        else:
            time.sleep(delay)
        for _ in range(1000):  # run bytecode: a pending handler fires
            pass

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.signum == signal.SIGALRM:
            signal.setitimer(signal.ITIMER_REAL, 0)


# A signal at a random moment may land inside a garbage-collection callback, where
# Python reports the handler's exception as unraisable: expected here, not leaked.
_RANDOM_SIGNALS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _fresh_jax_caches_after_signals():
    """An exception raised by a signal handler inside JAX's own tracing caches can
    leave a cache entry marked as in progress, so that the next call of that JAX
    function (``jnp.sum``'s, say) raises ``RecursionError`` in whatever test runs
    next in this process. The tests here deliver signals on purpose: clear JAX's
    caches after each, so no later test inherits such an entry."""
    yield
    jax.clear_caches()


@pytest.fixture
def _jax_frames_kept():
    """JAX's full tracebacks, for `_swallowed_by_jax`."""
    mode = jax.config.values["jax_traceback_filtering"]
    jax.config.update("jax_traceback_filtering", "off")
    yield
    jax.config.update("jax_traceback_filtering", mode)


@main_thread_only
@_RANDOM_SIGNALS
@pytest.mark.usefixtures("_jax_frames_kept")
@pytest.mark.parametrize("kind", sorted(INTERRUPT_KINDS))
def test_interrupts_at_random_points_never_break_a_donated_model(kind, implementation, monkeypatch):
    """Every call form, a signal whose handler raises at a random point of the call:
    afterwards the model holds the old values or the new ones (never a deleted
    buffer, never half a step), and it runs the next step."""
    signum, handler, raised = INTERRUPT_KINDS[kind]
    counting = _Counting(handler)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the sending thread gets the GIL without waiting
    previous = signal.signal(signum, counting)
    rng = random.Random(f"{kind} {implementation}")
    forms = _Forms()
    tried = interrupted_calls = 0
    broken: list[str] = []
    try:
        for form, n in INTERRUPT_FORMS.items():
            sender = _Sender(signum)
            node, call = forms.make(form)
            started = time.perf_counter()
            call()  # how long this form takes (a first call: a fresh one below)
            duration = time.perf_counter() - started
            for _ in range(n):
                node, call = forms.make(form)
                before = _state(node)[0]
                delay = rng.uniform(0.0, 1.2 * duration)
                returned = False
                tried += 1
                fired = counting.fired
                try:
                    sender.start(delay)
                    call()
                    returned = True
                    sender.wait(delay)
                except raised:
                    interrupted_calls += not returned
                except Exception as error:
                    if not _swallowed_by_jax(form, error, counting, fired, raised):
                        raise
                    interrupted_calls += 1
                finally:
                    sender.stop()
                why = _broken(node, before)
                if why is not None:
                    broken.append(f"{form}: {why}")
                    continue
                after = _state(node)[0]
                _next_step(form, node, call)()  # the model runs the next step
                assert _state(node)[0] == after + 1, form
    finally:
        signal.signal(signum, previous)
        sys.setswitchinterval(switch)
    print(
        f"{kind}, {implementation}: {tried} interrupts tried, {interrupted_calls} calls "
        f"interrupted, {len(broken)} models broken"
    )
    assert broken == [], f"{len(broken)} of {tried} models broken: {broken[:5]}"
    assert interrupted_calls > tried // 8, (interrupted_calls, tried)  # they did land in calls


@pytest.mark.usefixtures("_jax_frames_kept")
def test_an_interrupt_jax_swallows_while_lowering_leaves_the_model_whole(implementation):
    """The interrupt lands inside JAX's bare ``except:`` while the first call lowers
    (placed there with a trace function, where a signal's handler once landed in CI):
    JAX raises an unrelated error, nothing was consumed, the model keeps its old
    values and runs its next step; the random-signal tests recognize that error."""
    from jax._src import core

    target = core.is_constant_dim.__code__
    landed = _Counting(lambda signum, frame: None)

    def at_the_index_call(frame: Any, event: str, arg: Any) -> Any:
        caller = frame.f_back
        inside_jax_try = (
            event == "line"
            and "operator.index" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            and caller is not None
            and os.path.basename(caller.f_code.co_filename) == "mlir.py"
        )
        if inside_jax_try and not landed.fired:
            landed.fired += 1
            raise KeyboardInterrupt
        return at_the_index_call

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return at_the_index_call if frame.f_code is target else None

    f = treemode.jit(_step_counted, donate_argnums=0)
    model = Counted()
    tracing = sys.gettrace()
    sys.settrace(on_call)
    try:
        f(model, jnp.ones(2))
    except KeyboardInterrupt:
        pass  # a JAX without the bare except
    except Exception as error:
        assert _swallowed_by_jax("first call", error, landed, 0), error
    finally:
        sys.settrace(tracing)
    if not landed.fired:
        pytest.skip("this JAX does not lower through core.is_constant_dim")
    assert _broken(model, 0) is None
    assert _state(model)[0] == 0
    f(model, jnp.ones(2))
    assert _state(model)[0] == 1


def test_an_interrupt_jax_converts_while_placing_pmap_arguments_leaves_the_model_whole(
    implementation,
):
    """The interrupt lands inside a sharding's ``__eq__`` that JAX's cached
    comparison calls while a donated pmap places its arguments (placed there with
    a profile function, where a signal's handler once landed in CI): JAX raises a
    ValueError with the interrupt in its text, nothing was consumed, the model
    keeps its old values and runs its next step; the random-signal tests
    recognize that error."""
    from jax._src import sharding_impls

    target = sharding_impls.SingleDeviceSharding.memory_kind.fget.__code__
    landed = _Counting(lambda signum, frame: None)

    def at_memory_kind(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is target and not landed.fired:
            landed.fired += 1
            raise KeyboardInterrupt

    f = treemode.pmap(_step_counted, donate_argnums=0)
    xs = jnp.ones((jax.local_device_count(), 2))
    f(_per_device(Counted()), xs)  # warm: the comparison runs in JAX's cache
    model = _per_device(Counted())
    profiling = sys.getprofile()
    sys.setprofile(at_memory_kind)
    try:
        f(model, xs)
    except KeyboardInterrupt:
        pass  # a JAX whose comparison lets the exception through
    except Exception as error:
        assert _swallowed_by_jax("pmap", error, landed, 0, KeyboardInterrupt), error
    finally:
        sys.setprofile(profiling)
    if not landed.fired:
        pytest.skip("this JAX places pmap arguments without SingleDeviceSharding.memory_kind")
    assert _broken(model, 0) is None
    assert _state(model)[0] == 0
    f(model, xs)
    assert _state(model)[0] == 1


@main_thread_only
@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit"])
@pytest.mark.parametrize("when", ["first call", "retrace"])
def test_an_interrupt_during_a_slow_trace_is_raised_at_once(kind, when, implementation):
    """A signal during the trace (or the compilation) of a donated call is raised at
    once, as with ``jax.jit``: nothing was consumed yet, the model is unchanged."""
    signum, handler, raised = INTERRUPT_KINDS[kind]
    slow = [False]

    def step(m: Counted, x: jax.Array) -> jax.Array:
        if slow[0]:
            time.sleep(2.0)  # a long trace, in Python
        return _step_counted(m, x)

    f = treemode.jit(step, donate_argnums=0)
    model = Counted()
    if when == "retrace":
        f(model, jnp.ones(2))
        f(model, jnp.ones(2))  # the memo's plan runs the retrace below
    snap = Snapshot(model)
    slow[0] = True
    previous = signal.signal(signum, handler)
    sender = _Sender(signum)
    try:
        sender.start(0.2)
        started = time.perf_counter()
        with pytest.raises(raised):
            f(model, jnp.ones(3))
        elapsed = time.perf_counter() - started
    finally:
        sender.stop()
        signal.signal(signum, previous)
    assert elapsed < 0.2 + 0.5, elapsed
    snap.assert_unchanged()
    slow[0] = False
    count = _state(model)[0]
    f(model, jnp.ones(3))
    assert _state(model)[0] == count + 1


@main_thread_only
def test_a_hold_runs_a_handler_at_once_until_the_donated_buffers_are_consumed():
    """The hold itself: a signal before the executable ran is raised at once; after
    (a donated buffer deleted), at the end of the hold, by the original handler,
    which is back in place."""
    from treemode._pipeline import _interrupts

    def held(donated: list[Any], body: Callable[[], None]) -> None:
        token = _interrupts.hold(donated)
        try:
            body()
        finally:
            _interrupts.close()
            _interrupts.release(token)

    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        donated = [jnp.ones(2), 1.0]
        reached = []
        with pytest.raises(Alarm):
            held(donated, lambda: (signal.raise_signal(signal.SIGALRM), reached.append(1)))
        assert reached == []

        def consume_then_signal() -> None:
            donated[0].delete()  # what running the executable does
            signal.raise_signal(signal.SIGALRM)
            reached.append("end of the hold")

        with pytest.raises(Alarm):
            held(donated, consume_then_signal)
        assert reached == ["end of the hold"]
        assert signal.getsignal(signal.SIGALRM) is _alarm
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert _interrupts._open == [] and _interrupts._deferred == []
    finally:
        signal.signal(signal.SIGALRM, previous)


# The same property, drawn by hypothesis: any kind, any call form, any point of the
# call, after any number of earlier steps; the model then matches the eager program
# run for the steps that happened (``w`` is ``count`` everywhere).
_DURATIONS: dict[str, float] = {}


@st.composite
def interrupts(draw: Any) -> tuple[str, str, float, int]:
    """(kind, call form, when in the call as a fraction of its duration, earlier steps)."""
    kind = draw(st.sampled_from(sorted(INTERRUPT_KINDS)))
    form = draw(st.sampled_from(list(INTERRUPT_FORMS)))
    return kind, form, draw(st.floats(0.0, 1.2)), draw(st.integers(0, 2))


@main_thread_only
@_RANDOM_SIGNALS
@pytest.mark.usefixtures("_jax_frames_kept")
@given(interrupts())
def test_interrupted_donated_calls_match_eager(case: tuple[str, str, float, int]) -> None:
    kind, form, when, earlier = case
    signum, handler, raised = INTERRUPT_KINDS[kind]
    forms = _FORMS.get("forms")
    if forms is None:
        forms = _FORMS["forms"] = _Forms()
    if form not in _DURATIONS:
        _, call = forms.make(form)
        started = time.perf_counter()
        call()
        _DURATIONS[form] = time.perf_counter() - started
    node, call = forms.make(form)
    for _ in range(earlier):
        call()
    before = _state(node)[0]
    assert before == earlier
    counting = _Counting(handler)
    previous = signal.signal(signum, counting)
    sender = _Sender(signum)
    try:
        try:
            sender.start(when * _DURATIONS[form])
            call()
            sender.wait(when * _DURATIONS[form])
        except raised:
            pass
        except Exception as error:
            if not _swallowed_by_jax(form, error, counting, 0, raised):
                raise
        finally:
            sender.stop()
    finally:
        signal.signal(signum, previous)
    assert _broken(node, before) is None, _broken(node, before)
    count = _state(node)[0]
    _next_step(form, node, call)()
    eager = Counted()
    for _ in range(count + 1):
        _step_counted(eager, jnp.ones(2))
    assert _state(node)[0] == _state(eager)[0]
    w = _state(node)[1]  # (one copy per device under pmap)
    np.testing.assert_array_equal(w, np.broadcast_to(_state(eager)[1], w.shape))


_FORMS: dict[str, _Forms] = {}


@main_thread_only
@pytest.mark.parametrize("kind", sorted(INTERRUPT_KINDS))
def test_a_handler_installed_after_the_first_calls_is_held_too(kind, implementation):
    """Repeated calls (the executor's, where the extension is on) read the handler
    table on every call: a handler installed after the first calls waits for the
    write too. The signal is sent by the Variable's own write (a fault at the
    Variable level, which every write path reaches)."""
    signum, handler, raised = INTERRUPT_KINDS[kind]
    f = treemode.jit(_step_counted, donate_argnums=0)
    model = Counted()
    model.w = SignallingParam(jnp.zeros(3))
    for _ in range(3):
        f(model, jnp.ones(2))
    assert f._records  # the executor (compiled, or its Python twin) runs the call
    old = [v.get_raw_value() for v in _counted_variables(model)]
    previous = signal.signal(signum, handler)
    try:
        SignallingParam.signum = signum
        with pytest.raises(raised):
            f(model, jnp.ones(2))
    finally:
        SignallingParam.signum = None
        signal.signal(signum, previous)
    assert all(x.is_deleted() for x in old)
    assert _broken(model, 3) is None and _state(model)[0] == 4  # the step is written
    assert signal.getsignal(signum) is previous
    f(model, jnp.ones(2))
    assert _state(model)[0] == 5
