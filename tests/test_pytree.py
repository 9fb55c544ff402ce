"""treemode.Pytree: the proxy that makes an NNX module a pytree of raw arrays."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode
from treemode import Pytree


class Stack(nnx.Module):
    """Linear -> BatchNorm -> Dropout, with a helper method and a counter."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.drop(self.bn(self.lin(x)))

    def encode(self, x):
        self.calls[...] += 10
        return self.lin(x)

    def explode(self, x):
        self.calls[...] += 100
        self.bn(self.lin(x))
        raise RuntimeError("boom")


def stack() -> Stack:
    return Stack(nnx.Rngs(0))


def _numpy(x):
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def leaves_of(tree):
    return [_numpy(x) for x in jax.tree.leaves(tree)]


def assert_same_leaves(a, b):
    la, lb = leaves_of(a), leaves_of(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


# -- the seed's examples, in treemode names ------------------------------------------


def test_seed_linear_example():
    module = Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    module = jax.tree.map(lambda x: x, module)
    assert module.kernel.shape == (2, 3)

    y = module(jnp.ones((1, 2)))
    assert y.shape == (1, 3)


@pytest.mark.filterwarnings("ignore:'.value' access is now deprecated")
@pytest.mark.filterwarnings("ignore:'.value' setter is now deprecated")
def test_seed_counter_context_manager():
    @dataclasses.dataclass
    class Counter(nnx.Module):
        count: nnx.BatchStat[int]

    pt_counter = Pytree(Counter(nnx.BatchStat(0)))
    assert pt_counter.count.value == 0

    with pt_counter as counter:
        # The seed writes `counter.count += 1`; Flax 0.12 Variables reject in-place
        # operators (with or without a proxy), so the update goes through `.value`.
        counter.count.value += 1

    assert pt_counter.count.value == 1
    assert jax.tree.leaves(pt_counter) == [1]


# -- the pytree -----------------------------------------------------------------------


def test_leaves_are_the_raw_arrays_with_attribute_paths():
    module = stack()
    proxy = Pytree(module)
    flat = jax.tree_util.tree_flatten_with_path(proxy)[0]
    assert [jax.tree_util.keystr(p) for p, _ in flat] == [
        ".bn.bias",
        ".bn.mean",
        ".bn.scale",
        ".bn.var",
        ".calls",
        ".drop.rngs.count",
        ".drop.rngs.key",
        ".lin.bias",
        ".lin.kernel",
    ]
    # The leaves are the very arrays the module held: no copies.
    assert flat[8][1] is module.lin.kernel[...]
    assert all(isinstance(leaf, jax.Array) for _, leaf in flat)
    # Paths of nested proxies compose like attribute access.
    outer = {"net": proxy}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(outer)[0]]
    assert "['net'].lin.kernel" in paths
    simple = [
        jax.tree_util.keystr(p, simple=True, separator="/")
        for p, _ in jax.tree_util.tree_flatten_with_path(outer)[0]
    ]
    assert "net/lin.kernel" in simple


def test_module_key_is_a_getattr_key():
    proxy = Pytree(stack())
    path, _ = jax.tree_util.tree_flatten_with_path(proxy)[0][-1]
    (key,) = path
    assert isinstance(key, jax.tree_util.GetAttrKey)
    assert isinstance(key, treemode.ModuleKey)
    assert key.name == "lin.kernel"
    assert key.parts == (
        jax.tree_util.GetAttrKey("lin"),
        jax.tree_util.GetAttrKey("kernel"),
    )


def test_sequence_paths_use_indices():
    proxy = Pytree(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0))))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(proxy)[0]]
    assert paths == [".layers[0].bias", ".layers[0].kernel"]


def test_static_part_is_hashable_and_equal_for_equal_structure():
    a = Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    b = Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    c = Pytree(nnx.Linear(2, 4, rngs=nnx.Rngs(0)))
    ta, tb, tc = (jax.tree.structure(p) for p in (a, b, c))
    assert ta == tb and hash(ta) == hash(tb)
    assert ta != tc

    traces = []

    @jax.jit
    def apply(p, x):
        traces.append(None)
        return p(x)

    x = jnp.ones((1, 2))
    np.testing.assert_allclose(apply(a, x), a.to_module()(x), rtol=1e-6)
    np.testing.assert_allclose(apply(b, x), b.to_module()(x), rtol=1e-6)
    assert len(traces) == 1


