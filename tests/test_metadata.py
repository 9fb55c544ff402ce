"""transform_metadata: sharding metadata across a mapped axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode
from treemode._transforms._metadata import add_axis, remove_axis


def make_param(rngs):
    return nnx.Param(rngs.uniform((16,)), out_sharding=("dout",), eager_sharding=False)


def test_vmap_keyword_adds_partition_to_created_variables():
    create = treemode.vmap(make_param, transform_metadata={nnx.PARTITION_NAME: "din"})
    stack = create(treemode.split_rngs(nnx.Rngs(0), splits=8))
    assert stack.shape == (8, 16)
    assert stack.out_sharding == ("din", "dout")


def test_vmap_without_keyword_leaves_metadata():
    stack = treemode.vmap(make_param)(treemode.split_rngs(nnx.Rngs(0), splits=8))
    assert stack.out_sharding == ("dout",)


def test_out_axes_1_inserts_at_position_1():
    create = treemode.vmap(make_param, out_axes=1, transform_metadata={nnx.PARTITION_NAME: "din"})
    stack = create(treemode.split_rngs(nnx.Rngs(0), splits=4))
    assert stack.shape == (16, 4)
    assert stack.out_sharding == ("dout", "din")


def test_function_sees_metadata_without_the_mapped_axis():
    stack = treemode.vmap(make_param, transform_metadata={nnx.PARTITION_NAME: "din"})(
        treemode.split_rngs(nnx.Rngs(0), splits=4)
    )
    seen = []

    @treemode.vmap(in_axes=(0, None), transform_metadata={nnx.PARTITION_NAME: "din"})
    def scale(p, s):
        seen.append(p.out_sharding)
        p[...] = p[...] * s
        return p[...].sum()

    before = np.asarray(stack[...])
    scale(stack, 2.0)
    assert seen == [("dout",)]
    assert stack.out_sharding == ("din", "dout")  # restored on the caller's Variable
    np.testing.assert_allclose(stack[...], 2 * before)


def test_standalone_inside_treemode_vmap_and_jax_vmap():
    @treemode.vmap(in_axes=0, out_axes=0)
    @treemode.transform_metadata(in_axes=0, out_axes=0, partition="din")
    def create(key):
        return nnx.Param(
            jax.random.uniform(key, (16,)), out_sharding=("dout",), eager_sharding=False
        )

    keys = jax.random.split(jax.random.key(0), 8)
    assert create(keys).out_sharding == ("din", "dout")

    create_jax = jax.vmap(
        treemode.transform_metadata(
            lambda k: nnx.Param(
                jax.random.uniform(k, (16,)), out_sharding=("dout",), eager_sharding=False
            ),
            partition="din",
        )
    )
    v = create_jax(keys)
    assert v.shape == (8, 16) and v.out_sharding == ("din", "dout")


def test_pmap_keyword():
    n = jax.local_device_count()
    create = treemode.pmap(make_param, transform_metadata={nnx.PARTITION_NAME: "dev"})
    stack = create(treemode.split_rngs(nnx.Rngs(0), splits=n))
    assert stack.shape == (n, 16) and stack.out_sharding == ("dev", "dout")


def test_add_and_remove_axis_helpers():
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(
            2,
            3,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b")),
        )
    meta = {nnx.PARTITION_NAME: "layers"}
    add_axis(layer, 0, meta)
    assert layer.kernel.out_sharding == ("layers", "a", "b")
    assert layer.bias.get_metadata().get("out_sharding") is None  # nothing to extend
    remove_axis(layer, 0, meta)
    assert layer.kernel.out_sharding == ("a", "b")
    with pytest.raises(treemode.AxisError, match=r"\.kernel.*expects 'layers'.*found 'a'"):
        remove_axis(layer, 0, meta)
    assert layer.kernel.out_sharding == ("a", "b")


def test_remove_with_wrong_partition_leaves_inputs_unchanged():
    stack = treemode.vmap(make_param, transform_metadata={nnx.PARTITION_NAME: "din"})(
        treemode.split_rngs(nnx.Rngs(0), splits=4)
    )
    before = np.asarray(stack[...])

    @treemode.vmap(transform_metadata={nnx.PARTITION_NAME: "other"})
    def double(p):
        p[...] = p[...] * 2
        return p[...]

    with pytest.raises(treemode.AxisError, match=r"args\[0\].*expects 'other'.*found 'din'"):
        double(stack)
    assert stack.out_sharding == ("din", "dout")
    np.testing.assert_array_equal(stack[...], before)


def test_missing_partition_name():
    with pytest.raises(treemode.AxisError, match="partition"):
        treemode.transform_metadata(lambda x: x)
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap.*partition_name"):
        treemode.vmap(lambda x: x, transform_metadata={"foo": 1})


def test_other_metadata_fields_are_extended():
    v = nnx.Param(jnp.ones(3), out_sharding=("x",), eager_sharding=False, tags=("t",))
    add_axis(v, 0, {nnx.PARTITION_NAME: "layers", "tags": "stacked"})
    assert v.out_sharding == ("layers", "x")
    assert v.get_metadata()["tags"] == ("stacked", "t")


def test_transform_metadata_partition_none_is_an_unnamed_axis():
    """As in Flax: ``partition=None`` removes/inserts an axis with no mesh name;
    leaving ``partition`` out (with no ``metadata``) is an error."""
    v = nnx.Param(jnp.array(1), out_sharding=(None, "dout"), eager_sharding=False)

    @treemode.transform_metadata(in_axes=0, out_axes=1, partition=None)
    def f(v):
        v[...] += 1
        assert v.out_sharding == ("dout",)
        return nnx.Param(jnp.array(10), out_sharding=("dmid", "dout"), eager_sharding=False)

    v2 = f(v)
    assert v.out_sharding == (None, "dout") and int(v[...]) == 2
    assert v2.out_sharding == ("dmid", None, "dout") and int(v2[...]) == 10
    with pytest.raises(treemode.AxisError, match=r"treemode\.transform_metadata: pass partition"):
        treemode.transform_metadata(lambda v: v, in_axes=0, out_axes=0)
