"""Key paths in user terms, computed only when an error is raised."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

# The pipeline flattens ``(args, kwargs, closure)``; the first key says which.
_ROOT_NAMES = ("args", "kwargs", "closure")


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
    """``(SequenceKey(0), SequenceKey(1), GetAttrKey('w'))`` -> ``args[1].w``."""
    keys = list(path)
    if not root and keys and isinstance(keys[0], SequenceKey) and keys[0].idx < 3:
        root = _ROOT_NAMES[keys[0].idx]
        keys = keys[1:]
        if root == "closure" and keys and isinstance(keys[0], DictKey):
            root = f"closure {keys[0].key}"
            keys = keys[1:]
    return root + "".join(format_key(k) for k in keys)


def leaves_with_paths(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield from jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
