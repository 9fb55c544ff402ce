"""Explanations of retraces, shown while ``jax_explain_cache_misses`` is on.

(Failures are explained by ``_explain``.)

``jax.config.update("jax_explain_cache_misses", True)`` (or the
``jax.explain_cache_misses(True)`` context manager) makes JAX log why a jitted
function traces again. Behind a `treemode.jit` JAX only sees the flat arrays
of the call, so treemode logs (on the ``treemode`` logger, at WARNING like
JAX) what changed in terms of the user's arguments: the argument path, and
how it changed (structure, static value old -> new, shape/dtype old -> new).
Nothing here runs unless the switch is on.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._tree._diff import Change, Node, Nodes, Path, TreeDiff, replaced
from .._tree._leaves import is_graph_node, is_variable
from .._tree._paths import format_path
from .._tree._recursion import recursion_headroom
from .._tree._specs import DYNAMIC, StaticLeaf, StructureKey, VarSpec

logger = logging.getLogger("treemode")


def enabled() -> bool:
    """Whether JAX's ``jax_explain_cache_misses`` switch is on."""
    return bool(jax.config.jax_explain_cache_misses)  # pyright: ignore[reportAttributeAccessIssue]


def jax_explanations_off() -> contextlib.AbstractContextManager[Any]:
    """JAX's own explanations switched off (for a trace treemode explains itself)."""
    switch = getattr(jax, "explain_cache_misses", None)
    return contextlib.nullcontext() if switch is None else switch(False)


def _describe_fn(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return name
    return f"{name} (defined at {code.co_filename}:{code.co_firstlineno})"


# -- a new structure ----------------------------------------------------------------


# Parameters a transform passes before the call's arguments: fori_loop's index.
_LEADING_PARAMETERS = {"fori_loop": 1}


def parameter_names(
    fn: Callable[..., Any], n_args: int, kw_names: Sequence[str], skip: int = 0
) -> dict[str, str]:
    """The user's name of each argument root of a call of ``fn``: ``args[i]`` and
    ``kwargs['k']`` (treemode's display roots) -> the parameter that takes it, as
    ``jax.jit`` names it (``x``; ``args[0]`` for the first of ``*args``;
    ``kw['k']`` for a key of ``**kw``). Roots ``fn``'s signature does not name keep
    their display name. ``skip``: leading parameters the call's arguments do not
    fill (a loop index)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    kinds = inspect.Parameter
    params = signature.parameters
    positional = [
        name
        for name, p in params.items()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ][skip:]
    var_positional = next((n for n, p in params.items() if p.kind is kinds.VAR_POSITIONAL), None)
    var_keyword = next((n for n, p in params.items() if p.kind is kinds.VAR_KEYWORD), None)
    names: dict[str, str] = {}
    for i in range(n_args):
        if i < len(positional):
            names[f"args[{i}]"] = positional[i]
        elif var_positional is not None:
            names[f"args[{i}]"] = f"{var_positional}[{i - len(positional)}]"
    for name in kw_names:
        p = params.get(name)
        if p is not None and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY):
            names[f"kwargs[{name!r}]"] = name
        elif var_keyword is not None:
            names[f"kwargs[{name!r}]"] = f"{var_keyword}[{name!r}]"
    return names


def _root_names(key: Any, names: dict[str, str] | None = None) -> list[tuple[str, Any]]:
    """``(display name, per-argument key)`` of a ``CallKey`` (the user's parameter
    names where ``names`` has them, see `parameter_names`)."""
    roots = [(f"args[{i}]", k) for i, k in enumerate(key.positional)]
    roots += [(f"kwargs[{name!r}]", k) for name, k in key.keywords]
    if names:
        roots = [(names.get(root, root), k) for root, k in roots]
    return roots


def _skeleton(key: StructureKey) -> Any:
    """The argument rebuilt from its structure key, with its specs as leaves."""
    return key.treedef.unflatten(list(key.specs))


def _spec_change(before: Any, after: Any) -> str | None:
    if before == after:
        return None
    if type(before) is VarSpec and type(after) is VarSpec:
        if before.var_type is not after.var_type:
            old_type, new_type = before.var_type.__name__, after.var_type.__name__
            return f"the Variable type changed from {old_type} to {new_type}"
        old, new = dict(before.metadata), dict(after.metadata)
        for name in sorted(old.keys() | new.keys(), key=str):
            if name not in old or name not in new or old[name] != new[name]:
                return (
                    f"the Variable's metadata {name!r} changed from "
                    f"{old.get(name, '(absent)')!r} to {new.get(name, '(absent)')!r}"
                )
        return "the structure of the Variable's value changed"
    if isinstance(before, StaticLeaf) and isinstance(after, StaticLeaf):
        return f"static value {before.value!r} -> {after.value!r}"
    return f"{_kind(before)} -> {_kind(after)}"


def _kind(spec: Any) -> str:
    if type(spec) is VarSpec:
        return f"a {spec.var_type.__name__}"
    if spec is DYNAMIC:
        return "an array"
    if isinstance(spec, StaticLeaf):
        return f"the static value {spec.value!r}"
    return repr(spec)


def _children(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """One level of ``node``: ``([(key, child)], one-level treedef)``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(path[0], child) for path, child in pairs], treedef


