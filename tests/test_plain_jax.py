"""Plain JAX transforms over modules (modules are pytrees), and the seed scenarios.

- seed 002: ``jax.eval_shape(model, x)`` on a model whose backbone is a
  vmap-created stack scanned in ``__call__`` left tracers in the Variables (Flax).
- seed 004: a module scanning over stacked blocks, called inside ``jax.jit`` and
  again from a ``jax.lax.scan`` body closing over it, leaked a tracer (without the
  first call) or silently copied every parameter (with it) (Flax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter, Stateful, state_arrays, variable_buffers

import treemode
from treemode import Carry

WIDTH, DEPTH = 64, 4


def variables(node):
    return [
        leaf
        for leaf in jax.tree_util.tree_leaves(node, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if isinstance(leaf, nnx.Variable)
    ]


def assert_all_concrete(node):
    for var in variables(node):
        value = var.get_raw_value()
        assert isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer), var


# -- plain JAX over modules ------------------------------------------------------------------


def test_lax_scan_with_a_module_as_carry(tracer_leaks):
    model = Counter()
    xs = jnp.arange(6.0).reshape(3, 2)

    def body(m, x):
        y = m(x)
        return m, y

    out, ys = jax.lax.scan(body, model, xs)
    assert int(out.count[...]) == 3
    np.testing.assert_allclose(out.total[...], xs.sum())
    assert ys.shape == (3, 2)
    assert int(model.count[...]) == 0  # the input is a pytree: not mutated
    assert_all_concrete(model)
    assert_all_concrete(out)


def test_jax_vmap_jit_eval_shape_over_modules(tracer_leaks):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((5, 3))
    buffers = variable_buffers(model)
    y = jax.vmap(lambda m, xi: m(xi), in_axes=(None, 0))(model, x)
    np.testing.assert_allclose(y, model(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(model, x), model(x), rtol=1e-6)
    shape = jax.eval_shape(lambda m, x: m(x), model, x)
    assert shape.shape == (5, 2)
    returned = jax.jit(lambda m: m)(model)
    assert isinstance(returned, nnx.Linear)
    assert all(a is b for a, b in zip(buffers, variable_buffers(model), strict=True))
    assert_all_concrete(model)
    assert_all_concrete(returned)


def test_jax_jit_returns_an_updated_copy_of_a_stateful_module(tracer_leaks):
    model = Stateful(nnx.Rngs(0))

    @jax.jit
    def step(m, x):
        m(x)
        return m

    new = step(model, jnp.ones((2, 3)))
    assert int(new.dropout.rngs.count[...]) == 1
    assert int(model.dropout.rngs.count[...]) == 0
    assert_all_concrete(new)
    assert_all_concrete(model)


def test_treemode_transforms_inside_plain_jax_transforms(tracer_leaks):
    """A treemode.scan/cond/fori_loop inside jax.jit/jax.vmap over modules passed as args."""
    counter = Counter()

    @jax.jit
    def run(c, xs):
        treemode.scan(lambda c, x: (c, c(x)), c, xs)
        treemode.cond(True, lambda c: c(xs[0]), lambda c: xs[0], c)
        treemode.fori_loop(0, 2, lambda i, c: (c(xs[0]), c)[1], c)
        return c

    out = run(counter, jnp.ones((3, 2)))
    assert int(out.count[...]) == 6
    assert int(counter.count[...]) == 0
    assert_all_concrete(out)
    assert_all_concrete(counter)


def test_writing_to_a_module_closed_over_by_plain_jax_is_a_clear_error():
    counter = Counter()
    before = state_arrays(counter)

    @jax.jit
    def run(xs):
        return treemode.scan(lambda h, x: (h + counter(x).sum(), None), 0.0, xs)[0]

    with pytest.raises(treemode.TraceContextError, match=r"closure counter"):
        run(jnp.ones((3, 2)))
    for a, b in zip(before, state_arrays(counter), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_all_concrete(counter)


# -- seed 002 ----------------------------------------------------------------------------


class Backbone(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Linear(16, 32, rngs=rngs)

        @treemode.split_rngs(splits=3)
        @treemode.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return nnx.Linear(32, 32, rngs=rngs)

        self.backbone = create_block(rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        @treemode.scan(in_axes=(Carry, 0), out_axes=Carry)
        def forward(x, model):
            return model(x)

        return self.head(forward(self.stem(x), self.backbone))


def test_seed_002_jax_eval_shape_leaves_variables_concrete(tracer_leaks):
    model = Backbone(nnx.Rngs(0))
    assert model.backbone.kernel.shape == (3, 32, 32)
    buffers = variable_buffers(model)
    out = jax.eval_shape(model, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert out.shape == (8, 10)
    assert_all_concrete(model)
    assert all(a is b for a, b in zip(buffers, variable_buffers(model), strict=True))


def test_seed_002_treemode_eval_shape_leaves_variables_concrete(tracer_leaks):
    model = Backbone(nnx.Rngs(0))
    spec = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    assert treemode.eval_shape(model, spec).shape == (8, 10)
    assert treemode.eval_shape(lambda m, x: m(x), model, spec).shape == (8, 10)
    assert_all_concrete(model)


# -- seed 004 ----------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.param = nnx.Param(jax.random.normal(rngs.params(), (WIDTH, WIDTH)) / WIDTH)

    def __call__(self, x):
        return self.param @ x


class SeedModule(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @treemode.split_rngs(splits=DEPTH)
        @treemode.vmap(in_axes=(0,), out_axes=0)
        def create_blocks(rngs):
            return Block(rngs)

        self.blocks = create_blocks(rngs)

    def __call__(self, x):
        @treemode.scan(in_axes=(0, Carry), out_axes=Carry)
        def _scan(block, x):
            return block(x)

        x = jnp.broadcast_to(x, (WIDTH,))
        return _scan(self.blocks, x).sum()


NUM_ITERS = 5


def run_twice(module, x):
    x = module(x)

    def outer(i, _):
        return module(i), None

    return jax.lax.scan(outer, x, length=NUM_ITERS)[0]


def run_in_scan_only(module, x):
    def outer(i, _):
        return module(i), None

    return jax.lax.scan(outer, x, length=NUM_ITERS)[0]


def hand_inner(params, x):
    x = jnp.broadcast_to(x, (WIDTH,))
    return jax.lax.scan(lambda h, p: (p @ h, None), x, params)[0].sum()


def hand_twice(params, x):
    x = hand_inner(params, x)
    return jax.lax.scan(lambda i, _: (hand_inner(params, i), None), x, length=NUM_ITERS)[0]


def hand_in_scan_only(params, x):
    return jax.lax.scan(lambda i, _: (hand_inner(params, i), None), x, length=NUM_ITERS)[0]


@pytest.mark.parametrize(
    "ours, hand", [(run_twice, hand_twice), (run_in_scan_only, hand_in_scan_only)]
)
def test_seed_004_closure_in_lax_scan_compiles_without_leak(tracer_leaks, ours, hand):
    module = SeedModule(nnx.Rngs(0))
    params = module.blocks.param[...]
    got = jax.jit(ours)(module, jnp.array(1.0))
    want = jax.jit(hand)(params, jnp.array(1.0))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_all_concrete(module)


@pytest.mark.parametrize(
    "ours, hand", [(run_twice, hand_twice), (run_in_scan_only, hand_in_scan_only)]
)
def test_seed_004_no_extra_copy_of_the_parameters(ours, hand):
    module = SeedModule(nnx.Rngs(0))
    params = module.blocks.param[...]
    x = jnp.array(1.0)
    ours_mem = jax.jit(ours).lower(module, x).compile().memory_analysis()
    hand_mem = jax.jit(hand).lower(params, x).compile().memory_analysis()
    assert ours_mem.argument_size_in_bytes == hand_mem.argument_size_in_bytes
    assert ours_mem.temp_size_in_bytes == hand_mem.temp_size_in_bytes
    # and no temporary as large as the parameters exists at all
    assert ours_mem.temp_size_in_bytes < params.nbytes
