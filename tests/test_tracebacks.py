"""treemode's frames are filtered from user tracebacks the way JAX filters its own.

Every entry point from the user's code (a wrapper's call, the compiled
executor's miss, the eager loops, the constructors) is a boundary of JAX's
traceback filtering, and the package is registered with it: with JAX's default
``JAX_TRACEBACK_FILTERING=auto`` an error in the user's function shows the
call site and the user's frames only; with ``off``, treemode's frames are back.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode
from treemode._tree import _recursion

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


# -- Every printed part of a user mistake's traceback, chained causes included ------


class Hashless:
    """A static argument whose ``__hash__`` raises: the user's frame stays in the cause."""

    def __hash__(self) -> int:
        raise TypeError("Hashless cannot be hashed")


def _unhashable_static(m):
    treemode.jit(lambda m, s: m.w[...], static_argnums=1)(m, [1, 2])


def _raising_hash(m):
    treemode.jit(lambda m, s: m.w[...], static_argnums=1)(m, Hashless())


def _static_out_of_range(m):
    treemode.jit(lambda m: m.w[...], static_argnums=3)(m)


def _shared_variable(m):
    m.again = m.w
    treemode.jit(lambda m: m.w[...])(m)


def _new_attribute(m):
    def grow(m):
        m.extra = nnx.Param(jnp.zeros(1))

    treemode.jit(grow)(m)


def _model_mapped_with_the_batch(m):
    treemode.vmap(lambda m, x: m.w[...] * x, in_axes=(0, 0))(m, jnp.ones((3, 2)))


def _donated_twice(m):
    step = treemode.jit(lambda d: {"a": d["a"] + 1}, donate_argnums=0)
    state = {"a": jnp.ones(2)}
    step(state)
    step(state)  # its buffer was donated to the first call


def _check_no_aliases(m):
    m.again = m.w
    treemode.check_no_aliases(model=m)


def _proxy_of_a_number(m):
    treemode.Pytree(3)


def _proxy_edited(m):
    proxy = treemode.Pytree(m)
    proxy.w = nnx.Param(jnp.zeros(2))


class Link(nnx.Module):
    def __init__(self, child):
        self.w = nnx.Param(jnp.zeros(()))
        self.child = child


def _nested_too_deeply(m):
    """Deeper than the recursion limit (no headroom above it): refused with treemode's
    error, raised ``from None`` (test_hostile.py checks the refusal itself)."""
    limit = sys.getrecursionlimit()
    deep = None
    for _ in range(limit):
        deep = Link(deep)
    with mock.patch.object(_recursion, "RECURSION_HEADROOM", limit):
        treemode.jit(lambda m: 0, graph=True)(deep)


