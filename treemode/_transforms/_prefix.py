"""Broadcasting a user prefix (axes, shardings, ...) to the traced arrays.

Transforms take per-argument specifications as a pytree *prefix* of their
arguments: ``in_axes=(0, None)``, ``in_shardings=(model_shardings, batch)``.
Here a prefix may stop at any node of an argument, at a Variable, or inside a
Variable (``nnx.Param(sharding)`` gives that Variable's value a sharding), and a
module-shaped prefix (the module with each Variable replaced by a value) works
because it has the module's own structure.

Two conversions make other prefixes module-shaped or fit them to ``graph=True``:

- `decode_flax_prefixes`: Flax's graph-mode prefixes (``nnx.prefix(...,
  graph=True)`` output, one ``TreeState`` per graph node) become module-shaped
  prefixes, every transform decodes them when it is created;
- `graph_output_prefix`: with ``graph=True`` a transform's outputs reach JAX
  through `treemode.to_tree` (each NNX object a `GraphNode`, later references
  `SharedRef` markers), so a module-shaped prefix of the outputs (``out_axes``,
  ``out_specs``, ``out_shardings``) is converted to that form once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .. import _compat
from .._errors import AliasError, AxisError
from .._tree._flatten import ArgFlat
from .._tree._graph import GraphNode, same_spec
from .._tree._leaves import is_graph_node, is_variable, is_variable_or_graph_node
from .._tree._paths import format_path, nnx_path
from .._tree._recursion import below
from ._prefix_helpers import replace_variables


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


def decode_flax_prefixes(spec: Any, *, transform: str, what: str) -> Any:
    """``spec`` with every ``nnx.prefix(..., graph=True)`` prefix in it made module-shaped.

    Flax encodes each graph node of such a prefix as a ``TreeState``: the
    node's GraphDef and a State holding the prefix values, with a node already
    seen in the same ``nnx.prefix`` call (``nnx.prefix((m, m), ...)``) encoded
    as a reference to it. Decoded with Flax's own decoder, each becomes the node
    rebuilt with its prefix value in place of every Variable, the objects
    shared in the prefix shared in the result, which is what treemode's
    prefixes are. Prefixes computed in one ``nnx.prefix`` call are decoded
    together; a prefix that starts a new index space (another call) starts a
    new group. ``spec`` itself is returned when it holds no such prefix.

    **Raises:** `AxisError` naming the transform and ``what`` when Flax cannot
    decode a prefix (a reference to a node of a prefix that is not there).
    """
    tree_state, decode = _compat.FLAX_TREE_STATE, _compat.flax_from_tree
    if tree_state is None or decode is None:
        return spec

    def stop(x: Any) -> bool:
        return x is None or isinstance(x, tree_state) or is_variable_or_graph_node(x)

    flat, treedef = jax.tree_util.tree_flatten_with_path(spec, is_leaf=stop)
    leaves = [leaf for _, leaf in flat]
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, tree_state)]
    if not positions:
        return spec
    decoded: list[Any] = []
    group: list[int] = []
    group_decoded: tuple[Any, ...] = ()
    for i in positions:
        try:
            group_decoded = tuple(decode((*(leaves[j] for j in group), leaves[i])))
            group.append(i)
            continue
        except Exception as e:  # Flax's decoder raises several types
            if not group:
                raise _undecodable(transform, what, e) from None
        _check_consistent(group, group_decoded, leaves, flat, transform, what)
        decoded += group_decoded
        try:
            group_decoded = tuple(decode((leaves[i],)))
        except Exception as e:
            raise _undecodable(transform, what, e) from None
        group = [i]
    _check_consistent(group, group_decoded, leaves, flat, transform, what)
    decoded += group_decoded
    stripped = replace_variables(decoded, lambda _, var: var.get_raw_value())
    for i, value in zip(positions, stripped, strict=True):
        leaves[i] = value
    return treedef.unflatten(leaves)


def _check_consistent(
    group: list[int],
    decoded: tuple[Any, ...],
    leaves: list[Any],
    flat: list[tuple[Any, Any]],
    transform: str,
    what: str,
) -> None:
    """Raise if prefixes computed together give one shared Variable two values.

    Each prefix of one ``nnx.prefix`` call stores a Variable already seen in an
    earlier one as a reference, so decoding alone would silently give it the
    earlier value. As Flax does, the prefix function is asked again for the
    Variable at its path in each prefix (once per Variable and prefix), and two
    different answers are an error.
    """
    if len(group) < 2:
        return
    first: dict[int, tuple[str, Any]] = {}
    for i, root in zip(group, decoded, strict=True):
        fn = getattr(getattr(leaves[i], "prefix_fn", None), "value", None)
        if not callable(fn):
            continue
        root_name = f"{what}{jax.tree_util.keystr(flat[i][0])}"
        for path, var in variables_once(root):
            try:
                value = fn(nnx_path(path), var)
            except Exception:  # a filter that reads the (replaced) value: not checked
                continue
            where = format_path(path, root_name)
            seen = first.setdefault(id(var), (where, value))
            if seen[0] != where and not same_spec(seen[1], value):
                raise AliasError(
                    f"treemode.{transform}: the {type(var).__name__} at {seen[0]} is also "
                    f"reachable at {where} (the prefixes come from one nnx.prefix(..., "
                    f"graph=True) call, so it is one shared Variable), with two different "
                    f"{what}: {seen[1]!r} at {seen[0]} and {value!r} at {where}. A shared "
                    "Variable is one input of the transform, so it takes one specification. "
                    "Inconsistent aliasing detected. The following nodes have different "
                    f"prefixes: {seen[0]}, {where}.\n"
                    "Fix: make the filters give both paths the same value."
                )


def variables_once(root: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(key path, Variable)`` of each Variable of ``root``, at its first path."""
    out: list[tuple[tuple[Any, ...], Any]] = []
    seen: set[int] = set()
    keep: list[Any] = []

    def walk(path: tuple[Any, ...], x: Any) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        keep.append(x)
        if is_variable(x):
            out.append((path, x))
            return
        for k, child in jax.tree_util.tree_flatten_with_path(x, is_leaf=below(x))[0]:
            for p, c in jax.tree_util.tree_flatten_with_path(
                child, is_leaf=is_variable_or_graph_node
            )[0]:
                if is_variable_or_graph_node(c):
                    walk((*path, *k, *p), c)

    for p, c in jax.tree_util.tree_flatten_with_path(root, is_leaf=is_variable_or_graph_node)[0]:
        if is_variable_or_graph_node(c):
            walk(p, c)
    return out


