"""Axis specifications of the mapping transforms (vmap, pmap, scan, shard_map).

A mapping transform takes its per-argument specification (``in_axes``,
``in_specs``) as a tuple with one entry per positional argument, or a single
value for all of them. Each entry is a pytree prefix of its argument and may be
module-shaped (see `treemode.prefix`). This module resolves such a
specification against a prepared `treemode._pipeline._call.Call`:

- `call_axes` gives one value per ``call.dynamic`` entry and one per
  ``call.variables`` entry (keyword arguments get ``kwargs_axis``, Variables
  lifted from the function's closure get ``closure_axis``, ``None`` by default:
  broadcast);
- `check_mapped` checks integer axes against the shapes of the arrays and
  returns the mapped size;
- `dynamic_paths` names each dynamic array in user terms (error path only);
- `batched_update_error` builds the error for a broadcast Variable that
  the function set to a per-example value (found by ``_vmap.find_batched_update``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._errors import AxisError
from .._pipeline._call import Call
from .._tree._graph import check_one_spec_per_variable, original_roots
from .._tree._leaves import is_variable
from .._tree._paths import format_path
from .._tree._specs import DYNAMIC, VarSpec
from ._prefix import broadcast_to_dynamic, broadcast_to_leaves
from ._rng_hints import axis_hint


@dataclasses.dataclass(frozen=True)
class CallAxes:
    """Resolved axes of one call.

    Attributes:
        dynamic: one value per entry of ``call.dynamic``.
        variables: one value per entry of ``call.variables`` (the value of the
            Variable's first dynamic array; Variables are prefix leaves, so all
            arrays of a Variable share it).
    """

    dynamic: tuple[Any, ...]
    variables: tuple[Any, ...]


def is_int_axis(x: Any) -> bool:
    """An integer axis (``bool`` excluded)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_axis(x: Any) -> bool:
    """An integer axis or ``None`` (broadcast)."""
    return x is None or is_int_axis(x)


