"""Sharding metadata across a mapped axis: ``transform_metadata`` and its helpers.

A Variable created inside ``vmap``/``scan`` with ``out_sharding=('dout',)`` is
stacked along a new axis by the transform; its sharding metadata must grow by one
entry at that axis (the ``partition`` name, e.g. ``('din', 'dout')``), and a
function that runs on one slice of a stack must see the metadata without it.

- `add_axis` / `remove_axis` change the metadata of every Variable in
  a tree for one axis index;
- `apply_axis_metadata` does it per Variable following an axes prefix;
- `with_axis_metadata` wraps a function: remove the mapped axis from its
  input Variables, call it, add the axis back to the inputs and to the Variables
  of its output. ``vmap``/``pmap``/``scan`` use it for their
  ``transform_metadata=`` keyword, and `transform_metadata` is the public
  stand-alone form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import jax

from .. import _compat
from .._errors import AxisError
from .._pipeline import _call, _core, _pure
from .._tree._leaves import is_variable
from ._axes import is_axis, is_int_axis, positional_entries
from ._lifts import refuse_lifts
from ._prefix import broadcast_to_leaves
from ._signature import UNSPECIFIED, suggests_keywords

F = TypeVar("F", bound=Callable[..., Any])

PARTITION_NAME = "partition_name"  # the key used by flax.nnx (nnx.PARTITION_NAME)
_SHARDING_KEYS = ("out_sharding",)


def _split_metadata(metadata: Mapping[str, Any], transform: str) -> tuple[Any, dict[str, Any]]:
    if PARTITION_NAME not in metadata:
        raise AxisError(
            f"treemode.{transform}: transform_metadata={dict(metadata)!r} has no "
            f"{PARTITION_NAME!r} entry (nnx.PARTITION_NAME), the name to insert into the "
            "Variables' out_sharding for the mapped axis. Pass e.g. "
            f"transform_metadata={{nnx.PARTITION_NAME: 'layers'}} (or partition='layers')."
        )
    rest = {k: v for k, v in metadata.items() if k != PARTITION_NAME}
    return metadata[PARTITION_NAME], rest


def check_metadata(metadata: Mapping[str, Any], transform: str) -> None:
    """Raise ``AxisError`` unless ``metadata`` names the partition of the mapped axis."""
    _split_metadata(metadata, transform)


def _fields(var: Any, extra: Mapping[str, Any]) -> list[tuple[str, tuple[Any, ...], Any]]:
    """``(key, current tuple, entry for the axis)`` for each tuple-valued field to edit."""
    meta = _compat.metadata_of(var)
    fields = []
    for key in _SHARDING_KEYS:
        value = meta.get(key)
        if value:
            fields.append((key, tuple(value), None))
    for key, entry in extra.items():
        value = meta.get(key)
        if value and isinstance(value, tuple):
            fields.append((key, value, entry))
    return fields


def _add_one(var: Any, index: int, name: Any, extra: Mapping[str, Any]) -> None:
    updates: dict[str, Any] = {}
    for key, value, entry in _fields(var, extra):
        entry = name if key in _SHARDING_KEYS else entry
        items = list(value)
        at = index if index >= 0 else index + len(items) + 1
        while len(items) < at:
            items.append(None)
        items.insert(at, entry)
        updates[key] = tuple(items)
    if updates:
        _compat.set_metadata(var, {**_compat.metadata_of(var), **updates})
    var.add_axis(index, name)


def _remove_one(
    var: Any, index: int, name: Any, extra: Mapping[str, Any], where: str, transform: str
) -> None:
    updates: dict[str, Any] = {}
    for key, value, entry in _fields(var, extra):
        entry = name if key in _SHARDING_KEYS else entry
        items = list(value)
        at = index if index >= 0 else index + len(items)
        if not 0 <= at < len(items) or items[at] != entry:
            found = items[at] if 0 <= at < len(items) else "nothing"
            raise AxisError(
                f"treemode.{transform}: the {type(var).__name__} at {where} has "
                f"{key}={value!r}; removing the mapped axis {index} expects {entry!r} "
                f"there but found {found!r}. The Variable was not stacked with "
                f"partition {name!r} on that axis: check in_axes and the partition name."
            )
        del items[at]
        updates[key] = tuple(items)
    if updates:
        _compat.set_metadata(var, {**_compat.metadata_of(var), **updates})
    var.remove_axis(index, name)


def _variables(tree: Any) -> list[tuple[str, Any]]:
    out = []
    seen: set[int] = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
        if is_variable(leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((jax.tree_util.keystr(path), leaf))
    return out


def add_axis(
    tree: Any, index: int, metadata: Mapping[str, Any], *, transform: str = "add_axis"
) -> Any:
    """Insert the partition name at ``index`` in every Variable's sharding metadata.

    **Arguments:**

    - `tree`: a pytree of Variables/modules; changed in place.
    - `index`: the new axis' position in the Variables' arrays.
    - `metadata`: `{nnx.PARTITION_NAME: name, **other}`; other tuple-valued
      metadata fields named here get their value inserted at `index` too.

    **Returns:**

    `tree`.
    """
    name, extra = _split_metadata(metadata, transform)
    for _, var in _variables(tree):
        _add_one(var, index, name, extra)
    return tree


def remove_axis(
    tree: Any, index: int, metadata: Mapping[str, Any], *, transform: str = "remove_axis"
) -> Any:
    """Remove the partition name at ``index`` from every Variable's sharding metadata.

    The inverse of `add_axis`; raises `AxisError` naming the Variable if
    the entry at `index` is not the partition name. Changes `tree` in place and
    returns it.
    """
    name, extra = _split_metadata(metadata, transform)
    for where, var in _variables(tree):
        _remove_one(var, index, name, extra, where, transform)
    return tree


def _axis_pairs(
    tree: Any,
    axes: Any,
    where: str,
    what: str,
    is_leaf: Callable[[Any], bool],
    seen: set[int] | None = None,
) -> list[tuple[str, Any, int]]:
    """``(path, Variable, axis)`` for each Variable of ``tree`` with an int axis.

    Variables whose id is in ``seen`` are skipped; the others are added to it.
    """
    values = broadcast_to_leaves(axes, tree, is_prefix_leaf=is_leaf, where=where, what=what)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
    out: list[tuple[str, Any, int]] = []
    seen = set() if seen is None else seen
    for (path, leaf), axis in zip(leaves, values, strict=True):
        if is_variable(leaf) and is_int_axis(axis) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((where + jax.tree_util.keystr(path), leaf, int(axis)))
    return out


def apply_axis_metadata(
    tree: Any,
    axes: Any,
    metadata: Mapping[str, Any],
    *,
    add: bool,
    transform: str,
    where: str = "",
    is_leaf: Callable[[Any], bool] = is_axis,
    seen: set[int] | None = None,
) -> None:
    """Add (or remove) the axis given by the prefix ``axes`` to each Variable of ``tree``.

    Variables whose axis is not an int (``None``, a ``Carry`` marker) are left
    alone. Shared Variables are changed once (across calls sharing ``seen``).
    """
    name, extra = _split_metadata(metadata, transform)
    try:
        pairs = _axis_pairs(tree, axes, where or "the tree", f"treemode.{transform}", is_leaf, seen)
    except ValueError as e:
        if isinstance(e, AxisError):
            raise
        raise AxisError(str(e)) from None
    for path, var, axis in pairs:
        if add:
            _add_one(var, axis, name, extra)
        else:
            _remove_one(var, axis, name, extra, path, transform)


def with_axis_metadata(
    fn: Callable[..., Any],
    in_axes: Any,
    out_axes: Any,
    metadata: Mapping[str, Any],
    *,
    transform: str,
    kwargs_axis: Any = 0,
    is_leaf: Callable[[Any], bool] = is_axis,
    out_is_leaf: Callable[[Any], bool] | None = None,
) -> Callable[..., Any]:
    """Wrap ``fn`` to move sharding metadata across the mapped axis.

    On entry the axis (given per argument by `in_axes`) is removed from the
    input Variables' metadata; on exit it is added back to them and added to the
    output's Variables at `out_axes`. The input metadata is restored even if
    `fn` raises. `in_axes` is a single value or a tuple with one prefix per
    positional argument; keyword arguments use `kwargs_axis`.
    """
    out_leaf = out_is_leaf or is_leaf

    @functools.wraps(fn)
    @_compat.api_boundary
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        entries = positional_entries(
            in_axes,
            len(args),
            transform=transform,
            what="in_axes",
            is_leaf=is_leaf,
            kwargs_axis=kwargs_axis,
        )
        targets = [(f"args[{i}]", a, e) for i, (a, e) in enumerate(zip(args, entries, strict=True))]
        targets += [(f"kwargs[{k!r}]", v, kwargs_axis) for k, v in kwargs.items()]
        saved = [(var, _compat.metadata_of(var)) for _, a, _ in targets for _, var in _variables(a)]
        removed: set[int] = set()  # a Variable shared by two arguments moves once
        try:
            for where, tree, axes in targets:
                apply_axis_metadata(
                    tree,
                    axes,
                    metadata,
                    add=False,
                    transform=transform,
                    where=where,
                    is_leaf=is_leaf,
                    seen=removed,
                )
            out = fn(*args, **kwargs)
        except BaseException:
            for var, meta in saved:
                _compat.set_metadata(var, meta)
            raise
        added: set[int] = set()
        for where, tree, axes in targets:
            apply_axis_metadata(
                tree,
                axes,
                metadata,
                add=True,
                transform=transform,
                where=where,
                is_leaf=is_leaf,
                seen=added,
            )
        apply_axis_metadata(
            out,
            out_axes,
            metadata,
            add=True,
            transform=transform,
            where="output",
            is_leaf=out_leaf,
        )
        return out

    return wrapper


# The default of `transform_metadata`'s ``partition``: not given (``None`` is a value).
_UNSET: Any = UNSPECIFIED


@overload
def transform_metadata(
    f: None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    partition: Any = UNSPECIFIED,
    metadata: Mapping[str, Any] | None = None,
    graph: bool = False,
) -> Callable[[F], F]: ...


@overload
def transform_metadata(
    f: F,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    partition: Any = UNSPECIFIED,
    metadata: Mapping[str, Any] | None = None,
    graph: bool = False,
) -> F: ...


@suggests_keywords
def transform_metadata(
    f: Callable[..., Any] | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    partition: Any = UNSPECIFIED,
    metadata: Mapping[str, Any] | None = None,
    graph: bool = False,
) -> Any:
    """Move Variables' sharding metadata across the axis of an enclosing vmap/scan.

    Put it *inside* a mapping transform (`treemode.vmap`, `jax.vmap`,
    `treemode.scan`, ...), with the same `in_axes`/`out_axes`. The function then
    sees its mapped input Variables without the mapped axis in their
    `out_sharding`, and every Variable it returns (or of its mapped inputs) gets
    `partition` inserted at its output axis. This is what the `transform_metadata=`
    keyword of `treemode.vmap`/`pmap`/`scan` does for you.

    **Arguments:**

    - `f`: the function; omit it to use `transform_metadata(...)` as a decorator.
    - `in_axes`, `out_axes`: the axes of the enclosing transform (prefixes, may
      be module-shaped). Keyword arguments use axis 0.
    - `partition`: the mesh axis name recorded for the mapped axis; `None` records
      an axis with no mesh name (as in Flax's `nnx.transform_metadata`).
    - `metadata`: instead of `partition`, the full mapping
      `{nnx.PARTITION_NAME: name, ...}`; other tuple-valued metadata fields it
      names get their entry inserted too.
    - `graph`: if `True`, the arguments may reach one Variable twice (its
      metadata is moved once); with `False` (tree mode) that raises
      `AliasError`, as the other transforms do.

    **Returns:**

    The wrapped function.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    @treemode.vmap(in_axes=0, out_axes=0)
    @treemode.transform_metadata(in_axes=0, out_axes=0, partition="din")
    def create_stack(key):
        return nnx.Param(jax.random.uniform(key, (16,)), out_sharding=("dout",),
                         eager_sharding=False)

    stack = create_stack(jax.random.split(jax.random.key(0), 8))
    assert stack.shape == (8, 16)
    assert stack.out_sharding == ("din", "dout")
    ```
    """
    refuse_lifts(
        in_axes, transform="transform_metadata", what="in_axes", graph=graph, variables=True
    )
    refuse_lifts(
        out_axes, transform="transform_metadata", what="out_axes", graph=graph, variables=True
    )
    if metadata is None:
        if partition is _UNSET:
            raise AxisError(
                "treemode.transform_metadata: pass partition='name' (the mesh axis "
                "name of the mapped axis; None for an axis with no name) or "
                "metadata={nnx.PARTITION_NAME: 'name'}."
            )
        metadata = {PARTITION_NAME: partition}
    elif partition is not _UNSET:
        metadata = {**metadata, PARTITION_NAME: partition}
    _split_metadata(metadata, "transform_metadata")
    if f is None:
        return functools.partial(
            transform_metadata,
            in_axes=in_axes,
            out_axes=out_axes,
            metadata=metadata,
            graph=graph,
        )
    inner = with_axis_metadata(f, in_axes, out_axes, metadata, transform="transform_metadata")

    @functools.wraps(f)
    @_compat.api_boundary
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # The whole pipeline around a direct call (no JAX transform of its own): the
        # function sees trace-time copies whose metadata it may change freely, and
        # the caller's Variables get the changed values, all or nothing.
        call = _call.prepare("transform_metadata", f, args, kwargs, graph=graph)
        pure = _pure.PureFunction(call)
        pure.fn = inner
        return _core.run(call, pure, lambda: pure(*call.dynamic))

    return wrapper


__all__ = [
    "PARTITION_NAME",
    "add_axis",
    "apply_axis_metadata",
    "check_metadata",
    "remove_axis",
    "transform_metadata",
    "with_axis_metadata",
]
