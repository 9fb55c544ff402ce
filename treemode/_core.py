"""The pipeline every treemode transform shares.

Outside the JAX transform (``prepare`` / ``write_back``):

1. flatten each argument with Variables as leaves (cached per argument object);
   with ``graph=True`` the arguments first go through ``to_tree``;
2. find the Variables the function reaches through its closure and lift them
   into extra inputs;
3. reject aliases (one Variable reachable twice);
4. after the JAX transform returns, write the changed values back, checking
   first that every target may be written, so a failure leaves inputs untouched.

Inside the JAX transform (``PureFunction``): rebuild the arguments with fresh
Variables holding the traced values, point the lifted closure Variables at
traced values, call the user function, check that it changed no structure and
returned no input Variable, and return ``(output, updates)`` where ``updates``
has one entry per input Variable: its new value if the function changed it,
``None`` otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from collections.abc import Callable, Sequence
from itertools import chain, compress, repeat
from typing import TYPE_CHECKING, Any, NoReturn

import jax
from jax.core import Tracer

from . import _compat, _compiled, _graph, _pytree
from ._closure import closure_objects
from ._compat import metadata_of as _metadata_of
from ._compat import raw_value_of as _raw_value_of
from ._errors import AliasError, ClosureError, StructureError, TraceContextError
from ._flatten import (
    DYNAMIC,
    ArgFlat,
    StaticLeaf,
    VarSpec,
    _StructureKey,
    alias_error,
    first_duplicate,
    flatten_arg,
    rebuild,
    recursion_headroom,
    variable_dynamic,
    variable_specs,
    variables_of,
)
from ._hashed import HashedKey
from ._leaves import is_abstract_array, is_array, is_graph_node, is_variable, same_static
from ._paths import format_path
from ._stale import mark_trace_time, stale_write_error

if TYPE_CHECKING:
    from ._callsite import SiteCall


class CallKey(HashedKey):
    """Everything a trace depends on besides array shapes and dtypes."""

    __slots__ = ("positional", "keywords", "lifted", "graph")
    _fields = ("positional", "keywords", "lifted", "graph")

    def __init__(
        self,
        positional: tuple[Any, ...],  # per positional argument: structure key or ("static", v)
        keywords: tuple[tuple[str, Any], ...],
        lifted: tuple[VarSpec, ...],
        graph: bool,
    ):
        self.positional = positional
        self.keywords = keywords
        self.lifted = lifted
        self.graph = graph
        self._hash_fields()


class Call:
    """One transform call, prepared outside the JAX transform."""

    __slots__ = (
        "transform",
        "fn",
        "graph",
        "args",
        "kwargs",
        "static_positional",
        "static_keywords",
        "arg_flats",
        "kw_names",
        "lifted",
        "lifted_specs",
        "lifted_roots",
        "dynamic",
        "variables",
        "sources",
        "key",
    )

    transform: str
    fn: Callable[..., Any]
    graph: bool
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    static_positional: dict[int, Any]
    static_keywords: dict[str, Any]
    arg_flats: list[ArgFlat]
    kw_names: tuple[str, ...]
    lifted: list[Any]
    lifted_specs: tuple[VarSpec, ...]
    lifted_roots: list[tuple[str, Any]]
    dynamic: list[Any]
    variables: list[Any]
    sources: list[ArgFlat]  # the flattenings ``variables`` come from, in order
    key: CallKey

    def full(self) -> Call:
        """This call (a `SiteCall` builds its `Call` here; see ``_callsite``)."""
        return self

    def arg_roots(self) -> list[tuple[str, Any]]:
        """``(display name, tree as flattened)`` for every traced argument."""
        names = [f"args[{i}]" for i in range(len(self.args)) if i not in self.static_positional]
        pos = [a for i, a in enumerate(self.args) if i not in self.static_positional]
        kw = {name: self.kwargs[name] for name in self.kw_names}
        if self.graph:
            pos, kw = _graph.to_tree((pos, kw))
        names += [f"kwargs[{name!r}]" for name in self.kw_names]
        return list(zip(names, [*pos, *(kw[n] for n in self.kw_names)], strict=True))

    def traced_roots(
        self, argnums: frozenset[int] | set[int], argnames: frozenset[str] | set[str] = frozenset()
    ) -> list[int]:
        """Indices into ``arg_flats`` of the positional ``argnums`` and keyword ``argnames``."""
        roots: list[int] = []
        k = 0
        for i in range(len(self.args)):
            if i in self.static_positional:
                continue
            if i in argnums:
                roots.append(k)
            k += 1
        roots += [k + j for j, name in enumerate(self.kw_names) if name in argnames]
        return roots

    def root_dynamic_ranges(self) -> list[range]:
        """Per traced argument (``arg_flats`` order), its slice of ``dynamic``."""
        ranges: list[range] = []
        start = 0
        for flat in self.arg_flats:
            ranges.append(range(start, start + len(flat.dynamic)))
            start += len(flat.dynamic)
        return ranges

    def root_variable_ranges(self) -> list[range]:
        """Per traced argument (``arg_flats`` order), its slice of ``variables``."""
        ranges: list[range] = []
        start = 0
        for flat in self.arg_flats:
            ranges.append(range(start, start + len(flat.variables)))
            start += len(flat.variables)
        return ranges

    def variable_dynamic_ranges(self) -> list[range]:
        """Per Variable (``variables`` order, closure ones last), its slice of ``dynamic``."""
        ranges: list[range] = []
        offset = 0
        for flat in self.arg_flats:
            counts = iter(flat.var_dynamic_counts)
            for spec in flat.specs:
                if type(spec) is VarSpec:
                    n = next(counts)
                    ranges.append(range(offset, offset + n))
                    offset += n
                elif spec is DYNAMIC:
                    offset += 1
        for spec in self.lifted_specs:
            ranges.append(range(offset, offset + spec.num_dynamic))
            offset += spec.num_dynamic
        return ranges

    def variable_paths(self) -> list[str]:
        """Display path of every Variable in ``self.variables`` (error path only)."""
        paths: list[str] = []
        for root, tree in self.arg_roots() + self.lifted_roots:
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
                if is_variable(leaf):
                    paths.append(format_path(path, root))
        return paths

    def first_paths(self) -> dict[int, str]:
        """Variable id -> the first display path it is reachable at."""
        ids: dict[int, str] = {}
        for root, tree in self.arg_roots() + self.lifted_roots:
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
                if is_variable(leaf):
                    ids.setdefault(id(leaf), format_path(path, root))
        return ids


def _static_value(transform: str, where: str, value: Any) -> tuple[str, Any]:
    try:
        hash(value)
    except TypeError as e:
        from ._errors import StaticArgumentError

        raise StaticArgumentError(
            f"treemode.{transform}: static argument {where} of type "
            f"{type(value).__name__} is not hashable, so it cannot be part of the "
            "cache key. Make it hashable (a tuple instead of a list, a frozen "
            "dataclass) or pass it as a traced argument."
        ) from e
    return ("static", value)


def prepare(
    transform: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    graph: bool = False,
    static_argnums: frozenset[int] = frozenset(),
    static_argnames: frozenset[str] = frozenset(),
    abstract: bool = False,
    lift_closure: bool = True,
) -> Call:
    """Flatten the inputs of one transform call and check them for aliases."""
    is_dynamic = is_abstract_array if abstract else is_array
    call = Call()
    call.transform = transform
    call.fn = fn
    call.graph = graph
    call.args = tuple(args)
    call.kwargs = kwargs
    call.static_positional = {}
    call.static_keywords = {}
    if not (graph or static_argnums or static_argnames):
        # The hot path (jit calls in a training loop): no static arguments.
        n_args = len(call.args)
        names = tuple(sorted(kwargs)) if kwargs else ()
        try:
            flats = [flatten_arg(a, is_dynamic) for a in call.args]
            if names:
                flats += [flatten_arg(kwargs[name], is_dynamic) for name in names]
        except RecursionError:
            raise _too_deep(call) from None
        call.arg_flats = flats
        call.kw_names = names
        if names:
            pos_keys = tuple(map(_key_of, flats[:n_args]))
            kw_keys = tuple(zip(names, map(_key_of, flats[n_args:]), strict=True))
        else:
            pos_keys, kw_keys = tuple(map(_key_of, flats)), ()
        return _finish_prepare(call, pos_keys, kw_keys, is_dynamic, lift_closure)
    traced_pos: list[Any] = []
    for i, a in enumerate(call.args):
        if i in static_argnums:
            call.static_positional[i] = a
        else:
            traced_pos.append(a)
    traced_kw: dict[str, Any] = {}
    for name in sorted(kwargs):
        if name in static_argnames:
            call.static_keywords[name] = kwargs[name]
        else:
            traced_kw[name] = kwargs[name]
    if graph:
        # One to_tree over all arguments, so sharing across arguments is encoded.
        try:
            traced_pos, traced_kw = _graph.to_tree((traced_pos, traced_kw))
        except (RecursionError, _graph.CycleError):
            raise _too_deep(call) from None
    pos_trees = iter(traced_pos)
    positional: list[Any] = []
    arg_flats: list[ArgFlat] = []
    for i, a in enumerate(call.args):
        if i in call.static_positional:
            positional.append(_static_value(transform, f"args[{i}]", a))
            continue
        try:
            flat = flatten_arg(next(pos_trees), is_dynamic)
        except RecursionError:
            raise _too_deep(call) from None
        arg_flats.append(flat)
        positional.append(flat.key)
    keywords: list[tuple[str, Any]] = []
    kw_names: list[str] = []
    for name in sorted(kwargs):
        if name in call.static_keywords:
            keywords.append((name, _static_value(transform, f"kwargs[{name!r}]", kwargs[name])))
            continue
        try:
            flat = flatten_arg(traced_kw[name], is_dynamic)
        except RecursionError:
            raise _too_deep(call) from None
        arg_flats.append(flat)
        kw_names.append(name)
        keywords.append((name, flat.key))
    call.arg_flats = arg_flats
    call.kw_names = tuple(kw_names)
    return _finish_prepare(call, tuple(positional), tuple(keywords), is_dynamic, lift_closure)


def _too_deep(call: Call) -> StructureError:
    """A RecursionError while flattening the arguments: a cycle, or too deep."""
    roots = [(f"args[{i}]", a) for i, a in enumerate(call.args)]
    roots += [(f"kwargs[{name!r}]", v) for name, v in sorted(call.kwargs.items())]
    return _graph.recursion_error(call.transform, roots)


def _finish_prepare(
    call: Call,
    positional: tuple[Any, ...],
    keywords: tuple[tuple[str, Any], ...],
    is_dynamic: Callable[[Any], bool],
    lift_closure: bool,
) -> Call:
    """Closure lifting, the call key and the alias check, shared by both paths."""
    arg_flats = call.arg_flats
    sources = [f for f in arg_flats if f.variables]
    dynamic = list(chain.from_iterable(map(_dynamic_of, arg_flats)))
    call.lifted_roots = []
    lifted_flats: list[ArgFlat] = []
    if lift_closure:
        call.lifted_roots = [(f"closure {name}", obj) for name, obj in closure_objects(call.fn)]
        for _, obj in call.lifted_roots:
            flat = flatten_arg(obj, is_dynamic)
            if flat.variables:
                lifted_flats.append(flat)
    if lifted_flats:
        call.lifted = list(chain.from_iterable(f.variables for f in lifted_flats))
        call.lifted_specs = tuple(chain.from_iterable(map(variable_specs, lifted_flats)))
        for flat in lifted_flats:
            if flat.values_only:
                dynamic += flat.dynamic
            else:
                for var, spec in zip(flat.variables, variable_specs(flat), strict=True):
                    dynamic.extend(variable_dynamic(var, spec))
        sources += lifted_flats
    else:
        call.lifted = []
        call.lifted_specs = ()
    call.sources = sources
    call.variables = variables_of(sources)
    call.dynamic = dynamic
    call.key = CallKey(positional, keywords, call.lifted_specs, call.graph)

    # Each ArgFlat is alias-free on its own (checked once when it was built);
    # only Variables shared between sources remain to be found.
    if len(sources) == 1:
        aliased = sources[0].has_aliases
    else:
        aliased = any(map(_has_aliases_of, sources)) or (
            len(sources) > 1 and _shares_variables(sources)
        )
    if aliased:
        _raise_alias(call)
    return call


_key_of = operator.attrgetter("key")
_dynamic_of = operator.attrgetter("dynamic")
_has_aliases_of = operator.attrgetter("has_aliases")


# Whether a combination of Variable-id sets overlaps, memoized: a training loop
# passes the same cached arguments (so the same frozensets) on every call.
_overlap_memo: dict[tuple[frozenset[int], ...], bool] = {}
_OVERLAP_MEMO_SIZE = 256


def _shares_variables(sources: list[ArgFlat]) -> bool:
    ids = tuple(f.variable_ids for f in sources)
    shared = _overlap_memo.get(ids)
    if shared is None:
        shared = len(frozenset().union(*ids)) != sum(map(len, ids))
        if len(_overlap_memo) >= _OVERLAP_MEMO_SIZE:
            _overlap_memo.clear()
        _overlap_memo[ids] = shared
    return shared


def _raise_alias(call: Call) -> None:
    duplicate = first_duplicate(call.arg_roots() + call.lifted_roots)
    assert duplicate is not None, "duplicate Variable not found"
    leaf, first, where = duplicate
    if first.startswith("closure") != where.startswith("closure"):
        raise ClosureError(
            f"treemode.{call.transform}: the {type(leaf).__name__} at {where} "
            f"is reachable both as an argument and through the function's "
            f"closure ({first}). Pass the module only as an argument (or "
            "only through the closure), so that there is one place to write "
            "its updates back to."
        )
    raise alias_error(call.transform, leaf, first, where)


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
class TraceRecord:
    """What a trace learned that is not an array: metadata changes."""

    metadata_updates: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


_Binding = threading.local  # the call a PureFunction runs, per thread


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
        self.fn = call.fn
        self.transform = call.transform
        self.key = call.key
        self.graph = call.graph
        self.static_positional = dict(call.static_positional)
        self.static_keywords = dict(call.static_keywords)
        self.num_args = len(call.args)
        self.kw_names = call.kw_names
        self.force = force_updates
        self.allow_output_variables = allow_output_variables
        self.record = TraceRecord()
        # The current Call in ``binding.call``, per thread so concurrent calls do
        # not see each other. `bind` sets it; a hot path may set it directly.
        self.binding = _Binding()

    def bind(self, call: Call | SiteCall | None) -> None:
        self.binding.call = call

    @property
    def call(self) -> Call:
        call = getattr(self.binding, "call", None)
        assert call is not None, "PureFunction traced outside of a treemode call"
        return call.full()

    def rebuild_inputs(self, dynamic: Sequence[Any]) -> Inputs:
        """Arguments (as the user function sees them) rebuilt from dynamic arrays."""
        offset = 0
        leaves_in: list[list[Any]] = []
        pure_trees: list[Any] = []
        inner_vars: list[Any] = []
        flat_keys = [k for k in self.key.positional if isinstance(k, _StructureKey)]
        flat_keys += [k for _, k in self.key.keywords if isinstance(k, _StructureKey)]
        for key in flat_keys:
            n = _num_dynamic(key)
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

    def __call__(self, *dynamic: Any) -> tuple[Any, tuple[Any, ...]]:
        # Deep modules: rebuilding and checking them recurses like flattening.
        with recursion_headroom():
            return self._run(dynamic)

    def _run(self, dynamic: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
        call = self.call
        inputs = self.rebuild_inputs(dynamic)
        mark_trace_time(self, inputs.variables)  # writes from another trace: MutationError
        swapped = _swap_in(call.lifted, self.key.lifted, dynamic[inputs.consumed :])
        try:
            out = self.fn(*inputs.args, **inputs.kwargs)
            self._check_structure(call, inputs, out)
            out_tree = _graph.to_tree(out) if self.graph else out
            all_vars = inputs.variables + call.lifted
            self._check_outputs(call, out_tree, all_vars)
            updates = self._collect_updates(call, all_vars, dynamic)
        finally:
            _swap_out(swapped)
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
            leaves, treedef = jax.tree_util.tree_flatten(after, is_leaf=is_variable)
            problem = None
            owners = returned = None  # treemode.Pytree proxies; computed on a change only
            if treedef != key.treedef:
                problem = describe_structure_change(before, after)
            else:
                for j, (leaf, spec) in enumerate(zip(leaves, key.specs, strict=True)):
                    if type(spec) is VarSpec:
                        if leaf is not next(var_iter):
                            problem = (_leaf_path(after, j), _replaced(leaf, spec.var_type))
                            break
                    elif spec is DYNAMIC and leaf is not leaves_in[j]:
                        if owners is None:
                            owners = _pytree.proxy_leaf_owners(after)
                            returned = _pytree.returned_proxies(out)
                        owner = owners[j]
                        if owner is not None and returned and id(owner[1]) in returned:
                            continue  # a returned proxy carries its new state itself
                        if owner is not None:
                            raise StructureError(
                                _pytree.unreturned_proxy_message(
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
                    "the new object as an output."
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
        if kind == "input":
            assert index is not None
            in_path = call.variable_paths()[index]
            raise AliasError(
                f"treemode.{self.transform}: the function returns the "
                f"{type(var).__name__} that is also its input {in_path} (returned "
                f"at {out_paths[0]}).\n"
                "Tree mode cannot return an input Variable: it would come back as an "
                "independent copy. Return its value instead (e.g. `var[...]`), or "
                "return a new module built inside the function."
            )
        raise AliasError(
            f"treemode.{self.transform}: the function returns the same "
            f"{type(var).__name__} twice, at {out_paths[0]} and {out_paths[1]}.\n"
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
            value, metadata = _raw_value_of(var), _metadata_of(var)
            changed = _value_changed(value, before)
            if tuple(sorted(metadata.items())) != spec.metadata:
                metadata_updates[i] = dict(metadata)
            updates.append(value if (changed or i in self.force) else None)
        self.record.metadata_updates = metadata_updates
        return tuple(updates)

    def _flat_keys(self) -> list[_StructureKey]:
        keys = [k for k in self.key.positional if isinstance(k, _StructureKey)]
        keys += [k for _, k in self.key.keywords if isinstance(k, _StructureKey)]
        return keys


def _leaf_path(tree: Any, index: int) -> tuple[Any, ...]:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0][index][0]


def _replaced(leaf: Any, old_type: type) -> str:
    if type(leaf) is old_type:
        return f"the {old_type.__name__} was replaced by a new {old_type.__name__}"
    return f"the {old_type.__name__} was replaced by a {type(leaf).__name__}"


def _num_dynamic(key: _StructureKey) -> int:
    n = 0
    for spec in key.specs:
        if type(spec) is VarSpec:
            n += spec.num_dynamic
        elif spec is DYNAMIC:
            n += 1
    return n


def _value_changed(after: Any, before: Any) -> bool:
    if after is before:
        return False
    a_leaves, a_def = jax.tree_util.tree_flatten(after)
    b_leaves, b_def = jax.tree_util.tree_flatten(before)
    if a_def != b_def or len(a_leaves) != len(b_leaves):
        return True
    return any(x is not y for x, y in zip(a_leaves, b_leaves, strict=True))


def _swap_in(
    lifted: list[Any], specs: tuple[VarSpec, ...], dynamic: Sequence[Any]
) -> list[tuple[Any, Any, Any]]:
    """Point closure Variables at traced values; return what to restore."""
    swapped: list[tuple[Any, Any, Any]] = []
    offset = 0
    try:
        for var, spec in zip(lifted, specs, strict=True):
            n = spec.num_dynamic
            value = spec.build(dynamic[offset : offset + n])
            offset += n
            swapped.append((var, _raw_value_of(var), _compat.trace_state_of(var)))
            _compat.set_raw_value(var, value)
            _compat.set_trace_state(var, _compat.TraceState())
    except BaseException:
        _swap_out(swapped)
        raise
    return swapped


def _swap_out(swapped: list[tuple[Any, Any, Any]]) -> None:
    for var, value, trace_state in swapped:
        _compat.set_raw_value(var, value)
        _compat.set_trace_state(var, trace_state)


def describe_structure_change(
    before: Any, after: Any, *, leaf_changed: bool = False
) -> tuple[tuple[Any, ...], str]:
    """The first place where ``after`` differs structurally from ``before``."""
    result = _diff((), before, after)
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


def _diff(path: tuple[Any, ...], a: Any, b: Any) -> tuple[tuple[Any, ...], str] | None:
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
                return path, f"a {type(a).__name__} was replaced by a {type(b).__name__}"
            if not same_static(a, b):
                return path, f"the static value {a!r} was changed to {b!r}"
            return None
        return path, f"a {type(a).__name__} was replaced by a {type(b).__name__}"
    (ta, aux_a), ca = la
    (tb, aux_b), cb = lb
    if ta is not tb:
        return path, f"a {ta.__name__} was replaced by a {tb.__name__}"
    keys_a = [k for k, _ in ca]
    keys_b = [k for k, _ in cb]
    if keys_a != keys_b:
        for k in keys_b:
            if k not in keys_a:
                return (*path, k), "a new entry was added"
        for k in keys_a:
            if k not in keys_b:
                return (*path, k), "the entry was deleted"
    for (k, x), (_, y) in zip(ca, cb, strict=True):
        found = _diff((*path, k), x, y)
        if found is not None:
            return found
    if not same_static(aux_a, aux_b):
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
    return None


def check_writable(call: Call | SiteCall, updates: Sequence[Any]) -> None:
    """Raise before writing anything if a target Variable belongs to another trace."""
    # A Variable may be written in the trace it was created in (as Variable itself
    # checks). Fast path: the traces' weak references compared by identity, and
    # remembered per cached argument (a Variable's trace never changes).
    ref = current_trace_ref()
    if ref is not None and all(_writable_in(ref, flat) for flat in call.sources):
        return
    current = _compat.current_jax_trace()
    targets = [var for var, new in zip(call.variables, updates, strict=True) if new is not None]
    for var in targets:
        if _compat.jax_trace_of(_compat.trace_state_of(var)) != current and not var.hijax:
            index = next(i for i, v in enumerate(call.variables) if v is var)
            path = call.full().variable_paths()[index]
            raise TraceContextError(
                f"treemode.{call.transform}: cannot write the new value of the "
                f"{type(var).__name__} at {path} back: the Variable was created outside "
                "the JAX transform that is currently tracing (for example a module closed "
                "over by jax.jit or jax.lax.scan), so storing a traced value in it would "
                "leak a tracer.\nPass the module as an argument of that outer transform "
                "(e.g. treemode.jit instead of jax.jit over a closure)."
            )


def _writable_in(ref: Any, flat: ArgFlat) -> bool:
    """Whether every Variable of ``flat`` was created in the trace behind ``ref``."""
    entry = flat.origin or flat  # remembered on the cache entry
    if entry.writable_in is ref:
        return True
    writable = all(map(operator.is_, map(_trace_ref_of, flat.variables), repeat(ref)))
    if writable:
        entry.writable_in = ref
    return writable


_trace_ref_of = _compat.trace_ref_of


def write_back(
    call: Call | SiteCall,
    updates: Sequence[Any],
    metadata_updates: dict[int, dict[str, Any]] | None = None,
) -> None:
    """Store the changed values into the caller's Variables, all or nothing."""
    if not metadata_updates and store is DEFAULT_STORE and _write_changed is not None:
        # The common case, in one C pass: new values only, with the default hook.
        if any(map(operator.is_not, updates, repeat(None))):
            check_writable(call, updates)
            _write_changed(call.variables, updates)
        return
    changed = list(map(operator.is_not, updates, repeat(None)))
    if not metadata_updates and not any(changed):
        return  # the no-update path (a forward pass): nothing to check or write
    if all(changed):  # a train step: every Variable changed
        targets, values = list(call.variables), list(updates)
    else:
        targets = list(compress(call.variables, changed))
        values = list(compress(updates, changed))
    check_writable(call, updates)
    old_values = list(map(_raw_value_of, targets))
    meta_targets = [call.variables[i] for i in metadata_updates] if metadata_updates else []
    old_meta = [(var, _raw_value_of(var), _metadata_of(var)) for var in meta_targets]
    try:
        if store is DEFAULT_STORE:
            # The default hook, in one C-level pass (no interrupt can land midway).
            list(map(_setattr, targets, repeat(_compat.RAW_VALUE), values))
        else:
            for var, value in zip(targets, values, strict=True):
                store(var, value)
        if metadata_updates:
            for var, metadata in zip(meta_targets, metadata_updates.values(), strict=True):
                store(var, _raw_value_of(var), dict(metadata))
    except BaseException:
        for var, value in zip(targets, old_values, strict=True):
            _setattr(var, _compat.RAW_VALUE, value)
        for var, value, metadata in old_meta:
            _restore(var, value, metadata)
        raise


