"""``treemode.eval_shape``: inputs never mutated, abstract models, and the shardings
of the Variables' metadata under a mesh.

Under a mesh, as Flax's ``nnx.eval_shape`` does: each returned Variable's abstract value
gets ``NamedSharding(mesh, spec)``, the spec from its ``sharding_names`` /
``nnx.with_partitioning`` metadata (``P()`` without one), so that an abstract
model is a restore target with the intended shardings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter, Stateful
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treemode


def test_eval_shape_never_mutates(tracer_leaks):
    counter = Counter()
    before = counter.count.get_raw_value()
    out = treemode.eval_shape(lambda c, x: c(x), counter, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert out.shape == (3,) and out.dtype == jnp.float32
    assert counter.count.get_raw_value() is before
    assert isinstance(counter.total.get_raw_value(), jax.Array)


def test_eval_shape_builds_abstract_model():
    abstract = treemode.eval_shape(lambda: Stateful(nnx.Rngs(0)))
    assert isinstance(abstract.linear.kernel.get_raw_value(), jax.ShapeDtypeStruct)
    assert abstract.linear.kernel.shape == (3, 4)


class Model(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.lin = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.w = nnx.Param(jnp.ones((4, 8)), sharding_names=("model", None))
        self.count = nnx.Variable(jnp.zeros(()))


def _auto_mesh():
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)


def _shardings(model):
    state = nnx.state(model)
    return {
        path: leaf.sharding
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    }


@pytest.mark.parametrize("graph", [False, True])
def test_eval_shape_under_a_mesh_gives_the_metadata_sharding(graph):
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        ours = treemode.eval_shape(lambda: Model(nnx.Rngs(0)), graph=graph)
        flax = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    assert ours.lin.kernel.get_raw_value().sharding.spec == P(None, "model")
    assert ours.w.get_raw_value().sharding.spec == P("model", None)
    assert ours.lin.bias.get_raw_value().sharding.spec == P()
    got, expected = _shardings(ours), _shardings(flax)
    assert got.keys() == expected.keys() and len(got) == 4
    for path, sharding in expected.items():
        assert sharding is not None
        assert got[path] == sharding, path


def test_a_mesh_in_the_metadata_is_used_without_a_current_mesh():
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))

    def init():
        return nnx.Param(jnp.ones((4, 8)), sharding_names=(None, "model"), mesh=mesh)

    with nnx.use_eager_sharding(False):
        abstract = treemode.eval_shape(init)
    assert abstract.get_raw_value().sharding == NamedSharding(mesh, P(None, "model"))


def test_no_mesh_no_sharding_and_inputs_untouched():
    with nnx.use_eager_sharding(False):
        abstract = treemode.eval_shape(lambda: Model(nnx.Rngs(0)))
    assert abstract.lin.kernel.get_raw_value().sharding is None
    # A mesh at eval_shape time never touches the arguments' Variables.
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        before = model.w.get_raw_value()
        out = treemode.eval_shape(lambda m: m.w[...] * 2, model)
    assert model.w.get_raw_value() is before
    assert isinstance(out, jax.ShapeDtypeStruct)


def test_restore_into_the_abstract_model_keeps_the_sharding():
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        saved = jax.device_get(nnx.state(Model(nnx.Rngs(1))))  # e.g. read from a checkpoint
        abstract = treemode.eval_shape(lambda: Model(nnx.Rngs(0)))
    graphdef, target = nnx.split(abstract)
    restored = jax.tree.map(
        lambda t, x: jax.device_put(x, NamedSharding(mesh, t.sharding.spec)), target, saved
    )
    model = nnx.merge(graphdef, restored)
    assert model.lin.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    assert model.w[...].sharding == NamedSharding(mesh, P("model", None))
    np.testing.assert_array_equal(model.w[...], np.ones((4, 8)))
