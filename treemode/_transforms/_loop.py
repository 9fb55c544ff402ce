"""Loop state shared by ``scan``, ``while_loop``, ``fori_loop``, ``cond`` and ``switch``.

A loop over a tree-mode function carries only what changes from one step to the
next:

- the *free* arrays of the carry argument (arrays in plain containers or
  Equinox modules, not under an NNX object), which the function returns;
- the Variables that the function changes, whether they belong to the carry
  argument, to a broadcast argument or to the function's closure.

Every other array (read-only parameters above all) is a loop constant: it
goes through the loop state unchanged (never closed over, so JAX's trace cache
can reuse the body on the next call) and JAX turns it into a constant of the
loop, so it is never copied, stacked or returned. Which Variables
change is found by tracing the function once with ``jax.eval_shape`` before
building the loop (`probe_changed`).

The carry argument keeps its identity: the function must return the very NNX
objects and Variables it was given (it changes them in place), and the caller
gets back the original objects, updated. A plain array attribute of an NNX
object in the carry (an ``nnx.Pytree`` holding ``self.data = array``) is loop
state too: the function may reassign it, and since the object is returned as
the carry, its new value reaches the caller in a new object of that type (as a
carry is a new pytree in JAX), holding the same Variables; the caller's object
keeps its old value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from .._errors import StructureError
from .._pipeline import _call, _core, _pure, _retrace
from .._tree import _graph
from .._tree._graph import GraphNode, SharedRef
from .._tree._leaves import is_variable, is_variable_or_graph_node, same_static
from .._tree._paths import format_path
from .._tree._specs import DYNAMIC, VarSpec, variable_dynamic

# -- per-dynamic-array helpers ------------------------------------------------------


def abstract(x: Any, drop_axis: int | None = None) -> jax.ShapeDtypeStruct:
    """The abstract value of an array (or tracer), optionally without one axis."""
    aval = jax.typeof(x)
    shape = tuple(aval.shape)
    if drop_axis is not None:
        axis = drop_axis % len(shape)
        shape = shape[:axis] + shape[axis + 1 :]
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type)


def probe_changed(
    pure: _pure.PureFunction,
    call: _call.Call,
    avals: Sequence[Any],
    *,
    extra: Sequence[Any] = (),
    before: Callable[[Sequence[Any]], None] | None = None,
) -> frozenset[int]:
    """Indices (into ``call.variables``) of the Variables the function changes.

    Traces ``pure`` once, abstractly, on ``avals`` (one per dynamic array).
    ``extra`` are further abstract inputs (e.g. the loop index) handed to
    ``before`` inside the trace, so wrappers can make them visible to ``f``.
    """

    def run(extra_values: Sequence[Any], dynamic: Sequence[Any]) -> Any:
        if before is not None:
            before(extra_values)
        return pure(*dynamic)[1]

    # JAX's messages name each array as the user's call does. (The function keeps
    # its own name: a new `run` named like the user's at every probe would read, to
    # JAX's cache-miss explanations, as the user's function "re-defined".)
    names = _retrace.argument_names(call)
    info = (
        None
        if names is None
        else _compat.debug_info_named(call.transform, run, [""] * len(extra) + names)
    )
    if info is not None:
        run.__fun_debug_info__ = info  # type: ignore[attr-defined]
    with _core.bound(pure, call):
        updates = jax.eval_shape(run, list(extra), list(avals))
    return frozenset(i for i, u in enumerate(updates) if u is not None)


def variable_specs(call: _call.Call) -> list[VarSpec]:
    specs = [s for f in call.arg_flats for s in f.specs if type(s) is VarSpec]
    return specs + list(call.lifted_specs)


def type_problem(before: Any, after: Any) -> str | None:
    """Why ``after`` cannot replace ``before`` in a loop state (``None`` if it can)."""
    b_leaves, b_def = jax.tree_util.tree_flatten(before)
    a_leaves, a_def = jax.tree_util.tree_flatten(after)
    if b_def != a_def:
        return f"its structure changed from {b_def} to {a_def}"
    for b, a in zip(b_leaves, a_leaves, strict=True):
        tb, ta = jax.typeof(b), jax.typeof(a)
        if tb.shape != ta.shape or tb.dtype != ta.dtype:
            return (
                f"it went in as {tb.dtype}{list(tb.shape)} and came out as "
                f"{ta.dtype}{list(ta.shape)}"
            )
    return None


def type_error(transform: str, path: str, what: str, problem: str) -> StructureError:
    return StructureError(
        f"treemode.{transform}: {what} at {path} must keep its shape and dtype "
        f"from one iteration to the next, but {problem}.\n"
        "Cast or reshape the new value to the old one's type (e.g. "
        "`x.astype(old.dtype)`), or return it as an output instead of loop state."
    )


# -- the carry argument ----------------------------------------------------------------


def _is_coarse_leaf(x: Any) -> bool:
    return is_variable_or_graph_node(x) or isinstance(x, (GraphNode, SharedRef))


NODE, FREE, STATIC = "node", "free", "static"


@dataclasses.dataclass
class CarryStructure:
    """How one carry argument splits into NNX objects, free arrays and static leaves.

    ``kinds`` has one entry per coarse leaf (NNX objects and Variables are
    coarse leaves, the function must return them as they are); ``free`` holds the
    indices into ``call.dynamic`` of the free arrays, in coarse-leaf order, then
    those of the plain arrays inside NNX objects (``inner``: per such array, its
    coarse leaf, its key path inside the object and its abstract value).
    """

    root: str
    kinds: list[str]
    free: list[int]
    inner: list[tuple[int, tuple[Any, ...], Any]] = dataclasses.field(default_factory=list)
    # Indices into ``inner`` of the arrays the function reassigns (found when it is
    # traced); only their objects are rebuilt for the caller.
    reassigned: set[int] = dataclasses.field(default_factory=set)
    graph: bool = False  # the carry went through `to_tree` (graph=True)


def carry_structure(call: _call.Call, k: int, root: str) -> CarryStructure:
    """The structure of traced argument ``k`` (index into ``call.arg_flats``)."""
    flat = call.arg_flats[k]
    tree = call.arg_roots()[k][1]
    start = call.root_dynamic_ranges()[k].start
    coarse = jax.tree_util.tree_leaves(tree, is_leaf=_is_coarse_leaf)
    kinds: list[str] = []
    free: list[int] = []
    inner: list[tuple[int, tuple[Any, ...], Any]] = []
    inner_free: list[int] = []
    specs = iter(flat.specs)
    offset = start
    for c, leaf in enumerate(coarse):
        if _is_coarse_leaf(leaf):
            kinds.append(NODE)
            # With graph=True the object is in `to_tree` form (a `GraphNode`, or a
            # `SharedRef` with no leaves for a second reference); its key paths are
            # those of the object itself, so they lead to the same arrays.
            paths = [()] if is_variable(leaf) else [p for p, _ in _inner_leaves(leaf)]
            for path in paths:
                spec = next(specs)
                if spec is DYNAMIC and not is_variable(leaf):
                    inner.append((c, tuple(path), abstract(call.dynamic[offset])))
                    inner_free.append(offset)
                offset += spec.num_dynamic if type(spec) is VarSpec else int(spec is DYNAMIC)
            continue
        spec = next(specs)
        if spec is DYNAMIC:
            kinds.append(FREE)
            free.append(offset)
            offset += 1
        else:
            kinds.append(STATIC)
    return CarryStructure(root, kinds, free + inner_free, inner, graph=call.graph)


def _inner_leaves(node: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=is_variable)[0]


def inner_arrays(structure: CarryStructure, carry: Any) -> list[Any]:
    """The plain arrays inside the carry's NNX objects (call before the function runs)."""
    if not structure.inner:
        return []
    coarse = jax.tree_util.tree_leaves(carry, is_leaf=_is_coarse_leaf)
    return [_get_at(coarse[c], path) for c, path, _ in structure.inner]


