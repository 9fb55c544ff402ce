"""``to_tree`` / ``from_tree``: object graphs with sharing <-> pure pytrees.

``to_tree`` walks a pytree in flatten order. Every NNX object (Module, Rngs,
Optimizer, ``nnx.List``, ...) becomes a `GraphNode`, a pytree node that
stores the object's one-level structure; every Variable is kept as it is. The
second and later references to the same object become a static
`SharedRef` holding the pre-order index of the first one. The result has
no aliases, so any JAX transform can consume it. ``from_tree`` rebuilds the
objects in the same order and resolves each ``SharedRef`` to the object built
for its index, so the sharing is restored.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.tree_util import PyTreeDef

from .. import _compat
from .._errors import AliasError, CycleError
from ._leaves import is_variable, is_variable_or_graph_node
from ._paths import format_path
from ._recursion import below, recursion_headroom


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SharedRef:
    """A second reference to the object with pre-order index ``index``."""

    index: int


@jax.tree_util.register_pytree_with_keys_class
class GraphNode:
    """An NNX object in pure-pytree form: its children plus its one-level structure."""

    __slots__ = ("children", "keys", "node_def")

    def __init__(
        self,
        node_def: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm] - jaxlib has no stubs
        keys: tuple[Any, ...],
        children: list[Any],
    ):
        self.node_def = node_def
        self.keys = keys
        self.children = children

    def tree_flatten_with_keys(self):
        return list(zip(self.keys, self.children, strict=True)), (self.node_def, self.keys)

    def tree_flatten(self):
        return self.children, (self.node_def, self.keys)

    @classmethod
    def tree_unflatten(cls, aux, children):
        node_def, keys = aux
        return cls(node_def, keys, list(children))

    def __repr__(self) -> str:
        kind = self.node_def.node_data()
        name = kind[0].__name__ if kind else "?"
        return f"GraphNode({name}, {len(self.children)} children)"


def _is_marker(x: Any) -> bool:
    return isinstance(x, (GraphNode, SharedRef)) or is_variable(x)


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def to_tree(node: Any) -> Any:
    """Convert a pytree that may hold shared NNX objects into a pure pytree.

    **Arguments:**

    - `node`: any pytree: NNX Modules, Variables, Equinox modules, dicts, lists...

    **Returns:**

    A pytree without aliases: each NNX object appears once, as a `GraphNode`;
    later references to it are static `SharedRef` markers. Variables are kept as
    they are (the same objects), so writing to them writes to the originals.

    **Raises:**

    `StructureError` for a reference cycle (an object that contains itself).

    ```python
    import treemode
    from flax import nnx

    shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    tree = treemode.to_tree({"a": shared, "b": shared})
    restored = treemode.from_tree(tree)
    assert restored["a"] is restored["b"]
    ```
    """
    index: dict[int, int] = {}
    in_progress: set[int] = set()
    keepalive: list[Any] = []
    # convert runs inside JAX's C++ tree_map: an exception raised through it
    # corrupts the interpreter's recursion counter, so errors are raised after.
    errors: list[Exception] = []

    def convert(path: tuple[Any, ...], x: Any) -> Any:
        key = id(x)
        if errors:
            return None
        if key in index:
            if key in in_progress:
                errors.append(
                    CycleError(
                        f"treemode.to_tree: reference cycle at {format_path(path, 'node')}: "
                        f"a {type(x).__name__} contains itself. Tree mode needs an acyclic "
                        "graph; store the back-reference outside the module (or as a "
                        "static non-NNX attribute)."
                    )
                )
                return None
            return SharedRef(index[key])
        if len(in_progress) > max_depth:
            errors.append(RecursionError("to_tree: nested too deeply"))
            return None
        index[key] = len(index)
        keepalive.append(x)
        if is_variable(x):
            return x
        in_progress.add(key)
        try:
            flat, node_def = jax.tree_util.tree_flatten_with_path(x, is_leaf=below(x))
            keys = tuple(p[0] for p, _ in flat)
            children = [
                jax.tree_util.tree_map_with_path(
                    lambda p, c, k=k: (
                        convert((*path, k, *p), c) if is_variable_or_graph_node(c) else c
                    ),
                    child,
                    is_leaf=is_variable_or_graph_node,
                )
                for k, (_, child) in zip(keys, flat, strict=True)
            ]
        finally:
            in_progress.discard(key)
        return GraphNode(node_def, keys, children)

    with recursion_headroom():
        max_depth = sys.getrecursionlimit() // 7  # about six levels per nesting level
        tree = jax.tree_util.tree_map_with_path(
            lambda p, x: convert(p, x) if is_variable_or_graph_node(x) else x,
            node,
            is_leaf=is_variable_or_graph_node,
        )
    if errors:
        raise errors[0]
    return tree


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def from_tree(tree: Any) -> Any:
    """Rebuild the object graph encoded by `to_tree`.

    **Arguments:**

    - `tree`: the output of `to_tree` (or of a transform applied to it).

    **Returns:**

    The pytree with every `GraphNode` turned back into its NNX object and every
    `SharedRef` resolved to the same object as the reference it points to.

    ```python
    import treemode
    from flax import nnx

    class Pair(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 2, rngs=rngs)
            self.b = self.a

    pair = treemode.from_tree(treemode.to_tree(Pair(nnx.Rngs(0))))
    assert pair.a is pair.b
    ```
    """
    built: list[Any] = []

    def build(x: Any) -> Any:
        if isinstance(x, SharedRef):
            return built[x.index]
        slot = len(built)
        built.append(None)
        if isinstance(x, GraphNode):
            children = [
                jax.tree_util.tree_map(
                    lambda c: build(c) if _is_marker(c) else c, child, is_leaf=_is_marker
                )
                for child in x.children
            ]
            obj = x.node_def.unflatten(children)
        else:
            obj = x
        built[slot] = obj
        return obj

    with recursion_headroom():
        return jax.tree_util.tree_map(
            lambda x: build(x) if _is_marker(x) else x, tree, is_leaf=_is_marker
        )


def original_roots(call: Any) -> list[tuple[str, Any]]:
    """``(display name, argument as passed)`` of a call's traced arguments (before `to_tree`)."""
    static = call.static_positional
    roots = [(f"args[{i}]", a) for i, a in enumerate(call.args) if i not in static]
    return roots + [(f"kwargs[{name!r}]", call.kwargs[name]) for name in call.kw_names]


