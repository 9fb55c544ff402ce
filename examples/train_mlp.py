"""Train a small NNX model with treemode.jit + treemode.value_and_grad + optax.

Synthetic regression data (y = sin(x) plus noise); the model has BatchNorm
statistics, a Dropout Rngs stream and an optimizer state, all of which are
written back by `treemode.jit` after every step. Run with `make demo`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import treemode


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(1, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        x = nnx.gelu(self.norm(self.hidden(x)))
        return self.out(self.dropout(x))


@treemode.jit
def train_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@treemode.jit
def eval_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def main() -> None:
    key_x, key_noise = jax.random.split(jax.random.key(0))
    x = jax.random.uniform(key_x, (1024, 1), minval=-3.0, maxval=3.0)
    y = jnp.sin(x) + 0.05 * jax.random.normal(key_noise, x.shape)

    model = Regressor(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    epochs, batch = 8, 64
    steps_per_epoch = x.shape[0] // batch
    first_loss = None
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        for i in range(steps_per_epoch):
            xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
            losses.append(train_step(model, optimizer, xb, yb))
        epoch_loss = float(jnp.mean(jnp.stack(losses)))
        first_loss = epoch_loss if first_loss is None else first_loss
        bar = "#" * int(30 * epoch / epochs)
        print(f"epoch {epoch:2d}/{epochs} [{bar:<30}] train loss {epoch_loss:.4f}")

    model.eval()  # BatchNorm uses its running statistics, Dropout is off
    final = float(eval_loss(model, x, y))
    elapsed = time.perf_counter() - start
    print(f"final eval loss {final:.4f} (first epoch {first_loss:.4f}) in {elapsed:.1f}s")
    print(
        f"optimizer steps {int(optimizer.step[...])}, dropout rng count "
        f"{int(model.dropout.rngs.count[...])}"
    )
    assert final < first_loss, "the loss did not fall"


if __name__ == "__main__":
    main()
