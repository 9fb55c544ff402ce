"""Errors name the user's path and the real cause (issue 24, item 8).

JAX names an array by its place in the function it compiled; behind
`treemode.jit` that is a flat list of arrays, so its messages are translated
back to the user's argument paths. Every test runs with the compiled call
path (where the extension is on) and the Python one.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treemode


@pytest.fixture(autouse=True)
def _implementation(implementation):
    return implementation


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(8))
        self.b = nnx.Param(jnp.zeros(8))


def scaled(m, n):
    return (m.w[...] + m.b[...]) * n


def scaled_in_place(m, n):
    m.w[...] = m.w[...] * n
    return m.w[...] + m.b[...]


@pytest.mark.parametrize("warm", [False, True])
def test_an_overflowing_int_names_the_argument(warm):
    f = treemode.jit(scaled)
    m = Model()
    if warm:
        f(m, 2)
        f(m, 2)  # the memo matches the next call
    with pytest.raises(OverflowError) as info:
        f(m, 2**40)
    message = str(info.value)
    assert "argument path is n." in message
    assert "dynamic[" not in message and "args[" not in message
    with pytest.raises(OverflowError, match=r"argument path is n\."):
        f(m, n=2**40)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("warm", [False, True])
def test_an_array_on_another_device_names_the_variable(donate, warm):
    mesh = jax.make_mesh((8,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    m = Model()
    m.w.set_value(jax.device_put(m.w[...], rows))
    m.b.set_value(jax.device_put(m.b[...], rows))
    f = treemode.jit(scaled, donate_argnums=0 if donate else ())
    if warm:
        f(m, 1.0)
        f(m, 1.0)
    w = m.w.get_raw_value()
    m.b.set_value(jax.device_put(jnp.zeros(8), jax.devices()[1]))
    with pytest.raises(ValueError) as info:
        f(m, 1.0)
    message = str(info.value)
    assert "incompatible devices" in message
    assert "argument m.b of scaled " in message and "flat_args" not in message
    assert "argument m.w of scaled" in message
    for internal in ("dynamic[", "donated[", "kept[", "_JitEntry", "_call_flat", "_call_split"):
        assert internal not in message
    assert m.w.get_raw_value() is w and not w.is_deleted()  # left as it was


def test_a_buffer_the_user_deleted_is_not_blamed_on_donation(hooks):
    hooks.donation_seen(False)
    m = Model()
    f = treemode.jit(scaled)
    f(m, 1.0)
    m.b[...].delete()
    with pytest.raises(RuntimeError) as info:
        f(m, 1.0)
    assert not isinstance(info.value, treemode.DonationError)
    assert isinstance(info.value, treemode.TreemodeError)
    message = str(info.value)
    assert message.startswith(
        "treemode.jit: the buffer of the Param at args[0].b was deleted before this call"
    )
    assert "no treemode transform has donated buffers" in message


def test_a_buffer_shared_with_a_donated_one_is_a_donation_error():
    a = Model()
    b = treemode.clone(a)  # shares a's buffers
    treemode.jit(scaled_in_place, donate_argnums=0)(a, 1.0)  # donates a.w (written)
    with pytest.raises(treemode.DonationError) as info:
        treemode.jit(scaled)(b, 1.0)
    message = str(info.value)
    assert message.startswith(
        "treemode.jit: the buffer of the Param at args[0].w has been deleted or donated: "
        "treemode writes a new buffer into every Variable it donates, so this Variable "
        "shared its buffer with one donated to an earlier call"
    )
    assert "treemode.clone(module, arrays=True)" in message


class Field(eqx.Module):
    w: jax.Array
    scale: float = 2.0


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize(
    "make, root",
    [(lambda: Field(jnp.ones(3)), "args[0].w"), (lambda: {"a": jnp.ones(3)}, "args[0]['a']")],
    ids=["equinox-field", "dict"],
)
def test_a_donated_array_that_is_no_variable_is_reported_as_donated(make, root, warm):
    # treemode donated the array itself (as jax.jit does): nothing was shared, and
    # clone(arrays=True) would not help.
    f = treemode.jit(lambda t: jax.tree.map(lambda x: x * 2, t), donate_argnums=0)
    tree = make()
    if warm:
        tree = f(f(tree))  # the arrays the calls return are live
    f(tree)
    with pytest.raises(treemode.DonationError) as info:
        f(tree)
    message = str(info.value)
    assert message.startswith(f"treemode.jit: the buffer of {root} has been deleted or donated. ")
    assert "donates the arrays of a donated argument that are not Variable values" in message
    assert "shared" not in message and "clone(module, arrays=True)" not in message


class Tied(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.v = self.w


def test_graph_jvp_tangent_must_share_objects_as_the_primal():
    m = Tied()

    def f(m):
        return m.w[...] * 2 + m.v[...]

    with pytest.raises(treemode.StructureError) as info:
        treemode.jvp(f, (m,), (jax.tree.map(jnp.ones_like, m),), graph=True)
    message = str(info.value)
    assert "GraphNode given for a GraphNode" not in message
    assert "does not share objects as the argument does" in message
    assert "primals[0].v is also at primals[0].w" in message
    assert "nnx.clone(m)" in message
    # What the message recommends works.
    t = nnx.clone(m)
    nnx.update(t, jax.tree.map(jnp.ones_like, nnx.state(t)))
    out, tangent = treemode.jvp(f, (m,), (t,), graph=True)
    np.testing.assert_allclose(tangent, 3 * np.ones(3))


def test_graph_mode_messages_say_graph_mode():
    with pytest.raises(treemode.AliasError) as info:
        treemode.jit(lambda m: m.w, graph=True)(Model())
    message = str(info.value)
    assert "Graph mode (graph=True) does not support Variable aliasing" in message
    assert "Tree mode" not in message
    with pytest.raises(treemode.AliasError, match="Tree mode does not support"):
        treemode.jit(lambda m: m.w)(Model())
