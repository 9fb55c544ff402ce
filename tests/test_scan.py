"""treemode.scan: carry / broadcast / scanned arguments, write-back, memory, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter, state_arrays, variable_buffers

import treemode
from treemode import Carry

WIDTH, DEPTH = 8, 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jax.nn.tanh(self.linear(x))


def make_blocks(depth: int = DEPTH, seed: int = 0) -> Block:
    @treemode.split_rngs(splits=depth)
    @treemode.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Block(rngs)

    return create(nnx.Rngs(seed))


def hand_written(blocks: Block, x):
    """The same forward pass written with jax.lax.scan over the stacked arrays."""
    kernel, bias = blocks.linear.kernel[...], blocks.linear.bias[...]

    def step(h, params):
        k, b = params
        return jax.nn.tanh(h @ k + b), None

    return jax.lax.scan(step, x, (kernel, bias))[0]


class Stack(nnx.Module):
    def __init__(self, seed: int = 0):
        self.blocks = make_blocks(seed=seed)

    def __call__(self, x):
        @treemode.scan(in_axes=(Carry, 0), out_axes=Carry)
        def forward(h, block):
            return block(h)

        return forward(x, self.blocks)


def snapshot(*nodes):
    return [state_arrays(n) for n in nodes], [variable_buffers(n) for n in nodes]


def assert_unchanged(before, *nodes):
    values, buffers = before
    now_values, now_buffers = snapshot(*nodes)
    for a, b in zip(values, now_values, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    for a, b in zip(buffers, now_buffers, strict=True):
        assert all(x is y for x, y in zip(a, b, strict=True))


# -- the jax.lax.scan form ----------------------------------------------------------


def test_short_form_matches_lax_scan():
    xs = jnp.arange(5.0)
    f = lambda c, x: (c * 0.5 + x, c - x)
    got = treemode.scan(f, 1.0, xs)
    want = jax.lax.scan(f, 1.0, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w)


def test_python_number_carry_becomes_an_array():
    total, ys = treemode.scan(lambda c, x: (c + x, c), 0, jnp.arange(4))
    assert int(total) == 6 and ys.tolist() == [0, 0, 1, 3]


def test_reverse_and_unroll_match_lax_scan():
    xs = jnp.arange(6.0).reshape(3, 2)
    f = lambda c, x: (c + x, c * x)
    got = treemode.scan(f, jnp.zeros(2), xs, reverse=True, unroll=2)
    want = jax.lax.scan(f, jnp.zeros(2), xs, reverse=True, unroll=2)
    np.testing.assert_allclose(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1])


def test_length_without_scanned_inputs():
    @treemode.scan(in_axes=Carry, out_axes=Carry, length=4)
    def double(x):
        return x * 2

    assert float(double(jnp.array(1.0))) == 16.0


# -- scan over layers ---------------------------------------------------------------------


def test_scan_over_vmap_created_stack_matches_hand_written():
    model = Stack()
    x = jnp.linspace(-1, 1, 3 * WIDTH).reshape(3, WIDTH)
    np.testing.assert_allclose(model(x), hand_written(model.blocks, x), rtol=1e-6)
    jitted = jax.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(jitted, hand_written(model.blocks, x), rtol=1e-6)


def test_read_only_parameters_are_not_copied_or_written_back():
    model = Stack()
    before = snapshot(model)
    model(jnp.ones((2, WIDTH)))
    assert_unchanged(before, model)


def test_read_only_parameters_are_loop_constants_not_carry(monkeypatch):
    """Only the activations are carried; stacked params are xs, a broadcast module a constant.

    Read from what treemode hands ``jax.lax.scan`` (its public arguments) and from
    the scan equation's inputs and outputs, not from its parameters, which JAX
    renames (``num_carry`` is gone in JAX 0.11).
    """
    blocks = make_blocks()
    head = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(1))
    handed = []
    real_scan = jax.lax.scan

    def recording_scan(f, init, xs=None, *args, **kwargs):
        handed.append(jax.tree.leaves(xs))
        return real_scan(f, init, xs, *args, **kwargs)

    monkeypatch.setattr(jax.lax, "scan", recording_scan)

    @treemode.scan(in_axes=(Carry, 0, None), out_axes=Carry)
    def forward(h, block, head):
        return head(block(h))

    x = jnp.linspace(-1.0, 1.0, WIDTH)
    jaxpr = jax.make_jaxpr(lambda b, hd, x: forward(x, b, hd))(blocks, head, x)
    monkeypatch.undo()
    (scanned,) = handed
    stacked = jax.tree.leaves(blocks)
    assert sorted(a.shape for a in scanned) == sorted(p.shape for p in stacked)
    assert all(a.shape[0] == DEPTH for a in scanned)  # the stacked params, a slice per step
    (scan_eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    # One output: the final activations. The read-only arrays treemode passes
    # through the loop state came out of the carry as loop constants (nothing
    # copied per step), and nothing is stacked.
    assert len(scan_eqn.outvars) == 1
    # Its inputs: the head's parameters (constants), the activations, the stacked params.
    assert len(scan_eqn.invars) == len(jax.tree.leaves(head)) + 1 + len(scanned)
    out = jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *jax.tree.leaves((blocks, head)), x)
    np.testing.assert_allclose(out[0], forward(x, blocks, head), rtol=1e-6)


def _memory(fn, *args):
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes


def test_scan_over_layers_costs_no_more_memory_than_hand_written():
    model = Stack()
    x = jnp.ones((2, WIDTH))
    ours_temp, ours_args = _memory(lambda m, x: m(x), model, x)
    params = (model.blocks.linear.kernel[...], model.blocks.linear.bias[...])

    def hand(params, x):
        def step(h, p):
            return jax.nn.tanh(h @ p[0] + p[1]), None

        return jax.lax.scan(step, x, params)[0]

    hand_temp, hand_args = _memory(hand, params, x)
    assert ours_args == hand_args
    assert ours_temp <= hand_temp


def test_method_decorator_scans_over_self():
    class Layers(nnx.Module):
        def __init__(self):
            self.blocks = make_blocks()

        @treemode.scan(in_axes=(0, Carry), out_axes=Carry)
        def apply(self_block, x):  # noqa: N805 - self is the stacked block
            return self_block(x)

    layers = Layers()
    x = jnp.ones((1, WIDTH))
    got = Layers.apply(layers.blocks, x)
    np.testing.assert_allclose(got, hand_written(layers.blocks, x), rtol=1e-6)


def test_flax_carry_marker_is_accepted():
    blocks = make_blocks()
    f = treemode.scan(lambda h, b: b(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    x = jnp.ones((1, WIDTH))
    np.testing.assert_allclose(f(x, blocks), hand_written(blocks, x), rtol=1e-6)


# -- Variables that change -------------------------------------------------------------------


def test_mutated_broadcast_variable_is_threaded_through_the_steps():
    counter, eager = Counter(), Counter()
    xs = jnp.arange(12.0).reshape(4, 3)

    @treemode.scan(in_axes=(None, 0), out_axes=0)
    def step(c, x):
        return c(x)

    ys = step(counter, xs)
    want = jnp.stack([eager(x) for x in xs])
    np.testing.assert_allclose(ys, want)
    assert int(counter.count[...]) == 4
    np.testing.assert_allclose(counter.total[...], eager.total[...])


def test_mutated_scanned_variables_come_back_stacked_on_their_axis():
    class Stats(nnx.Module):
        def __init__(self, axis):
            shape = [2, 2]
            shape[axis] = 3
            self.seen = nnx.BatchStat(jnp.zeros(shape))
            self.scale = nnx.Param(jnp.arange(6.0).reshape(shape))

    for axis in (0, 1):
        stats = Stats(axis)
        scale = stats.scale.get_raw_value()
        axes = treemode.prefix(stats, {nnx.BatchStat: axis, nnx.Param: axis})

        @treemode.scan(in_axes=(Carry, axes), out_axes=Carry)
        def step(h, s):
            s.seen[...] += h + s.scale[...]
            return h + 1

        h = step(jnp.zeros(2), stats)
        np.testing.assert_allclose(h, 3.0)
        want = jnp.arange(6.0).reshape(stats.scale.shape) + jnp.expand_dims(
            jnp.arange(3.0), 1 - axis
        )
        np.testing.assert_allclose(stats.seen[...], want)
        assert stats.scale.get_raw_value() is scale  # read-only: untouched


def test_carry_module_keeps_identity_and_gets_updates():
    counter = Counter()

    @treemode.scan(in_axes=(Carry, 0), out_axes=(Carry, 0))
    def step(carry, x):
        c, total = carry
        y = c(x)
        return (c, total + y.sum()), c.count[...]

    (c_out, total), counts = step((counter, 0.0), jnp.ones((3, 2)))
    assert c_out is counter
    assert int(counter.count[...]) == 3 and counts.tolist() == [1, 2, 3]
    assert float(total) == 12.0


def test_closure_variables_are_written_back():
    counter = Counter()

    def step(h, x):
        counter.count[...] += 1
        return h + x, None

    h, _ = treemode.scan(step, jnp.array(0.0), jnp.arange(5.0))
    assert float(h) == 10.0 and int(counter.count[...]) == 5


def test_broadcast_rngs_advance_like_an_eager_loop():
    class Noisy(nnx.Module):
        def __init__(self):
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    model, eager = Noisy(), Noisy()
    xs = jnp.ones((3, 5))

    @treemode.scan(in_axes=(None, 0), out_axes=0)
    def apply(m, x):
        return m.dropout(x)

    ys = apply(model, xs)
    want = jnp.stack([eager.dropout(x) for x in xs])
    np.testing.assert_allclose(ys, want)
    assert int(model.dropout.rngs.count[...]) == 3


def test_keyword_arguments_are_broadcast():
    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry)
    def step(h, x, *, scale):
        return h + x * scale

    assert float(step(jnp.array(0.0), jnp.arange(3.0), scale=jnp.array(2.0))) == 6.0


def test_out_axes_stack_outputs_on_the_given_axis():
    @treemode.scan(in_axes=(Carry, 0), out_axes=(Carry, 1))
    def step(h, x):
        return h + 1, jnp.full((2,), h)

    _, ys = step(jnp.array(0.0), jnp.arange(3.0))
    assert ys.shape == (2, 3)
    np.testing.assert_allclose(ys[0], [0.0, 1.0, 2.0])


def test_modules_created_inside_are_stacked():
    @treemode.scan(in_axes=0, out_axes=0)
    def create(key):
        return nnx.Linear(2, 3, rngs=nnx.Rngs(key))

    stack = create(jax.random.split(jax.random.key(0), 4))
    assert stack.kernel.shape == (4, 2, 3)


def test_transform_metadata_removes_the_axis_inside_the_scan():
    @treemode.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(key):
        return nnx.Param(
            jax.random.normal(key, (WIDTH,)), out_sharding=("model",), eager_sharding=False
        )

    stack = create(jax.random.split(jax.random.key(0), DEPTH))
    assert stack.out_sharding == ("layers", "model")
    seen = []

    @treemode.scan(
        in_axes=(Carry, 0), out_axes=Carry, transform_metadata={nnx.PARTITION_NAME: "layers"}
    )
    def step(h, p):
        seen.append(p.out_sharding)
        return h + p[...]

    step(jnp.zeros(WIDTH), stack)
    assert seen and all(s == ("model",) for s in seen)
    assert stack.out_sharding == ("layers", "model")


def test_graph_mode_shared_module_in_broadcast_argument():
    shared = Counter()
    pair = {"a": shared, "b": shared}

    @treemode.scan(in_axes=(None, 0), out_axes=0, graph=True)
    def step(p, x):
        p["a"](x)
        return p["b"].count[...]

    counts = step(pair, jnp.ones((3, 2)))
    assert counts.tolist() == [1, 2, 3]
    assert int(shared.count[...]) == 3


def test_works_inside_jit_and_writes_back_through_it():
    counter = Counter()

    @treemode.jit
    def run(c, xs):
        @treemode.scan(in_axes=(None, 0), out_axes=0)
        def step(c, x):
            return c(x)

        return step(c, xs)

    run(counter, jnp.ones((4, 2)))
    assert int(counter.count[...]) == 4


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "in_axes, out_axes, match",
    [
        ((Carry, Carry), (Carry, 0), "Carry appears twice in in_axes"),
        ((Carry, 0), (Carry, Carry), "Carry appears twice in out_axes"),
        (((Carry, 0), 0), (Carry, 0), r"inside in_axes\[0\]"),
        ((Carry, 0), 0, "in_axes has a treemode.Carry but out_axes does not"),
        ((0, 0), (Carry, 0), "out_axes has a treemode.Carry but in_axes does not"),
        ((Carry, 0), (Carry, None), r"out_axes\[1\] is None"),
        ([Carry, 0], (Carry, 0), "is a list"),
    ],
)
def test_bad_axis_specs_are_rejected_when_decorating(in_axes, out_axes, match):
    with pytest.raises(treemode.AxisError, match=match):
        treemode.scan(lambda c, x: (c, x), in_axes=in_axes, out_axes=out_axes)


def test_wrong_number_of_in_axes_entries():
    counter = Counter()
    before = snapshot(counter)
    f = treemode.scan(lambda c, x, y: (c, x), in_axes=(Carry, 0), out_axes=(Carry, 0))
    with pytest.raises(treemode.AxisError, match="in_axes has 2 entries but the function"):
        f(jnp.zeros(()), jnp.ones(3), counter)
    assert_unchanged(before, counter)


def test_mismatched_scan_lengths_name_both_paths():
    f = treemode.scan(lambda c, a, b: (c, a + b), in_axes=(Carry, 0, 0), out_axes=(Carry, 0))
    with pytest.raises(treemode.AxisError, match=r"args\[1\].*args\[2\]"):
        f(jnp.zeros(()), jnp.ones(3), jnp.ones(4))
    with pytest.raises(treemode.AxisError, match="length=5"):
        treemode.scan(lambda c, x: (c, x), jnp.zeros(()), jnp.ones(3), length=5)


def test_nothing_scanned_needs_length():
    f = treemode.scan(lambda c: c, in_axes=Carry, out_axes=Carry)
    with pytest.raises(treemode.AxisError, match="Pass length=n"):
        f(jnp.zeros(()))


def test_function_must_return_a_tuple_matching_out_axes():
    f = treemode.scan(lambda c, x: c, in_axes=(Carry, 0), out_axes=(Carry, 0))
    with pytest.raises(treemode.AxisError, match="must return a tuple of 2 values"):
        f(jnp.zeros(()), jnp.ones(3))


def test_replacing_a_carried_module_is_an_error_and_leaves_inputs_unchanged():
    counter = Counter()
    before = snapshot(counter)

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry)
    def step(c, x):
        c.count[...] += 1
        return Counter()

    with pytest.raises(treemode.StructureError, match=r"carry at args\[0\] must stay the same"):
        step(counter, jnp.ones(3))
    assert_unchanged(before, counter)


def test_replacing_a_carried_variable_is_an_error():
    counter = Counter()

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry)
    def step(carry, x):
        c, h = carry
        return (c, nnx.Variable(h[...] + x))

    with pytest.raises(treemode.StructureError, match=r"args\[0\]\[1\] must stay the same Var"):
        step((counter, nnx.Variable(jnp.zeros(()))), jnp.ones(3))


def test_changing_the_carry_structure_or_dtype_is_an_error():
    f = treemode.scan(lambda c, x: ((c, c), x), in_axes=(Carry, 0), out_axes=(Carry, 0))
    with pytest.raises(treemode.StructureError, match="does not have the structure"):
        f(jnp.zeros(()), jnp.ones(3))
    g = treemode.scan(lambda c, x: (c.astype(jnp.int32), x), in_axes=(Carry, 0))
    with pytest.raises(treemode.StructureError, match=r"args\[0\] must keep its shape and dtype"):
        g(jnp.zeros(()), jnp.ones(3))


def test_broadcast_variable_changing_shape_is_an_error():
    counter = Counter()
    before = snapshot(counter)

    @treemode.scan(in_axes=(None, 0), out_axes=0)
    def step(c, x):
        c.total.set_value(jnp.zeros((2,)))
        return x

    with pytest.raises(treemode.StructureError, match=r"args\[0\]\.total must keep its shape"):
        step(counter, jnp.ones(3))
    assert_unchanged(before, counter)


def test_alias_between_arguments_is_rejected():
    counter = Counter()
    f = treemode.scan(lambda c, a, b: (c, 0.0), in_axes=(Carry, None, None), length=2)
    with pytest.raises(treemode.AliasError, match=r"args\[1\]\.count.*args\[2\]\.count"):
        f(jnp.zeros(()), counter, counter)


def test_equinox_module_as_carry_and_as_scanned_stack():
    import equinox as eqx

    class Wrap(eqx.Module):
        lin: eqx.nn.Linear
        act: object = jax.nn.relu  # a non-array leaf: static

    def step(w, x):
        w = eqx.tree_at(lambda w: w.lin.bias, w, w.lin.bias + 1)
        return w, w.act(w.lin(x))

    w0 = Wrap(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    w1, ys = treemode.scan(step, w0, jnp.ones((4, 3)))
    np.testing.assert_allclose(w1.lin.bias - w0.lin.bias, 4.0)
    assert ys.shape == (4, 3) and w1.act is jax.nn.relu

    keys = jax.random.split(jax.random.key(1), 5)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(keys)
    forward = treemode.scan(lambda h, layer: layer(h), in_axes=(Carry, 0), out_axes=Carry)
    want = jax.lax.scan(
        lambda h, p: (p[0] @ h + p[1], None), jnp.ones(3), (stack.weight, stack.bias)
    )[0]
    np.testing.assert_allclose(forward(jnp.ones(3), stack), want, rtol=1e-6)


def test_graph_mode_carry_with_a_shared_module():
    shared = Counter()
    pair = {"a": shared, "b": shared}

    @treemode.scan(in_axes=(Carry, 0), out_axes=(Carry, 0), graph=True)
    def step(carry, x):
        p, h = carry
        p["a"].count[...] += 1
        return (p, h + x), p["b"].count[...]

    (p, h), counts = step((pair, 0.0), jnp.arange(3.0))
    assert p["a"] is shared and p["b"] is shared
    assert float(h) == 3.0 and counts.tolist() == [1, 2, 3]
    assert int(shared.count[...]) == 3


class CarryPytree(nnx.Pytree):
    """A carry object with a plain array attribute next to a Variable."""

    def __init__(self, data):
        self.data = data
        self.count = nnx.BatchStat(jnp.array(0))


class PlainCarry(nnx.Pytree):
    def __init__(self, data):
        self.data = data


@pytest.mark.parametrize("graph", [False, True])
def test_plain_array_of_a_pytree_carry_may_be_reassigned(graph):
    # As in JAX, the carry is a new pytree: the new value reaches the returned
    # carry; the caller's object keeps its old value and its Variables are updated.
    carry = CarryPytree(jnp.array(0.0))

    @treemode.scan(in_axes=(Carry, 0), out_axes=(Carry, 0), graph=graph)
    def step(state, x):
        state.data = state.data + x
        state.count[...] += 1
        return state, state.data

    out, ys = step(carry, jnp.arange(1.0, 5.0))
    assert type(out) is CarryPytree and out is not carry
    assert float(out.data) == 10.0
    np.testing.assert_allclose(ys, [1.0, 3.0, 6.0, 10.0])
    assert float(carry.data) == 0.0  # the caller's object is unchanged...
    assert out.count is carry.count and int(carry.count[...]) == 4  # ...its Variables updated
    # Under jit (which may not return input Variables: objects holding arrays only),
    # with a tuple carry holding two such objects, one of them reassigned
    pair = (PlainCarry(jnp.array(0.0)), PlainCarry(jnp.array(10.0)))

    @treemode.jit(graph=graph)
    def run(pair):
        def body(p, x):
            p[0].data = p[0].data + 1
            return p, None

        return treemode.scan(body, in_axes=(Carry, 0), out_axes=(Carry, 0), graph=graph)(
            pair, jnp.zeros(3)
        )

    (a, b), _ = run(pair)
    assert float(a.data) == 3.0 and float(b.data) == 10.0
    assert float(pair[0].data) == 0.0 and type(a) is PlainCarry


@pytest.mark.parametrize("graph", [False, True])
def test_unchanged_pytree_carry_keeps_its_identity(graph):
    carry = CarryPytree(jnp.array(1.0))

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=graph)
    def step(state, x):
        state.count[...] += 1
        return state

    assert step(carry, jnp.zeros(3)) is carry
    assert int(carry.count[...]) == 3


@pytest.mark.parametrize("graph", [False, True])
def test_pytree_carry_array_must_keep_its_shape(graph):
    carry = CarryPytree(jnp.array(0.0))

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=graph)
    def step(state, x):
        state.data = jnp.stack([state.data, x])
        state.count[...] += 1
        return state

    with pytest.raises(treemode.StructureError, match=r"carry array at args\[0\]\.data"):
        step(carry, jnp.zeros(3))
    assert float(carry.data) == 0.0 and int(carry.count[...]) == 0


@pytest.mark.parametrize("graph", [False, True])
def test_while_and_fori_loops_carry_pytree_arrays_too(graph):
    carry = CarryPytree(jnp.array(0.0))

    def body(state):
        state.data = state.data + 2.0
        return state

    out = treemode.while_loop(lambda s: s.data < 5.0, body, carry, graph=graph)
    assert float(out.data) == 6.0 and float(carry.data) == 0.0
    out = treemode.fori_loop(0, 4, lambda i, s: body(s), carry, graph=graph)
    assert float(out.data) == 8.0


@pytest.mark.parametrize("graph", [False, True])
def test_pytree_carry_arrays_in_containers(graph):
    class Holder(nnx.Pytree):
        def __init__(self):
            self.d = nnx.data({"a": jnp.array(0.0)})
            self.t = nnx.data((jnp.array(0.0),))

    holder = Holder()

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=graph)
    def in_dict(h, x):
        h.d["a"] = h.d["a"] + x
        return h

    out = in_dict(holder, jnp.arange(4.0))
    assert float(out.d["a"]) == 6.0 and float(holder.d["a"]) == 0.0

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=graph)
    def new_tuple(h, x):
        h.t = (h.t[0] + x,)  # a new container: a structural change, named
        return h

    with pytest.raises(treemode.StructureError, match=r"args\[0\]\.t\[0\]"):
        new_tuple(holder, jnp.arange(4.0))
    assert float(holder.t[0]) == 0.0


def test_graph_mode_pytree_carry_keeps_its_sharing():
    # With graph=True the carry may share objects: a renewed object is renewed
    # everywhere it is referenced, and the objects it shares inside stay shared.
    p = PlainCarry(jnp.array(0.0))

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=True)
    def step(pair, x):
        pair[0].data = pair[0].data + x
        return pair

    a, b = step((p, p), jnp.arange(3.0))
    assert a is b and a is not p and type(a) is PlainCarry
    assert float(a.data) == 3.0 and float(p.data) == 0.0

    class Outer(nnx.Pytree):
        def __init__(self, inner):
            self.a = inner
            self.b = inner
            self.w = nnx.Param(jnp.ones(2))

    outer = Outer(PlainCarry(jnp.array(1.0)))

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=True)
    def nested(o, x):
        o.a.data = o.a.data + x
        o.w[...] += 1
        return o

    new = nested(outer, jnp.arange(3.0))
    assert new is not outer and new.a is new.b and float(new.a.data) == 4.0
    assert float(outer.a.data) == 1.0  # the caller's objects keep their arrays
    assert new.w is outer.w and outer.w[...].tolist() == [4.0, 4.0]


@pytest.mark.parametrize("graph", [False, True])
def test_removed_pytree_carry_array_is_named(graph):
    carry = PlainCarry(jnp.array(0.0))

    @treemode.scan(in_axes=(Carry, 0), out_axes=Carry, graph=graph)
    def step(state, x):
        del state.data
        return state

    with pytest.raises(
        treemode.StructureError, match=r"carry array at args\[0\]\.data was removed"
    ):
        step(carry, jnp.zeros(3))
    assert float(carry.data) == 0.0
