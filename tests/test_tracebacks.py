"""treemode's frames are filtered from user tracebacks the way JAX filters its own.

Every entry point from the user's code (a wrapper's call, the compiled
executor's miss, the eager loops, the constructors) is a boundary of JAX's
traceback filtering, and the package is registered with it: with JAX's default
``JAX_TRACEBACK_FILTERING=auto`` an error in the user's function shows the
call site and the user's frames only; with ``off``, treemode's frames are back.
"""

from __future__ import annotations

import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode

PACKAGE = os.path.dirname(os.path.abspath(treemode.__file__)) + os.sep


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))


def user_body(m, x):
    if x.shape[-1] == 3:  # a new shape: traced again (on the fast path: the miss)
        raise ValueError("an error in the user's function")
    return m.w[...] * x


def _jit_cold(m):
    treemode.jit(user_body)(m, jnp.ones(3))


def _jit_retrace(m):
    f = treemode.jit(user_body)
    f(m, jnp.ones(2))
    f(m, jnp.ones(2))  # warm (with the extension: the fast-path record)
    f(m, jnp.ones(3))


def _vmap(m):
    treemode.vmap(user_body, in_axes=(None, 0))(m, jnp.ones((4, 3)))


def _scan(m):
    treemode.scan(lambda m, x: (m, user_body(m, x)))(m, jnp.ones((4, 3)))


def _grad(m):
    treemode.grad(lambda m, x: jnp.sum(user_body(m, x)))(m, jnp.ones(3))


def _cond(m):
    treemode.cond(jnp.array(True), user_body, lambda m, x: x, m, jnp.ones(3))


CALLS = [_jit_cold, _jit_retrace, _vmap, _scan, _grad, _cond]


def _frames(error):
    return [(f.filename, f.name) for f in traceback.extract_tb(error.__traceback__)]


@pytest.fixture
def filtering():
    """Set JAX_TRACEBACK_FILTERING for one test (restored after)."""
    before = jax.config.values["jax_traceback_filtering"]
    yield lambda mode: jax.config.update("jax_traceback_filtering", mode)
    jax.config.update("jax_traceback_filtering", before)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__.lstrip("_"))
def test_the_filtered_traceback_shows_the_user_frames_only(call, filtering):
    filtering("auto")  # JAX's default
    with pytest.raises(ValueError, match="an error in the user's function") as info:
        call(Model())
    frames = _frames(info.value)
    assert not [f for f in frames if f[0].startswith(PACKAGE)], frames
    names = [name for _, name in frames]
    assert names[0] == "test_the_filtered_traceback_shows_the_user_frames_only"
    assert call.__name__ in names  # the call site
    assert names[-1] == "user_body"  # where it was raised
    assert all("/jax/" not in path for path, _ in frames), frames
    # One note, as JAX's own boundary adds.
    notes = getattr(info.value, "__notes__", [])
    assert sum("JAX has removed its internal frames" in n for n in notes) == 1


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__.lstrip("_"))
def test_with_filtering_off_treemodes_frames_reappear(call, filtering):
    filtering("off")
    with pytest.raises(ValueError, match="an error in the user's function") as info:
        call(Model())
    frames = _frames(info.value)
    assert [f for f in frames if f[0].startswith(PACKAGE)], frames
    assert frames[-1][1] == "user_body"
    assert not any("JAX has removed" in n for n in getattr(info.value, "__notes__", []))


def _boom(x):
    if np.sum(x) > 100:
        raise ValueError("the callback failed")


def test_a_run_time_error_on_the_fast_path_is_filtered_once(filtering):
    filtering("auto")

    @treemode.jit(donate_argnums=0)
    def step(m, x):
        jax.debug.callback(_boom, x)
        m.w[...] += x
        return m.w[...]

    m = Model()
    step(m, jnp.ones(2))
    step(m, jnp.ones(2))  # warm: the executor (with the extension) runs the next call
    with pytest.raises(jax.errors.JaxRuntimeError, match="the callback failed") as info:
        step(m, jnp.full(2, 1000.0))
    frames = _frames(info.value)
    assert not [f for f in frames if f[0].startswith(PACKAGE)], frames
    notes = getattr(info.value, "__notes__", [])
    assert sum("JAX has removed its internal frames" in n for n in notes) == 1
    assert sum("after XLA took the buffers it donated" in n for n in notes) == 1


def test_treemodes_own_errors_are_filtered_too(filtering):
    filtering("auto")

    def grow(m):
        m.extra = nnx.Param(jnp.zeros(1))  # structural: refused

    with pytest.raises(treemode.StructureError) as info:
        treemode.jit(grow)(Model())
    frames = _frames(info.value)
    assert not [f for f in frames if f[0].startswith(PACKAGE)], frames
    assert frames[0][1] == "test_treemodes_own_errors_are_filtered_too"
    # An error at construction (a misspelled keyword) as well.
    with pytest.raises(TypeError, match="Did you mean 'donate_argnums'") as info:
        treemode.jit(grow, donate_argnum=0)  # type: ignore[call-overload]
    assert not [f for f in _frames(info.value) if f[0].startswith(PACKAGE)]
