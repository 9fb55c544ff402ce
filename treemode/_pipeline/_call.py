"""Call preparation, outside the JAX transform: step 1 of the pipeline.

`prepare` flattens each argument with Variables as leaves (cached per argument
object; with ``graph=True`` the arguments first go through ``to_tree``), finds
the Variables the function reaches through its closure and lifts them into
extra inputs, rejects aliases (one Variable reachable twice) and builds the
`CallKey` a trace is cached under. The result is a `Call`; other transforms'
calls (a loop's, a branch's) offer the same `PreparedCall` interface.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any, Protocol

import jax

from .. import _caches
from .._compat import take_flax_static_cache
from .._errors import ClosureError, CycleError, StaticArgumentError, StructureError
from .._tree import _graph
from .._tree._aliases import alias_error, first_duplicate
from .._tree._closure import closure_objects
from .._tree._flatten import ArgFlat, flatten_arg, variable_specs, variables_of
from .._tree._hashed import HashedKey
from .._tree._leaves import is_abstract_traced, is_traced, is_variable
from .._tree._paths import format_path, paths_and_leaves
from .._tree._recursion import recursion_error, recursion_headroom
from .._tree._specs import DYNAMIC, StaticLeaf, StructureKey, VarSpec, variable_dynamic


class PreparedCall(Protocol):
    """What running and writing back need of a call (a `Call`, or another transform's).

    ``variables`` are every input Variable in the order of the updates,
    ``sources`` the flattenings they come from, ``dynamic`` the arrays handed
    to JAX. `full` gives the whole `Call` (prepared once, on demand), for a
    retrace or an error message.
    """

    @property
    def transform(self) -> str: ...

    @property
    def graph(self) -> bool: ...

    @property
    def dynamic(self) -> Sequence[Any]: ...

    @property
    def sources(self) -> list[ArgFlat]: ...

    @property
    def variables(self) -> list[Any]: ...

    def full(self) -> Call: ...


class CallKey(HashedKey):
    """Everything a trace depends on besides array shapes and dtypes."""

    __slots__ = ("positional", "keywords", "lifted", "closure", "graph")
    _fields = ("positional", "keywords", "lifted", "closure", "graph")

    def __init__(
        self,
        positional: tuple[Any, ...],  # per positional argument: structure key or StaticLeaf
        keywords: tuple[tuple[str, Any], ...],
        lifted: tuple[VarSpec, ...],
        graph: bool,
        closure: tuple[StructureKey, ...] = (),
    ):
        self.positional = positional
        self.keywords = keywords
        self.lifted = lifted
        # The structure of each object found in the closure (its classes and static
        # attributes): the trace reads them from a copy rebuilt with this structure.
        self.closure = closure
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
        "lifted_objects",
        "closure_aliases",
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
    lifted_objects: list[tuple[str, Any, ArgFlat]]  # (root name, object, flattening)
    # Closure objects that are the arguments' own (not lifted): (root name, object, where)
    closure_aliases: tuple[tuple[str, Any, ArgumentNode], ...]
    dynamic: list[Any]
    variables: list[Any]
    sources: list[ArgFlat]  # the flattenings ``variables`` come from, in order
    key: CallKey

    def full(self) -> Call:
        """This call, whole (for a retrace or an error message)."""
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

    def arg_objects(self) -> list[tuple[str, Any]]:
        """``(display name, object as passed)`` for every traced argument (as
        `arg_roots`, before ``to_tree`` in graph mode)."""
        names = [f"args[{i}]" for i in range(len(self.args)) if i not in self.static_positional]
        pos = [a for i, a in enumerate(self.args) if i not in self.static_positional]
        names += [f"kwargs[{name!r}]" for name in self.kw_names]
        return list(zip(names, [*pos, *(self.kwargs[n] for n in self.kw_names)], strict=True))

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

    def paths_and_leaves(self) -> Iterator[tuple[str, Any]]:
        """``(display path, leaf)`` for every leaf of the traced arguments and lifted
        closure objects, Variables as leaves, in flattening order (error path only)."""
        return paths_and_leaves(self.arg_roots() + self.lifted_roots)

    def variable_paths(self) -> list[str]:
        """Display path of every Variable in ``self.variables`` (error path only)."""
        return [where for where, leaf in self.paths_and_leaves() if is_variable(leaf)]


def _static_value(transform: str, where: str, value: Any) -> StaticLeaf:
    try:
        hash(value)
    except TypeError as e:
        raise StaticArgumentError(
            f"treemode.{transform}: static argument {where} of type "
            f"{type(value).__name__} is not hashable, so it cannot be part of the "
            "cache key. Make it hashable (a tuple instead of a list, a frozen "
            "dataclass) or pass it as a traced argument."
        ) from e
    return StaticLeaf(value)  # compared by value and type, as jax.jit does


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
    # nnx.cached_partial leaves a cache for the Flax transform it calls: treemode
    # takes it (so Flax finds it consumed) and runs the call as the plain partial.
    take_flax_static_cache()
    is_dynamic = is_abstract_traced if abstract else is_traced
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
        except (RecursionError, CycleError):
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
    return recursion_error(call.transform, roots)


def _finish_prepare(
    call: Call,
    positional: tuple[Any, ...],
    keywords: tuple[tuple[str, Any], ...],
    is_dynamic: Callable[[Any], bool],
    lift_closure: bool,
) -> Call:
    """Closure lifting, the call key and the alias check, shared by both paths."""
    call.closure_aliases = ()
    found: list[tuple[str, Any]] = []
    if lift_closure:
        found = closure_objects(call.fn, call.transform)
        if found and any(name.startswith("default ") for name, _ in found):
            found = _without_passed_defaults(call, found)
    closure_keys = _lift(call, found, is_dynamic)
    aliased = _aliased(call.sources)
    if aliased and call.lifted_objects:
        # A closure object that is one of the arguments' own objects (the
        # ``self.model`` of a trainer whose step takes ``model``) is not lifted:
        # the trace reaches the argument's rebuilt object by the closure's route.
        aliases = closure_aliases(call)
        if aliases:
            call.closure_aliases = tuple(aliases)
            aliased_ids = {id(obj) for _, obj, _ in aliases}
            closure_keys = _lift(call, found, is_dynamic, aliased_ids)
            aliased = _aliased(call.sources)
    call.key = CallKey(positional, keywords, call.lifted_specs, call.graph, closure_keys)
    if aliased:
        _raise_alias(call)
    return call


def _lift(
    call: Call,
    found: list[tuple[str, Any]],
    is_dynamic: Callable[[Any], bool],
    aliased_ids: set[int] | None = None,
) -> tuple[Any, ...]:
    """Lift the closure objects ``found`` (all but ``aliased_ids``, the closure
    aliases of argument objects): set the call's lifted fields, ``sources``,
    ``variables`` and ``dynamic``; return the closure part of the call key."""
    arg_flats = call.arg_flats
    sources = [f for f in arg_flats if f.variables]
    dynamic = list(chain.from_iterable(map(_dynamic_of, arg_flats)))
    call.lifted_roots = []
    call.lifted_objects = []
    lifted_flats: list[ArgFlat] = []
    closure_keys: tuple[Any, ...] = ()
    if found:
        keys: list[Any] = []
        aliases = {id(obj): node for _, obj, node in call.closure_aliases}
        for name, obj in found:
            root = f"closure {name}"
            if aliased_ids is not None and id(obj) in aliased_ids:
                keys.append(ArgumentAlias(*aliases[id(obj)].key))
                continue
            call.lifted_roots.append((root, obj))
            flat = flatten_arg(obj, is_dynamic)
            keys.append(flat.key)
            if flat.variables:
                lifted_flats.append(flat)
                call.lifted_objects.append((root, obj, flat))
        closure_keys = tuple(keys)
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
    return closure_keys


class ArgumentNode:
    """Where a closure object sits among the arguments: the ``k``-th traced
    argument flattened up to it (``up_to``), at leaf ``index``."""

    __slots__ = ("k", "up_to", "index", "path")

    def __init__(self, k: int, up_to: Any, index: int, path: str):
        self.k = k
        self.up_to = up_to
        self.index = index
        self.path = path

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.k, self.index, self.up_to.num_leaves, self.up_to.num_nodes)

    def find(self, tree: Any) -> Any:
        """The object at this place in ``tree`` (an argument rebuilt in a trace)."""
        return self.up_to.flatten_up_to(tree)[self.index]


class ArgumentAlias(HashedKey):
    """The closure part of a `CallKey` for a closure object that is an argument's."""

    __slots__ = ("k", "index", "num_leaves", "num_nodes")
    _fields = ("k", "index", "num_leaves", "num_nodes")

    def __init__(self, k: int, index: int, num_leaves: int, num_nodes: int):
        self.k = k
        self.index = index
        self.num_leaves = num_leaves
        self.num_nodes = num_nodes
        self._hash_fields()


def closure_aliases(call: Call) -> list[tuple[str, Any, ArgumentNode]]:
    """The closure objects found for ``call`` that are objects of its arguments.

    ``(root name, object, where)`` for each lifted NNX object (or Variable)
    that is an argument itself or an object inside one (reached through
    attributes, lists and dicts as the argument is flattened). Such an object
    is one set of Variables with the argument: the trace hands the closure's
    route the argument's rebuilt object. An object that only shares some
    Variables with an argument (it holds the argument, or a Variable of it)
    is not one of these: lifting it would make two copies, and the alias
    check refuses it.
    """
    aliases: list[tuple[str, Any, ArgumentNode]] = []
    roots = call.arg_objects()
    for root, obj, flat in call.lifted_objects:
        for k, arg_flat in enumerate(call.arg_flats):
            # (graph=True: an argument's flattening is its to_tree form, which
            # encodes a Variable shared between arguments once.)
            if not call.graph and arg_flat.variable_ids.isdisjoint(flat.variable_ids):
                continue
            where = _argument_node(roots[k][1], obj, k, roots[k][0])
            if where is not None:
                aliases.append((root, obj, where))
                break
    return aliases


def _argument_node(tree: Any, obj: Any, k: int, name: str) -> ArgumentNode | None:
    """Where ``obj`` sits inside the argument ``tree`` (``None``: not one of its objects)."""

    def stop(x: Any) -> bool:
        return x is obj or is_variable(x)

    with recursion_headroom():
        with_paths, up_to = jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop)
    for index, (path, leaf) in enumerate(with_paths):
        if leaf is obj:
            return ArgumentNode(k, up_to, index, format_path(path, name))
    return None