def test_tree_map_identity_round_trip():
    proxy = Pytree(stack())
    copy = jax.tree.map(lambda x: x, proxy)
    assert type(copy) is Pytree
    assert jax.tree.structure(copy) == jax.tree.structure(proxy)
    assert all(x is y for x, y in zip(jax.tree.leaves(copy), jax.tree.leaves(proxy), strict=True))
    x = jnp.ones((4, 2))
    np.testing.assert_allclose(copy.encode(x), proxy.to_module().encode(x), rtol=1e-6)


def test_wrapping_shares_no_state_with_the_module():
    module = stack()
    proxy = Pytree(module)
    before = leaves_of(proxy)
    module.calls[...] = 7
    module.bn(jnp.ones((4, 3)))
    assert_same_leaves(proxy, before)
    module_before = leaves_of(nnx.state(module))
    proxy(jnp.ones((4, 2)))
    assert int(proxy.calls[...]) == 1
    assert_same_leaves(nnx.state(module), module_before)
    assert int(module.calls[...]) == 7


def test_unflatten_accepts_any_leaves_and_is_lazy(hooks):
    built = hooks.calls("proxy_build")
    proxy = Pytree(stack())
    sentinel = object()
    for make in (
        lambda x: None,
        lambda x: sentinel,
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
        lambda x: True,
    ):
        odd = jax.tree.map(make, proxy)
        assert type(odd) is Pytree
        assert built == []  # nothing materialized by unflattening
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), proxy)
    assert shapes.lin.kernel.shape == (2, 3)
    assert isinstance(shapes.lin.kernel[...], jax.ShapeDtypeStruct)
    assert len(built) == 1
    assert shapes.lin.kernel.shape == (2, 3)  # cached: not rebuilt
    assert len(built) == 1
    # None leaves survive a round trip through jax.tree.map (None is an empty subtree).
    nones = jax.tree.map(lambda x: None, proxy)
    assert jax.tree.leaves(nones) == []
    assert jax.tree.structure(jax.tree.map(lambda x: 0, nones, is_leaf=lambda x: x is None))


def test_attribute_access_returns_values_from_one_cached_module():
    proxy = Pytree(stack())
    assert proxy.lin.kernel is proxy.lin.kernel
    assert proxy.lin.kernel[...] is jax.tree.leaves(proxy)[-1]
    assert proxy.bn.momentum == 0.99
    assert proxy.drop.rate == 0.5
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = proxy.nope


def test_call_captures_new_state():
    proxy = Pytree(stack())
    structure = jax.tree.structure(proxy)
    reference = stack()
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(proxy(x), reference(x), rtol=1e-6)
    assert_same_leaves(proxy, nnx.state(reference))
    assert int(proxy.calls[...]) == 1
    assert int(proxy.drop.rngs.count[...]) == 1
    assert jax.tree.structure(proxy) == structure


def test_method_and_submodule_calls_keep_the_proxy_consistent():
    proxy = Pytree(stack())
    reference = stack()
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(proxy.encode(x), reference.encode(x), rtol=1e-6)
    h = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(proxy.bn(h), reference.bn(h), rtol=1e-6)
    key_a = proxy.drop.rngs()
    key_b = reference.drop.rngs()
    assert (jax.random.key_data(key_a) == jax.random.key_data(key_b)).all()
    # The leaves (what a transform sees) carry every update.
    assert_same_leaves(proxy, nnx.state(reference))
    copy = jax.tree.map(lambda x: x, proxy)
    assert int(copy.calls[...]) == 10
    assert int(copy.drop.rngs.count[...]) == 1
    np.testing.assert_allclose(copy.bn.mean[...], reference.bn.mean[...], rtol=1e-6)


