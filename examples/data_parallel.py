"""Data-parallel training on 8 devices with treemode.jit and shardings.

The model and the optimizer state are replicated on every device, each batch is
split along its first axis across the devices, and `treemode.jit` writes the
updated parameters, BatchNorm statistics and optimizer state back into the
ordinary NNX objects after each step. The result is checked against the same
steps run on a single device.

Run it on a CPU with 8 virtual devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import treemode  # noqa: E402

N_DEVICES = 8
STEPS = 30


def make_model() -> nnx.Module:
    return nnx.Sequential(
        nnx.Linear(4, 32, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(32, rngs=nnx.Rngs(1)),
        nnx.relu,
        nnx.Linear(32, 1, rngs=nnx.Rngs(2)),
    )


def train_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def train(step_fn, model, optimizer, batches):
    return [float(step_fn(model, optimizer, x, y)) for x, y in batches]


def main() -> None:
    devices = jax.devices()
    assert len(devices) >= N_DEVICES, f"need {N_DEVICES} devices, found {len(devices)}"
    mesh = Mesh(np.array(devices[:N_DEVICES]), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharded = NamedSharding(mesh, P("data"))

    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(4, 1)).astype(np.float32)
    batches = []
    for _ in range(STEPS):
        x = rng.normal(size=(64, 4)).astype(np.float32)
        batches.append((jnp.asarray(x), jnp.asarray(x @ w_true)))

    # Data parallel: one sharding per argument; a single sharding for a module
    # applies to every Variable in it (a module-shaped prefix could differ per
    # Variable).
    parallel_step = treemode.jit(
        train_step,
        in_shardings=(replicated, replicated, batch_sharded, batch_sharded),
    )
    model = make_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    sharded_batches = [
        (jax.device_put(x, batch_sharded), jax.device_put(y, batch_sharded)) for x, y in batches
    ]
    losses = train(parallel_step, model, optimizer, sharded_batches)

    # The same steps on one device.
    ref_model = make_model()
    ref_optimizer = nnx.Optimizer(ref_model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    ref_losses = train(treemode.jit(train_step), ref_model, ref_optimizer, batches)

    for step in (0, STEPS // 2, STEPS - 1):
        print(f"step {step:3d}  loss {losses[step]:.4f}  (single device {ref_losses[step]:.4f})")

    kernel = model.layers[0].kernel[...]
    assert len(kernel.sharding.device_set) == N_DEVICES, "parameters stay replicated"
    assert losses[-1] < losses[0] / 2, "the loss falls"
    assert optimizer.step[...] == STEPS, "optimizer state is written back"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        model.layers[1].mean[...], ref_model.layers[1].mean[...], rtol=1e-4, atol=1e-5
    )
    print(f"data parallel on {N_DEVICES} devices matches the single-device run")


if __name__ == "__main__":
    main()
