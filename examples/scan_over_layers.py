"""A stack of transformer blocks applied with one `treemode.scan` over the layers.

The blocks are created at once: `treemode.split_rngs` gives each layer its own
random keys and `treemode.vmap` stacks the layers, so every Variable of
`model.blocks` has a leading axis of size `DEPTH`. `Model.__call__` scans over
that axis, so the block is traced and compiled once, however deep the stack is.
Each block has its own Dropout stream; the scan advances it and writes the new
counts back into the model.

The task is a small sequence-regression problem that needs attention: every
position must predict the mean of the sequence. The model is trained for a few
steps with `treemode.jit` + `treemode.value_and_grad` + optax.

    python examples/scan_over_layers.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import treemode
from treemode import Carry

DEPTH, DIM, HEADS, SEQ = 4, 16, 2, 8
STEPS = 60


class Block(nnx.Module):
    """Pre-norm self-attention + MLP, each with a residual connection."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=DIM, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(1, DIM, rngs=rngs)

        # One call creates DEPTH blocks: split_rngs gives vmap a batch of keys,
        # vmap stacks every Variable of the blocks on a new leading axis.
        @treemode.split_rngs(splits=DEPTH)
        @treemode.vmap(in_axes=(0,), out_axes=0)
        def create_blocks(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = create_blocks(rngs)
        self.head = nnx.Linear(DIM, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # The activations are the carry; the stacked blocks are scanned: step i
        # sees layer i. Each layer's Dropout count advances and is written back.
        @treemode.scan(in_axes=(Carry, 0), out_axes=Carry)
        def forward(h: jax.Array, block: Block) -> jax.Array:
            return block(h)

        return self.head(forward(self.embed(x), self.blocks))


@treemode.jit
def train_step(model: Model, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: Model) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = treemode.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def dropout_counts(model: Model) -> list[int]:
    return model.blocks.dropout.rngs.count[...].tolist()


def main() -> None:
    model = Model(nnx.Rngs(params=0, dropout=1))
    kernel = model.blocks.up.kernel
    assert kernel.shape == (DEPTH, DIM, 4 * DIM), kernel.shape
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    counts_before = dropout_counts(model)

    key = jax.random.key(0)
    losses = []
    start = time.perf_counter()
    for step in range(1, STEPS + 1):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (32, SEQ, 1))
        y = jnp.broadcast_to(jnp.mean(x, axis=1, keepdims=True), x.shape)
        losses.append(float(train_step(model, optimizer, x, y)))
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start

    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(
        f"{DEPTH} scanned blocks, {STEPS} steps in {elapsed:.1f}s: loss {first:.4f} -> {last:.4f}"
    )
    print(f"dropout counts per layer {counts_before} -> {dropout_counts(model)}")
    assert last < first / 2, "the loss did not fall"
    assert int(optimizer.step[...]) == STEPS, "the optimizer state is written back"
    assert dropout_counts(model) == [c + STEPS for c in counts_before], (
        "each layer's Dropout stream advances once per step"
    )


if __name__ == "__main__":
    main()
