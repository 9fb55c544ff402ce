"""Flax's graph-mode lift objects and Variable prefixes are refused when a transform is made.

``nnx.StateAxes``, ``nnx.StateSharding`` and ``nnx.DiffState`` select state in
Flax's graph mode (the grad family reads ``DiffState``, the others refuse it); a
Variable inside an axis specification (``in_axes=(nnx.Param(0),)``) gives an axis
to a Variable's value instead of to the Variable. treemode refuses
both when the transform is created (not at the first call), with an `AxisError`
that names the transform, the keyword, the position and the treemode form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treemode


class Model(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((4, 3)))
        self.count = nnx.BatchStat(jnp.zeros(4))


def _mesh():
    return jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])


def _state_axes():
    return nnx.StateAxes({nnx.BatchStat: 0, ...: None})


def _state_sharding():
    return nnx.StateSharding({...: NamedSharding(_mesh(), P())})


def _diff_state() -> Any:
    return nnx.DiffState(0, nnx.Param)


f = lambda *a: a[0]  # noqa: E731


SA, SS = "StateAxes", "StateSharding"

# (transform, keyword, a factory of the spec, lift class name, where in the spec)
TREE_MODE = [
    ("vmap", "in_axes", lambda: (_state_axes(), 0), SA, "in_axes[0]"),
    ("vmap", "out_axes", _state_axes, SA, "out_axes"),
    ("pmap", "in_axes", lambda: (_state_axes(),), SA, "in_axes[0]"),
    ("scan", "in_axes", lambda: (treemode.Carry, _state_axes()), SA, "in_axes[1]"),
    ("jit", "in_shardings", _state_sharding, SS, "in_shardings"),
    ("jit", "out_shardings", lambda: (_state_sharding(),), SS, "out_shardings[0]"),
    ("shard_map", "in_specs", lambda: (_state_sharding(),), SS, "in_specs[0]"),
    ("transform_metadata", "in_axes", lambda: (_state_axes(),), SA, "in_axes[0]"),
]


def _make(transform, what, spec):
    kw = {what: spec()}
    if transform == "shard_map":
        kw.update(mesh=_mesh(), out_specs=P())
    if transform == "transform_metadata":
        return treemode.transform_metadata(partition="p", **kw)
    return getattr(treemode, transform)(f, **kw)


def test_jit_partial_refuses_state_sharding() -> None:
    with pytest.raises(treemode.AxisError, match=r"treemode.jit_partial: `in_shardings` cannot"):
        treemode.jit_partial(f, 1, in_shardings=(_state_sharding(),))


@pytest.mark.parametrize(
    "name, what, spec, lift, where", TREE_MODE, ids=[c[0] + "-" + c[1] for c in TREE_MODE]
)
def test_lift_object_refused_at_decoration_in_tree_mode(name, what, spec, lift, where) -> None:
    with pytest.raises(treemode.AxisError) as info:
        _make(name, what, spec)
    text = str(info.value)
    assert isinstance(info.value, ValueError)
    assert text.startswith(
        f"treemode.{name}: `{what}` cannot contain `{lift}` objects in tree mode"
    )
    assert f"{where} is an nnx.{lift}" in text
    assert f"docs/migration.md#{lift.lower()}" in text
    assert "treemode.prefix(" in text or "nnx.split(" in text


@pytest.mark.parametrize("graph", [False, True])
def test_diffstate_is_read_by_the_grad_family_in_both_modes(graph) -> None:
    # grad, value_and_grad and custom_vjp read a DiffState (tests/test_grad_wrt.py);
    # nothing is refused when they are made.
    treemode.grad(f, argnums=_diff_state(), graph=graph)
    treemode.value_and_grad(f, argnums=(_diff_state(), 1), graph=graph)
    treemode.custom_vjp(f, nondiff_argnums=(_diff_state(),), graph=graph)


def test_diffstate_elsewhere_is_refused() -> None:
    # Where no treemode transform reads it (an axis specification), it is refused.
    with pytest.raises(treemode.AxisError, match="`in_axes` cannot contain `DiffState`"):
        treemode.vmap(f, in_axes=(_diff_state(),))


def test_state_axes_with_graph_true_is_checked_at_the_call() -> None:
    # With graph=True a StateAxes is left to the call, which resolves the
    # specification against the object graph and names the Variable it reaches.
    forward = treemode.vmap(lambda m, x: x, in_axes=(_state_axes(), 0), graph=True)
    model = Model()
    before = np.asarray(model.count[...])
    with pytest.raises(treemode.AxisError, match="docs/migration.md#stateaxes"):
        forward(model, jnp.ones((4, 3)))
    np.testing.assert_array_equal(model.count[...], before)


# (transform, keyword, the spec, where, the Variable's type, the value it holds)
VARIABLE_PREFIXES = [
    ("vmap", "in_axes", (nnx.Variable(0),), "in_axes[0]", "nnx.Variable", "0"),
    ("vmap", "out_axes", {"a": nnx.Param(1)}, "out_axes['a']", "nnx.Param", "1"),
    ("pmap", "in_axes", nnx.BatchStat(0), "in_axes", "nnx.BatchStat", "0"),
    ("scan", "in_axes", (treemode.Carry, nnx.Param(None)), "in_axes[1]", "nnx.Param", "None"),
    ("transform_metadata", "out_axes", (nnx.Param(0),), "out_axes[0]", "nnx.Param", "0"),
]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize(
    "name, what, spec, where, kind, value",
    VARIABLE_PREFIXES,
    ids=[c[0] + "-" + c[3] for c in VARIABLE_PREFIXES],
)
def test_variable_in_axis_spec_refused_at_decoration(
    name, what, spec, where, kind, value, graph
) -> None:
    with pytest.raises(treemode.AxisError) as info:
        if name == "transform_metadata":
            treemode.transform_metadata(partition="p", graph=graph, **{what: spec})
        else:
            getattr(treemode, name)(f, graph=graph, **{what: spec})
    text = str(info.value)
    assert text.startswith(f"treemode.{name}: {where} is an {kind} holding {value}.")
    assert "Variables prefixes are not supported" in text
    assert f"({value} instead of {kind}({value}))" in text
    assert "treemode.prefix(model" in text


def test_module_built_with_tree_map_is_refused_and_prefix_works() -> None:
    model = Model()
    kept = jax.tree.map(lambda _: 0, model)  # the Variables stay, holding 0
    with pytest.raises(
        treemode.AxisError, match=r"in_axes\[0\]\.count is an nnx.BatchStat holding 0"
    ):
        treemode.vmap(lambda m: m.w[...], in_axes=(kept,))
    axes = treemode.prefix(model, {nnx.BatchStat: 0, ...: None})
    out = treemode.vmap(lambda m: m.count[...] + m.w[...].sum(), in_axes=(axes,))(model)
    assert out.shape == (4,)


def test_variables_holding_shardings_are_accepted() -> None:
    # Shardings are not axes: nnx.get_partition_spec / nnx.get_named_sharding give
    # Variables holding the shardings, and jit/shard_map take them as they are.
    mesh = _mesh()
    model = Model()
    shardings = nnx.get_named_sharding(nnx.state(model), mesh)
    assert any(
        isinstance(v, nnx.Variable)
        for v in jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )
    state = nnx.state(model)

    @treemode.jit(in_shardings=(shardings,))
    def step(state):
        state["count"][...] += 1
        return state["w"][...].sum()

    assert step(state) == 12.0
    assert np.all(state["count"][...] == 1)


def test_plain_specs_are_untouched() -> None:
    # The check only looks for lift objects: ordinary specs still work.
    model = Model()
    out = treemode.vmap(lambda m, x: m.w[...] * x, in_axes=(None, 0))(model, jnp.ones((2, 1)))
    assert out.shape == (2, 4, 3)
    g = treemode.grad(lambda m: jnp.sum(m.w[...]), argnums=(0,))(model)
    assert isinstance(g[0], Model)
