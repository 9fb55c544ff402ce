"""The Flax originals of the programs in examples/, run with Flax's graph-mode transforms.

Each function here re-states, at the sizes of the corresponding treemode example,
the computation of a program from Flax 0.12.8's `examples/nnx_toy_examples/`
with the graph-mode features that tree mode rejects left in place (attributes
created and popped inside the step, an optimizer that holds the model's own
Variables, `nnx.vmap`/`nnx.scan` with graph updates). tests/test_examples.py runs
them next to the treemode examples on the same seeds and data and compares the
losses.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# ---------------------------------------------------------------------------
# 05_vae.py: the encoder sets `self.kl_loss` inside the step; the loss pops it.
# ---------------------------------------------------------------------------


class VaeLoss(nnx.Variable):
    pass


class VaeEncoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], -1))
        x = jax.nn.relu(self.linear1(x))
        mean = self.linear_mean(x)
        std = jnp.exp(self.linear_std(x))
        self.kl_loss = VaeLoss(
            jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1))
        )
        key = self.rngs.noise()
        return mean + std * jax.random.normal(key, mean.shape)


class VaeDecoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        return self.linear2(jax.nn.relu(self.linear1(z)))


class VAE(nnx.Module):
    def __init__(self, din, hidden_size, latent_size, output_shape, *, rngs: nnx.Rngs):
        self.output_shape = output_shape
        self.encoder = VaeEncoder(din, hidden_size, latent_size, rngs=rngs)
        self.decoder = VaeDecoder(latent_size, hidden_size, int(np.prod(output_shape)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = self.decoder(self.encoder(x))
        return jnp.reshape(logits, (-1, *self.output_shape))


def vae_losses(
    batches: tp.Sequence[np.ndarray],
    image_shape: tuple[int, int],
    hidden: int,
    latent: int,
) -> list[float]:
    model = VAE(int(np.prod(image_shape)), hidden, latent, image_shape, rngs=nnx.Rngs(0, noise=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: VAE, optimizer: nnx.Optimizer, x: jax.Array):
        def loss_fn(model: VAE):
            logits = model(x)
            losses = nnx.pop(model, VaeLoss)
            kl_loss = sum(jax.tree_util.tree_leaves(losses), 0.0)
            reconstruction_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x))
            return reconstruction_loss + 0.1 * kl_loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, x)) for x in batches]


# ---------------------------------------------------------------------------
# 10_fsdp_and_optimizer.py: sharding metadata on a 2 x 4 mesh; the SGD optimizer
# holds the model's own Params (`nnx.variables(model, nnx.Param)`).
# ---------------------------------------------------------------------------


def fsdp_losses(
    batches: tp.Sequence[tuple[np.ndarray, np.ndarray]], din: int, dmid: int, dout: int
) -> tuple[list[float], dict[str, tp.Any]]:
    """The losses, and the final Params and momentum (arrays) by name."""
    from jax.experimental import mesh_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))
    rules = {"embed": None, "mlp": "model", "data": "data"}

    def names(*keys: str) -> tuple[str | None, ...]:
        return tuple(rules[k] for k in keys)

    class MLP(nnx.Module):
        def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
            self.w1 = nnx.Param(
                nnx.initializers.lecun_normal()(rngs.params(), (din, dmid)),
                out_sharding=names("embed", "mlp"),
            )
            self.b1 = nnx.Param(jnp.zeros((dmid,)), out_sharding=names("mlp"))
            self.w2 = nnx.Param(
                nnx.initializers.lecun_normal()(rngs.params(), (dmid, dout)),
                out_sharding=names("embed", "mlp"),
            )

        def __call__(self, x: jax.Array):
            return nnx.relu(x @ self.w1 + self.b1) @ self.w2

    class SGDState(nnx.Variable):
        pass

    class SGD(nnx.Pytree):
        def __init__(self, params: nnx.State, lr, decay=0.9):
            def init_optimizer_state(variable: nnx.Variable):
                return SGDState(jnp.zeros_like(variable.value), **variable.get_metadata())

            self.lr = lr
            self.params = nnx.data(params)  # the model's own Variables
            self.momentum = nnx.data(
                jax.tree.map(
                    init_optimizer_state,
                    self.params,
                    is_leaf=lambda x: isinstance(x, nnx.Variable),
                )
            )
            self.decay = decay

        def update(self, grads: nnx.State):
            def update_fn(params: nnx.Variable, momentum: SGDState, grad: nnx.Variable):
                momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
                params[...] -= self.lr * momentum[...]

            jax.tree.map(
                update_fn,
                self.params,
                self.momentum,
                grads,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )

    @nnx.jit
    def create_model():
        model = MLP(din, dmid, dout, rngs=nnx.Rngs(0))
        optimizer = SGD(nnx.variables(model, nnx.Param), 0.01, decay=0.9)
        return model, optimizer

    with jax.set_mesh(mesh):
        model, optimizer = create_model()

    @nnx.jit
    def train_step(model: MLP, optimizer: SGD, x, y):
        def loss_fn(model):
            return jnp.mean((y - model(x)) ** 2)

        loss, grad = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(grad)
        return loss

    losses = []
    for x, y in batches:
        x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        losses.append(float(train_step(model, optimizer, x, y)))
    final = {name: getattr(model, name)[...] for name in ("w1", "b1", "w2")}
    final.update({f"momentum.{k}": v[...] for k, v in optimizer.momentum.items()})
    return losses, final


# ---------------------------------------------------------------------------
# 06_scan_over_layers.py: blocks created with nnx.split_rngs + nnx.vmap, applied
# with nnx.scan (graph mode), trained with nnx.jit + nnx.value_and_grad.
# ---------------------------------------------------------------------------


class ScanBlock(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
        self.n_layers = n_layers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return ScanBlock(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan
        def scan_fn(x: jax.Array, block: ScanBlock):
            x = block(x)
            return x, None

        x, _ = scan_fn(x, self.layers)
        return x


def scan_mlp_losses(
    batches: tp.Sequence[tuple[np.ndarray, np.ndarray]], dim: int, n_layers: int
) -> tuple[list[float], nnx.State]:
    """The losses, and the model's final state."""
    model = ScanMLP(dim, n_layers=n_layers, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: ScanMLP, optimizer: nnx.Optimizer, x, y):
        def loss_fn(model: ScanMLP):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, x, y)) for x, y in batches]
    return losses, nnx.state(model)
