"""What makes one Variable reachable twice an error, and how that error explains it.

`first_duplicate` finds the first Variable reached at two paths of the given
roots; `alias_error` builds the `AliasError` for it, naming an object passed
beside another that owns it (`owned_argument`: a module beside the
``nnx.ModelAndOptimizer`` holding it) with the two fixes. The public check,
`treemode.check_no_aliases`, is `treemode._tree._flatten.check_no_aliases`; the
transforms call these through their call preparation (`treemode._pipeline._call`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
from flax.nnx import ModelAndOptimizer

from .._errors import AliasError
from ._leaves import is_graph_node, is_variable
from ._paths import format_path, paths_and_leaves
from ._recursion import recursion_headroom


def first_duplicate(roots: Iterable[tuple[str, Any]]) -> tuple[Any, str, str] | None:
    """``(variable, first path, second path)`` of the first Variable reached twice."""
    seen: dict[int, str] = {}
    for where, leaf in paths_and_leaves(roots):
        if is_variable(leaf):
            first = seen.setdefault(id(leaf), where)
            if first != where:
                return leaf, first, where
    return None


def alias_error(
    transform: str,
    var: Any,
    first: str,
    second: str,
    roots: Sequence[tuple[str, Any]] = (),
    parameters: dict[str, str] | None = None,
    expand: bool = False,
) -> AliasError:
    """The `AliasError` for ``var``, reached at ``first`` and at ``second``.

    With ``roots`` (the ``(name, tree)`` pairs the paths start from), an object
    passed beside another that owns it (a module beside the
    ``nnx.ModelAndOptimizer`` holding it as ``.model``) is named as such, with
    the two fixes; ``parameters`` maps a root's name to the function's
    parameter (``{"args[1]": "optimizer"}``); with ``expand``, the items of a
    root that is a tuple, list or dict are the arguments (``args=(model,
    optimizer)`` of `check_no_aliases`).
    """
    owned = owned_argument(roots, expand=expand)
    if owned is not None:
        name, obj, owner_name, owner, path = owned
        kind = type(obj).__name__
        parameters = parameters or {}

        def described(root: str, value: Any) -> str:
            parameter = parameters.get(root)
            what = type(value).__name__
            return f"{root} ({parameter}: {what})" if parameter else f"{root} ({what})"

        example = ""
        if isinstance(owner, ModelAndOptimizer) and path == f"{owner_name}.model":
            example = (
                " (an nnx.ModelAndOptimizer holds its model: `def train_step(optimizer, "
                "batch)` with `model = optimizer.model` inside)"
            )
        return AliasError(
            f"treemode.{transform}: {described(name, obj)} is also reachable inside "
            f"{described(owner_name, owner)}, as {path}: an object that owns the "
            f"{kind} was passed beside it, so each of its Variables is reachable twice "
            f"(the {type(var).__name__} at {first} and {second}) and would become two "
            "independent copies, one of the updates lost.\n"
            f"Fix: pass only {owner_name} and reach the {kind} through it as {path}"
            f"{example}, or keep the sharing with treemode.{transform}(..., graph=True).\n"
            "See docs/migration.md#modelandoptimizer."
        )
    return AliasError(
        f"treemode.{transform}: Duplicate {type(var).__name__}: the same "
        f"{type(var).__name__} is reachable twice, found at paths {first} and {second}.\n"
        "Tree mode treats modules as pytrees, so the two references would become "
        "independent copies and one of the updates would be lost.\n"
        "Fix: remove the duplicate reference, pass a copy made with treemode.clone(...), "
        f"or keep the sharing with treemode.{transform}(..., graph=True).\n"
        "See docs/migration.md#shared-variables."
    )


def owned_argument(
    roots: Sequence[tuple[str, Any]], *, expand: bool = False
) -> tuple[str, Any, str, Any, str] | None:
    """An NNX object among ``roots`` that another of them owns, if there is one.

    ``(name, object, owner's name, owner, path of the object inside the owner)``.
    The candidates are the roots (each an argument), or with ``expand`` the
    items of a root that is a tuple, list or dict (``args=(model, optimizer)``).
    Error path only.
    """
    candidates: list[tuple[str, Any]] = []
    for name, tree in roots:
        if not expand:
            candidates.append((name, tree))
        elif isinstance(tree, (tuple, list)) and not is_graph_node(tree):
            candidates += [(f"{name}[{i}]", x) for i, x in enumerate(tree)]
        elif type(tree) is dict:
            candidates += [(f"{name}[{k!r}]", x) for k, x in tree.items()]
        else:
            candidates.append((name, tree))
    for name, obj in candidates:
        if not (is_graph_node(obj) or is_variable(obj)):
            continue
        for owner_name, owner in candidates:
            if owner is obj or not is_graph_node(owner):
                continue
            path = _path_to(owner, obj, owner_name)
            if path is not None:
                return name, obj, owner_name, owner, path
    return None


def _path_to(tree: Any, obj: Any, root: str) -> str | None:
    """The path of ``obj`` inside ``tree`` (``None``: not reachable), as flattened."""

    def stop(x: Any) -> bool:
        return x is obj or is_variable(x)

    try:
        with recursion_headroom():
            with_paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop)[0]
    except (RecursionError, ValueError, TypeError):  # a cycle, or an odd node: no guess
        return None
    for path, leaf in with_paths:
        if leaf is obj:
            return format_path(path, root)
    return None
