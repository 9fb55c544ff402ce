"""Checked by pyright in tests/test_typing.py (never imported by the suite).

Each ``reveal_type`` line's expected text is in that test: the transforms keep
the wrapped function's parameters (and, for vmap, its result type), as
``jax.vmap`` does for type checkers.
"""

from typing import reveal_type

import jax

import treemode


def f(x: jax.Array, scale: float) -> jax.Array:
    return x * scale


reveal_type(treemode.vmap(f))  # vmap
reveal_type(treemode.vmap(in_axes=(0, None))(f))  # vmap decorator
reveal_type(treemode.grad(f))  # grad
reveal_type(treemode.grad(argnums=0)(f))  # grad decorator
reveal_type(treemode.value_and_grad(f))  # value_and_grad
reveal_type(jax.vmap(f))  # jax.vmap, for comparison

treemode.vmap(f)(jax.numpy.ones(3), "two")  # error: wrong argument type
treemode.grad(f)(jax.numpy.ones(3))  # error: missing argument