def _is_spec(x: Any) -> bool:
    return isinstance(x, (VarSpec, StaticLeaf)) or x is DYNAMIC


class _SkeletonDiff(TreeDiff):
    """Two arguments rebuilt from their keys (`_skeleton`): the specs are the leaves."""

    added = "a new entry"
    removed = "the entry is gone"
    reordered = "the order of the entries changed: {} -> {}"

    def leaf(self, path: Path, a: Any, b: Any) -> Change | Nodes | None:
        if _is_spec(a):
            if _is_spec(b):
                what = _spec_change(a, b)
                return None if what is None else (path, what)
            return path, f"{_kind(a)} was replaced by a {type(b).__name__}"
        if _is_spec(b):
            return path, f"a {type(a).__name__} was replaced by {_kind(b)}"
        if type(a) is not type(b):
            return replaced(path, type(a), type(b))
        (ca, ta), (cb, tb) = _children(a), _children(b)
        return Nodes(Node(type(a), ta, ca), Node(type(b), tb, cb))

    def static_change(self, path: Path, a: Any, b: Any, node: Node) -> Change:
        if is_graph_node(a):
            va, vb = vars(a), vars(b)
            children = {getattr(k, "name", None) for k, _ in node.children}
            for name in sorted(va.keys() | vb.keys()):
                x, y = va.get(name), vb.get(name)
                if name.startswith("_pytree__") or name in children:
                    continue  # NNX's bookkeeping, or data compared above
                try:
                    same = bool(x == y)
                except Exception:
                    same = x is y
                if not same:
                    return (
                        (*path, jax.tree_util.GetAttrKey(name)),
                        f"static attribute {x!r} -> {y!r}",
                    )
        return path, "the static fields of this node changed"


def _argument_change(before: Any, after: Any) -> str | None:
    """How one argument's key changed (``None``: it did not)."""
    if before == after:
        return None
    static_before, static_after = _static_arg(before), _static_arg(after)
    if static_before is not None and static_after is not None:
        return f"static argument {static_before[0]!r} -> {static_after[0]!r}"
    if static_before is not None:
        return "was a static argument, now traced"
    if static_after is not None:
        return "was traced, now a static argument"
    if before.treedef == after.treedef:
        paths = jax.tree_util.tree_flatten_with_path(_skeleton(after))[0]
        for (path, _), old, new in zip(paths, before.specs, after.specs, strict=True):
            what = _spec_change(old, new)
            if what is not None:
                return f"{format_path(path, '')}: {what}" if path else what
        return None
    try:
        found = _SkeletonDiff().first(_skeleton(before), _skeleton(after))
    except Exception:  # a node type that cannot be rebuilt from its specs
        found = None
    if found is None:
        return f"pytree structure {before.treedef} -> {after.treedef}"
    path, what = found
    return f"{format_path(path, '')}: {what}" if path else what


def _static_arg(key: Any) -> tuple[Any] | None:
    """``(value,)`` of a static argument's key, ``None`` for a traced argument's."""
    if isinstance(key, StaticLeaf):
        return (key.value,)
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "static":
        return (key[1],)
    return None


def _key_changes(before: Any, after: Any, fn: Callable[..., Any] | None = None) -> list[str]:
    changes: list[str] = []
    names: dict[str, str] = {}
    if fn is not None:
        for key in (before, after):
            kw_names = [name for name, _ in key.keywords]
            names.update(parameter_names(fn, len(key.positional), kw_names))
    old_roots, new_roots = dict(_root_names(before, names)), dict(_root_names(after, names))
    for name in old_roots.keys() | new_roots.keys():
        if name not in new_roots:
            changes.append(f"{name}: no longer passed")
        elif name not in old_roots:
            changes.append(f"{name}: newly passed")
    for name, new in _root_names(after, names):
        old = old_roots.get(name)
        if old is None:
            continue
        what = _argument_change(old, new)
        if what is not None:
            changes.append(f"{name}{what}" if what.startswith((".", "[")) else f"{name}: {what}")
    if before.lifted != after.lifted:
        changes.append("the Variables read through the function's closure changed")
    elif before.closure != after.closure:
        changes.append(
            "a module read through the function's closure changed its class or a static attribute"
        )
    if before.graph != after.graph:
        changes.append(f"graph {before.graph} -> {after.graph}")
    return changes


