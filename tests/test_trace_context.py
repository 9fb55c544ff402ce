"""treemode's caches in front of ``jax.jit`` answer to JAX's key (docs/guides/jit.md,
"What is cached"): a change of the trace context or of an input's sharding between
warm calls gives what ``jax.jit`` on the flat arrays gives (dtypes, shardings,
values, retraces), donated and undonated, on the compiled and the Python path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import treemode


class State(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(8.0, dtype=jnp.float32).reshape(8, 1) / 8)
        self.acc = nnx.BatchStat(jnp.zeros((8, 1), jnp.float32))


def _body(w, acc, x):
    """The step on flat arrays: what both peers compute."""
    y = w * x + jnp.asarray(1.0, dtype=float)  # float64 under x64
    h = jnp.dot(w.T, x)
    return y.sum() + h.sum(), (acc + y).astype(acc.dtype)  # as Flax's `v[...] = x` stores


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def _default_device() -> contextlib.AbstractContextManager[None]:
    return jax.default_device(jax.devices()[1])


# Each option JAX keys its traces on, entered after the warm calls.
CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "x64": _x64,
    "matmul_precision": lambda: jax.default_matmul_precision("highest"),
    "dtype_promotion": lambda: jax.numpy_dtype_promotion("strict"),
    "rank_promotion": lambda: jax.numpy_rank_promotion("raise"),
    "default_device": _default_device,
    "debug_nans": lambda: jax.debug_nans(True),
    "debug_infs": lambda: jax.debug_infs(True),
}


def _run_peers(donate: bool, context, x_of: Callable[[], jax.Array]):
    """Two warm calls, then one under ``context``, for treemode and for ``jax.jit`` on
    the flat arrays; each returns per call (result or error type, traces so far)."""
    counts = {"treemode": 0, "jax": 0}

    def step(m, x):
        counts["treemode"] += 1
        out, acc = _body(m.w[...], m.acc[...], x)
        m.acc[...] = acc
        return out

    def flat(w, acc, x):
        counts["jax"] += 1
        return _body(w, acc, x)

    wrapped = treemode.jit(step, donate_argnums=0 if donate else None)
    floor = jax.jit(flat, donate_argnums=1 if donate else ())
    model = State()
    w, acc = jnp.array(model.w[...]), jnp.array(model.acc[...])
    results: dict[str, list] = {"treemode": [], "jax": []}

    def one(name: str) -> None:
        nonlocal w, acc
        try:
            if name == "treemode":
                out = wrapped(model, x_of())
                new = model.acc[...]
            else:
                out, acc = floor(w, acc, x_of())
                new = acc
            results[name].append(
                (
                    jax.typeof(out).dtype,
                    jax.typeof(new).dtype,
                    np.asarray(out).item(),
                    out.sharding.device_set,
                    counts[name],
                )
            )
        except Exception as error:  # noqa: BLE001 (the type is what both must agree on)
            results[name].append((type(error).__name__, counts[name]))

    for name in results:
        one(name)
        one(name)
        with context():
            one(name)
            one(name)
        one(name)
    return results


@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
@pytest.mark.parametrize("option", sorted(CONTEXTS))
def test_a_changed_trace_context_gives_what_jax_jit_gives(implementation, option, donate):
    results = _run_peers(donate, CONTEXTS[option], lambda: jnp.ones((8, 1), jnp.float32))
    assert results["treemode"] == results["jax"]


def test_the_sweep_sees_each_change():
    """The sweep would catch a stale program: each option changes what ``jax.jit``
    does (a dtype, an error, a retrace), so an unchanged result cannot pass by luck."""
    for option, context in CONTEXTS.items():
        if option.startswith("debug_"):
            continue  # they change nothing in a program without NaNs or infinities
        results = _run_peers(False, context, lambda: jnp.ones((8, 1), jnp.float32))["jax"]
        assert results[2] != results[1], option


@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
def test_an_input_of_another_sharding_gets_its_own_program(implementation, donate):
    """Explicit sharding: a replicated input after warm calls with a sharded one of the
    same shape gets a program typed for it, as under ``jax.jit``."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))

    def typed(tree):
        return [str(jax.typeof(leaf).sharding.spec) for leaf in jax.tree.leaves(tree)]

    def step(m, x):
        m.acc[...] = m.acc[...] + m.w[...] * x
        return m.w[...] * x

    def flat(w, acc, x):
        return w * x, acc + w * x

    with jax.set_mesh(mesh):
        sharded = NamedSharding(mesh, P("x"))
        replicated = NamedSharding(mesh, P())
        wrapped = treemode.jit(step, donate_argnums=0 if donate else None)
        floor = jax.jit(flat, donate_argnums=1 if donate else ())
        seen: dict[str, list] = {"treemode": [], "jax": []}
        for name in seen:
            model = State()
            w = jax.device_put(model.w[...], sharded)
            acc = jax.device_put(model.acc[...], sharded)
            for placement in (sharded, sharded, replicated, replicated):
                if name == "treemode":  # the donated accumulator is the model's new one
                    w, acc = model.w[...], model.acc[...]
                model.w.value = w = jax.device_put(w, placement)
                model.acc.value = acc = jax.device_put(acc, placement)
                x = jax.device_put(jnp.ones((8, 1)), placement)
                if name == "treemode":
                    out = wrapped(model, x)
                    seen[name].append(typed((out, model.acc[...])))
                else:
                    out, acc = floor(w, acc, x)
                    seen[name].append(typed((out, acc)))
        assert seen["treemode"] == seen["jax"]
        assert seen["jax"][0] != seen["jax"][2]
