"""Every transform runs through one orchestrator (`treemode._pipeline._core.run`).

Two failures inside the function that treemode explains, the same for every
transform and entry point: an input module holds a value traced by a JAX
transform that has already returned (a tracer kept after its trace) and the
function uses it; an input's buffer was deleted (donated to an earlier call).
Each transform must explain it the same way (the error type, a message naming
the transform, the path of the Variable and the fix) and leave its inputs
exactly as they were, although the function changed a Variable before failing.

Also here: the module import graph of the package has no cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import treemode

_LEAKED: list[Any] = []


def _leak(x):
    _LEAKED.append(x)  # kept after the trace ends: the failure every case hits
    return x


# A tracer of jax.vmap: JAX raises on it while tracing abstractly too (eval_shape).
jax.vmap(_leak)(jnp.ones((3, 2)))
LEAKED = _LEAKED[0]


class Model(nnx.Module):
    def __init__(self, w: Any):
        self.w = nnx.Param(jnp.zeros(2))
        self.count = nnx.BatchStat(jnp.array(0))
        self.w.set_raw_value(w)


def uses_leaked(m, x):
    m.count[...] += 1  # changed before the failure: must not reach the caller
    return jnp.sum(m.w[...] * x + LEAKED)


def reads(m, x):
    m.count[...] += 1
    return jnp.sum(m.w[...] * x)


X = jnp.ones(2)


def _aot(f, m):
    compiled = treemode.jit(f).lower(Model(jnp.zeros(2)), X).compile()
    return compiled(m, X)


def _while(f, m):
    def body(v):
        return v[0], v[1] + f(v[0], v[1])

    return treemode.while_loop(lambda v: v[0].count[...] < 1, body, (m, X))


def _fori(f, m):
    def body(i, v):
        return v[0], v[1] + f(v[0], v[1])

    return treemode.fori_loop(0, 1, body, (m, X))


def _custom_vjp(f, m):
    g = treemode.custom_vjp(f)
    g.defvjp(lambda m, x: (f(m, x), None), lambda res, ct: (None, ct * X))
    return g(m, X)


def _shard_map(f, m):
    mesh = jax.make_mesh((2,), ("d",))
    return treemode.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P())(m, X)


def _transform_metadata(f, m):
    return treemode.transform_metadata(f, in_axes=None, out_axes=None, partition="p")(m, X)


N = jax.local_device_count()
XS = jnp.stack([X, X])

# name: (the transform the message names, the input's name, how to call it)
CASES: dict[str, tuple[str, str, Callable[[Callable[..., Any], Model], Any]]] = {
    "jit": ("jit", "args[0]", lambda f, m: treemode.jit(f)(m, X)),
    "jit.trace": ("jit", "args[0]", lambda f, m: treemode.jit(f).trace(m, X)),
    "jit.lower": ("jit", "args[0]", lambda f, m: treemode.jit(f).lower(m, X)),
    "jit.eval_shape": ("jit", "args[0]", lambda f, m: treemode.jit(f).eval_shape(m, X)),
    "Compiled.__call__": ("jit", "args[0]", _aot),
    "jit_partial": ("jit", "args[0]", lambda f, m: treemode.jit_partial(f, m)(X)),
    "eval_shape": ("eval_shape", "args[0]", lambda f, m: treemode.eval_shape(f, m, X)),
    "vmap": ("vmap", "args[0]", lambda f, m: treemode.vmap(f, in_axes=(None, 0))(m, XS)),
    "pmap": (
        "pmap",
        "args[0]",
        lambda f, m: treemode.pmap(f, in_axes=(None, 0))(m, jnp.ones((N, 2))),
    ),
    "shard_map": ("shard_map", "args[0]", _shard_map),
    "scan": (
        "scan",
        "args[0]",
        lambda f, m: treemode.scan(f, in_axes=(None, 0), out_axes=0)(m, XS),
    ),
    "while_loop": ("while_loop", "init_val[0]", _while),
    "fori_loop": ("fori_loop", "init_val[0]", _fori),
    "cond": ("cond", "args[0]", lambda f, m: treemode.cond(jnp.array(True), f, f, m, X)),
    "switch": ("switch", "args[0]", lambda f, m: treemode.switch(jnp.array(1), [f, f], m, X)),
    "grad": ("grad", "args[0]", lambda f, m: treemode.grad(f)(m, X)),
    "value_and_grad": ("value_and_grad", "args[0]", lambda f, m: treemode.value_and_grad(f)(m, X)),
    "vjp": ("vjp", "args[0]", lambda f, m: treemode.vjp(f, m, X)),
    "jvp": ("jvp", "args[0]", lambda f, m: treemode.jvp(f, (m, X), (None, X))),
    "custom_vjp": ("custom_vjp", "args[0]", _custom_vjp),
    "remat": ("remat", "args[0]", lambda f, m: treemode.remat(f)(m, X)),
    "checkify": ("checkify", "args[0]", lambda f, m: treemode.checkify(f)(m, X)),
    "transform_metadata": ("transform_metadata", "args[0]", _transform_metadata),
}
# Only values of the current trace reach a compiled executable (JAX rejects a tracer
# there before anything runs), and abstract evaluation never reads a buffer.
TRACER_CASES = sorted(set(CASES) - {"Compiled.__call__"})
BUFFER_CASES = sorted(set(CASES) - {"jit.trace", "jit.lower", "jit.eval_shape", "eval_shape"})


def _assert_explained_and_untouched(case: str, m: Model, f: Callable[..., Any], error: type):
    transform, root, call = CASES[case]
    variables = [m.w, m.count]
    values = [v.get_raw_value() for v in variables]
    metadata = [dict(v.get_metadata()) for v in variables]
    with pytest.raises(error) as info:
        call(f, m)
    assert str(info.value).startswith(f"treemode.{transform}: ")
    assert [m.w, m.count] == variables  # the same Variables...
    assert all(v.get_raw_value() is x for v, x in zip(variables, values, strict=True))
    assert [dict(v.get_metadata()) for v in variables] == metadata  # ...values, metadata
    return str(info.value), root


@pytest.mark.parametrize("case", TRACER_CASES)
def test_a_leaked_tracer_is_explained_the_same_way(case):
    message, root = _assert_explained_and_untouched(
        case, Model(LEAKED), uses_leaked, treemode.TraceContextError
    )
    assert f"the Param at {root}.w holds a value traced by a JAX transform" in message
    assert "Return new modules from the transform instead of storing them" in message


@pytest.mark.parametrize("case", BUFFER_CASES)
def test_a_deleted_buffer_is_explained_the_same_way(case, hooks):
    hooks.donation_seen(True)  # a donating call ran: the likely cause is a shared buffer
    w = jnp.ones(2)
    w.delete()
    message, root = _assert_explained_and_untouched(case, Model(w), reads, treemode.DonationError)
    assert f"the buffer of the Param at {root}.w has been deleted or donated" in message
    assert "treemode.clone(module, arrays=True)" in message


@pytest.mark.parametrize("case", BUFFER_CASES)
def test_a_buffer_deleted_without_any_donation_is_blamed_on_the_user(case, hooks):
    hooks.donation_seen(False)  # no treemode transform ever donated a buffer
    w = jnp.ones(2)
    w.delete()
    message, root = _assert_explained_and_untouched(case, Model(w), reads, RuntimeError)
    assert f"the buffer of the Param at {root}.w was deleted before this call" in message
    assert "no treemode transform has donated buffers" in message
    assert "shared its buffer" not in message


# -- no import cycle inside the package ----------------------------------------------------
