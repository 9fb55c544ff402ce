"""Checked by pyright in tests/test_typing.py (never imported by the suite).

Each ``reveal_type`` line's expected text is in that test: every public
transform keeps the wrapped function's parameters, and its result type where
the transform keeps it (as ``jax.vmap`` does for type checkers). A wrapper
class (``JitWrapped``, ``VmapWrapped``, ...) is generic in both. Each line
marked ``# error: ...`` is a wrong call the checker must report; no other
line may be an error.
"""

from typing import reveal_type

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import treemode


def f(x: jax.Array, scale: float) -> jax.Array:
    return x * scale


def with_aux(x: jax.Array, scale: float) -> tuple[jax.Array, str]:
    return x * scale, "aux"


def double(x: jax.Array) -> jax.Array:
    return x * 2


class Model(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones(2))

    @treemode.jit
    def jitted(self, x: jax.Array) -> jax.Array:
        return x * self.w[...]

    @treemode.vmap
    def mapped(self, x: jax.Array) -> jax.Array:
        return x * self.w[...]


def train_step(model: Model, lr: float, x: jax.Array) -> float:
    return 0.0


mesh = Mesh(jax.devices(), ("d",))
spec = PartitionSpec()
model = Model()
x = jnp.ones(3)

reveal_type(treemode.jit(f))  # jit
reveal_type(treemode.jit(static_argnums=1)(f))  # jit decorator
reveal_type(treemode.jit_partial(train_step, model))  # jit_partial
reveal_type(treemode.jit_partial(train_step, model, 0.1))  # jit_partial, two bound
reveal_type(treemode.vmap(f))  # vmap
reveal_type(treemode.vmap(in_axes=(0, None))(f))  # vmap decorator
reveal_type(treemode.pmap(f))  # pmap
reveal_type(treemode.pmap(axis_name="i")(f))  # pmap decorator
reveal_type(treemode.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))  # shard_map
reveal_type(treemode.shard_map(mesh=mesh, in_specs=spec, out_specs=spec)(f))  # shard_map decorator
reveal_type(treemode.scan(f))  # scan
reveal_type(treemode.scan(in_axes=(treemode.Carry, None))(f))  # scan decorator
reveal_type(treemode.scan(with_aux, x, x))  # scan, called at once
reveal_type(treemode.custom_vjp(f))  # custom_vjp
reveal_type(treemode.custom_vjp(nondiff_argnums=(1,))(f))  # custom_vjp decorator
reveal_type(treemode.remat(f))  # remat
reveal_type(treemode.checkpoint(prevent_cse=False)(f))  # checkpoint decorator
reveal_type(treemode.checkify(f))  # checkify
reveal_type(treemode.grad(f))  # grad
reveal_type(treemode.grad(argnums=0)(f))  # grad decorator
reveal_type(treemode.value_and_grad(f))  # value_and_grad
reveal_type(treemode.capture(nnx.Intermediate)(f))  # capture decorator
reveal_type(treemode.transform_metadata(f))  # transform_metadata
reveal_type(treemode.eval_shape(Model))  # eval_shape
reveal_type(treemode.vjp(f, x, 2.0))  # vjp
reveal_type(treemode.vjp(with_aux, x, 2.0, has_aux=True))  # vjp with aux
reveal_type(treemode.jvp(f, (x, 2.0), (x, 0.0)))  # jvp
reveal_type(treemode.jvp(with_aux, (x, 2.0), (x, 0.0), True))  # jvp with aux
reveal_type(treemode.cond(True, double, double, x))  # cond
reveal_type(treemode.switch(0, [double, double], x))  # switch
reveal_type(treemode.fori_loop(0, 3, lambda i, y: double(y), x))  # fori_loop
reveal_type(treemode.while_loop(lambda y: False, double, x))  # while_loop
reveal_type(treemode.split_rngs(nnx.Rngs(0), splits=2))  # split_rngs
reveal_type(treemode.fork_rngs(nnx.Rngs(0)))  # fork_rngs
reveal_type(model.jitted)  # a jitted method
reveal_type(model.mapped)  # a vmapped method
reveal_type(jax.vmap(f))  # jax.vmap, for comparison

treemode.vmap(f)(x, "two")  # error: wrong argument type
treemode.grad(f)(x)  # error: missing argument
treemode.jit(f)(x, "two")  # error: wrong argument type
print(treemode.jit(f).not_an_attribute)  # error: unknown attribute
treemode.jit_partial(train_step, model)("lr", x)  # error: wrong argument type
treemode.scan(f)(x)  # error: missing argument
treemode.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(x)  # error: missing argument
treemode.custom_vjp(f)(x, "two")  # error: wrong argument type
treemode.remat(f)(x)  # error: missing argument
model.jitted(x, x)  # error: too many arguments