def _get_at(node: Any, path: Sequence[Any]) -> Any:
    for key in path:
        node = _child(node, key)
    return node


def _set_at(node: Any, path: Sequence[Any], value: Any) -> None:
    """Set the leaf at ``path`` (attribute, dict and list keys) inside ``node``."""
    parent = node
    for key in path[:-1]:
        parent = _child(parent, key)
    key = path[-1]
    if isinstance(key, jax.tree_util.GetAttrKey):
        setattr(parent, key.name, value)
    elif isinstance(key, jax.tree_util.DictKey):
        parent[key.key] = value
    elif isinstance(key, jax.tree_util.SequenceKey):
        parent[key.idx] = value
    else:
        raise TypeError(f"cannot set a leaf at {key!r}")


def _child(parent: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(parent, key.name)
    if isinstance(key, jax.tree_util.DictKey):
        return parent[key.key]
    if isinstance(key, jax.tree_util.SequenceKey):
        return parent[key.idx]
    raise TypeError(f"cannot follow {key!r}")


def check_carry_out(
    transform: str,
    structure: CarryStructure,
    carry_in: Any,
    carry_out: Any,
    inner_before: Sequence[Any] = (),
) -> list[Any]:
    """Check the function's new carry against the carry it received.

    Returns the new values of the free arrays (then of the plain arrays inside
    the carry's NNX objects, `inner_arrays` taken before the function ran:
    ``inner_before``; those objects get their old arrays back, so that the
    function's input looks unchanged and the new values travel in the loop
    state). Raises `StructureError` naming the path when the structure differs,
    an NNX object or Variable was replaced, or a free array changed shape or dtype.
    """
    in_paths, in_def = jax.tree_util.tree_flatten_with_path(
        carry_in, is_leaf=is_variable_or_graph_node
    )
    out_leaves, out_def = jax.tree_util.tree_flatten(carry_out, is_leaf=is_variable_or_graph_node)
    if in_def != out_def:
        path, what = _pure.describe_structure_change(carry_in, carry_out)
        raise StructureError(
            f"treemode.{transform}: the carry returned by the function does not have the "
            f"structure of the carry it received, at {format_path(path, structure.root)}: "
            f"{what}.\nReturn the carry with the same structure (the same modules, "
            "containers and static values); put new things in the outputs instead."
        )
    free: list[Any] = []
    for (path, before), after, kind in zip(in_paths, out_leaves, structure.kinds, strict=True):
        where = format_path(path, structure.root)
        if kind == NODE:
            if after is not before:
                _raise_replaced(transform, where, before, after)
        elif kind == FREE:
            try:
                after = jnp.asarray(after)
            except TypeError:
                raise StructureError(
                    f"treemode.{transform}: the carry at {where} was an array and the "
                    f"function returned a {type(after).__name__} in its place. Return an "
                    "array of the same shape and dtype."
                ) from None
            problem = type_problem(before, after)
            if problem is not None:
                raise type_error(transform, where, "the carry array", problem)
            free.append(after)
        elif not same_static(before, after):
            raise StructureError(
                f"treemode.{transform}: the static carry value at {where} changed from "
                f"{before!r} to {after!r}. Static values (non-array leaves) cannot change "
                "inside a loop; make it an array or keep it constant."
            )
    if structure.inner:
        free += _take_inner(transform, structure, in_paths, out_leaves, inner_before)
    return free


def _take_inner(
    transform: str,
    structure: CarryStructure,
    in_paths: Sequence[tuple[Any, Any]],
    out_leaves: Sequence[Any],
    inner_before: Sequence[Any],
) -> list[Any]:
    """The new plain arrays of the carry's NNX objects; the objects get the old ones back."""
    values: list[Any] = []
    restore: list[tuple[Any, Any, Any]] = []
    for k, ((c, path, aval), old) in enumerate(zip(structure.inner, inner_before, strict=True)):
        node = out_leaves[c]
        where = format_path((*in_paths[c][0], *path), structure.root)
        try:
            raw = _get_at(node, path)
        except (TypeError, AttributeError, KeyError, IndexError):
            raise StructureError(
                f"treemode.{transform}: the carry array at {where} was removed by the "
                "function. Keep it in the carry (assign a new array of the same shape "
                "and dtype instead)."
            ) from None
        try:
            new = jnp.asarray(raw)
        except TypeError:
            raise StructureError(
                f"treemode.{transform}: the carry at {where} was an array and the "
                f"function put a {type(raw).__name__} in its place. Assign an array of "
                "the same shape and dtype."
            ) from None
        if tuple(new.shape) != tuple(aval.shape) or new.dtype != aval.dtype:
            problem = (
                f"it went in as {aval.dtype}{list(aval.shape)} and came out as "
                f"{new.dtype}{list(new.shape)}"
            )
            raise type_error(transform, where, "the carry array", problem)
        values.append(new)
        if raw is not old:
            structure.reassigned.add(k)
            restore.append((node, path, old))
    for node, path, old in restore:
        try:
            _set_at(node, path, old)
        except (TypeError, AttributeError, KeyError, IndexError):
            pass  # e.g. inside a new tuple: the structure check then names the change
    return values


def _raise_replaced(transform: str, where: str, before: Any, after: Any) -> None:
    kind = "Variable" if is_variable(before) else "object"
    raise StructureError(
        f"treemode.{transform}: the carry at {where} must stay the same {kind}, but the "
        f"function returned a different {type(after).__name__} in its place.\n"
        f"{transform} Variable identity must be preserved across iterations: carry "
        "modules and Variables keep their identity, so change them in place (e.g. "
        "`m.w[...] = new` or `m.count[...] += 1`) and return the same object."
    )


def rebuild_carry(original: Any, structure: CarryStructure, free_values: Sequence[Any]) -> Any:
    """The caller's carry object with new free arrays; NNX objects are kept as they are,
    except that one whose plain arrays are carried becomes a new object of its type
    holding the new arrays and the same Variables."""
    if not structure.free:
        return original
    leaves, treedef = jax.tree_util.tree_flatten(original, is_leaf=is_variable_or_graph_node)
    values = iter(free_values)
    new = [
        next(values) if kind == FREE else leaf
        for leaf, kind in zip(leaves, structure.kinds, strict=True)
    ]
    per_node: dict[int, dict[tuple[Any, ...], Any]] = {}
    changed: set[int] = set()
    for k, ((c, path, _), value) in enumerate(zip(structure.inner, values, strict=True)):
        per_node.setdefault(c, {})[path] = value
        if k in structure.reassigned:
            changed.add(c)
    renewed: dict[int, Any] = {}  # id(caller's object) -> the new one
    for c in sorted(changed):
        renewed[id(leaves[c])] = new[c] = _renew(new[c], per_node[c], structure.graph)
    if structure.graph and renewed:
        # A second reference to a renewed object (a `SharedRef` in the structure)
        # refers to the new object too, so the carry keeps its sharing.
        new = [
            renewed.get(id(leaf), x) if kind == NODE else x
            for leaf, x, kind in zip(leaves, new, structure.kinds, strict=True)
        ]
    if not structure.kinds.count(FREE) and not changed:
        return original
    return treedef.unflatten(new)


def _renew(node: Any, values: dict[tuple[Any, ...], Any], graph: bool) -> Any:
    """A new object of ``node``'s type with ``values`` at their key paths (the same
    Variables; with ``graph``, the objects it shares inside stay shared)."""
    tree = _graph.to_tree(node) if graph else node
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)
    rebuilt = treedef.unflatten([values.get(tuple(p), x) for p, x in flat])
    return _graph.from_tree(rebuilt) if graph else rebuilt


