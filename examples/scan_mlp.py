"""An MLP whose blocks are created with `treemode.vmap` and applied with `treemode.scan`.

After Flax's `examples/nnx_toy_examples/06_scan_over_layers.py`, with a short
training loop added. Each `Block` holds a Linear layer, BatchNorm and Dropout.
`treemode.split_rngs` gives every layer its own keys and `treemode.vmap` creates
all layers at once, so every Variable of `model.layers` has a leading `layer`
axis; `__call__` scans over that axis. During training, each layer's BatchNorm
statistics and Dropout counter change inside the scan (inside `treemode.grad`,
inside `treemode.jit`) and are written back into the model.

The code is the Flax original's with `nnx.split_rngs`/`nnx.vmap`/`nnx.scan`
replaced by their treemode namesakes. tests/test_examples.py checks that the
losses equal those of the Flax original run in graph mode on the same data (see
examples/scan_over_layers.py for a scanned transformer).

    python examples/scan_mlp.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import treemode

DIM, N_LAYERS = 10, 5
BATCH, STEPS = 64, 10


class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    """`vmap` in `__init__` stacks `n_layers` Blocks; `scan` in `__call__` applies them."""

    def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
        self.n_layers = n_layers

        @treemode.split_rngs(splits=n_layers)
        @treemode.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs) -> Block:
            return Block(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @treemode.scan
        def scan_fn(x: jax.Array, block: Block) -> tuple[jax.Array, None]:
            return block(x), None

        x, _ = scan_fn(x, self.layers)
        return x


def make_model() -> tuple[ScanMLP, nnx.Optimizer]:
    model = ScanMLP(DIM, n_layers=N_LAYERS, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def make_batches(steps: int = STEPS, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Regression targets sin(x) for random inputs, one batch per step."""
    rng = np.random.RandomState(seed)
    batches = []
    for _ in range(steps):
        x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
        batches.append((x, np.sin(x)))
    return batches


@treemode.jit
def train_step(model: ScanMLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: ScanMLP) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def train(batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[ScanMLP, list[float]]:
    model, optimizer = make_model()
    return model, [float(train_step(model, optimizer, x, y)) for x, y in batches]


def main() -> None:
    model, losses = train(make_batches())
    for step, loss in enumerate(losses):
        print(f"step {step}  loss {loss:.5f}")
    print(jax.tree.map(jnp.shape, nnx.state(model)))
    assert model.layers.linear.kernel.shape == (N_LAYERS, DIM, DIM)
    # Dropout at rate 0.5 makes single steps noisy: compare the first and last three.
    assert sum(losses[-3:]) < sum(losses[:3]), "the loss did not fall"
    # BatchNorm's running mean moved in every layer, inside the scan.
    assert (jnp.abs(model.layers.bn.mean[...]).sum(axis=1) > 0).all()

    model.eval()  # Dropout off, BatchNorm uses its running statistics
    y = model(jnp.ones((3, DIM)))
    assert y.shape == (3, DIM)


if __name__ == "__main__":
    main()
