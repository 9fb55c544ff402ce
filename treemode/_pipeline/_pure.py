"""The pure function, inside the JAX transform: step 3 of the pipeline.

`PureFunction` is the user function as a function of the dynamic arrays only:
it rebuilds the arguments with fresh Variables holding the traced values,
rebuilds the closure objects the same way and hands the user function a copy
of itself that reaches them (``_substitute``: the caller's objects are never
written while tracing), calls it, checks that it changed no structure and
returned no input Variable, and returns ``(output, updates)`` where ``updates``
has one entry per input Variable: its new value if the function changed it,
``None`` otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat
from .._errors import AliasError, ClosureError, StructureError
from .._tree import _graph, _pytree_unreturned
from .._tree._diff import Change, Node, Nodes, Path, TreeDiff, replaced
from .._tree._leaves import (
    frozen_metadata,
    is_array,
    is_graph_node,
    is_variable,
    is_variable_or_graph_node,
    same_static,
    same_treedef,
)
from .._tree._paths import format_path
from .._tree._recursion import recursion_headroom
from .._tree._specs import DYNAMIC, StaticLeaf, StructureKey, VarSpec, dynamic_count, rebuild
from ._call import Call, PreparedCall
from ._retrace import argument_names
from ._stale import mark_trace_time
from ._substitute import Substitution
from ._unlifted import warn_unlifted


@dataclasses.dataclass
class Inputs:
    """The user function's arguments, rebuilt inside a trace."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pure_trees: list[Any]  # per traced argument, the tree that was flattened
    variables: list[Any]  # the fresh Variables, in ``Call.variables`` order
    leaves: list[list[Any]]  # per traced argument, its leaves as rebuilt
    consumed: int  # how many dynamic arrays the arguments used (closure ones follow)


@dataclasses.dataclass
class _Closure:
    """The lifted closure objects, rebuilt inside a trace."""

    replacements: dict[int, Any]  # id(caller's object) -> rebuilt object
    variables: list[Any]  # the rebuilt Variables, in ``Call.lifted`` order
    # (root name, caller's object, rebuilt object, structure key, rebuilt leaves)
    roots: list[tuple[str, Any, Any, StructureKey, list[Any]]]


def _rebuild_closure(call: Call, dynamic: Sequence[Any]) -> _Closure:
    """Each lifted closure object rebuilt from its structure key (part of the call's
    `CallKey`), its Variables holding the traced values in ``dynamic`` (its other
    arrays are the caller's, as constants)."""
    closure = _Closure({}, [], [])
    offset = 0
    for root, obj, flat in call.lifted_objects:
        key = flat.key
        leaves_dynamic: list[Any] = []
        for spec, leaf in zip(key.specs, flat.leaves, strict=True):
            if type(spec) is VarSpec:
                n = spec.num_dynamic
                leaves_dynamic.extend(dynamic[offset : offset + n])
                offset += n
            elif spec is DYNAMIC:
                leaves_dynamic.append(leaf)
        tree, variables, leaves = rebuild(key, leaves_dynamic)
        closure.replacements[id(obj)] = tree
        closure.variables.extend(variables)
        closure.roots.append((root, obj, tree, key, leaves))
    return closure


def _known_objects(call: Call) -> set[int]:
    """The ids of the NNX objects a call hands the function: lifted or arguments."""
    known = {id(obj) for _, obj in call.lifted_roots}
    known.update(id(obj) for _, obj, _ in call.closure_aliases)
    leaves = jax.tree_util.tree_leaves((call.args, call.kwargs), is_leaf=is_variable_or_graph_node)
    known.update(id(x) for x in leaves if is_variable_or_graph_node(x))
    return known


def _check_reached(
    transform: str, call: Call, closure: _Closure, substitution: Substitution
) -> None:
    missed = [root for root, obj, *_ in closure.roots if id(obj) not in substitution.used]
    missed += [root for root, obj, _ in call.closure_aliases if id(obj) not in substitution.used]
    if missed:
        raise ClosureError(
            f"treemode.{transform}: the function reaches {', '.join(missed)} through its "
            "closure, but treemode could not hand it a traced copy by the same route "
            "(a subclass of tuple, or a class whose instances object.__new__ cannot "
            "make, on the way).\nPass the module as an argument instead."
        )


@dataclasses.dataclass
class TraceFindings:
    """What a trace learned that is not an array: metadata changes."""

    metadata_updates: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