def _undecodable(transform: str, what: str, error: Exception) -> AxisError:
    return AxisError(
        f"treemode.{transform}: {what} holds a prefix made by nnx.prefix(..., "
        f"graph=True) that Flax cannot decode ({type(error).__name__}: {error}). Such "
        "prefixes number the graph nodes jointly: compute the prefixes of all the "
        "objects of one call together, in argument order, e.g. px1, px2 = "
        "nnx.prefix((m1, m2), filters, graph=True), and pass all of them."
    )


def graph_output_prefix(spec: Any) -> Any:
    """A prefix of a function's outputs, in the form `treemode.to_tree` gives the outputs.

    With ``graph=True`` a transform's outputs reach JAX through `to_tree`: each
    NNX object becomes a `GraphNode` (its one-level structure and children) and
    every later reference to it a `SharedRef` with no arrays. Each NNX object
    of ``spec`` (a module-shaped prefix) is converted the same way, so that JAX
    matches it against the outputs; a later reference to an object already
    converted covers a `SharedRef` and becomes ``None`` (it has no arrays to
    specify). Variables in ``spec`` give their values. Without NNX objects,
    ``spec`` is returned as it is.
    """

    def stop(x: Any) -> bool:
        return is_variable_or_graph_node(x)

    if not any(map(stop, jax.tree_util.tree_leaves(spec, is_leaf=stop))):
        return spec
    seen: set[int] = set()
    keep: list[Any] = []  # the objects whose ids are in ``seen`` stay alive

    def walk(x: Any) -> Any:
        if is_variable(x):
            return x.get_raw_value()
        if not is_graph_node(x):
            return x
        if id(x) in seen:
            return None
        seen.add(id(x))
        keep.append(x)
        flat, node_def = jax.tree_util.tree_flatten_with_path(x, is_leaf=below(x))
        keys = tuple(p[0] for p, _ in flat)
        children = [jax.tree_util.tree_map(walk, c, is_leaf=stop) for _, c in flat]
        return GraphNode(node_def, keys, children)

    return jax.tree_util.tree_map(walk, spec, is_leaf=stop)
