"""treemode.jit: write-back, retracing, static arguments, AOT, methods."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import MLP, Counter, Stateful, assert_same_state, variable_buffers

import treemode


def test_counter_written_back_like_eager():
    counter, eager = Counter(), Counter()

    @treemode.jit
    def step(c, x):
        return c(x)

    for i in range(3):
        y = step(counter, jnp.full((2,), float(i)))
        y_eager = eager(jnp.full((2,), float(i)))
        np.testing.assert_allclose(y, y_eager)
    assert int(counter.count[...]) == 3
    assert_same_state(counter, eager)


def test_batchnorm_dropout_rngs_advance_like_eager():
    model = Stateful(nnx.Rngs(0))
    eager = treemode.clone(model)
    x = jnp.arange(12.0).reshape(4, 3)

    @treemode.jit
    def forward(m, x):
        return m(x)

    for _ in range(2):
        np.testing.assert_allclose(forward(model, x), eager(x), rtol=1e-6)
    assert_same_state(model, eager)
    assert int(model.dropout.rngs.count[...]) == 2
    assert not np.allclose(model.bn.mean[...], 0.0)


def test_unchanged_variables_keep_their_buffers():
    model = Stateful(nnx.Rngs(0))
    kernel, bias = model.linear.kernel.get_raw_value(), model.linear.bias.get_raw_value()
    mean = model.bn.mean.get_raw_value()

    @treemode.jit
    def forward(m, x):
        return m(x)

    forward(model, jnp.ones((2, 3)))
    assert model.linear.kernel.get_raw_value() is kernel
    assert model.linear.bias.get_raw_value() is bias
    assert model.bn.mean.get_raw_value() is not mean


def test_optimizer_state_advances_like_eager():
    def make():
        model = MLP(2, 3, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-1), wrt=nnx.Param)

    model, opt = make()
    model_e, opt_e = make()

    def step(model, opt, x):
        grads = jax.tree.map(lambda p: jnp.sum(x) * jnp.ones_like(p), nnx.state(model, nnx.Param))
        opt.update(model, grads)

    jitted = treemode.jit(step)
    for i in range(3):
        x = jnp.full((3,), float(i + 1))
        jitted(model, opt, x)
        step(model_e, opt_e, x)
    assert int(opt.step[...]) == 3
    assert_same_state(model, model_e)
    assert_same_state(opt, opt_e)


def test_no_retrace_when_values_change_and_retrace_on_structure():
    traces = []

    @treemode.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f(m, jnp.ones((1, 2)))
    m.kernel[...] = m.kernel[...] * 2
    f(m, jnp.ones((1, 2)))
    f(nnx.Linear(2, 2, rngs=nnx.Rngs(1)), jnp.zeros((1, 2)))
    assert len(traces) == 1

    m.promote_dtype = lambda xs, dtype=None: xs  # static attribute changes: new trace
    f(m, jnp.ones((1, 2)))
    assert len(traces) == 2

    m.kernel.set_metadata("tag", "changed")  # Variable metadata changes: new trace
    f(m, jnp.ones((1, 2)))
    assert len(traces) == 3

    m.kernel = nnx.BatchStat(m.kernel[...])  # Variable type changes: new trace
    f(m, jnp.ones((1, 2)))
    assert len(traces) == 4

    f(m, jnp.ones((3, 2)))  # new shape: JAX retraces
    assert len(traces) == 5


def test_non_array_leaves_are_static_python_numbers_are_traced():
    traces = []

    @treemode.jit
    def f(x, scale, activation):
        traces.append(1)
        return activation(x) * scale

    np.testing.assert_allclose(f(jnp.ones(2), 2.0, jnp.tanh), jnp.tanh(1.0) * 2 * jnp.ones(2))
    f(jnp.ones(2), 2.0, jnp.tanh)
    assert len(traces) == 1
    # A new Python number is a new value of a traced argument, as in jax.jit.
    np.testing.assert_allclose(f(jnp.ones(2), 3.0, jnp.tanh), jnp.tanh(1.0) * 3 * jnp.ones(2))
    assert len(traces) == 1
    f(jnp.ones(2), 3.0, jax.nn.relu)  # a new function is a new static value
    assert len(traces) == 2


def test_static_argnums_and_argnames():
    traces = []

    @treemode.jit(static_argnums=1, static_argnames="mode")
    def f(x, n, mode="add"):
        traces.append(1)
        return x + n if mode == "add" else x * n

    np.testing.assert_allclose(f(jnp.ones(2), 3), 4 * jnp.ones(2))
    np.testing.assert_allclose(f(jnp.ones(2), n=3, mode="mul"), 3 * jnp.ones(2))
    f(jnp.zeros(2), 3)
    assert len(traces) == 2


def test_unhashable_static_argument_is_reported():
    f = treemode.jit(lambda x, cfg: x, static_argnums=1)
    with pytest.raises(
        treemode.StaticArgumentError, match=r"treemode.jit: static argument args\[1\]"
    ):
        f(jnp.ones(1), [1, 2])


def test_static_argnums_out_of_range():
    with pytest.raises(treemode.StaticArgumentError, match="static_argnums contains 3"):
        treemode.jit(lambda x: x, static_argnums=3)


def test_jit_as_method_decorator():
    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.calls = nnx.BatchStat(jnp.array(0))

        @treemode.jit
        def __call__(self, x):
            self.calls[...] += 1
            return self.w[...] * x

    m = Model()
    np.testing.assert_allclose(m(jnp.full(2, 3.0)), jnp.full(2, 3.0))
    m(jnp.ones(2))
    assert int(m.calls[...]) == 2


def test_decorator_with_and_without_arguments():
    @treemode.jit
    def a(x):
        return x + 1

    @treemode.jit(donate_argnums=0)
    def b(x):
        return x + 1

    assert float(a(jnp.array(1.0))) == 2.0
    assert float(b(jnp.array(1.0))) == 2.0


def test_lower_compile_and_call_writes_back():
    counter = Counter()
    step = treemode.jit(lambda c, x: c(x))
    lowered = step.lower(counter, jax.ShapeDtypeStruct((2,), jnp.float32))
    assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None
    compiled(counter, jnp.ones(2))
    assert int(counter.count[...]) == 1


def test_compiled_call_checks_structure_and_donation_like_the_jitted_function():
    step = treemode.jit(lambda c, x: c(x), donate_argnums=0)
    compiled = step.lower(Counter(), jax.ShapeDtypeStruct((2,), jnp.float32)).compile()

    other = Counter()
    other.extra = nnx.Param(jnp.zeros(1))  # another structure than the one lowered for
    with pytest.raises(treemode.StructureError, match="Lower and compile again"):
        compiled(other, jnp.ones(2))
    assert int(other.count[...]) == 0

    shared = Counter()
    shared.alias = nnx.Param(shared.count.get_raw_value())  # one buffer, two Variables
    compiled_shared = step.lower(shared, jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
    with pytest.raises(treemode.DonationError, match="same buffer"):
        compiled_shared(shared, jnp.ones(2))
    assert int(shared.count[...]) == 0


def test_trace_exposes_jaxpr_and_does_not_mutate():
    counter = Counter()
    traced = treemode.jit(lambda c, x: c(x)).trace(counter, jnp.ones(2))
    assert "add" in str(traced.jaxpr)
    assert int(counter.count[...]) == 0


def test_jit_eval_shape_does_not_mutate():
    counter = Counter()
    out = treemode.jit(lambda c, x: c(x)).eval_shape(counter, jnp.ones(2))
    assert out.shape == (2,)
    assert int(counter.count[...]) == 0


def test_async_dispatch_kept():
    @treemode.jit
    def heavy(m, x):
        for _ in range(30):
            x = jnp.tanh(x @ m.kernel[...])
        return x

    m = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
    x = jnp.ones((256, 256))
    heavy(m, x).block_until_ready()
    out = heavy(m, x)
    # The result is a jax.Array produced by XLA's async dispatch, not a host copy.
    assert isinstance(out, jax.Array)
    out.block_until_ready()


def test_jit_partial_binds_leading_arguments():
    model = Stateful(nnx.Rngs(0))
    eager = treemode.clone(model)
    traces = []

    def forward(m, x):
        traces.append(1)
        return m(x)

    fast = treemode.jit_partial(forward, model)
    for i in range(3):
        x = jnp.full((2, 3), float(i))
        np.testing.assert_allclose(fast(x), eager(x), rtol=1e-6)
    assert len(traces) == 1
    assert_same_state(model, eager)


def test_outputs_can_be_new_modules():
    @treemode.jit
    def make(key):
        return nnx.Linear(2, 3, rngs=nnx.Rngs(key))

    m = make(jax.random.key(0))
    assert isinstance(m, nnx.Linear)
    assert m.kernel.shape == (2, 3)
    assert isinstance(m.kernel.get_raw_value(), jax.Array)


def test_kwargs_are_flattened_and_written_back():
    counter = Counter()

    @treemode.jit
    def f(x, *, c):
        return c(x)

    f(jnp.ones(2), c=counter)
    assert int(counter.count[...]) == 1


def test_in_and_out_shardings_with_module_shaped_prefix():
    mesh = jax.make_mesh((8,), ("data",))
    replicated = jax.NamedSharding(mesh, jax.P())
    batch = jax.NamedSharding(mesh, jax.P("data"))
    model = Counter()
    prefix = jax.tree.map(
        lambda v: replicated, model, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )

    @treemode.jit(in_shardings=(prefix, batch), out_shardings=batch)
    def step(m, x):
        return m(x)

    y = step(model, jnp.arange(16.0))
    assert y.sharding == batch
    assert model.total.get_raw_value().sharding.is_equivalent_to(replicated, 0)
    assert float(model.total[...]) == float(jnp.arange(16.0).sum())


def test_buffers_of_read_only_parameters_are_reused():
    model = MLP(2, 3, nnx.Rngs(0))
    before = variable_buffers(model)
    treemode.jit(lambda m, x: m(x))(model, jnp.ones(3))
    after = variable_buffers(model)
    assert all(a is b for a, b in zip(before, after, strict=True))


def test_flatten_cache_does_not_keep_modules_alive():
    import gc
    import weakref

    from treemode._tree import _flatten

    f = treemode.jit(lambda m, x: m(x))
    model = Stateful(nnx.Rngs(0))
    f(model, jnp.ones((2, 3)))
    assert id(model) in _flatten._cache
    ref = weakref.ref(model)
    key = id(model)
    del model
    gc.collect()
    assert ref() is None
    assert key not in _flatten._cache or _flatten._cache[key]._ref() is not None


def test_optimizer_state_is_cached_and_revalidated():
    from treemode._tree import _flatten

    model = MLP(1, 2, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = treemode.jit(lambda o, x: x * o.step[...])
    step(opt, jnp.ones(1))
    assert id(opt) in _flatten._cache  # nnx.State in opt_state is guarded, not re-walked
    entry = _flatten._cache[id(opt)]
    assert entry._guard is not None and entry._guard.holds(entry.variables, opt)
    # Replacing an entry inside the State's plain mapping invalidates the cache.
    opt.step = nnx.OptState(jnp.array(5, jnp.uint32))
    np.testing.assert_allclose(step(opt, jnp.ones(1)), [5.0])


class _Tagged(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))


def _tag_pairs(m, x):
    if x.shape == (2,):  # a metadata update made by the trace of this shape only
        m.w.set_metadata("tag", "pairs")
    m.w[...] += x.sum()
    return x


@pytest.mark.parametrize("order", [(2, 3), (3, 2)])
def test_metadata_updates_belong_to_the_trace_of_the_call(order):
    """One entry holds an executable per input shape; each call writes back the
    metadata updates of its own trace, never those of the latest trace."""
    f = treemode.jit(_tag_pairs)
    for n in order:  # one trace per shape, in this order
        f(_Tagged(), jnp.ones(n))
    for n in order:
        m = _Tagged()
        for _ in range(3):  # a new model (the full call), then the same one (the memo)
            f(m, jnp.ones(n))
            expected = _Tagged()
            _tag_pairs(expected, jnp.ones(n))
            assert m.w.get_metadata().get("tag") == expected.w.get_metadata().get("tag")


def test_deepcopy_of_a_jitted_function_like_jax_jit():
    import copy

    traces = []

    def step(counter, x):
        traces.append(None)
        return counter(x)

    x = jnp.ones(3)
    jax_copy = copy.deepcopy(jax.jit(lambda x: x + 1))  # what treemode.jit follows
    np.testing.assert_allclose(jax_copy(x), x + 1)
    f = treemode.jit(step)
    counter = Counter()
    f(counter, x)
    g = copy.deepcopy(f)
    assert g is not f and g.fn is f.fn
    np.testing.assert_allclose(g(counter, x), x + 1)
    assert counter.count[...] == 2 and len(traces) == 1  # the compiled entries are shared


def test_deepcopy_of_jit_partial_copies_the_bound_modules():
    import copy

    counter = Counter()
    f = treemode.jit_partial(lambda c, x: c(x), counter)
    f(jnp.ones(3))
    g = copy.deepcopy(f)
    g(jnp.ones(3))
    g(jnp.ones(3))
    assert counter.count[...] == 1  # the original's module is not the copy's
    assert g.partial_args[0].count[...] == 3


def test_pickling_a_jitted_function_is_a_clear_error_as_in_jax():
    import pickle

    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(jax.jit(_module_level_double))  # jax.jit's wrapper does not pickle
    with pytest.raises(TypeError, match=r"treemode\.jit: cannot pickle the jitted function"):
        pickle.dumps(treemode.jit(_module_level_double))


def _module_level_double(x):
    return x * 2
