"""`_callsite.run_plan`, the Python twin of the compiled memo call, on the plan it shares.

Where the extension is on, ``treemode.jit`` calls run the plan in C; these tests
run the same plan through ``run_plan`` with each implementation of the helpers
(`implementation`), so the Python twin is checked in both modes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode
from treemode._pipeline import _callsite


class Counter(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.count = nnx.BatchStat(jnp.array(0))


class OtherCounter(Counter):
    pass


_MEMO_PLAN = _callsite.memo_plan  # the `implementation` fixture's "python" turns plans off


@pytest.fixture
def helpers(implementation, monkeypatch):
    """Plans on, with the compiled or the Python helpers (`implementation`)."""
    monkeypatch.setattr(_callsite, "memo_plan", _MEMO_PLAN)
    return implementation


def _step(m: Counter, x: jax.Array) -> jax.Array:
    m.count[...] += 1
    m.w[...] = m.w[...] + x
    return jnp.sum(m.w[...])


def _called_twice(**jit_kwargs):
    f = treemode.jit(_step, **jit_kwargs)
    m = Counter()
    f(m, jnp.ones(3))
    f(m, jnp.ones(3))  # the first write through the memo remembers the trace writable
    memo = f._memo
    assert memo is not None and memo[2] is not None, "no memo plan was made"
    return f, m, memo[2]


def test_a_matching_call_runs_the_plan_and_writes_back(helpers):
    f, m, plan = _called_twice()
    out = _callsite.run_plan(plan, (m, jnp.ones(3)))
    assert out is not _callsite.MISS
    np.testing.assert_allclose(out, 12.0)  # w went 1 -> 2 -> 3 -> 4
    assert int(m.count[...]) == 3
    np.testing.assert_allclose(m.w[...], np.full(3, 4.0))


def test_a_donated_call_runs_the_plan_and_gets_fresh_buffers(helpers):
    _, m, plan = _called_twice(donate_argnums=0)
    before = m.w[...]
    out = _callsite.run_plan(plan, (m, jnp.ones(3)))
    np.testing.assert_allclose(out, 12.0)
    assert before.is_deleted() and not m.w[...].is_deleted()


@pytest.mark.parametrize(
    "change",
    ["new attribute", "replaced Variable", "new class", "another object", "array for the model"],
)
def test_a_call_the_plan_does_not_describe_is_a_miss_and_writes_nothing(helpers, change):
    f, m, plan = _called_twice()
    target = m
    if change == "new attribute":
        m.scale = 2  # pyright: ignore[reportAttributeAccessIssue]
    elif change == "replaced Variable":
        m.count = nnx.BatchStat(jnp.array(5))
    elif change == "new class":
        m.__class__ = OtherCounter
    elif change == "another object":
        target = Counter()
    else:
        target = jnp.ones(3)
    values = [np.asarray(v[...]) for v in (m.w, m.count)]
    assert _callsite.run_plan(plan, (target, jnp.ones(3))) is _callsite.MISS
    for v, before in zip((m.w, m.count), values, strict=True):
        np.testing.assert_array_equal(v[...], before)
    # The call itself (through `_call`, which prepares in full) still runs correctly.
    if isinstance(target, Counter):
        f(target, jnp.ones(3))
        expected = {"another object": 1, "replaced Variable": 6}.get(change, 3)
        assert int(target.count[...]) == expected


def test_a_failure_inside_the_plan_call_is_explained_and_unbinds(helpers):
    _, m, plan = _called_twice()
    with pytest.raises(TypeError, match="incompatible shapes"):  # a new shape retraces
        _callsite.run_plan(plan, (m, jnp.ones(4)))
    assert getattr(plan.entry.binding, "call", None) is None
    assert int(m.count[...]) == 2


class EqualToAll(nnx.Module):
    """A module whose ``==`` claims equality with anything (None included)."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))

    def __eq__(self, other):
        return True

    __hash__ = nnx.Module.__hash__


def test_closure_objects_are_matched_by_identity_not_equality(helpers):
    held = EqualToAll()
    f = treemode.jit(lambda x: held.w[...] + x)
    f(jnp.ones(3))
    f(jnp.ones(3))
    memo = f._memo
    assert memo is not None and memo[2] is not None
    out = _callsite.run_plan(memo[2], (jnp.ones(3),))
    assert out is not _callsite.MISS  # a live object is not taken for a dead one
    np.testing.assert_allclose(out, np.full(3, 2.0))
