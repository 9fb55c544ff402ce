"""Key paths in user terms, computed only when an error is raised (or a filter asks)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ._leaves import is_variable


def format_key(key: Any) -> str:
    if isinstance(key, GetAttrKey):
        return f".{key.name}"
    if isinstance(key, SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, DictKey):
        return f"[{key.key!r}]"
    if isinstance(key, FlattenedIndexKey):
        return f"[{key.key}]"
    return str(key)


def format_path(path: Sequence[Any], root: str = "") -> str:
    """``(SequenceKey(1), GetAttrKey('w'))`` under root ``args`` -> ``args[1].w``."""
    return root + "".join(format_key(k) for k in path)


def nnx_path(keys: Sequence[Any]) -> tuple[Any, ...]:
    """A JAX key path as an NNX path (``('layers', 0, 'kernel')``), for NNX filters.

    A key with ``parts`` (a `treemode.Pytree` proxy's ``ModuleKey``) stands for
    the path it holds.
    """
    out: list[Any] = []
    for key in keys:
        parts = getattr(key, "parts", None)
        if parts is not None:
            out.extend(nnx_path(parts))
        elif isinstance(key, GetAttrKey):
            out.append(key.name)
        elif isinstance(key, SequenceKey):
            out.append(key.idx)
        elif isinstance(key, (DictKey, FlattenedIndexKey)):
            out.append(key.key)
        else:
            out.append(str(key))
    return tuple(out)


def paths_and_leaves(roots: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(display path, leaf)`` for every leaf of every ``(root name, tree)``.

    Variables are leaves; trees are walked in order.
    """
    for root, tree in roots:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
            yield format_path(path, root), leaf