def check_one_spec_per_variable(
    transform: str,
    what: str,
    roots: list[tuple[str, Any, list[Any]]],
    describe: Callable[[Any], str] = repr,
) -> None:
    """``graph=True``: raise if one Variable reached twice gets two specifications.

    With sharing, a Variable passed in two places is one input of the JAX
    transform, so it can take only one ``in_axes``, ``argnums`` membership or
    sharding. ``roots`` are ``(name, original argument, values)``, ``values``
    holding one specification per leaf of the argument (Variables count as
    leaves, in ``jax.tree_util.tree_leaves`` order).

    **Raises:**

    `AliasError` naming both paths and both specifications.
    """
    first: dict[int, tuple[int, int, Any]] = {}
    for r, (_, tree, values) in enumerate(roots):
        leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_variable)
        for j, (leaf, value) in enumerate(zip(leaves, values, strict=True)):
            if not is_variable(leaf):
                continue
            seen = first.setdefault(id(leaf), (r, j, value))
            if not same_spec(seen[2], value):
                where = [_leaf_path(roots[k][0], roots[k][1], i) for k, i in (seen[:2], (r, j))]
                raise AliasError(
                    f"treemode.{transform}: Inconsistent aliasing detected: the "
                    f"{type(leaf).__name__} at {where[0]} is also reachable at {where[1]} "
                    f"(shared, graph=True), with two different {what}, {where[0]}: "
                    f"{describe(seen[2])} and {where[1]}: {describe(value)}. Duplicate "
                    "references to one Variable are one input of the transform, so it takes "
                    "one specification.\n"
                    f"Fix: give both places the same {what}, or pass the Variable only once."
                )