def new_structure(
    transform: str, fn: Callable[..., Any], key: Any, previous: Sequence[Any]
) -> None:
    """Log why a call with ``key`` traces again, against the closest of ``previous``
    keys (oldest first; of the equally close, the latest)."""
    if not previous:
        return
    best: list[str] | None = None
    for old in reversed(previous):
        changes = _key_changes(old, key, fn)
        if best is None or len(changes) < len(best):
            best = changes
    assert best is not None
    lines = "\n".join(f"  * {c}" for c in best) or "  * (no difference found)"
    logger.warning(
        "treemode.%s: tracing %s again: the arguments differ from the closest "
        "previous call in:\n%s",
        transform,
        _describe_fn(fn),
        lines,
    )


# -- new shapes or dtypes -----------------------------------------------------------


def _aval(x: Any) -> Any:
    aval = getattr(x, "aval", None)
    if aval is None:
        return jax.typeof(x)
    return aval


def _aval_str(aval: Any) -> str:
    text = aval.str_short() if hasattr(aval, "str_short") else str(aval)
    return f"{text} (weakly typed)" if getattr(aval, "weak_type", False) else text


def dynamic_paths(call: Any, parameters: bool = False) -> list[str]:
    """The display path of each of ``call``'s dynamic arrays (a full `Call`).

    ``parameters``: rooted at the user's parameter names (``model.kernel``, as
    ``jax.jit`` names them, see `parameter_names`) rather than at ``args[0]``.
    """
    paths: list[str] = []
    names: dict[str, str] = {}
    if parameters:
        skip = _LEADING_PARAMETERS.get(call.transform, 0)
        names = parameter_names(call.fn, len(call.args), call.kw_names, skip)
    for (display, tree), flat in zip(call.arg_roots(), call.arg_flats, strict=True):
        root = names.get(display) or str(display)
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
        for (path, _), spec in zip(leaves, flat.specs, strict=True):
            where = format_path(path, root)
            if type(spec) is VarSpec:
                n = spec.num_dynamic
                paths += [where] if n == 1 else [f"{where} (value leaf {i})" for i in range(n)]
            elif spec is DYNAMIC:
                paths.append(where)
    lifted_paths: dict[int, str] = {}
    for root, tree in call.lifted_roots:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
            if is_variable(leaf):
                lifted_paths.setdefault(id(leaf), format_path(path, root))
    for var, spec in zip(call.lifted, call.lifted_specs, strict=True):
        where = lifted_paths.get(id(var), "closure")
        n = spec.num_dynamic
        paths += [where] if n == 1 else [f"{where} (value leaf {i})" for i in range(n)]
    return paths


def argument_names(call: Any) -> list[str] | None:
    """The user's name of each of ``call``'s dynamic arrays, for JAX's messages
    (`dynamic_paths` rooted at the parameters); ``None`` where they cannot be
    told (a call is never refused over a name)."""
    try:
        # Deep modules: the paths recurse like flattening (a RecursionError inside
        # JAX's C++ flattening would corrupt the interpreter's counter).
        with recursion_headroom():
            return dynamic_paths(call.full(), parameters=True)
    except Exception:
        return None


def new_types(
    transform: str,
    fn: Callable[..., Any],
    call: Any,
    seen: list[tuple[Any, ...]],
    dynamic: Sequence[Any],
    jax_explains: bool = False,
) -> None:
    """Record this trace's input types in ``seen``; log what changed if it is a retrace.

    Called at every trace (the record is kept even while the switch is off).
    ``jax_explains``: JAX's own message names the user's paths (the traced function
    carries them, `treemode._compat.name_arguments`), so treemode logs nothing: one
    message per retrace.
    """
    avals = tuple(map(_aval, dynamic))
    previous = list(seen)
    seen.append(avals)
    if not previous or not enabled() or jax_explains:
        return
    closest = min(
        reversed(previous),
        key=lambda old: sum(a != b for a, b in zip(old, avals, strict=True)),
    )
    paths = dynamic_paths(call.full(), parameters=True)
    lines = [
        f"  * {path}: {_aval_str(new)} (before {_aval_str(old)})"
        for path, old, new in zip(paths, closest, avals, strict=True)
        if old != new
    ]
    logger.warning(
        "treemode.%s: tracing %s again: the arguments differ from the closest "
        "previous call in shape or dtype:\n%s",
        transform,
        _describe_fn(fn),
        "\n".join(lines) or "  * (no difference found)",
    )


__all__ = [
    "argument_names",
    "dynamic_paths",
    "enabled",
    "jax_explanations_off",
    "logger",
    "new_structure",
    "parameter_names",
    "new_types",
]
