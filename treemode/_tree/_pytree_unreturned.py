"""`treemode.Pytree` proxies passed to a treemode transform and not returned.

A proxy is a plain pytree: no transform writes its changes back into the proxy
that was passed. The pure function (`treemode._pipeline._pure`) finds, for a
Variable whose state changed, the proxy that owns it (`proxy_leaf_owners`); if
the function's output does not hold that proxy (`returned_proxies`), the change
would be lost, and `unreturned_proxy_message` explains why and what to do.
"""

from __future__ import annotations

from typing import Any

import jax

from ._leaves import is_variable
from ._pytree import Pytree


def _is_proxy_or_variable(x: Any) -> bool:
    return isinstance(x, Pytree) or is_variable(x)


def proxy_leaf_owners(tree: Any) -> list[tuple[tuple[Any, ...], Pytree[Any]] | None]:
    """Per leaf of ``tree_flatten(tree, is_leaf=is_variable)``: the Pytree proxy it
    belongs to (with the proxy's key path), or ``None``."""
    owners: list[tuple[tuple[Any, ...], Pytree[Any]] | None] = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_proxy_or_variable)[0]:
        if isinstance(x, Pytree):
            owners.extend([(tuple(path), x)] * len(jax.tree_util.tree_leaves(x)))
        else:
            owners.append(None)
    return owners


def returned_proxies(out: Any) -> set[int]:
    """Ids of the Pytree proxies that appear in a function's output."""
    return {
        id(x)
        for x in jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, Pytree))
        if isinstance(x, Pytree)
    }


def unreturned_proxy_message(transform: str, proxy_path: str, leaf_path: str) -> str:
    """The explanation for a proxy whose state changed inside a transform."""
    return (
        f"treemode.{transform}: the function changed the state of the treemode.Pytree "
        f"at {proxy_path} (first at {leaf_path}) but does not return that proxy.\n"
        "A Pytree proxy is a plain pytree: no transform writes its changes back into "
        "the proxy you passed. Return it (e.g. `return y, proxy`, or in the `aux` of "
        "value_and_grad(..., has_aux=True)) and use the returned proxy, as with Equinox "
        "modules; or pass the NNX module itself, whose Variables treemode writes back."
    )