_Binding = threading.local  # the call a PureFunction runs, per thread


class UnboundTrace(Exception):
    """JAX traced a pure function while no call of the pipeline was bound to it.

    The compiled executor of a fast-path record calls the entry without binding
    its call; if JAX must trace then (new shapes, or its cache was cleared), the
    trace raises this before running anything, and the executor's miss runs the
    call through the pipeline, which binds it.
    """

    def __init__(self, transform: str):
        super().__init__(
            f"treemode.{transform}: a traced function ran outside of a treemode call "
            "(internal: the call is retried through the pipeline)"
        )


class PureFunction:
    """The user function as a pure function of the dynamic arrays.

    Built once per `CallKey`; the current `Call` (needed only while
    tracing, for the closure Variables and error paths) is set by the caller
    with `bind` for the duration of the JAX call.
    """

    def __init__(
        self,
        call: Call,
        *,
        force_updates: frozenset[int] = frozenset(),
        allow_output_variables: bool = False,
    ):
        # The function traced; ``None``: the bound call's (an entry that may outlive
        # the wrapper then keeps no reference to the user's function).
        self.fn: Callable[..., Any] | None = call.fn
        self.transform = call.transform
        self.key = call.key
        self.graph = call.graph
        self.static_positional = dict(call.static_positional)
        self.static_keywords = dict(call.static_keywords)
        self.num_args = len(call.args)
        self.kw_names = call.kw_names
        self.force = force_updates
        self.allow_output_variables = allow_output_variables
        # ``graph=True``: the transform's output specification, checked against
        # the outputs at trace time (`_graph.check_one_output_spec_per_variable`):
        # ``(what, prefix, select, is_spec_leaf, root)``, ``select`` picking from
        # the function's output the part ``prefix`` describes (named ``root``).
        self.output_spec: tuple[str, Any, Callable[[Any], Any], Any, str] | None = None
        self.findings = TraceFindings()
        # The current Call in ``binding.call``, per thread so concurrent calls do
        # not see each other. `bind` sets it; a hot path may set it directly.
        self.binding = _Binding()

    def bind(self, call: PreparedCall | None) -> None:
        self.binding.call = call

    @property
    def user_fn(self) -> Any:
        """The user function as this trace runs it: a copy reaching the rebuilt
        closure objects while one is being traced (see ``_substitute``)."""
        fn = getattr(self.binding, "fn", None)
        return self.call.fn if fn is None else fn

    @property
    def call(self) -> Call:
        call = getattr(self.binding, "call", None)
        if call is None:
            raise UnboundTrace(self.transform)
        return call.full()

    def rebuild_inputs(self, dynamic: Sequence[Any]) -> Inputs:
        """Arguments (as the user function sees them) rebuilt from dynamic arrays."""
        offset = 0
        leaves_in: list[list[Any]] = []
        pure_trees: list[Any] = []
        inner_vars: list[Any] = []
        for key in self._flat_keys():
            n = sum(map(dynamic_count, key.specs))
            tree, variables, leaves = rebuild(key, dynamic[offset : offset + n])
            offset += n
            pure_trees.append(tree)
            leaves_in.append(leaves)
            inner_vars.extend(variables)
        n_pos = self.num_args - len(self.static_positional)
        if self.graph:
            pos, kw = _graph.from_tree(
                (pure_trees[:n_pos], dict(zip(self.kw_names, pure_trees[n_pos:], strict=True)))
            )
            trees = iter([*pos, *(kw[n] for n in self.kw_names)])
        else:
            trees = iter(pure_trees)
        args = tuple(
            self.static_positional[i] if i in self.static_positional else next(trees)
            for i in range(self.num_args)
        )
        kwargs = {name: next(trees) for name in self.kw_names}
        kwargs.update(self.static_keywords)
        return Inputs(args, kwargs, pure_trees, inner_vars, leaves_in, offset)

    @property
    def __fun_debug_info__(self) -> Any:
        """What JAX names this function and its arguments by when a transform traces
        it directly (``cond``, loops, ``eval_shape``...): the user function, and each
        dynamic array by its path in the bound call (``x``, ``model.kernel``).

        Read by JAX while it traces (``api_util.debug_info``), never on a cached call;
        ``None`` (JAX's own names) outside a bound call or on another JAX layout.
        """
        call = getattr(self.binding, "call", None)
        if call is None or not _compat.NAMES_ARGUMENTS:
            return None
        names = argument_names(call)
        if names is None:
            return None
        try:
            fn = call.full().fn if self.fn is None else self.fn
            return _compat.debug_info_named(self.transform, fn, names)
        except Exception:  # never fail a trace over a name
            return None

    def __call__(self, *dynamic: Any) -> tuple[Any, tuple[Any, ...]]:
        # Deep modules: rebuilding and checking them recurses like flattening.
        with recursion_headroom():
            return self._run(dynamic)

    def _run(self, dynamic: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
        call = self.call
        inputs = self.rebuild_inputs(dynamic)
        closure = _rebuild_closure(call, dynamic[inputs.consumed :])
        if call.closure_aliases:
            # A closure object that is an argument's: the argument's rebuilt object.
            traced = [a for i, a in enumerate(inputs.args) if i not in self.static_positional]
            traced += [inputs.kwargs[name] for name in self.kw_names]
            for _, obj, where in call.closure_aliases:
                closure.replacements[id(obj)] = where.find(traced[where.k])
        all_vars = inputs.variables + closure.variables
        # Writes from another trace: MutationError.
        mark_trace_time(self, all_vars, [root for root, *_ in closure.roots])
        fn = call.fn if self.fn is None else self.fn
        substitution = None
        try:
            if closure.replacements:
                substitution = Substitution(closure.replacements)
                user_fn = substitution.callable(call.fn)
                fn = user_fn if fn is call.fn else substitution.callable(fn)
                _check_reached(self.transform, call, closure, substitution)
                self.binding.fn = user_fn  # what `user_fn` gives wrappers of the user function
            out = fn(*inputs.args, **inputs.kwargs)
        finally:
            if substitution is not None:
                self.binding.fn = None
                substitution.finish()
        # After the call: what it read may have been made on the way (an lru_cache).
        warn_unlifted(self.transform, call.fn, _known_objects(call))
        self._check_structure(call, inputs, out)
        self._check_closure_structure(closure)
        if self.graph and self.output_spec is not None:
            what, prefix, select, is_spec_leaf, root = self.output_spec
            _graph.check_one_output_spec_per_variable(
                self.transform, what, select(out), prefix, is_spec_leaf, root
            )
        out_tree = _graph.to_tree(out) if self.graph else out
        self._check_outputs(call, out_tree, all_vars)
        updates = self._collect_updates(call, all_vars, dynamic)
        return out_tree, updates

    # -- checks ---------------------------------------------------------------

    def _check_structure(self, call: Call, inputs: Inputs, out: Any = None) -> None:
        args, kwargs = inputs.args, inputs.kwargs
        trees_after = [a for i, a in enumerate(args) if i not in self.static_positional]
        trees_after += [kwargs[name] for name in self.kw_names]
        if self.graph:
            n_pos = self.num_args - len(self.static_positional)
            pos, kw = _graph.to_tree(
                (trees_after[:n_pos], dict(zip(self.kw_names, trees_after[n_pos:], strict=True)))
            )
            trees_after = [*pos, *(kw[n] for n in self.kw_names)]
        var_iter = iter(inputs.variables)
        roots = call.arg_roots()
        for (root, before), after, key, leaves_in in zip(
            roots, trees_after, [f.key for f in call.arg_flats], inputs.leaves, strict=True
        ):
            self._check_root(root, before, after, key, var_iter, leaves_in, out)

    def _check_closure_structure(self, closure: _Closure) -> None:
        var_iter = iter(closure.variables)
        for root, before, after, key, leaves_in in closure.roots:
            self._check_root(root, before, after, key, var_iter, leaves_in, None)

    def _check_root(
        self,
        root: str,
        before: Any,
        after: Any,
        key: StructureKey,
        var_iter: Any,
        leaves_in: list[Any],
        out: Any,
    ) -> None:
        """Raise `StructureError` if the function changed ``after``'s structure
        (``after`` was rebuilt from ``key``; ``before`` is the caller's object)."""
        leaves, treedef = jax.tree_util.tree_flatten(after, is_leaf=is_variable)
        problem = None
        owners = returned = None  # treemode.Pytree proxies; computed on a change only
        if not same_treedef(treedef, key.treedef):
            problem = describe_structure_change(before, after)
        else:
            for j, (leaf, spec) in enumerate(zip(leaves, key.specs, strict=True)):
                if type(spec) is VarSpec:
                    if leaf is not next(var_iter):
                        problem = (_leaf_path(after, j), _replaced(leaf, spec.var_type))
                        break
                elif spec is DYNAMIC and leaf is not leaves_in[j]:
                    if owners is None:
                        owners = _pytree_unreturned.proxy_leaf_owners(after)
                        returned = _pytree_unreturned.returned_proxies(out)
                    owner = owners[j]
                    if owner is not None and returned and id(owner[1]) in returned:
                        continue  # a returned proxy carries its new state itself
                    if owner is not None:
                        raise StructureError(
                            _pytree_unreturned.unreturned_proxy_message(
                                self.transform,
                                format_path(owner[0], root),
                                format_path(_leaf_path(after, j), root),
                            )
                        )
                    what = (
                        "a plain array attribute (not an nnx.Variable) was reassigned; "
                        "wrap it in an nnx.Variable so that its updates are written back"
                    )
                    problem = (_leaf_path(after, j), what)
                    break
                elif isinstance(spec, StaticLeaf) and not same_static(leaf, spec.value):
                    what = f"the static value {spec.value!r} was changed to {leaf!r}"
                    problem = (_leaf_path(after, j), what)
                    break
        if problem is not None:
            path, what = problem
            raise StructureError(
                f"treemode.{self.transform}: the function changed the structure of "
                f"its input at {format_path(path, root)}: {what}.\n"
                "A tree-mode transform only writes back new values of existing "
                "Variables. Make structural changes (new attributes, new or replaced "
                "Variables, changed static fields) outside the transform, or return "
                "the new object as an output.\nSee docs/migration.md#structural-changes."
            )

    def _check_outputs(self, call: Call, out_tree: Any, all_vars: list[Any]) -> None:
        input_ids = {id(v): i for i, v in enumerate(all_vars)}
        seen: dict[int, Any] = {}
        out_leaves = jax.tree_util.tree_leaves(out_tree, is_leaf=is_variable)
        problem: tuple[str, Any, Any] | None = None
        for leaf in out_leaves:
            if not is_variable(leaf):
                continue
            if id(leaf) in input_ids and not self.allow_output_variables:
                problem = ("input", leaf, input_ids[id(leaf)])
                break
            if id(leaf) in seen:
                problem = ("twice", leaf, None)
                break
            seen[id(leaf)] = leaf
        if problem is None:
            return
        kind, var, index = problem
        out_paths = [
            format_path(p, "output")
            for p, leaf in jax.tree_util.tree_flatten_with_path(out_tree, is_leaf=is_variable)[0]
            if leaf is var
        ]
        name = type(var).__name__
        if kind == "input":
            assert index is not None
            in_path = call.variable_paths()[index]
            if index >= len(call.variables) - len(call.lifted):
                head = (
                    f"Cannot return captured Variable: the function returns the {name} at "
                    f"{in_path}, which it captures from its closure (returned at "
                    f"{out_paths[0]})."
                )
            else:
                head = (
                    f"Duplicate {name}: the function returns the {name} that is also its "
                    f"input {in_path} (returned at {out_paths[0]})."
                )
            raise AliasError(
                f"treemode.{self.transform}: {head}\n"
                f"{'Graph mode (graph=True)' if self.graph else 'Tree mode'} does not "
                "support Variable aliasing between inputs and outputs: the returned one "
                "would come back as an independent copy. Return its value "
                "instead (e.g. `var[...]`), or return a new module built inside the function."
            )
        raise AliasError(
            f"treemode.{self.transform}: Duplicate {name}: the function returns the same "
            f"{name} twice, at {out_paths[0]} and {out_paths[1]}.\n"
            "In tree mode the two would come back as independent copies. Return it "
            f"once, or keep the sharing with treemode.{self.transform}(..., graph=True)."
        )

    def _collect_updates(
        self, call: Call, all_vars: list[Any], dynamic: Sequence[Any]
    ) -> tuple[Any, ...]:
        specs = [s for k in self._flat_keys() for s in k.specs if type(s) is VarSpec]
        specs += list(self.key.lifted)
        updates: list[Any] = []
        metadata_updates: dict[int, dict[str, Any]] = {}
        ranges = call.variable_dynamic_ranges()
        for i, (var, spec) in enumerate(zip(all_vars, specs, strict=True)):
            before = spec.build([dynamic[j] for j in ranges[i]])
            value, metadata = _compat.raw_value_of(var), _compat.metadata_of(var)
            changed = _value_changed(value, before)
            if frozen_metadata(metadata) != spec.frozen:
                metadata_updates[i] = dict(metadata)
            updates.append(value if (changed or i in self.force) else None)
        self.findings.metadata_updates = metadata_updates
        return tuple(updates)

    def _flat_keys(self) -> list[StructureKey]:
        keys = [k for k in self.key.positional if isinstance(k, StructureKey)]
        keys += [k for _, k in self.key.keywords if isinstance(k, StructureKey)]
        return keys


def _leaf_path(tree: Any, index: int) -> tuple[Any, ...]:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0][index][0]


