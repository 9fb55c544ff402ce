"""A fully sharded training step: Variable sharding metadata on a 2 x 4 mesh of 8 devices.

After Flax's `examples/nnx_toy_examples/10_fsdp_and_optimizer.py`. Each Param
declares its sharding in its metadata (`out_sharding=("embed", "mlp")`, mapped to
mesh axes by `MeshRules`); created under `jax.set_mesh`, the arrays are sharded
as they are created, and the SGD momentum copies the Params' metadata so that it
is sharded the same way. The batch is sharded over the `data` axis.

The one change from the original is the optimizer. There, `SGD` keeps
`nnx.variables(model, nnx.Param)`, the model's own Params, and updates them in
place; a tree-mode `jit` given both the model and such an optimizer sees every
Param twice and raises `AliasError` (see docs/migration.md#optimizer-holds-model).
Here `SGD` holds only its momentum, and `update(model, grads)` takes the model,
as `nnx.Optimizer` does.

tests/test_examples.py checks that the losses equal those of the Flax original
run in graph mode on the same data.

    python examples/fsdp.py
"""

from __future__ import annotations

import os

# 8 virtual CPU devices; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treemode

DIN, DMID, DOUT = 1, 32, 1
BATCH, STEPS = 32, 10


def make_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))


@dataclasses.dataclass(unsafe_hash=True)
class MeshRules:
    """Logical axis names -> mesh axis names."""

    embed: str | None = None
    mlp: str | None = None
    data: str | None = None

    def __call__(self, *keys: str) -> tuple[str | None, ...]:
        return tuple(getattr(self, key) for key in keys)


mesh_rules = MeshRules(embed=None, mlp="model", data="data")


class MLP(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(
            init(rngs.params(), (din, dmid)), out_sharding=mesh_rules("embed", "mlp")
        )
        self.b1 = nnx.Param(jnp.zeros((dmid,)), out_sharding=mesh_rules("mlp"))
        self.w2 = nnx.Param(
            init(rngs.params(), (dmid, dout)), out_sharding=mesh_rules("embed", "mlp")
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


class SGDState(nnx.Variable):
    pass


class SGD(nnx.Pytree):
    """SGD with momentum; holds the momentum only (the model is passed to `update`)."""

    def __init__(self, model: nnx.Module, lr: float, decay: float = 0.9):
        def init_momentum(variable: nnx.Variable) -> SGDState:
            # The Param's metadata (out_sharding) shards the momentum like the Param.
            return SGDState(jnp.zeros_like(variable[...]), **variable.get_metadata())

        self.lr = lr
        self.decay = decay
        self.momentum = nnx.data(
            jax.tree.map(
                init_momentum,
                nnx.variables(model, nnx.Param),
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )
        )

    def update(self, model: nnx.Module, grads: nnx.Module) -> None:
        def update_fn(param: nnx.Variable, momentum: SGDState, grad: nnx.Variable) -> None:
            momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
            param[...] -= self.lr * momentum[...]

        jax.tree.map(
            update_fn,
            nnx.variables(model, nnx.Param),
            self.momentum,
            nnx.variables(grads, nnx.Param),
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )


@treemode.jit
def create_model() -> tuple[MLP, SGD]:
    model = MLP(DIN, DMID, DOUT, rngs=nnx.Rngs(0))
    return model, SGD(model, 0.01, decay=0.9)


@treemode.jit
def train_step(model: MLP, optimizer: SGD, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return jnp.mean((y - model(x)) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def make_batches(steps: int = STEPS, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Noisy samples of 0.8 x^2 + 0.1, one batch per step (the same for every caller)."""
    rng = np.random.RandomState(seed)
    x = np.linspace(-2, 2, 100, dtype=np.float32)[:, None]
    y = (0.8 * x**2 + 0.1 + rng.normal(0, 0.1, size=x.shape)).astype(np.float32)
    batches = []
    for _ in range(steps):
        idx = rng.choice(len(x), size=BATCH)
        batches.append((x[idx], y[idx]))
    return batches


def train(batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[MLP, SGD, list[float]]:
    mesh = make_mesh()
    with jax.set_mesh(mesh):
        model, optimizer = create_model()
    losses = []
    for x, y in batches:
        x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        losses.append(float(train_step(model, optimizer, x, y)))
    return model, optimizer, losses


def main() -> None:
    model, optimizer, losses = train(make_batches())
    for step, loss in enumerate(losses):
        print(f"step {step}  loss {loss:.5f}")
    assert losses[-1] < losses[0], "the loss did not fall"
    # Every Param and its momentum are sharded as their metadata says, after training.
    assert model.w1[...].sharding.spec == P(None, "model")
    assert model.b1[...].sharding.spec == P("model")
    assert optimizer.momentum["w1"][...].sharding.spec == P(None, "model")
    assert len(model.w1[...].sharding.device_set) == 8
    print("w1 sharding:", model.w1[...].sharding)


if __name__ == "__main__":
    main()
