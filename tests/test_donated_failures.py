"""A donated call that fails while its executable runs keeps JAX's error.

After XLA took the donated buffers, a failure (a host callback that raises, a
run-time error) is JAX's own exception, same type and message, with a note
naming the Variables whose buffers are now deleted; it is never blamed on an
earlier donation. Under ``jax.debug_nans`` / ``jax.debug_infs`` a donated step
(warm, on the compiled fast path or not) runs undonated, so JAX's re-run names
the primitive that made the NaN/Inf and the model keeps its buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.b = nnx.Param(jnp.zeros(3))
        self.scale = nnx.Param(jnp.ones(()))  # only read: never donated


def _boom(x):
    if np.sum(x) > 100:
        raise ValueError("the callback failed")


def _wrong_shape(x):
    # The runtime refuses a result of the wrong shape (a failure JAX raises itself).
    return np.zeros(5 if np.sum(x) > 100 else 3, np.float32)


def _step_with(callback):
    @treemode.jit(donate_argnums=0)
    def step(m, x):
        m.w[...] = m.w[...] + x
        m.b[...] = m.b[...] - x
        return jnp.sum(m.w[...] * m.scale[...]) + callback(x)

    return step


def _raise_in_callback(x):
    jax.debug.callback(_boom, x)
    return 0.0


def _runtime_failure(x):
    return jnp.sum(jax.pure_callback(_wrong_shape, jax.ShapeDtypeStruct((3,), jnp.float32), x))


FAIL = jnp.full(3, 1000.0)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize(
    "callback, text",
    [(_raise_in_callback, "the callback failed"), (_runtime_failure, "")],
    ids=["raising-callback", "runtime-failure"],
)
def test_a_failure_during_execution_keeps_jaxs_error_and_names_the_consumed(callback, text, warm):
    step = _step_with(callback)
    m = Model()
    if warm:  # compiled, and (with the extension) on the fast-path record
        step(m, jnp.ones(3))
        step(m, jnp.ones(3))
    try:
        step(m, FAIL)
        jax.block_until_ready(m.w[...])
        raise AssertionError("expected the call to fail")
    except jax.errors.JaxRuntimeError as e:  # JAX's own type, not a treemode error
        error = e
    assert not isinstance(error, treemode.TreemodeError)
    assert text in str(error)
    assert "donated to an earlier call" not in str(error)
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "after XLA took the buffers it donated" in notes
    assert "treemode.clone(module, arrays=True)" in notes
    # As with jax.jit's donate_argnums: the consumed buffers are deleted, and the
    # note names exactly those (a read-only Variable may keep its buffer).
    assert m.w.get_raw_value().is_deleted() and m.b.get_raw_value().is_deleted()
    for name in ("w", "b", "scale"):
        deleted = getattr(m, name).get_raw_value().is_deleted()
        assert (f"args[0].{name}" in notes) == deleted


def test_a_failure_without_donation_has_no_note_and_keeps_the_model():
    @treemode.jit
    def step(m, x):
        m.w[...] = m.w[...] + x
        jax.debug.callback(_boom, x)
        return m.w[...]

    m = Model()
    before = m.w.get_raw_value()
    with pytest.raises(jax.errors.JaxRuntimeError, match="the callback failed") as info:
        step(m, FAIL)
        jax.block_until_ready(m.w[...])
    assert not any("donated" in n for n in getattr(info.value, "__notes__", []))
    assert m.w.get_raw_value() is before and not before.is_deleted()


def test_an_input_deleted_before_the_call_is_still_a_donation_error():
    m = Model()
    step = _step_with(_raise_in_callback)
    step(m, jnp.ones(3))
    shared = treemode.clone(m)  # shares m's buffers
    step(m, jnp.ones(3))  # donates them
    with pytest.raises(treemode.DonationError, match=r"args\[0\]\.(w|b) has been deleted or don"):
        step(shared, jnp.ones(3))


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_reusing_a_module_a_failed_call_consumed_names_that_failure(warm):
    step = _step_with(_raise_in_callback)
    m = Model()
    if warm:
        step(m, jnp.ones(3))
        step(m, jnp.ones(3))
    with pytest.raises(jax.errors.JaxRuntimeError):
        step(m, FAIL)
        jax.block_until_ready(m.w[...])
    with pytest.raises(treemode.DonationError) as info:
        step(m, jnp.ones(3))
    message = str(info.value)
    assert "args[0].w has been deleted or donated" in message or "args[0].b has been" in message
    assert "failed while its executable ran" in message
    assert "shared" not in message


@pytest.mark.parametrize(
    "checks, make, text",
    [
        (jax.debug_nans, lambda w: jnp.log(w - 2.0), "invalid value (nan) encountered in log"),
        (jax.debug_infs, lambda w: 1.0 / (w - 1.0), "invalid value (inf) encountered in div"),
    ],
    ids=["nans", "infs"],
)
def test_debug_checks_name_the_primitive_on_a_warm_donated_step(checks, make, text):
    @treemode.jit(donate_argnums=0)
    def step(m, x):
        m.w[...] = m.w[...] + x
        return jnp.sum(make(m.w[...]))

    m = Model()
    step(m, jnp.zeros(3))
    step(m, jnp.zeros(3))  # warm: with the extension, run by the fast-path record
    before = m.w.get_raw_value()
    with checks(True):
        with pytest.raises(FloatingPointError, match=text.replace("(", r"\(").replace(")", r"\)")):
            step(m, jnp.zeros(3))
    # Undonated under the check: the model is as it was, its buffers alive.
    assert m.w.get_raw_value() is before and not before.is_deleted()
    np.testing.assert_array_equal(before, np.ones(3))
    # A step without a NaN under the check runs and writes back (not donated).
    with checks(True):
        step(m, jnp.ones(3))
    assert not before.is_deleted()
    np.testing.assert_array_equal(m.w[...], np.full(3, 2.0))
    # Off again: donated as before.
    kept = m.w.get_raw_value()
    step(m, jnp.zeros(3))
    assert kept.is_deleted()