def test_iterating_a_list_gives_submodules_that_update_the_proxy():
    proxy = Pytree(
        nnx.Sequential(nnx.BatchNorm(2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
    )
    x = jnp.arange(8.0).reshape(4, 2)
    for layer in proxy.layers:
        layer(x)
    assert len(proxy.layers) == 2
    means = [np.asarray(m) for m in jax.tree.leaves(proxy)[1::4]]
    assert all(np.abs(m).sum() > 0 for m in means)


def test_direct_variable_edits_are_captured():
    proxy = Pytree(stack())
    proxy.lin.kernel[...] = jnp.zeros((2, 3))
    proxy.calls[...] = 5
    copy = jax.tree.map(lambda x: x, proxy)
    np.testing.assert_array_equal(copy.lin.kernel[...], np.zeros((2, 3)))
    assert int(copy.calls[...]) == 5


def test_setting_attributes_on_the_proxy_points_to_the_context_manager():
    proxy = Pytree(stack())
    before = leaves_of(proxy)
    with pytest.raises(treemode.ProxyError, match=r"with proxy as module:\n\s+module.lin = "):
        proxy.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    with pytest.raises(treemode.ProxyError, match="cannot set attribute 'momentum'"):
        proxy.bn.momentum = 0.5
    with pytest.raises(treemode.ProxyError, match="cannot delete attribute 'bn'"):
        del proxy.bn
    with pytest.raises(AttributeError):  # ProxyError is an AttributeError
        proxy.x = 1
    assert_same_leaves(proxy, before)
    assert proxy.bn.momentum == 0.99


def test_with_block_writes_back_structural_edits():
    proxy = Pytree(stack())
    with proxy as module:
        assert isinstance(module, Stack)
        module.lin = nnx.Linear(2, 5, rngs=nnx.Rngs(1))
        module.bn = nnx.BatchNorm(5, rngs=nnx.Rngs(1))
        module.extra = nnx.Param(jnp.ones(2))
    assert proxy.lin.kernel.shape == (2, 5)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(proxy)[0]]
    assert ".extra" in paths
    copy = jax.tree.map(lambda x: x, proxy)
    assert copy(jnp.ones((4, 2))).shape == (4, 5)


def test_with_block_that_raises_leaves_the_proxy_as_it_was():
    proxy = Pytree(stack())
    before = leaves_of(proxy)
    structure = jax.tree.structure(proxy)
    with pytest.raises(ValueError, match="stop"):
        with proxy as module:
            module.calls[...] = 99
            module.extra = nnx.Param(jnp.ones(2))
            raise ValueError("stop")
    assert jax.tree.structure(proxy) == structure
    assert_same_leaves(proxy, before)
    assert int(proxy.calls[...]) == 0


def test_failed_method_call_leaves_the_proxy_as_it_was():
    proxy = Pytree(stack())
    bn = proxy.bn
    before = leaves_of(proxy)
    with pytest.raises(RuntimeError, match="boom"):
        proxy.explode(jnp.ones((4, 2)))
    assert_same_leaves(proxy, before)
    assert int(proxy.calls[...]) == 0
    with pytest.raises(treemode.ProxyError, match="stale"):
        bn(jnp.ones((4, 3)))
    proxy.bn(jnp.ones((4, 3)))  # a fresh reference works


def test_to_module_graphdef_and_state():
    proxy = Pytree(stack())
    module = proxy.to_module()
    assert isinstance(module, Stack)
    assert module is not proxy.to_module()
    module.calls[...] = 3  # independent of the proxy
    assert int(proxy.calls[...]) == 0
    graphdef, state = proxy.graphdef, proxy.state
    assert isinstance(graphdef, nnx.GraphDef)
    assert isinstance(state, nnx.State)
    merged = nnx.merge(graphdef, state)
    x = jnp.ones((4, 2))
    np.testing.assert_allclose(merged.encode(x), proxy.to_module().encode(x), rtol=1e-6)


def test_wrapping_a_proxy_or_a_submodule():
    proxy = Pytree(stack())
    again = Pytree(proxy)
    assert jax.tree.structure(again) == jax.tree.structure(proxy)
    sub = Pytree(proxy.bn)
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(sub)[0]] == [
        ".bias",
        ".mean",
        ".scale",
        ".var",
    ]


def test_rejects_objects_that_are_not_nnx():
    with pytest.raises(TypeError, match="expected an NNX object"):
        Pytree({"w": jnp.ones(2)})


class Tied(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(2, 2, rngs=rngs)
        self.b = self.a
        self.scale = nnx.Param(jnp.ones(2))
        self.scale_again = self.scale

    def __call__(self, x):
        self.scale[...] = self.scale[...] * 2
        return self.b(self.a(x)) * self.scale_again[...]


def test_shared_references_are_one_leaf_and_stay_shared():
    proxy = Pytree(Tied(nnx.Rngs(0)))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(proxy)[0]]
    assert paths == [".a.bias", ".a.kernel", ".scale"]
    module = proxy.to_module()
    assert module.a is module.b and module.scale is module.scale_again
    reference = Tied(nnx.Rngs(0))
    x = jnp.ones((1, 2))
    np.testing.assert_allclose(proxy(x), reference(x), rtol=1e-6)
    np.testing.assert_allclose(jax.tree.leaves(proxy)[2], reference.scale[...])