def _describe(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else f"a {type(x).__name__}"


def positional_entries(
    spec: Any,
    num_args: int,
    *,
    transform: str,
    what: str = "in_axes",
    is_leaf: Callable[[Any], bool] = is_axis,
    kwargs_axis: Any = 0,
) -> list[Any]:
    """One entry of ``spec`` per positional argument (static ones included).

    ``kwargs_axis`` is what keyword arguments get (for the error message).
    """
    if isinstance(spec, tuple) and not is_leaf(spec):
        if len(spec) != num_args:
            raise AxisError(
                f"treemode.{transform}: {what} has {len(spec)} entries but the function "
                f"is called with {num_args} positional argument(s). Give one entry per "
                f"positional argument (e.g. {what}=({', '.join(['0'] * max(num_args, 1))}"
                f"{',' if num_args == 1 else ''})), or a single value for all of them. "
                + keyword_rule(transform, kwargs_axis)
            )
        return list(spec)
    if isinstance(spec, list):
        raise AxisError(
            f"treemode.{transform}: {what} is a list; JAX expects a tuple with one entry "
            f"per positional argument. Use {what}=tuple(...)."
        )
    if spec is None or is_leaf(spec):
        return [spec] * num_args
    raise AxisError(
        f"treemode.{transform}: {what} must be {_kinds(is_leaf)}, or a tuple with one "
        f"entry per positional argument; got {_describe(spec)}. To give a module-shaped "
        f"prefix for a single argument, wrap it in a tuple: {what}=(prefix,)."
    )


def keyword_rule(transform: str, kwargs_axis: Any) -> str:
    """What ``transform`` does with keyword arguments, for an ``in_axes`` message."""
    if is_int_axis(kwargs_axis):
        return f"Keyword arguments are always mapped over axis {kwargs_axis}, as in JAX."
    if kwargs_axis is None:
        if transform == "scan":
            return "Keyword arguments are not scanned: every step receives them whole."
        return "Keyword arguments are not mapped: every instance receives them whole."
    return f"Keyword arguments always get {kwargs_axis!r}."


def check_axes_spec(spec: Any, *, transform: str, what: str = "out_axes") -> None:
    """Raise ``AxisError`` if a leaf of ``spec`` (a prefix, may be module-shaped)
    is neither an int nor None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=is_axis)[0]:
        if not is_axis(leaf):
            where = f"{what}{jax.tree_util.keystr(path)}"
            raise AxisError(
                f"treemode.{transform}: {where} is {_describe(leaf)}; each axis must be an "
                "int or None."
            )


def _kinds(is_leaf: Callable[[Any], bool]) -> str:
    return "an int or None" if is_leaf is is_axis else "a single specification"


def call_axes(
    call: Call,
    spec: Any,
    *,
    what: str = "in_axes",
    kwargs_axis: Any = 0,
    closure_axis: Any = None,
    is_leaf: Callable[[Any], bool] = is_axis,
    valid: Callable[[Any], bool] | None = is_axis,
    expected: str = "an int or None",
) -> CallAxes:
    """Resolve a per-positional-argument prefix ``spec`` for ``call``.

    **Arguments:**

    - `call`: the prepared call (`_core.prepare`).
    - `spec`: a single value, or a tuple with one prefix per positional argument
      (entries of static arguments are ignored). A prefix may be module-shaped.
    - `what`: the keyword's name, for error messages.
    - `kwargs_axis`: the value of every array of a keyword argument.
    - `closure_axis`: the value of every Variable lifted from the closure.
    - `is_leaf`: which prefix nodes are specification values (e.g. also accept
      a `Carry` marker or a `PartitionSpec`).
    - `valid`: a check of each resolved value (`None` to skip), with
      `expected` describing the valid values in the error message.

    **Returns:**

    A `CallAxes` with one value per dynamic array and per Variable.
    """
    transform = call.transform
    entries = positional_entries(
        spec,
        len(call.args),
        transform=transform,
        what=what,
        is_leaf=is_leaf,
        kwargs_axis=kwargs_axis,
    )
    traced_entries = [e for i, e in enumerate(entries) if i not in call.static_positional]
    roots = call.arg_roots()
    dynamic: list[Any] = []
    if call.graph:
        dynamic = graph_prefix_values(call, traced_entries, is_leaf, kwargs_axis, what)
    for k, (flat, (name, tree)) in enumerate(zip(call.arg_flats, roots, strict=True)):
        if call.graph:
            break
        if k < len(traced_entries):
            try:
                dynamic += broadcast_to_dynamic(
                    traced_entries[k],
                    flat,
                    tree,
                    is_prefix_leaf=is_leaf,
                    where=name,
                    what=f"treemode.{transform}: {what}",
                )
            except ValueError as e:
                raise AxisError(str(e)) from None
        else:
            dynamic += [kwargs_axis] * len(flat.dynamic)
    dynamic += [closure_axis] * (len(call.dynamic) - len(dynamic))
    if valid is not None:
        for i, value in enumerate(dynamic):
            if not valid(value):
                path = dynamic_paths(call)[i]
                flax_lift = type(value).__name__ in ("StateAxes", "StateSharding")
                raise AxisError(
                    f"treemode.{transform}: {what} gives {_describe(value)} for {path}; "
                    f"each value must be {expected}."
                    + (" See docs/migration.md#stateaxes." if flax_lift else "")
                )
    ranges = call.variable_dynamic_ranges()
    variables = [dynamic[r[0]] if len(r) else closure_axis for r in ranges]
    if any(not len(r) for r in ranges[: sum(len(f.variables) for f in call.arg_flats)]):
        _empty_variable_axes(call, traced_entries, variables, ranges, is_leaf, kwargs_axis, what)
    return CallAxes(tuple(dynamic), tuple(variables))


def _empty_variable_axes(
    call: Call,
    traced_entries: list[Any],
    variables: list[Any],
    ranges: Sequence[range],
    is_leaf: Callable[[Any], bool],
    kwargs_axis: Any,
    what: str,
) -> None:
    """Give the argument Variables that hold no array yet their axis from the prefix.

    Such a Variable (``nnx.Intermediate({})``, the buffer ``sow`` and
    `treemode.capture` fill) has no dynamic array to read its axis from, but the
    value the function writes into it comes back on that axis.
    """
    index = {id(v): i for i, v in enumerate(call.variables)}
    for k, (name, original) in enumerate(original_roots(call)):
        leaves = jax.tree_util.tree_leaves(original, is_leaf=is_variable)
        if k < len(traced_entries):
            values = broadcast_to_leaves(
                traced_entries[k],
                original,
                is_prefix_leaf=is_leaf,
                where=name,
                what=f"treemode.{call.transform}: {what}",
            )
        else:
            values = [kwargs_axis] * len(leaves)
        for leaf, value in zip(leaves, values, strict=True):
            i = index.get(id(leaf)) if is_variable(leaf) else None
            if i is not None and not len(ranges[i]):
                variables[i] = value


def graph_prefix_values(
    call: Call,
    traced_entries: Sequence[Any],
    is_leaf: Callable[[Any], bool],
    kwargs_axis: Any,
    what: str,
) -> list[Any]:
    """``graph=True``: one value per entry of the arguments' dynamic arrays.

    ``traced_entries`` holds one prefix per traced positional argument (the
    other traced arguments get ``kwargs_axis``). Each prefix is broadcast over
    its argument as passed (the objects, so a module-shaped prefix matches),
    then the values are read off per dynamic array of the `to_tree` form.
    Closure Variables are not included. A Variable reachable from two
    arguments (or twice from one) is one input, so all its places must give it
    the same value (`AliasError` otherwise).
    """
    per_root: list[tuple[str, Any, list[Any]]] = []
    for k, (name, original) in enumerate(original_roots(call)):
        if k < len(traced_entries):
            try:
                values = broadcast_to_leaves(
                    traced_entries[k],
                    original,
                    is_prefix_leaf=is_leaf,
                    where=name,
                    what=f"treemode.{call.transform}: {what}",
                )
            except ValueError as e:
                raise AxisError(str(e)) from None
        else:
            values = [kwargs_axis] * len(jax.tree_util.tree_leaves(original, is_leaf=is_variable))
        per_root.append((name, original, values))
    check_one_spec_per_variable(call.transform, what, per_root)
    out: list[Any] = []
    for flat, (_, original, values) in zip(call.arg_flats, per_root, strict=True):
        leaves = jax.tree_util.tree_leaves(original, is_leaf=is_variable)
        by_id: dict[int, Any] = {}
        for leaf, value in zip(leaves, values, strict=True):
            by_id.setdefault(id(leaf), value)
        for leaf, count in zip(flat.leaves, flat.leaf_dynamic_counts(), strict=True):
            if count:
                out += [by_id.get(id(leaf))] * count
    return out


def dynamic_paths(call: Call) -> list[str]:
    """Display path of every entry of ``call.dynamic`` (compute on error paths only)."""
    paths: list[str] = []
    for flat, (root, tree) in zip(call.arg_flats, call.arg_roots(), strict=True):
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
        for (path, leaf), count in zip(leaves, flat.leaf_dynamic_counts(), strict=True):
            paths += _leaf_paths(format_path(path, root), leaf, count)
    for spec, (root, path) in zip(call.lifted_specs, _lifted_leaves(call), strict=True):
        paths += _leaf_paths(format_path(path, root), None, spec.num_dynamic)
    return paths


def _lifted_leaves(call: Call) -> list[tuple[str, tuple[Any, ...]]]:
    out: list[tuple[str, tuple[Any, ...]]] = []
    for root, obj in call.lifted_roots:
        for path, leaf in jax.tree_util.tree_flatten_with_path(obj, is_leaf=is_variable)[0]:
            if is_variable(leaf):
                out.append((root, path))
    return out


def _leaf_paths(where: str, leaf: Any, count: int) -> list[str]:
    if count == 1:
        return [where]
    return [f"{where} (value leaf {j})" for j in range(count)]


def check_mapped(
    call: Call,
    axes: Sequence[Any],
    *,
    what: str = "in_axes",
    axis_size: int | None = None,
    require_size: bool = True,
) -> int | None:
    """Check integer ``axes`` (one per dynamic array) against the array shapes.

    Returns the mapped size, or ``axis_size`` when nothing is mapped.
    """
    transform = call.transform
    size: int | None = None
    first = -1
    for i, (x, axis) in enumerate(zip(call.dynamic, axes, strict=True)):
        if not is_int_axis(axis):
            continue
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if not -len(shape) <= axis < len(shape):
            path = dynamic_paths(call)[i]
            if shape:
                fix = f"Use an axis in [{-len(shape)}, {len(shape)}) or None to broadcast it."
                has = f"shape {tuple(shape)} ({len(shape)} dimension(s))"
            else:  # no axis at all: [0, 0) would be an empty range
                fix = "A scalar has no axis to map: use None to broadcast it."
                has = "shape () (a scalar)"
            raise AxisError(
                f"treemode.{transform}: {what} maps {path} over axis {axis}, but it has "
                f"{has}. {fix}" + axis_hint(call, i, path)
            )
        n = shape[axis]
        if size is None:
            size, first = n, i
        elif n != size:
            paths = dynamic_paths(call)
            raise AxisError(
                f"treemode.{transform}: mapped axes have different sizes: {paths[first]} "
                f"has size {size} on its mapped axis {axes[first]}, but {paths[i]} has "
                f"size {n} on axis {axis}. Every mapped array must have the same size "
                "along its mapped axis."
                + (
                    axis_hint(call, first, paths[first])
                    or axis_hint(call, i, paths[i])
                    or broadcast_hint(call, axes, (first, i))
                )
            )
    if size is not None and axis_size is not None and axis_size != size:
        raise AxisError(
            f"treemode.{transform}: axis_size={axis_size} but the mapped arguments have "
            f"size {size} along their mapped axes."
        )
    if size is None:
        if axis_size is None and require_size:
            raise AxisError(
                f"treemode.{transform}: no argument is mapped ({what} is None for every "
                "array), so the size of the mapped axis is unknown. Pass axis_size=n, or "
                "map at least one argument."
            )
        return axis_size
    return size


def broadcast_hint(call: Call, axes: Sequence[Any], indices: Sequence[int]) -> str:
    """For mapped sizes that differ, where one of the arrays at ``indices`` is a
    Variable of a positional argument (a model): the ``in_axes`` that broadcasts
    that argument, the commonest fix (``vmap(f, in_axes=(0, 0))(model, x)``
    maps the model's weights along with the batch)."""
    if call.transform not in ("vmap", "pmap") or call.static_positional:
        return ""
    owners: list[int] = []  # per dynamic array: the traced argument it belongs to
    in_variable: list[bool] = []
    for k, flat in enumerate(call.arg_flats):
        for spec in flat.specs:
            if type(spec) is VarSpec:
                owners += [k] * spec.num_dynamic
                in_variable += [True] * spec.num_dynamic
            elif spec is DYNAMIC:
                owners.append(k)
                in_variable.append(False)
    for index in indices:
        if index >= len(owners) or not in_variable[index] or owners[index] >= len(call.args):
            continue
        model = owners[index]
        shown = []
        for k in range(len(call.args)):
            if k == model:
                shown.append("None")
                continue
            used = {repr(axes[j]) for j, owner in enumerate(owners) if owner == k}
            shown.append(used.pop() if len(used) == 1 else "...")
        suggestion = f"({shown[0]},)" if len(shown) == 1 else f"({', '.join(shown)})"
        return (
            f"\nIf the {type(call.args[model]).__name__} at args[{model}] is the same for "
            f"every example, broadcast it rather than map it: in_axes={suggestion}."
        )
    return ""


def batched_update_error(call: Call, index: int, *, axis_name: Any = None) -> AxisError:
    """The error for broadcast Variable ``index`` set to a per-example value."""
    var = call.variables[index]
    path = call.variable_paths()[index]
    kind = type(var).__name__
    reduce = (
        f"reduce it over the mapped axis first (e.g. jax.lax.pmean(x, {axis_name!r}))"
        if axis_name is not None
        else "reduce it over the mapped axis first (give the transform an axis_name and "
        "use jax.lax.pmean)"
    )
    return AxisError(
        f"treemode.{call.transform}: the {kind} at {path} is broadcast (its in_axes is "
        f"None), but the function set it to a value that differs across the mapped axis, "
        "which cannot be written back into a single Variable.\n"
        f"Fix: map it (e.g. in_axes=treemode.prefix(module, {{nnx.{kind}: 0, ...: None}})), "
        f"or {reduce}."
    )


__all__ = [
    "CallAxes",
    "batched_update_error",
    "call_axes",
    "check_axes_spec",
    "check_mapped",
    "dynamic_paths",
    "graph_prefix_values",
    "is_axis",
    "is_int_axis",
    "positional_entries",
]
