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
