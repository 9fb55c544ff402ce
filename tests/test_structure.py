"""Structural changes inside a transform raise StructureError naming the path."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

import treemode


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.scale = 2.0
        self.sub = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.raw = jnp.zeros(2)


def add_attribute(m):
    m.new = nnx.Param(jnp.zeros(1))


def replace_variable(m):
    m.w = nnx.Param(jnp.zeros(2))


def change_static(m):
    m.scale = 3.0


def delete_attribute(m):
    del m.sub


def replace_submodule_variable(m):
    m.sub.kernel = nnx.BatchStat(m.sub.kernel[...])


def reassign_plain_array(m):
    m.raw = m.raw + 1


@pytest.mark.parametrize(
    "mutate, path, what",
    [
        (add_attribute, r"args\[0\]\.new", "new attribute"),
        (replace_variable, r"args\[0\]\.w", "replaced"),
        (change_static, r"args\[0\]\.scale", "static attribute was changed from 2.0 to 3.0"),
        (delete_attribute, r"args\[0\]\.sub", "deleted"),
        (replace_submodule_variable, r"args\[0\]\.sub\.kernel", "replaced by a BatchStat"),
        (reassign_plain_array, r"args\[0\]\.raw", "plain array attribute"),
    ],
    ids=["new-attribute", "replaced-variable", "static", "deleted", "nested-type", "plain-array"],
)
def test_structure_change_raises(mutate, path, what):
    m = Model()
    w = m.w.get_raw_value()

    @treemode.jit
    def f(m):
        m.w[...] += 1  # a legitimate update, which must not be written back either
        mutate(m)

    with pytest.raises(treemode.StructureError, match=r"treemode\.jit: .*" + path) as info:
        f(m)
    assert what in str(info.value)
    # Inputs are untouched: no attribute added/removed, no value written back.
    assert m.w.get_raw_value() is w
    assert m.scale == 2.0 and hasattr(m, "sub") and not hasattr(m, "new")


def test_structure_change_in_graph_mode():
    m = Model()
    m.alias = m.sub

    @treemode.jit(graph=True)
    def f(m):
        m.extra = nnx.Param(jnp.zeros(1))

    with pytest.raises(treemode.StructureError, match="extra"):
        f(m)


def test_eval_shape_reports_structure_changes_too():
    with pytest.raises(treemode.StructureError, match=r"treemode\.eval_shape: .*args\[0\]\.new"):
        treemode.eval_shape(add_attribute, Model())