_NO_SPEC: Any = object()  # `_spec_at`: the prefix does not reach this path


def check_one_output_spec_per_variable(
    transform: str,
    what: str,
    out: Any,
    prefix: Any,
    is_spec_leaf: Callable[[Any], bool] | None = None,
    root: str = "output",
    describe: Callable[[Any], str] = repr,
) -> None:
    """``graph=True``: raise if one Variable returned at two paths gets two output specs.

    The output side of `check_one_spec_per_variable`. With sharing, a Variable
    returned at two paths of ``out`` (the function's output, before `to_tree`)
    is one output of the JAX transform, which takes it at the first path
    only: ``prefix`` (``out_axes``, ``out_specs``, ``out_shardings``: a prefix
    of ``out``, possibly module-shaped, its Variables holding the values) must
    give every path of it the same specification. Paths the prefix does not
    reach are left to JAX's own error. ``is_spec_leaf`` marks further prefix
    leaves (e.g. `treemode.Carry`); ``root`` starts the paths in the message.
    Runs at trace time only.

    **Raises:**

    `AliasError` naming both paths and both specifications.
    """
    leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_variable)[0]
    first: dict[int, tuple[Any, Any]] = {}
    for path, leaf in leaves:
        if not is_variable(leaf):
            continue
        seen = first.get(id(leaf))
        if seen is None:
            first[id(leaf)] = (path, _NO_SPEC)
            continue
        if seen[1] is _NO_SPEC:
            seen = first[id(leaf)] = (seen[0], _spec_at(prefix, seen[0], is_spec_leaf))
        spec = _spec_at(prefix, path, is_spec_leaf)
        if seen[1] is _NO_SPEC or spec is _NO_SPEC or same_spec(seen[1], spec):
            continue
        where = [format_path(seen[0], root), format_path(path, root)]
        raise AliasError(
            f"treemode.{transform}: Inconsistent aliasing detected: the "
            f"{type(leaf).__name__} returned at {where[0]} is also returned at {where[1]} "
            f"(shared, graph=True), with two different {what}, {where[0]}: "
            f"{describe(seen[1])} and {where[1]}: {describe(spec)}. Duplicate references "
            "to one Variable are one output of the transform, so it takes one "
            "specification.\n"
            f"Fix: give both places the same {what}, or return the Variable only once."
        )


def _spec_at(prefix: Any, path: tuple[Any, ...], is_spec_leaf: Callable[[Any], bool] | None) -> Any:
    """The specification ``prefix`` gives the output leaf at ``path`` (`_NO_SPEC`: none)."""
    node = prefix
    for key in path:
        if _is_prefix_leaf(node, is_spec_leaf):
            break
        for child_path, child in _one_level(node):
            if child_path == (key,):
                node = child
                break
        else:
            return _NO_SPEC
    if not _is_prefix_leaf(node, is_spec_leaf):
        return _NO_SPEC
    return node.get_raw_value() if is_variable(node) else node


def _one_level(node: Any) -> list[tuple[tuple[Any, ...], Any]]:
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]


def _is_prefix_leaf(node: Any, is_spec_leaf: Callable[[Any], bool] | None) -> bool:
    if node is None or is_variable(node) or (is_spec_leaf is not None and is_spec_leaf(node)):
        return True
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(node))


def same_spec(a: Any, b: Any) -> bool:
    """Whether two specifications (axes, shardings, ...) given to one Variable agree:
    the same object, or equal values of the same type."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _leaf_path(root: str, tree: Any, index: int) -> str:
    path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0][index][0]
    return format_path(path, root)
