"""while_loop, fori_loop, cond, switch and checkify over modules, with write-back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter, Stateful, assert_same_state, state_arrays, variable_buffers
from jax.experimental import checkify

import treemode


class Acc(nnx.Module):
    def __init__(self):
        self.total = nnx.Variable(jnp.array(0.0))
        self.scale = nnx.Param(jnp.array(2.0))


def snapshot(*nodes):
    return [state_arrays(n) for n in nodes], [variable_buffers(n) for n in nodes]


def assert_unchanged(before, *nodes):
    values, buffers = before
    now_values, now_buffers = snapshot(*nodes)
    for a, b in zip(values, now_values, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    for a, b in zip(buffers, now_buffers, strict=True):
        assert all(x is y for x, y in zip(a, b, strict=True))


# -- while_loop --------------------------------------------------------------------------


def test_while_loop_writes_back_and_returns_the_same_module():
    counter = Counter()

    def body(val):
        c, x = val
        c(x)
        return c, x * 2

    out, x = treemode.while_loop(lambda v: v[1].sum() < 50, body, (counter, jnp.ones(2)))
    assert out is counter
    assert int(counter.count[...]) == 5 and x.tolist() == [32.0, 32.0]
    np.testing.assert_allclose(counter.total[...], 2 + 4 + 8 + 16 + 32 - 0 * 1 - 0)


def test_while_loop_read_only_parameters_keep_their_buffers():
    acc = Acc()
    scale = acc.scale.get_raw_value()

    def body(a):
        a.total[...] += a.scale[...]
        return a

    treemode.while_loop(lambda a: a.total[...] < 7, body, acc)
    assert float(acc.total[...]) == 8.0
    assert acc.scale.get_raw_value() is scale


def test_while_loop_cond_sees_closure_state_changed_by_body():
    counter = Counter()

    def body(x):
        counter.count[...] += 1
        return x + 1

    out = treemode.while_loop(lambda x: counter.count[...] < 5, body, 0)
    assert int(out) == 5 and int(counter.count[...]) == 5


def test_while_loop_duplicated_init_is_an_alias_error():
    """Flax's tree-mode while_loop skips this check and silently loses an update."""
    acc = Acc()
    before = snapshot(acc)

    def body(val):
        a, b = val
        a.total[...] += 1
        b.total[...] += 1
        return a, b

    match = r"found at paths init_val\[0\]\.scale and init_val\[1\]\.scale"
    with pytest.raises(treemode.AliasError, match=match):
        treemode.while_loop(lambda v: v[0].total[...] < 3, body, (acc, acc))
    assert_unchanged(before, acc)


def test_while_loop_cond_must_not_change_variables():
    acc = Acc()

    def cond(a):
        a.total[...] += 1
        return a.total[...] < 3

    with pytest.raises(treemode.StructureError, match=r"cond_fun changed the Variable"):
        treemode.while_loop(cond, lambda a: a, acc)


def test_while_loop_body_returning_a_new_module_is_an_error():
    acc = Acc()
    before = snapshot(acc)
    with pytest.raises(treemode.StructureError, match=r"carry at init_val must stay the same"):
        treemode.while_loop(lambda a: a.total[...] < 3, lambda a: Acc(), acc)
    assert_unchanged(before, acc)


def test_while_loop_body_changing_a_variable_dtype_is_an_error():
    acc = Acc()

    def body(a):
        a.total.set_value(a.total[...].astype(jnp.int32))
        return a

    with pytest.raises(treemode.StructureError, match=r"init_val\.total must keep its shape"):
        treemode.while_loop(lambda a: a.total[...] < 3, body, acc)


# -- fori_loop ---------------------------------------------------------------------------


def test_fori_loop_matches_an_eager_loop_with_batchnorm_dropout_and_rngs():
    model = Stateful(nnx.Rngs(0))
    eager = treemode.clone(model)
    x = jnp.arange(12.0).reshape(4, 3)

    def body(i, val):
        m, y = val
        return m, y + m(x * i)

    m, y = treemode.fori_loop(0, 3, body, (model, jnp.zeros((4, 4))))
    want = sum(eager(x * i) for i in range(3))
    assert m is model
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert_same_state(model, eager)