MISTAKES = [
    (_unhashable_static, treemode.StaticArgumentError, TypeError),
    (_raising_hash, treemode.StaticArgumentError, TypeError),
    (_static_out_of_range, treemode.StaticArgumentError, None),
    (_shared_variable, treemode.AliasError, None),
    (_new_attribute, treemode.StructureError, None),
    (_model_mapped_with_the_batch, treemode.AxisError, None),
    (_donated_twice, treemode.TreemodeError, Exception),
    (_check_no_aliases, treemode.AliasError, None),
    (_proxy_of_a_number, TypeError, None),
    (_proxy_edited, treemode.ProxyError, None),
    (_nested_too_deeply, treemode.StructureError, None),
]


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions a printed traceback shows with it (causes, contexts)."""
    out = []
    while error is not None:
        out.append(error)
        if error.__cause__ is not None:
            error = error.__cause__
        elif not error.__suppress_context__:
            error = error.__context__
        else:
            break
    return out


@pytest.mark.parametrize(
    ("mistake", "raised", "cause"), MISTAKES, ids=lambda x: getattr(x, "__name__", "")
)
def test_no_printed_part_of_a_mistakes_traceback_starts_in_treemode(
    mistake, raised, cause, filtering, implementation
):
    """The whole exception as Python prints it (``traceback.format_exception``, chained
    causes and contexts included) shows no treemode frame, and every treemode class
    under its public name (``treemode.AliasError``)."""
    filtering("auto")
    with pytest.raises(raised) as info:
        mistake(Model())
    printed = "".join(traceback.format_exception(info.value))
    assert PACKAGE not in printed, printed
    chain = _chain(info.value)
    if cause is not None:
        assert len(chain) >= 2 and isinstance(chain[1], cause), printed
    for error in chain:
        header = traceback.format_exception_only(error)[0]
        assert not header.startswith("treemode._"), header
        if type(error).__module__.startswith("treemode"):
            assert header.startswith(f"treemode.{type(error).__name__}: "), header
    assert printed.count("JAX has removed its internal frames") == 1, printed


def test_the_users_own_frame_stays_in_a_cause(filtering):
    """A cause raised in the user's code (a ``__hash__``) keeps the user's frame."""
    filtering("auto")
    with pytest.raises(treemode.StaticArgumentError) as info:
        _raising_hash(Model())
    cause = info.value.__cause__
    assert isinstance(cause, TypeError)
    assert [f.name for f in traceback.extract_tb(cause.__traceback__)] == ["__hash__"]
    printed = "".join(traceback.format_exception(info.value))
    assert "Hashless cannot be hashed" in printed and PACKAGE not in printed


def test_with_filtering_off_a_causes_treemode_frames_reappear(filtering):
    filtering("off")
    with pytest.raises(treemode.StaticArgumentError) as info:
        _unhashable_static(Model())
    assert PACKAGE in "".join(traceback.format_exception(info.value.__cause__))


def _public_classes() -> list[type]:
    return [
        value
        for name, value in vars(treemode).items()
        if not name.startswith("_")
        and isinstance(value, type)
        and issubclass(value, (Exception, Warning))
    ]


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_public_errors_and_warnings_display_under_their_public_name(cls):
    """``treemode.AliasError``, not ``treemode._errors.AliasError``: in tracebacks, in
    ``repr`` of the class, and pickle finds the class (and its instances) by that name."""
    assert cls.__module__ == "treemode", cls
    assert getattr(treemode, cls.__qualname__) is cls
    assert repr(cls) == f"<class 'treemode.{cls.__name__}'>"
    error = cls("a message")
    header = traceback.format_exception_only(error)[0]
    assert header == f"treemode.{cls.__name__}: a message\n", header
    assert pickle.loads(pickle.dumps(cls)) is cls
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls and again.args == ("a message",)


def test_every_public_error_class_is_checked():
    names = {c.__name__ for c in _public_classes()}
    assert {"AliasError", "TreemodeError", "DonationError", "VersionWarning"} <= names
    assert {"ExtensionWarning", "ClosureWarning", "BroadcastRngsWarning"} <= names


def test_the_errors_of_argnums_and_cycles_display_under_their_public_name():
    """Before: ``treemode._transforms._grad._ArgnumsError`` and
    ``treemode._tree._recursion.CycleError``; both are public now, and caught
    by their public names (an argnums error is also JAX's TypeError and Flax's
    ValueError; a cycle is a StructureError)."""
    with pytest.raises(treemode.ArgnumsError) as info:
        treemode.grad(lambda m: m, argnums="m")
    header = traceback.format_exception_only(info.value)[0]
    assert header.startswith("treemode.ArgnumsError: treemode.grad: argnums must be"), header
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)

    class Holder(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.items = nnx.List([])

    m = Holder()
    m.items.append(m)
    with pytest.raises(treemode.CycleError) as cycle:
        treemode.to_tree(m)
    header = traceback.format_exception_only(cycle.value)[0]
    assert header.startswith("treemode.CycleError: "), header
    assert isinstance(cycle.value, treemode.StructureError)
