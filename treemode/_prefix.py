"""Broadcasting a user prefix (axes, shardings, ...) to the traced arrays.

Transforms take per-argument specifications as a pytree *prefix* of their
arguments: ``in_axes=(0, None)``, ``in_shardings=(model_shardings, batch)``.
Here a prefix may stop at any node of an argument, at a Variable, or inside a
Variable (``nnx.Param(sharding)`` gives that Variable's value a sharding), and a
module-shaped prefix (the module with each Variable replaced by a value) works
because it has the module's own structure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._flatten import ArgFlat
from ._leaves import is_variable


def broadcast_to_dynamic(
    prefix: Any,
    flat: ArgFlat,
    tree: Any,
    *,
    is_prefix_leaf: Callable[[Any], bool],
    where: str,
    what: str,
) -> list[Any]:
    """One prefix value per dynamic array of ``flat`` (the flattening of ``tree``)."""
    per_leaf = broadcast_to_leaves(
        prefix, tree, is_prefix_leaf=is_prefix_leaf, where=where, what=what
    )
    out: list[Any] = []
    for value, count in zip(per_leaf, flat.leaf_dynamic_counts(), strict=True):
        out.extend([value] * count)
    return out


def broadcast_to_leaves(
    prefix: Any,
    tree: Any,
    *,
    is_prefix_leaf: Callable[[Any], bool],
    where: str,
    what: str,
) -> list[Any]:
    """One prefix value per leaf of ``tree`` (Variables count as leaves)."""

    def leaf(x: Any) -> bool:
        return x is None or is_variable(x) or is_prefix_leaf(x)

    prefix_leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=leaf)
    try:
        subtrees = prefix_def.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what} for {where} does not match its structure: the specification "
            f"must be a prefix of the argument (a single value, or a tree of the same "
            f"shape with values in place of Variables or arrays).\nDetails: {e}"
        ) from None
    out: list[Any] = []
    for value, sub in zip(prefix_leaves, subtrees, strict=True):
        if is_variable(value):
            value = value.get_raw_value()
        n = len(jax.tree_util.tree_leaves(sub, is_leaf=is_variable))
        out.extend([value] * n)
    return out