_setattr = object.__setattr__

_write_changed = _compiled.write_changed  # the compiled writes; None: the loop above

# The current trace's weak reference (`_compat.current_trace_ref`); kept as a name
# here because the compiled call path reads the same object (`_compiled.Layout`).
current_trace_ref = _compat.current_trace_ref


def store(var: Any, value: Any, metadata: dict[str, Any] | None = None) -> None:
    """Write one Variable (bypassing the trace-level check done by ``check_writable``).

    The one place Variables are written, so tests can inject faults here; while
    it is not replaced, `write_back` does the same writes in bulk.
    """
    _compat.set_raw_value(var, value)
    if metadata is not None:
        _compat.set_metadata(var, metadata)


DEFAULT_STORE = store  # the compiled write path runs only while `store` is this one


def _restore(var: Any, value: Any, metadata: dict[str, Any]) -> None:
    _compat.set_raw_value(var, value)
    _compat.set_metadata(var, metadata)


@contextlib.contextmanager
def bound(pure: PureFunction, call: Call):
    """Make ``call`` visible to ``pure`` while a JAX transform may trace it."""
    pure.bind(call)
    try:
        yield
    except (RuntimeError, jax.errors.UnexpectedTracerError) as e:
        raise_explained(call, e)
    finally:
        pure.bind(None)