def _replaced(leaf: Any, old_type: type) -> str:
    if type(leaf) is old_type:
        return f"the {old_type.__name__} was replaced by a new {old_type.__name__}"
    return f"the {old_type.__name__} was replaced by a {type(leaf).__name__}"


def _value_changed(after: Any, before: Any) -> bool:
    if after is before:
        return False
    a_leaves, a_def = jax.tree_util.tree_flatten(after)
    b_leaves, b_def = jax.tree_util.tree_flatten(before)
    if a_def != b_def or len(a_leaves) != len(b_leaves):
        return True
    return any(x is not y for x, y in zip(a_leaves, b_leaves, strict=True))


def describe_structure_change(before: Any, after: Any) -> tuple[tuple[Any, ...], str]:
    """The first place where ``after`` differs structurally from ``before``."""
    result = _ObjectDiff().first(before, after)
    if result is not None:
        return result
    return ((), "the structure changed")  # pragma: no cover - defensive


def _one_level(x: Any) -> tuple[Any, list[tuple[Any, Any]]] | None:
    """``(node_data, [(key, child)])`` of a pytree node, ``None`` for a leaf."""
    if is_variable(x):
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is x:
        return None
    node_data = treedef.node_data()
    if node_data is None:
        return None
    return node_data, [(p[0], c) for p, c in flat]