def scalars_to_arrays(tree: Any) -> Any:
    """Python numbers in plain containers become arrays (as ``jax.lax.scan`` does).

    Numbers inside NNX objects and Equinox modules stay static; those inside
    other pytree nodes are traced by the flattening (see ``_leaves.is_traced``).
    """

    def is_leaf(x: Any) -> bool:
        return not isinstance(x, (tuple, list, dict)) or is_variable_or_graph_node(x)

    def is_number(x: Any) -> bool:
        return isinstance(x, (bool, int, float, complex)) and not isinstance(x, jax.Array)

    # ``device_put`` keeps Python numbers weakly typed, as the JAX loops do.
    if is_number(tree):
        return jax.device_put(tree)
    if not isinstance(tree, (tuple, list, dict)):
        return tree
    if not any(map(is_number, jax.tree_util.tree_leaves(tree, is_leaf=is_leaf))):
        return tree  # keep the caller's containers
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x) if is_number(x) else x, tree, is_leaf=is_leaf
    )


# -- loop state ------------------------------------------------------------------------


class LoopState:
    """Where each dynamic array of a call goes in a loop; structure only.

    The loop state is ``(consts, free, values)``:

    - ``consts``: the arrays the function only reads. They go through the state
      unchanged rather than being closed over, so that the loop body depends on
      its inputs only and JAX's trace cache can reuse it on the next call (a
      closed-over array would be baked into the cached jaxpr). JAX turns state
      entries that the body returns unchanged into loop constants itself, so
      nothing is copied or stacked;
    - ``free``: the free arrays of the carry argument (indices into
      ``call.dynamic``);
    - ``values``: the values of the Variables the function changes
      (``state_vars``, indices into ``call.variables``).

    Arrays in ``sliced`` (scanned over) are given per step instead. A
    `LoopState` holds no arrays: it is built once per call structure and shared
    by the calls (and threads) that have that structure.
    """

    def __init__(
        self,
        transform: str,
        call: _call.Call,
        free: Sequence[int],
        state_vars: Iterable[int],
        sliced: Iterable[int] = (),
    ):
        self.transform = transform
        self.size = len(call.dynamic)
        self.num_variables = len(call.variables)
        self.free = list(free)
        self.state_vars = sorted(state_vars)
        self.ranges = call.variable_dynamic_ranges()
        self.specs = variable_specs(call)
        taken = set(self.free).union(sliced)
        for i in self.state_vars:
            taken.update(self.ranges[i])
        self.consts = [j for j in range(self.size) if j not in taken]

    def init(self, dynamic: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """The initial state from a call's dynamic arrays."""
        values = [
            self.specs[i].build([dynamic[j] for j in self.ranges[i]]) for i in self.state_vars
        ]
        return [dynamic[j] for j in self.consts], [dynamic[j] for j in self.free], values

    def assemble(self, state: Sequence[Any], sliced: dict[int, Any] | None = None) -> list[Any]:
        """The call's dynamic arrays rebuilt from the state (and the ``sliced`` arrays)."""
        consts, free, values = state[:3]
        dynamic: list[Any] = [None] * self.size
        for j, x in zip(self.consts, consts, strict=True):
            dynamic[j] = x
        for j, x in zip(self.free, free, strict=True):
            dynamic[j] = x
        for i, value in zip(self.state_vars, values, strict=True):
            leaves = variable_dynamic(_ValueHolder(value), self.specs[i])
            for j, x in zip(self.ranges[i], leaves, strict=True):
                dynamic[j] = x
        if sliced:
            for j, x in sliced.items():
                dynamic[j] = x
        return dynamic

    def next_state(
        self,
        call: _call.Call,
        state: Sequence[Any],
        free_out: Sequence[Any],
        updates: Sequence[Any],
        allowed: frozenset[int] = frozenset(),
    ) -> tuple[Any, ...]:
        """The state after one step; raises if a Variable outside the state changed.

        ``call`` is the bound call (for error messages). ``allowed`` are
        Variables that may change without being state (scanned ones). Entries of
        the state after ``values`` (a while loop's condition inputs) are passed on.
        """
        state_set = set(self.state_vars)
        for i, u in enumerate(updates):
            if u is not None and i not in state_set and i not in allowed:
                path = call.variable_paths()[i]
                raise StructureError(
                    f"treemode.{self.transform}: the {type(call.variables[i]).__name__} "
                    f"at {path} was left unchanged when the function was first traced but "
                    "changed when it was traced again. The set of Variables a loop body "
                    "changes must not depend on anything but shapes and static values."
                )
        new_values: list[Any] = []
        for i, old in zip(self.state_vars, state[2], strict=True):
            new = updates[i]
            if new is None:
                new = old
            problem = type_problem(old, new)
            if problem is not None:
                what = f"the {type(call.variables[i]).__name__}"
                raise type_error(self.transform, call.variable_paths()[i], what, problem)
            new_values.append(new)
        return (state[0], list(free_out), new_values, *state[3:])

    def final_updates(self, values: Sequence[Any]) -> list[Any]:
        """An updates tuple for ``write_back``: the state Variables' final values."""
        updates: list[Any] = [None] * self.num_variables
        for i, v in zip(self.state_vars, values, strict=True):
            updates[i] = v
        return updates


class _ValueHolder:
    """Quacks like a Variable for `variable_dynamic`."""

    __slots__ = (_compat.RAW_VALUE,)

    def __init__(self, value: Any):
        _compat.set_raw_value(self, value)
