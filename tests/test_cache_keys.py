"""What a cached call compares: static values with their types, Variable metadata of any kind.

A trace is specialized on every static value it saw, so a cached trace may be
reused only for static values the program cannot tell apart: equal *and* of the
same type (``2 == 2.0``, but ``x * 2`` is int32 where ``x * 2.0`` is float32).
Each case compares the jitted result with the eager program's (and, for
``static_argnums``, with ``jax.jit``'s).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode

# (first value, then an equal value of another type)
EQUAL_OTHER_TYPE = [
    (2, 2.0),
    (1, 1 + 0j),
    (2, np.int32(2)),
    (True, 1),
    (1, True),
    ((2,), (2.0,)),
    ((1, (True,)), (1, (1,))),
]
IDS = ["int-float", "int-complex", "int-np.int32", "bool-int", "int-bool", "tuple", "nested"]


def _program(x, s):
    """A result whose dtype depends on the type of ``s`` (at any depth of a tuple)."""
    leaves = jax.tree_util.tree_leaves(s)
    return [x * leaf for leaf in leaves] + [jnp.asarray(leaf) for leaf in leaves]


def _dtypes(out):
    return [jnp.asarray(y).dtype for y in out]


class Scaled(nnx.Module):
    def __init__(self, s):
        self.w = nnx.Param(jnp.arange(3, dtype=jnp.int32))
        self.s = s  # a static attribute (not an array, not a Variable)


@pytest.mark.parametrize(("first", "second"), EQUAL_OTHER_TYPE, ids=IDS)
def test_static_argnums_value_of_another_type_retraces_like_jax_jit(first, second):
    x = jnp.arange(3, dtype=jnp.int32)
    ours = treemode.jit(_program, static_argnums=1)
    theirs = jax.jit(_program, static_argnums=1)
    for s in (first, second, first):
        eager = _program(x, s)
        assert _dtypes(ours(x, s)) == _dtypes(eager)
        if not isinstance(s, tuple):  # jax.jit compares the top-level type only
            assert _dtypes(theirs(x, s)) == _dtypes(eager)


@pytest.mark.parametrize(("first", "second"), EQUAL_OTHER_TYPE, ids=IDS)
def test_static_argnames_value_of_another_type_retraces(first, second):
    x = jnp.arange(3, dtype=jnp.int32)
    ours = treemode.jit(lambda x, *, s: _program(x, s), static_argnames="s")
    for s in (first, second):
        assert _dtypes(ours(x, s=s)) == _dtypes(_program(x, s))


@pytest.mark.parametrize("graph", [False, True], ids=["tree", "graph"])
@pytest.mark.parametrize(("first", "second"), EQUAL_OTHER_TYPE, ids=IDS)
def test_module_attribute_replaced_by_equal_value_of_another_type(first, second, graph):
    traces = []

    @treemode.jit(graph=graph)
    def f(m):
        traces.append(type(m.s))
        return _program(m.w[...], m.s)

    m = Scaled(first)
    assert _dtypes(f(m)) == _dtypes(_program(m.w[...], m.s))
    m.s = second
    assert _dtypes(f(m)) == _dtypes(_program(m.w[...], m.s))
    assert traces[-1] is type(second)


def test_same_type_and_value_reuses_the_trace():
    traces = []

    @treemode.jit
    def f(m):
        traces.append(None)
        return m.w[...] * m.s[0]

    m = Scaled((1000, "relu"))
    f(m)
    m.s = (int("1000"), "".join(["re", "lu"]))  # equal, of the same types, new objects
    f(m)
    assert len(traces) == 1


def test_static_leaf_of_a_dict_argument_of_another_type():
    # Fractions stay static leaves whatever the classification of Python scalars.
    def f(d):
        return d["x"] * (1.5 if isinstance(d["s"], Fraction) else 1)

    jitted = treemode.jit(f)
    x = jnp.ones(2)
    for s in (2.0, Fraction(2), 2.0):
        np.testing.assert_array_equal(jitted({"x": x, "s": s}), f({"x": x, "s": s}))


def test_equinox_static_field_of_another_type():
    class Eqx(eqx.Module):
        w: jax.Array
        s: object = eqx.field(static=True)

    jitted = treemode.jit(lambda e: _program(e.w, e.s))
    w = jnp.arange(3, dtype=jnp.int32)
    for s in (2, 2.0):
        assert _dtypes(jitted(Eqx(w, s))) == _dtypes(_program(w, s))


def test_variable_metadata_of_another_type():
    seen = []

    @treemode.jit
    def f(v):
        seen.append(type(v.scale))
        return v[...] * v.scale

    v = nnx.Param(jnp.arange(3, dtype=jnp.int32), scale=2)
    assert f(v).dtype == jnp.int32
    v.set_metadata(scale=2.0)
    assert f(v).dtype == jnp.float32
    assert seen == [int, float]


def test_static_attribute_whose_equality_fails_is_a_different_structure():
    # np.int32(0) == (0, 0) gives an array, which PyTreeDef's comparison refuses.
    m = Scaled(np.int32(0))
    f = treemode.jit(lambda m: _program(m.w[...], m.s))
    for s in (np.int32(0), (0, 0), np.int32(0)):
        m.s = s
        assert _dtypes(f(m)) == _dtypes(_program(m.w[...], s))


def test_function_changing_a_static_attribute_to_another_type_is_a_structure_error():
    m = Scaled(2)

    @treemode.jit
    def f(m):
        m.s = 2.0
        return m.w[...]

    with pytest.raises(treemode.StructureError, match=r"args\[0\]\.s"):
        f(m)
    assert type(m.s) is int


# -- Variable metadata that is not hashable ------------------------------------


class Tagged(nnx.Module):
    def __init__(self, tags):
        self.w = nnx.Param(jnp.ones(2), tags=tags)
        self.b = nnx.Param(jnp.zeros(2), groups={"decay": ["w"], "skip": {"b"}})


def _step(m):
    m.w[...] += 1.0
    return m.w[...].sum() + m.b[...].sum()


@pytest.mark.parametrize("graph", [False, True], ids=["tree", "graph"])
def test_list_valued_metadata_works_like_nnx_jit(graph):
    ours, theirs = Tagged(["decay"]), Tagged(["decay"])
    jitted = treemode.jit(_step, graph=graph)
    reference = nnx.jit(_step)
    for _ in range(2):
        np.testing.assert_array_equal(jitted(ours), reference(theirs))
    np.testing.assert_array_equal(ours.w[...], theirs.w[...])
    assert ours.w.tags == ["decay"]
    assert ours.b.groups == {"decay": ["w"], "skip": {"b"}}


def test_list_metadata_keeps_the_users_objects_and_changes_retrace():
    traces = []

    @treemode.jit
    def f(m):
        traces.append(list(m.w.tags))
        return _step(m)

    tags = ["decay"]
    m = Tagged(tags)
    f(m)
    f(m)
    assert m.w.tags is tags  # the user's list, not a frozen copy
    assert traces == [["decay"]]
    m.w.set_metadata(tags=["decay", "ema"])
    f(m)
    m.w.set_metadata(tags=("decay", "ema"))  # equal items, another container type
    f(m)
    assert traces == [["decay"], ["decay", "ema"], ["decay", "ema"]]
    assert type(m.w.tags) is tuple


def test_list_metadata_in_vmap_grad_and_pytree_proxy():
    m = Tagged(["decay"])
    out = treemode.vmap(lambda m, x: m.w[...] * x, in_axes=(None, 0))(m, jnp.ones(3))
    assert out.shape == (3, 2)
    grads = treemode.grad(lambda m: (m.w[...] ** 2).sum())(m)
    assert grads.w.tags == ["decay"]
    proxy = treemode.Pytree(m)
    leaves, treedef = jax.tree_util.tree_flatten(proxy)
    assert jax.tree_util.tree_unflatten(treedef, leaves).w.tags == ["decay"]


def test_metadata_updated_to_a_list_inside_the_function_is_written_back():
    m = Tagged(("decay",))

    @treemode.jit
    def f(m):
        m.w.set_metadata(tags=["decay", "new"])
        return m.w[...]

    f(m)
    assert m.w.tags == ["decay", "new"]


@dataclasses.dataclass
class _Unhashable:
    name: str
    __hash__ = None  # type: ignore[assignment]


def test_unhashable_metadata_object_is_compared_by_identity():
    traces = []

    @treemode.jit
    def f(v):
        traces.append(None)
        return v[...] * 2

    tag = _Unhashable("a")
    v = nnx.Param(jnp.ones(2), tag=tag)
    f(v)
    f(v)
    assert len(traces) == 1
    v.set_metadata(tag=_Unhashable("a"))  # equal, but another object: retrace (sound)
    f(v)
    assert len(traces) == 2