def test_fori_loop_closure_module_and_dynamic_bounds_under_jit():
    acc = Acc()

    @treemode.jit
    def run(n):
        def body(i, carry):
            acc.total[...] += i
            return carry

        return treemode.fori_loop(0, n, body, jnp.array(0))

    run(jnp.array(5))
    assert float(acc.total[...]) == 10.0


def test_fori_loop_static_bounds_are_differentiable():
    def loss(w):
        acc = Acc()
        acc.scale[...] = w

        def body(i, a):
            a.total[...] += a.scale[...] * i
            return a

        treemode.fori_loop(0, 4, body, acc)
        return acc.total[...]

    assert float(jax.grad(loss)(3.0)) == 6.0


def test_fori_loop_alias_error():
    acc = Acc()
    with pytest.raises(treemode.AliasError):
        treemode.fori_loop(0, 2, lambda i, v: v, {"a": acc, "b": acc})


# -- cond / switch --------------------------------------------------------------------------


def _bump(c, x):
    c.count[...] += 1
    return x + 1


def test_cond_only_one_branch_changes_a_variable():
    counter = Counter()
    total = counter.total.get_raw_value()
    y = treemode.cond(jnp.array(True), _bump, lambda c, x: x, counter, jnp.array(1.0))
    assert float(y) == 2.0 and int(counter.count[...]) == 1
    y = treemode.cond(jnp.array(False), _bump, lambda c, x: x, counter, jnp.array(1.0))
    assert float(y) == 1.0 and int(counter.count[...]) == 1
    assert counter.total.get_raw_value() is total  # changed by neither branch


def test_cond_branches_with_different_closure_modules():
    a, b = Acc(), Acc()

    def left(x):
        a.total[...] += x
        return x

    def right(x):
        b.total[...] += 2 * x
        return -x

    treemode.cond(True, left, right, jnp.array(3.0))
    treemode.cond(False, left, right, jnp.array(3.0))
    assert float(a.total[...]) == 3.0 and float(b.total[...]) == 6.0


def test_cond_inside_jit_writes_back():
    counter = Counter()

    @treemode.jit
    def step(c, flag):
        return treemode.cond(flag, _bump, lambda c, x: x, c, jnp.array(0.0))

    step(counter, jnp.array(True))
    step(counter, jnp.array(False))
    step(counter, jnp.array(True))
    assert int(counter.count[...]) == 2


def test_cond_duplicated_operand_is_an_alias_error():
    counter = Counter()
    with pytest.raises(treemode.AliasError):
        treemode.cond(True, lambda a, b: None, lambda a, b: None, counter, counter)


def test_cond_branch_changing_variable_type_is_an_error():
    counter = Counter()
    before = snapshot(counter)

    def bad(c):
        c.total.set_value(jnp.zeros(3))

    with pytest.raises(treemode.StructureError, match=r"args\[0\]\.total must keep its shape"):
        treemode.cond(True, bad, lambda c: None, counter)
    assert_unchanged(before, counter)


def test_switch_selects_and_clamps_like_jax():
    acc = Acc()

    def add(k):
        def branch(a, x):
            a.total[...] += k * x
            return a.total[...]

        return branch

    branches = [add(1.0), add(10.0), add(100.0)]
    for i in [0, 2, 2, 7, -3]:  # out of range is clamped, as in jax.lax.switch
        treemode.switch(jnp.array(i), branches, acc, jnp.array(1.0))
    assert float(acc.total[...]) == 1 + 100 + 100 + 100 + 1


# -- checkify --------------------------------------------------------------------------------


def _checked_step(counter, x):
    checkify.check(jnp.all(x > 0), "x must be positive")
    return counter(x)


def test_checkify_writes_back_and_reports_errors():
    counter = Counter()
    checked = treemode.checkify(_checked_step)
    err, y = checked(counter, jnp.ones(2))
    assert err.get() is None and y.tolist() == [2.0, 2.0]
    assert int(counter.count[...]) == 1
    err, _ = checked(counter, -jnp.ones(2))
    assert "x must be positive" in err.get()
    with pytest.raises(checkify.JaxRuntimeError):
        err.throw()


def test_checkify_float_checks_under_jit():
    counter = Counter()

    @treemode.jit
    def run(c, x):
        return treemode.checkify(lambda c, x: c(jnp.log(x)), errors=checkify.float_checks)(c, x)

    err, _ = run(counter, jnp.array([-1.0]))
    assert "nan generated" in err.get()
    assert int(counter.count[...]) == 1