def _aliased(sources: list[ArgFlat]) -> bool:
    """Whether a Variable is reachable twice from ``sources`` (each flattening is
    alias-free on its own, checked once when it was built)."""
    if len(sources) == 1:
        return sources[0].has_aliases
    return any(map(_has_aliases_of, sources)) or (len(sources) > 1 and _shares_variables(sources))


def _without_passed_defaults(call: Call, found: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Drop default arguments that this call passes explicitly (they are arguments then)."""
    passed = {id(a) for a in call.args} | {id(v) for v in call.kwargs.values()}
    return [(n, o) for n, o in found if not (n.startswith("default ") and id(o) in passed)]


_key_of = operator.attrgetter("key")
_dynamic_of = operator.attrgetter("dynamic")
_has_aliases_of = operator.attrgetter("has_aliases")


# Whether a combination of Variable-id sets overlaps, memoized: a training loop
# passes the same cached arguments (so the same frozensets) on every call.
_overlap_memo: dict[tuple[frozenset[int], ...], bool] = {}
_caches.register(_overlap_memo.clear)
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
        argument, closure = (where, first) if first.startswith("closure") else (first, where)
        holder = next(
            (r for r, _ in call.lifted_roots if closure == r or closure.startswith(r + ".")),
            closure,
        )
        name = holder.removeprefix("closure ")
        raise ClosureError(
            f"treemode.{call.transform}: the {type(leaf).__name__} at {closure} "
            f"is reachable both as an argument ({argument}) and through the "
            f"function's closure, inside {name}, which is not itself one of the "
            "arguments' objects: lifting it would make a second copy of these "
            "Variables, and one of the updates would be lost. (A closure object "
            "that is an argument, or an object inside one, is fine: the trace "
            f"reaches the argument's.) If {name} owns the module, pass it as an "
            "argument instead of the module and reach the module through it; or "
            "pass the module only through the closure."
        )
    raise alias_error(
        call.transform, leaf, first, where, roots=call.arg_roots(), parameters=_parameters(call)
    )


def _parameters(call: Call) -> dict[str, str]:
    """The function's parameter behind each argument root (error path only)."""
    try:
        signature = inspect.signature(call.fn)
        bound = signature.bind_partial(*call.args, **call.kwargs)
    except (TypeError, ValueError):  # no signature, or not one these arguments fit
        return {}
    names: dict[str, str] = {}
    position = 0
    for parameter, value in bound.arguments.items():
        kind = signature.parameters[parameter].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            for i in range(len(value)):
                names[f"args[{position + i}]"] = f"{parameter}[{i}]"
            position += len(value)
        elif parameter in call.kwargs:
            names[f"kwargs[{parameter!r}]"] = parameter
        elif kind is not inspect.Parameter.VAR_KEYWORD:
            names[f"args[{position}]"] = parameter
            position += 1
    return names


__all__ = ["Call", "CallKey", "PreparedCall", "prepare"]