def test_a_call_that_adds_an_attribute_updates_the_structure():
    class Lazy(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

        def __call__(self, x):
            if not hasattr(self, "seen"):
                self.seen = nnx.BatchStat(jnp.zeros(2))
            self.seen[...] += x
            return x * self.w[...]

    proxy = Pytree(Lazy())
    assert len(jax.tree.leaves(proxy)) == 1
    proxy(jnp.ones(2))
    assert len(jax.tree.leaves(proxy)) == 2
    np.testing.assert_array_equal(jax.tree.map(lambda x: x, proxy).seen[...], np.ones(2))


def test_proxy_of_an_nnx_module_holding_an_equinox_module():
    class Net(nnx.Module):
        def __init__(self):
            self.mlp = nnx.data(eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)))
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.lin(self.mlp(x))

    net = Net()
    proxy = Pytree(net)
    # The activation functions are static; only arrays are leaves.
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(proxy))
    assert len(jax.tree.leaves(proxy)) == 6
    x = jnp.ones(2)
    np.testing.assert_allclose(jax.jit(lambda p, x: p(x))(proxy, x), net(x), rtol=1e-6)


def test_calls_inside_jit_do_not_touch_the_outer_proxy(tracer_leaks):
    proxy = Pytree(stack())
    before = leaves_of(proxy)

    @jax.jit
    def step(p, x):
        y = p(x)
        return y, p

    y, new = step(proxy, jnp.ones((4, 2)))
    assert_same_leaves(proxy, before)
    assert int(new.calls[...]) == 1
    assert int(proxy.calls[...]) == 0


def test_copy_deepcopy_and_pickle():
    import copy
    import pickle

    proxy = Pytree(stack())
    x = jnp.ones((4, 2))
    for other in (copy.copy(proxy), copy.deepcopy(proxy), pickle.loads(pickle.dumps(proxy))):
        assert type(other) is Pytree
        assert jax.tree.structure(other) == jax.tree.structure(proxy)
        assert_same_leaves(other, proxy)
        np.testing.assert_allclose(other.encode(x), proxy.to_module().encode(x), rtol=1e-6)
    restored = pickle.loads(pickle.dumps(proxy))
    assert jax.tree.structure(restored) == jax.tree.structure(proxy)


# -- a proxy read through the closure of a JAX transform -----------------------


def _closure_transforms():
    return {
        "jax.jit": lambda f: jax.jit(f),
        "jax.vmap": lambda f: lambda x: jax.vmap(f)(x[None])[0],
        "lax.scan": lambda f: lambda x: jax.lax.scan(lambda c, x: (c, f(x)), 0, x[None])[1][0],
    }


@pytest.mark.parametrize("transform", list(_closure_transforms()))
def test_stateful_call_through_a_closure_raises_and_keeps_the_proxy(transform):
    proxy = Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
    x = jnp.arange(8.0).reshape(4, 2)
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(proxy)]
    wrapped = _closure_transforms()[transform](lambda x: proxy(x))
    with pytest.raises(treemode.TraceContextError, match="treemode.Pytree.*BatchNorm proxy"):
        wrapped(x)
    after = jax.tree.leaves(proxy)
    assert not any(isinstance(leaf, jax.core.Tracer) for leaf in after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    proxy(x)  # still usable eagerly, and its statistics advance there
    assert float(jnp.abs(proxy.mean[...]).sum()) > 0


def test_a_submodule_method_or_with_block_through_a_closure_raises_too():
    proxy = Pytree(Stack(nnx.Rngs(0)))
    x = jnp.ones((4, 2))
    with pytest.raises(treemode.TraceContextError):
        jax.jit(lambda h: proxy.bn(h))(jnp.ones((4, 3)))

    def edit(x):
        with proxy as module:
            module.calls[...] += x.sum().astype(jnp.int32)
        return x

    with pytest.raises(treemode.TraceContextError):
        jax.jit(edit)(x)
    assert int(proxy.calls[...]) == 0


def test_read_only_calls_through_a_closure_and_proxies_passed_in_still_work():
    net = nnx.BatchNorm(2, use_running_average=True, rngs=nnx.Rngs(0))
    proxy = Pytree(net)
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(jax.jit(lambda x: proxy(x))(x), net(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(lambda x: proxy(x))(x), net(x), rtol=1e-6)

    training = Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))

    @jax.jit
    def step(p, x):
        y = p(x)  # p is this trace's proxy: its new state is returned
        return p, y

    training, _ = step(training, x)
    assert float(jnp.abs(training.mean[...]).sum()) > 0
    grads = jax.grad(lambda p, x: p(x).sum())(Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0))), x)
    assert isinstance(grads, Pytree)
    made_inside = jax.jit(lambda x: Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))(x))(x)
    assert made_inside.shape == (4, 2)
    eqx_step = eqx.filter_jit(lambda p, x: (p, p(x)))
    again, _ = eqx_step(Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0))), x)
    assert float(jnp.abs(again.mean[...]).sum()) > 0
