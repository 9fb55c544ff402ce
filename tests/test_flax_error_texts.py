"""Errors that Flax users catch: the type Flax raises (or a subclass) and its phrase.

Flax's own tests match these (``assertRaisesRegex(ValueError, ...)``); treemode's
message keeps its form (the transform, the path, the fix) and carries the phrase.
Also here: texts that were wrong for one transform (scan's rule for keyword
arguments, the axis range of a scalar).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import treemode

GRAPH_NODES = "Graph nodes are not allowed as prefixes"


@pytest.mark.parametrize("graph", [False, True])
def test_graph_node_as_vmap_prefix(graph):
    m = nnx.Dict(a=nnx.Param(1))
    with pytest.raises(ValueError, match=GRAPH_NODES) as info:
        treemode.vmap(lambda x: x, in_axes=m, graph=graph)
    assert isinstance(info.value, treemode.AxisError)
    assert str(info.value).startswith("treemode.vmap: in_axes.a is an nnx.Param holding 1.")


@pytest.mark.parametrize("graph", [False, True])
def test_graph_node_as_grad_argnums(graph):
    m = nnx.Dict(a=nnx.Param(1))
    for error in (ValueError, TypeError):  # Flax raises ValueError; JAX a TypeError
        with pytest.raises(error, match=GRAPH_NODES) as info:
            treemode.grad(lambda x: x, argnums=m, graph=graph)
        assert "treemode.grad: argnums must be an int" in str(info.value)
        assert "got a Dict (a graph node)" in str(info.value)


@pytest.mark.parametrize("what", ["in_shardings", "out_shardings"])
@pytest.mark.parametrize("graph", [False, True])
def test_graph_node_or_variable_as_jit_sharding_prefix(what, graph):
    for spec, where in [(nnx.Dict(a=nnx.Param(1)), f"{what}.a"), (nnx.Param(1), what)]:
        with pytest.raises(ValueError, match=GRAPH_NODES) as info:
            treemode.jit(lambda x: x, graph=graph, **{what: spec})
        assert isinstance(info.value, treemode.AxisError)
        assert str(info.value).startswith(
            f"treemode.jit: {where} is an nnx.Param holding 1, not a sharding."
        )
    with pytest.raises(treemode.AxisError, match=GRAPH_NODES):
        treemode.jit_partial(lambda x: x, graph=graph, **{what: nnx.Param(1)})


def test_variables_holding_shardings_are_accepted_by_jit():
    # What nnx.get_named_sharding returns: Variables holding shardings.
    mesh = jax.make_mesh((1,), ("d",))
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    shardings = jax.tree.map(
        lambda v: v.replace(jax.NamedSharding(mesh, P())),
        nnx.state(model),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    forward = treemode.jit(lambda m, x: m(x), in_shardings=(shardings, None))
    assert forward.in_shardings is not None
    with_none = nnx.Dict(a=nnx.Param(None), b=nnx.Param(P()))
    treemode.jit(lambda x: x, in_shardings=with_none)  # None and specs are shardings too


def test_scan_all_carry_with_two_arguments():
    @dataclasses.dataclass
    class Foo(nnx.Module):
        n: nnx.BatchStat

    foo = Foo(n=nnx.BatchStat(jnp.array(0)))
    loop = treemode.scan(lambda foo, x: foo, in_axes=treemode.Carry, out_axes=treemode.Carry)
    with pytest.raises(
        ValueError, match="When in_axes=Carry, the function must take exactly one argument"
    ) as info:
        loop(foo, 0)
    assert str(info.value).startswith("treemode.scan: When in_axes=Carry")
    assert int(foo.n[...]) == 0


def test_scan_in_axes_arity_error_says_keywords_are_not_scanned():
    scanned = treemode.scan(lambda c, x: (c, x), in_axes=(treemode.Carry, 0, 0))
    with pytest.raises(treemode.AxisError) as info:
        scanned(jnp.zeros(()), jnp.ones(3))
    text = str(info.value)
    assert "in_axes has 3 entries but the function is called with 2" in text
    assert text.endswith("Keyword arguments are not scanned: every step receives them whole.")
    assert "mapped over axis 0" not in text


def test_vmap_in_axes_arity_error_says_keywords_are_mapped():
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(lambda a, b: a, in_axes=(0, 0, 0))(jnp.ones(3), jnp.ones(3))
    assert str(info.value).endswith("Keyword arguments are always mapped over axis 0, as in JAX.")


def test_unsplit_rngs_in_vmap_has_no_empty_axis_range():
    model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    count = np.asarray(model.rngs.count[...])
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(lambda m, x: m(x))(model, jnp.ones((3, 2)))
    text = str(info.value)
    assert "[0, 0)" not in text
    assert "but it has shape () (a scalar). A scalar has no axis to map: use None" in text
    assert "treemode.split_rngs(rngs, splits=n)" in text  # the hint for an Rngs stream
    np.testing.assert_array_equal(model.rngs.count[...], count)


def test_non_scalar_axis_range_is_unchanged():
    with pytest.raises(treemode.AxisError) as info:
        treemode.vmap(lambda x: x, in_axes=2)(jnp.ones((3, 2)))
    assert "Use an axis in [-2, 2) or None to broadcast it." in str(info.value)
