"""A variational autoencoder whose KL term is collected with `treemode.capture`.

After Flax's `examples/nnx_toy_examples/05_vae.py`. There, the encoder stores its
KL divergence as a new attribute (`self.kl_loss = Loss(...)`) during the forward
pass and the loss function removes it again with `nnx.pop(model, Loss)`: a graph
update, which a tree-mode transform rejects. Here the encoder `sow`s the KL term
into a `Loss` collection and the loss function reads it from
`treemode.capture(model, Loss)(x)`, which returns the output and the collected
values and leaves the module's structure untouched. The encoder's noise stream
(an `nnx.Rngs` held by the module) advances inside `treemode.jit` and is written
back like any other Variable.

The data are random binary "images" (the original downloads MNIST); the sizes
are tiny so that the program runs in seconds. tests/test_examples.py checks that
the losses equal those of the Flax original run in graph mode on the same data.

    python examples/vae.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import treemode

IMAGE_SHAPE = (8, 8)
HIDDEN, LATENT = 32, 4
BATCH, STEPS = 16, 8


class Loss(nnx.Variable):
    """The collection the encoder sows its KL divergence into."""


class Encoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.linear1(x.reshape((x.shape[0], -1))))
        mean = self.linear_mean(x)
        std = jnp.exp(self.linear_std(x))
        kl = jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1))
        # Graph mode: `self.kl_loss = Loss(kl)`. Tree mode: sow it, capture reads it.
        self.sow(Loss, "kl_loss", kl)
        return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


class Decoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        return self.linear2(jax.nn.relu(self.linear1(z)))


class VAE(nnx.Module):
    def __init__(self, din: int, hidden: int, latent: int, output_shape, *, rngs: nnx.Rngs):
        self.output_shape = tuple(output_shape)
        self.encoder = Encoder(din, hidden, latent, rngs=rngs)
        self.decoder = Decoder(latent, hidden, int(np.prod(output_shape)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = self.decoder(self.encoder(x))
        return jnp.reshape(logits, (-1, *self.output_shape))

    def generate(self, z: jax.Array) -> jax.Array:
        return nnx.sigmoid(jnp.reshape(self.decoder(z), (-1, *self.output_shape)))


def make_model() -> tuple[VAE, nnx.Optimizer]:
    model = VAE(int(np.prod(IMAGE_SHAPE)), HIDDEN, LATENT, IMAGE_SHAPE, rngs=nnx.Rngs(0, noise=1))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def make_batches(steps: int = STEPS, seed: int = 42) -> list[np.ndarray]:
    """Random binary images, one batch per step (the same for every caller)."""
    rng = np.random.RandomState(seed)
    return [(rng.rand(BATCH, *IMAGE_SHAPE) > 0.5).astype(np.float32) for _ in range(steps)]


@treemode.jit
def train_step(model: VAE, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    def loss_fn(model: VAE) -> jax.Array:
        logits, losses = treemode.capture(model, Loss)(x)
        kl_loss = sum(jax.tree_util.tree_leaves(losses), 0.0)
        reconstruction_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x))
        return reconstruction_loss + 0.1 * kl_loss

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@treemode.jit
def sample(model: VAE, z: jax.Array) -> jax.Array:
    return model.generate(z)


def train(batches: list[np.ndarray]) -> tuple[VAE, list[float]]:
    model, optimizer = make_model()
    losses = [float(train_step(model, optimizer, x)) for x in batches]
    return model, losses


def main() -> None:
    model, losses = train(make_batches())
    for step, loss in enumerate(losses):
        print(f"step {step}  loss {loss:.5f}")
    assert losses[-1] < losses[0], "the loss did not fall"
    # The noise stream advanced once per step, inside the jitted step.
    assert int(model.encoder.rngs.noise.count[...]) == len(losses)
    assert not hasattr(model.encoder, "kl_loss")  # no graph update happened
    samples = sample(model, jnp.ones((3, LATENT)))
    assert samples.shape == (3, *IMAGE_SHAPE)


if __name__ == "__main__":
    main()
