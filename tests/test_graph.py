"""to_tree / from_tree round trips with sharing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Stateful, assert_same_state

import treemode


class Shared(nnx.Module):
    def __init__(self):
        self.enc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.dec = self.enc
        self.tied = self.enc.kernel
        self.blocks = nnx.List([self.enc, nnx.Linear(2, 2, rngs=nnx.Rngs(1))])


def test_to_tree_has_no_aliases():
    tree = treemode.to_tree(Shared())
    treemode.check_no_aliases(tree=tree)
    variables = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    assert len(variables) == 4  # enc.kernel, enc.bias, blocks[1].kernel, blocks[1].bias


def test_round_trip_restores_identity_of_shared_objects():
    restored = treemode.from_tree(treemode.to_tree(Shared()))
    assert restored.enc is restored.dec
    assert restored.tied is restored.enc.kernel
    assert restored.blocks[0] is restored.enc
    assert restored.blocks[1] is not restored.enc


def test_round_trip_through_jax_tree_map_gives_new_objects_same_values():
    model = Shared()
    tree = jax.tree.map(lambda x: x * 2, treemode.to_tree(model))
    restored = treemode.from_tree(tree)
    assert restored.enc is restored.dec
    assert restored.enc.kernel is not model.enc.kernel
    np.testing.assert_allclose(restored.enc.kernel[...], 2 * model.enc.kernel[...])


def test_round_trip_of_mixed_containers():
    model = Stateful(nnx.Rngs(0))
    tree = {"a": model, "b": [model, 3], "c": (jnp.ones(2), "static")}
    restored = treemode.from_tree(treemode.to_tree(tree))
    assert restored["a"] is restored["b"][0]
    assert restored["b"][1] == 3 and restored["c"][1] == "static"
    assert_same_state(restored["a"], model)


def test_to_tree_through_jit():
    model = Shared()
    tree = treemode.to_tree(model)

    @jax.jit
    def double(tree):
        m = treemode.from_tree(tree)
        assert m.enc is m.dec
        m.enc.kernel[...] *= 2
        return treemode.to_tree(m)

    restored = treemode.from_tree(double(tree))
    np.testing.assert_allclose(restored.dec.kernel[...], 2 * model.enc.kernel[...])


def test_cycles_are_reported():
    class Node(nnx.Module):
        def __init__(self):
            self.children_ = nnx.List([])

    root = Node()
    root.children_.append(root)
    with pytest.raises(treemode.StructureError, match=r"reference cycle at node\.children_\[0\]"):
        treemode.to_tree(root)


def test_graph_mode_mutation_seen_through_every_reference():
    model = Shared()

    @treemode.jit(graph=True)
    def f(m):
        m.enc.kernel[...] += 1
        m.tied[...] += 1

    before = np.array(model.enc.kernel[...])
    f(model)
    np.testing.assert_allclose(model.dec.kernel[...], before + 2)
    assert model.tied is model.enc.kernel


# -- one shared Variable, two specifications (graph=True) ----------------------


def _product(a, b):
    return a[...] * b[...] ** 2


def test_grad_of_one_of_two_references_to_a_shared_variable_is_an_error():
    v = nnx.Param(jnp.array(2.0))
    with pytest.raises(ValueError, match="Inconsistent aliasing"):
        nnx.grad(_product, argnums=1)(v, v)  # what Flax does
    with pytest.raises(treemode.AliasError) as info:
        treemode.grad(_product, argnums=1, graph=True)(v, v)
    message = str(info.value)
    assert "treemode.grad" in message and "args[0]" in message and "args[1]" in message
    assert "argnums, args[0]: not differentiated and args[1]: differentiated" in message
    assert float(v[...]) == 2.0
    # Both references differentiated, or the same Variable inside one argument, is fine.
    g0, g1 = treemode.grad(_product, argnums=(0, 1), graph=True)(v, v)
    assert float(g0[...]) == float(g1[...]) == 12.0  # d(v^3)/dv


def test_grad_with_a_shared_submodule_in_a_non_differentiated_argument():
    shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    holder = nnx.Dict(layer=shared)
    expected = r"Param at args\[0\]\.bias is also reachable at args\[1\]\.layer\.bias"
    with pytest.raises(treemode.AliasError, match=expected):
        treemode.grad(lambda m, h: m(jnp.ones(2)).sum(), graph=True)(shared, holder)


def test_vmap_mapped_and_broadcast_references_to_one_variable_is_an_error():
    w = nnx.Param(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="Inconsistent aliasing"):
        nnx.vmap(lambda a, b: a[...] + b[...], in_axes=(0, None))(w, w)
    with pytest.raises(treemode.AliasError) as info:
        treemode.vmap(lambda a, b: a[...] + b[...], in_axes=(0, None), graph=True)(w, w)
    assert "in_axes, args[0]: 0 and args[1]: None" in str(info.value)
    assert "treemode.vmap" in str(info.value)
    out = treemode.vmap(lambda a, b: a[...] + b[...], in_axes=(0, 0), graph=True)(w, w)
    assert out.shape == (3, 2)


def test_vmap_module_shaped_prefix_giving_a_tied_weight_two_axes_is_an_error():
    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.ones((3, 2)))
            self.b = self.a

    m = Tied()
    axes = treemode.prefix(m, lambda path, v: 0 if path == ("a",) else None)
    with pytest.raises(treemode.AliasError, match=r"args\[0\]\.a.*args\[0\]\.b"):
        treemode.vmap(lambda m: m.a[...], in_axes=(axes,), graph=True)(m)


def test_scan_carry_and_scanned_references_to_one_variable_is_an_error():
    w = nnx.Param(jnp.ones((4, 2)))

    def body(carry, x):
        return carry, x[...]

    with pytest.raises(treemode.AliasError, match="in_axes"):
        treemode.scan(body, in_axes=(treemode.Carry, 0), graph=True)(w, w)


def test_jit_two_shardings_for_one_shared_variable_is_an_error():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    w = nnx.Param(jnp.ones((4, 2)))
    split = NamedSharding(mesh, PartitionSpec("x"))
    replicated = NamedSharding(mesh, PartitionSpec())
    f = treemode.jit(lambda a, b: a[...] + b[...], in_shardings=(split, replicated), graph=True)
    with pytest.raises(treemode.AliasError, match="in_shardings") as info:
        f(w, w)
    assert "args[0]" in str(info.value) and "args[1]" in str(info.value)
    same = treemode.jit(lambda a, b: a[...] + b[...], in_shardings=(split, split), graph=True)
    np.testing.assert_allclose(same(w, w), 2 * np.ones((4, 2)))


def test_custom_vjp_shared_variable_in_a_nondiff_argument_is_an_error():
    @treemode.custom_vjp(nondiff_argnums=(1,), graph=True)
    def f(a, b):
        return (a[...] * b[...]).sum()

    f.defvjp(lambda a, b: (f(a, b), None), lambda b, res, g: (None,))
    v = nnx.Param(jnp.ones(2))
    with pytest.raises(treemode.AliasError, match="nondiff_argnums"):
        f(v, v)