class _ObjectDiff(TreeDiff):
    """The function's inputs before and after its trace: Variables, arrays and
    static values are the leaves, and an attribute an NNX object gained or lost
    is named as an attribute."""

    added = "a new entry was added"
    removed = "the entry was deleted"

    def leaf(self, path: Path, a: Any, b: Any) -> Change | Nodes | None:
        if is_variable(a) or is_variable(b):
            if not (is_variable(a) and is_variable(b)):
                if is_variable(a):
                    return path, f"the {type(a).__name__} was replaced by a {type(b).__name__}"
                return path, f"a {type(a).__name__} was replaced by a {type(b).__name__}"
            if type(a) is not type(b):
                return path, f"the {type(a).__name__} was replaced by a {type(b).__name__}"
            return None
        if is_graph_node(a) and is_graph_node(b) and type(a) is type(b):
            va, vb = vars(a), vars(b)
            added = [k for k in vb if k not in va]
            removed = [k for k in va if k not in vb]
            if added:
                return (*path, jax.tree_util.GetAttrKey(added[0])), "a new attribute was added"
            if removed:
                return (*path, jax.tree_util.GetAttrKey(removed[0])), "the attribute was deleted"
        la, lb = _one_level(a), _one_level(b)
        if la is None or lb is None:
            if la is None and lb is None:
                if is_array(a) or is_array(b):
                    if is_array(a) and is_array(b):
                        return None  # values are compared positionally, not here
                    return replaced(path, type(a), type(b))
                if not same_static(a, b):
                    return path, f"the static value {a!r} was changed to {b!r}"
                return None
            return replaced(path, type(a), type(b))
        ((ta, aux_a), ca), ((tb, aux_b), cb) = la, lb
        return Nodes(Node(ta, aux_a, ca), Node(tb, aux_b, cb))

    def static_equal(self, a: Any, b: Any) -> bool:
        return same_static(a, b)

    def static_change(self, path: Path, a: Any, b: Any, node: Node) -> Change:
        if is_graph_node(a):
            va, vb = vars(a), vars(b)
            for name in va:
                x = va[name]
                if is_variable(x) or is_array(x) or _one_level(x) is not None:
                    continue  # data: compared through the children above
                if name in vb and not same_static(x, vb[name]):
                    return (
                        (*path, jax.tree_util.GetAttrKey(name)),
                        f"the static attribute was changed from {va[name]!r} to {vb[name]!r}",
                    )
        return path, "a static field of this node changed"


__all__ = ["Inputs", "PureFunction", "TraceFindings", "UnboundTrace", "describe_structure_change"]
