"""Distributed training on 8 virtual CPU devices: data parallel with treemode.jit
shardings, tensor parallel with treemode.shard_map; both equal the single-device run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import state_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treemode

N_DEV = 8


@pytest.fixture(scope="module")
def devices():
    devs = jax.devices()
    assert len(devs) >= N_DEV, "conftest sets 8 virtual CPU devices"
    return devs[:N_DEV]


def assert_close_state(a, b, rtol=2e-5, atol=2e-6):
    xs, ys = state_arrays(a), state_arrays(b)
    assert len(xs) == len(ys)
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"state leaf {i}")


def batch(n=16, din=4, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, din)), jax.random.normal(ky, (n, 1))


# -- helpers ---------------------------------------------------------------------


def test_sharding_of_and_partition_specs(devices):
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(
            4,
            8,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
        )
    shardings = treemode.sharding_of(layer, mesh)
    assert isinstance(shardings, nnx.Linear)
    assert shardings.kernel == NamedSharding(mesh, P(None, "model"))
    assert shardings.bias == NamedSharding(mesh, P("model"))
    specs = treemode.partition_specs(layer)
    assert specs.kernel == P(None, "model") and specs.bias == P("model")
    placed = jax.device_put(layer, shardings)
    assert placed.kernel[...].sharding == shardings.kernel


def test_prefix_no_filter_matches():
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    pattern = r"treemode\.prefix: no filter matches the Param at node\.bias"
    with pytest.raises(ValueError, match=pattern):
        treemode.prefix(bn, {nnx.BatchStat: 0})


# -- data parallel -----------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs):
        # No bias before BatchNorm: its gradient is zero up to rounding, which
        # Adam would amplify into arbitrary, device-count-dependent updates.
        self.l1 = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def dp_step(model, opt, x, y):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def test_data_parallel_jit_with_module_shaped_shardings(devices):
    mesh = Mesh(np.array(devices), ("data",))
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_model = treemode.clone(model)
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

    replicated = NamedSharding(mesh, P())
    model_sh = treemode.sharding_of(model, mesh)  # no annotations: replicated
    opt_sh = treemode.sharding_of(opt, mesh)
    data_sh = NamedSharding(mesh, P("data"))
    step = treemode.jit(
        dp_step,
        in_shardings=(model_sh, opt_sh, data_sh, data_sh),
        out_shardings=replicated,
    )
    ref_step = treemode.jit(dp_step)

    for i in range(3):
        x, y = batch(seed=i)
        loss = step(model, opt, x, y)
        ref_loss = ref_step(ref_model, ref_opt, x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)

    assert_close_state(model, ref_model)
    assert_close_state(opt, ref_opt)
    # BatchNorm statistics and optimizer state were written back, on the mesh.
    assert not np.allclose(model.bn.mean[...], 0.0)
    assert int(opt.step[...]) == 3
    assert model.l1.kernel[...].sharding == replicated
    assert len(model.bn.var[...].sharding.device_set) == N_DEV


def test_forward_pass_with_explicit_shardings(devices):
    # A trace that updates no Variable, under in_shardings and out_shardings
    # (whose per-Variable entries fix the shape of the updates output).
    mesh = Mesh(np.array(devices), ("data",))
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    kernel = model.kernel[...]
    replicated = NamedSharding(mesh, P())
    data_sh = NamedSharding(mesh, P("data"))
    forward = treemode.jit(
        lambda m, x: m(x),
        in_shardings=(treemode.sharding_of(model, mesh), data_sh),
        out_shardings=data_sh,
    )
    x = batch()[0]
    for _ in range(2):  # the full path, then the call-site memo
        out = forward(model, x)
        np.testing.assert_allclose(out, model(x), rtol=1e-5)
        assert out.sharding == data_sh
    assert model.kernel[...] is kernel  # nothing written back
    only_out = treemode.jit(lambda m, x: m(x), out_shardings=replicated)
    assert only_out(model, x).sharding == replicated


# -- tensor parallel ----------------------------------------------------------------


class TPNet(nnx.Module):
    """Megatron-style MLP: column-parallel l1 + BatchNorm, row-parallel l2."""

    def __init__(self, rngs, hidden=16):
        init = nnx.initializers.lecun_normal()
        with nnx.use_eager_sharding(False):
            self.w1 = nnx.Param(init(rngs.params(), (4, hidden)), out_sharding=(None, "model"))
            self.bn = nnx.BatchNorm(hidden, rngs=rngs)
            for v in (self.bn.scale, self.bn.bias, self.bn.mean, self.bn.var):
                v.set_metadata(out_sharding=("model",))
            self.w2 = nnx.Param(init(rngs.params(), (hidden, 1)), out_sharding=("model", None))
            self.b2 = nnx.Param(jnp.zeros(1))

    def forward(self, x, axis_name=None):
        h = nnx.relu(self.bn(x @ self.w1[...]))
        partial = h @ self.w2[...]
        if axis_name is not None:
            partial = jax.lax.psum(partial, axis_name)
        return partial + self.b2[...]


def tp_step(model, opt, x, y, axis_name=None):
    def loss_fn(m):
        return jnp.mean((m.forward(x, axis_name) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def test_tensor_parallel_shard_map_matches_single_device(devices):
    mesh = Mesh(np.array(devices), ("model",))
    model = TPNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_model = treemode.clone(model)
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

    model_specs = treemode.partition_specs(model)
    opt_specs = treemode.partition_specs(opt)  # Adam moments inherit the params' specs
    assert model_specs.w1 == P(None, "model") and model_specs.b2 == P()
    sharded = treemode.shard_map(
        lambda m, o, x, y: tp_step(m, o, x, y, axis_name="model"),
        mesh=mesh,
        in_specs=(model_specs, opt_specs, P(), P()),
        out_specs=P(),
    )
    step = treemode.jit(sharded)
    ref_step = treemode.jit(tp_step)

    for i in range(3):
        x, y = batch(seed=i)
        loss = step(model, opt, x, y)
        ref_loss = ref_step(ref_model, ref_opt, x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)

    assert_close_state(model, ref_model)
    assert_close_state(opt, ref_opt)
    assert not np.allclose(model.bn.mean[...], 0.0)
    assert int(opt.step[...]) == 3
    assert model.w1[...].sharding.spec == P(None, "model")


def test_shard_map_eager_write_back(devices):
    mesh = Mesh(np.array(devices), ("d",))

    class Stats(nnx.Module):
        def __init__(self):
            self.per_shard = nnx.BatchStat(jnp.zeros(N_DEV))
            self.total = nnx.BatchStat(jnp.zeros(()))

    stats = Stats()
    specs = treemode.prefix(stats, {lambda path, v: "per_shard" in path: P("d"), ...: P()})

    @treemode.shard_map(mesh=mesh, in_specs=(specs, P("d")), out_specs=P("d"))
    def f(s, x):
        s.per_shard[...] += x.sum()
        s.total[...] += jax.lax.psum(x.sum(), "d")
        return x * 2

    x = jnp.arange(2.0 * N_DEV).reshape(N_DEV, 2)
    y = f(stats, x)
    np.testing.assert_allclose(y, 2 * x)
    np.testing.assert_allclose(stats.per_shard[...], x.sum(axis=1))
    assert float(stats.total[...]) == float(x.sum())


def test_shard_map_replicated_variable_set_per_shard_names_path(devices):
    mesh = Mesh(np.array(devices), ("d",))
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    before = [a.copy() for a in state_arrays(bn)]
    f = treemode.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
    pattern = r"(?s)treemode\.shard_map.*args\[0\]\.mean.*pmean"
    with pytest.raises(treemode.AxisError, match=pattern):
        f(bn, jnp.ones((N_DEV, 2)))
    for a, b in zip(state_arrays(bn), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "in_specs, pattern",
    [
        (
            (P(), P("d", None, None)),
            r"gives P\('d', None, None\) to args\[1\], which has shape \(8, 2\)",
        ),
        ((P(), P("x")), r"mesh has no axis 'x'"),
        ((P(), P(None, "d")), r"dimension 1 of args\[1\] .*not divisible by 8"),
        ((P(), 0), r"in_specs gives 0 for args\[1\].*PartitionSpec"),
        ((P(),), r"in_specs has 1 entries"),
    ],
)
def test_shard_map_bad_specs(devices, in_specs, pattern):
    mesh = Mesh(np.array(devices), ("d",))
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    f = treemode.shard_map(lambda m, x: x, mesh=mesh, in_specs=in_specs, out_specs=P("d"))
    with pytest.raises(treemode.AxisError, match=pattern):
        f(bn, jnp.ones((N_DEV, 2)))


def test_shard_map_explicit_mesh_unplaced_input_names_path(devices):
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = treemode.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    with pytest.raises(treemode.AxisError, match=r"args\[0\].*jax\.device_put"):
        f(jnp.ones(N_DEV))
    placed = jax.device_put(jnp.ones(N_DEV), NamedSharding(mesh, P("d")))
    np.testing.assert_allclose(f(placed), 2 * jnp.ones(N_DEV))