def raise_explained(call: Call | SiteCall, error: BaseException) -> NoReturn:
    """Raise ``error``, or the treemode error `explain_failure` finds behind it."""
    if isinstance(error, (RuntimeError, jax.errors.UnexpectedTracerError)):
        better = explain_failure(call.full(), error)
        if better is not None:
            raise better from error
    raise error


def explain_failure(call: Call, error: BaseException) -> Exception | None:
    """A treemode error naming the input behind a JAX failure, if there is one.

    Called only after JAX raised: an input array that was deleted (donated to
    an earlier call), or an input holding a tracer of a trace that has ended
    (a module created or changed inside a transform and kept outside it).
    """
    from ._errors import DonationError

    stale = stale_write_error(error)  # a host callback wrote a trace-time Variable
    if stale is not None:
        return stale
    for root, tree in call.arg_roots() + call.lifted_roots:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
            values = jax.tree_util.tree_leaves(_raw_value_of(leaf) if is_variable(leaf) else leaf)
            where = format_path(path, root)
            what = f"the {type(leaf).__name__} at {where}" if is_variable(leaf) else where
            for x in values:
                if isinstance(error, jax.errors.UnexpectedTracerError) and isinstance(x, Tracer):
                    return TraceContextError(
                        f"treemode.{call.transform}: {what} holds a value traced by a JAX "
                        "transform that has already returned (the module was created or "
                        "changed inside a transform and kept outside it, e.g. appended to a "
                        "list). Return new modules from the transform instead of storing "
                        "them, and rebuild this one outside any transform."
                    )
                if isinstance(x, jax.Array) and not isinstance(x, Tracer):
                    if x.is_deleted():
                        return DonationError(
                            f"treemode.{call.transform}: the buffer of {what} was deleted: it "
                            "was donated to an earlier call (donate_argnums) while this "
                            "argument shared it. Give each module its own buffers with "
                            "treemode.clone(module, arrays=True) before donating."
                        )
    return None


def finish(call: Call, out: Any) -> Any:
    """Turn the transform's output tree back into objects (graph mode)."""
    return _graph.from_tree(out) if call.graph else out


__all__ = [
    "Call",
    "CallKey",
    "PureFunction",
    "bound",
    "prepare",
    "write_back",
    "finish",
    "is_graph_node",
]
