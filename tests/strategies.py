"""Hypothesis strategies: random module trees and random programs over them.

A scenario is pure data (a tree *description* and a *program*), so the same
scenario can be built any number of times into fresh, identical objects: one
copy runs the program eagerly, another runs it through a treemode transform,
and the two end states are compared.

Trees mix nested NNX modules (with static attributes), ``nnx.List`` and
``nnx.Dict``, Python dicts/lists/tuples, Equinox modules (with a static field),
plain arrays, and Variables of several types: ``nnx.Param``, ``nnx.BatchStat``,
a custom ``nnx.Variable`` subclass, integer counters and ``nnx.Rngs``. A
scenario may add a second reference to a Variable, an ``nnx.Rngs`` or a
module, which ``graph=False`` transforms must reject and ``graph=True`` ones
must handle.

Values are small integers in float32 (and random draws), and programs only add,
double and draw, so eager and compiled runs give bit-identical results.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import strategies as st

# -- the objects trees are made of ----------------------------------------------------


class Custom(nnx.Variable):
    """A user-defined Variable type."""


class Count(nnx.Variable):
    """An integer step counter."""


class Node(nnx.Module):
    """A module whose attributes are set by the builder."""

    code = 1.0  # what the "module" op reads: which class the module has


class Block(nnx.Module):
    """A second module class (so module types vary too)."""

    code = 2.0


class Box(eqx.Module):
    children: tuple
    tag: str = eqx.field(static=True)


VAR_TYPES: dict[str, type] = {
    "param": nnx.Param,
    "batch_stat": nnx.BatchStat,
    "custom": Custom,
    "count": Count,
}
MODULE_TYPES: dict[str, type] = {"node": Node, "block": Block}


# -- descriptions ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Var:
    kind: str  # a key of VAR_TYPES
    values: tuple[int, ...]  # one value: a scalar
    uid: int


@dataclasses.dataclass(frozen=True)
class Rngs:
    seed: int
    uid: int


@dataclasses.dataclass(frozen=True)
class Module:
    cls: str  # a key of MODULE_TYPES
    fields: tuple[tuple[str, Any], ...]
    statics: tuple[tuple[str, Any], ...]
    uid: int


@dataclasses.dataclass(frozen=True)
class Container:
    kind: str  # "nlist", "ndict", "list", "dict", "tuple", "eqx"
    items: tuple[tuple[Any, Any], ...]  # (key, child); keys are indices for sequences
    uid: int


@dataclasses.dataclass(frozen=True)
class Array:
    values: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Static:
    value: Any


@dataclasses.dataclass(frozen=True)
class Ref:
    """A second reference to the object built for ``uid``."""

    uid: int


Desc = Var | Rngs | Module | Container | Array | Static | Ref

# A path is a tuple of steps: ("attr", name) or ("item", key).
Path = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Op:
    # "read", "add", "double", "mix", "draw", "draw_into", "static", "array",
    # "type" (which type a Variable has), "module" (which class a module has)
    kind: str
    a: int = 0  # index into Handles.variables / rngs / statics / arrays
    a_path: int = 0  # which of the object's paths to use
    b: int = 0
    b_path: int = 0
    c: int = 0


@dataclasses.dataclass(frozen=True)
class Handles:
    """What a program can reach, by path from the root."""

    variables: tuple[tuple[str, tuple[Path, ...]], ...]  # (kind, paths)
    rngs: tuple[tuple[Path, ...], ...]
    statics: tuple[Path, ...]
    arrays: tuple[Path, ...]
    modules: tuple[Path, ...] = ()  # the nnx.Modules (the "module" op)
    objects: tuple[Path, ...] = ()  # every NNX object (Modules, nnx.List/Dict, Rngs)


@dataclasses.dataclass(frozen=True)
class Scenario:
    tree: Desc
    handles: Handles
    program: tuple[Op, ...]
    shared: bool  # whether some object is reachable twice


# -- building ------------------------------------------------------------------------


def _value(values: tuple[int, ...], dtype: Any, batch: bool) -> jax.Array:
    x = jnp.asarray(values[0] if len(values) == 1 else values, dtype)
    return x[None] if batch else x


def _data(value: Any) -> Any:
    """Mark plain containers stored on NNX objects as data (as Flax requires)."""
    if isinstance(value, (dict, list, tuple, eqx.Module)):
        return nnx.data(value)
    return value


def build(desc: Desc, *, batch: bool = False) -> Any:
    """Fresh objects for ``desc``; ``batch=True`` adds a leading axis of size 1."""
    built: dict[int, Any] = {}

    def make(d: Desc) -> Any:
        if isinstance(d, Ref):
            return built[d.uid]
        if isinstance(d, Static):
            return d.value
        if isinstance(d, Array):
            return _value(d.values, jnp.float32, batch)
        if isinstance(d, Var):
            dtype = jnp.int32 if d.kind == "count" else jnp.float32
            obj = VAR_TYPES[d.kind](_value(d.values, dtype, batch))
        elif isinstance(d, Rngs):
            obj = nnx.Rngs(d.seed)
            if batch:
                stream = obj.default
                stream.key.set_raw_value(stream.key.get_raw_value()[None])
                stream.count.set_raw_value(stream.count.get_raw_value()[None])
        elif isinstance(d, Module):
            obj = MODULE_TYPES[d.cls]()
            for name, value in d.statics:
                setattr(obj, name, value)
            for name, child in d.fields:
                setattr(obj, name, _data(make(child)))
        else:
            assert isinstance(d, Container)
            children = [make(c) for _, c in d.items]
            keys = [k for k, _ in d.items]
            if d.kind == "nlist":
                obj = nnx.List([_data(c) for c in children])
            elif d.kind == "ndict":
                obj = nnx.Dict({k: _data(c) for k, c in zip(keys, children, strict=True)})
            elif d.kind == "dict":
                obj = dict(zip(keys, children, strict=True))
            elif d.kind == "list":
                obj = list(children)
            elif d.kind == "tuple":
                obj = tuple(children)
            else:
                obj = Box(tuple(children), f"box{d.uid}")
        built[d.uid] = obj
        return obj

    return make(desc)


def resolve(root: Any, path: Path) -> Any:
    x = root
    for kind, key in path:
        if kind == "attr":
            x = getattr(x, key)
        else:
            x = x[key]
    return x


def _child_step(d: Desc, key: Any) -> tuple[tuple[str, Any], ...]:
    if isinstance(d, Module):
        return (("attr", key),)
    assert isinstance(d, Container)
    if d.kind == "eqx":
        return (("attr", "children"), ("item", key))
    return (("item", key),)


def handles(tree: Desc) -> Handles:
    """Every Variable, Rngs, static attribute and plain array, with all its paths."""
    var_paths: dict[int, list[Path]] = {}
    var_kinds: dict[int, str] = {}
    rngs_paths: dict[int, list[Path]] = {}
    statics: list[Path] = []
    arrays: list[Path] = []
    modules: list[Path] = []
    objects: list[Path] = []
    by_uid: dict[int, Desc] = {}

    def walk(d: Desc, path: Path, via_ref: bool) -> None:
        if isinstance(d, Ref):
            walk(by_uid[d.uid], path, True)
            return
        if isinstance(d, (Var, Rngs, Module, Container)):
            by_uid.setdefault(d.uid, d)
        if not via_ref and (
            isinstance(d, (Rngs, Module))
            or (isinstance(d, Container) and d.kind in ("nlist", "ndict"))
        ):
            objects.append(path)
            if isinstance(d, Module):
                modules.append(path)
        if isinstance(d, Var):
            var_kinds[d.uid] = d.kind
            var_paths.setdefault(d.uid, []).append(path)
        elif isinstance(d, Rngs):
            rngs_paths.setdefault(d.uid, []).append(path)
        elif isinstance(d, Array):
            if not via_ref:
                arrays.append(path)
        elif isinstance(d, Module):
            if not via_ref:
                statics.extend(
                    (*path, ("attr", name)) for name, v in d.statics if isinstance(v, int)
                )
            for name, child in d.fields:
                walk(child, (*path, *_child_step(d, name)), via_ref)
        elif isinstance(d, Container):
            for key, child in d.items:
                walk(child, (*path, *_child_step(d, key)), via_ref)

    walk(tree, (), False)
    return Handles(
        variables=tuple((var_kinds[u], tuple(p)) for u, p in var_paths.items()),
        rngs=tuple(tuple(p) for p in rngs_paths.values()),
        statics=tuple(statics),
        arrays=tuple(arrays),
        modules=tuple(modules),
        objects=tuple(objects),
    )


# -- running a program ------------------------------------------------------------------


def run(program: tuple[Op, ...], h: Handles, root: Any) -> list[jax.Array]:
    """Run ``program`` on ``root`` (eagerly or inside a transform); float32 outputs."""
    outs: list[jax.Array] = []

    def var(i: int, p: int) -> Any:
        paths = h.variables[i][1]
        return resolve(root, paths[p % len(paths)])

    def rngs(i: int, p: int) -> Any:
        paths = h.rngs[i]
        return resolve(root, paths[p % len(paths)])

    for op in program:
        if op.kind == "read":
            outs.append(var(op.a, op.a_path)[...].astype(jnp.float32))
        elif op.kind == "add":
            v = var(op.a, op.a_path)
            v[...] = v[...] + jnp.asarray(op.c, v.dtype)
        elif op.kind == "double":
            v = var(op.a, op.a_path)
            v[...] = v[...] * jnp.asarray(2, v.dtype)
        elif op.kind == "mix":
            v, w = var(op.a, op.a_path), var(op.b, op.b_path)
            v[...] = v[...] + jnp.sum(w[...]).astype(v.dtype)
        elif op.kind == "draw":
            outs.append(jax.random.uniform(rngs(op.a, op.a_path)(), (2,)))
        elif op.kind == "draw_into":
            v = var(op.b, op.b_path)
            bits = jax.random.randint(rngs(op.a, op.a_path)(), v.shape, 0, 8)
            v[...] = v[...] + bits.astype(v.dtype)
        elif op.kind == "static":
            outs.append(jnp.asarray(resolve(root, h.statics[op.a]), jnp.float32))
        elif op.kind == "array":
            outs.append(resolve(root, h.arrays[op.a]) * 2.0)
        elif op.kind == "type":
            kind = list(VAR_TYPES.values()).index(type(var(op.a, op.a_path)))
            outs.append(jnp.asarray(kind, jnp.float32))
        elif op.kind == "module":
            outs.append(jnp.asarray(type(resolve(root, h.modules[op.a])).code, jnp.float32))
        else:  # pragma: no cover
            raise AssertionError(op.kind)
    return outs


def make_program(s: Scenario):
    """The scenario's program as a function of the root."""

    def program(root: Any) -> list[jax.Array]:
        return run(s.program, s.handles, root)

    return program


def variables_of(root: Any) -> list[Any]:
    """Every Variable reachable from ``root`` (with repeats for shared ones)."""
    return [
        x
        for x in jax.tree_util.tree_leaves(root, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if isinstance(x, nnx.Variable)
    ]


def state_of(root: Any, *, unbatch: bool = False) -> list[np.ndarray]:
    """The value of every Variable (keys as key data), as numpy arrays."""
    out = []
    for v in variables_of(root):
        value = v.get_raw_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        value = np.asarray(value)
        out.append(value[0] if unbatch else value)
    return out


# -- strategies ------------------------------------------------------------------------

NAMES = ("a", "b", "c", "d")


@st.composite
def _tree(draw: Any, depth: int, uids: list[int], kinds: tuple[str, ...]) -> Desc:
    def uid() -> int:
        uids[0] += 1
        return uids[0]

    leaf_kinds = ["var", "var", "var", "rngs", "array", "static"]
    node_kinds = ["module", "nlist", "ndict", "dict", "list", "tuple", "eqx"]
    kind = draw(st.sampled_from(leaf_kinds + (node_kinds if depth > 0 else [])))
    if kind == "var":
        var_kind = draw(st.sampled_from(kinds))
        size = draw(st.sampled_from([1, 2]))
        values = tuple(draw(st.lists(st.integers(-4, 4), min_size=size, max_size=size)))
        return Var(var_kind, values, uid())
    if kind == "rngs":
        return Rngs(draw(st.integers(0, 3)), uid())
    if kind == "array":
        return Array(tuple(draw(st.lists(st.integers(-4, 4), min_size=2, max_size=2))))
    if kind == "static":
        return Static(draw(st.sampled_from(["relu", "tanh", "x"])))
    n = draw(st.integers(0, 3))
    children = [draw(_tree(depth - 1, uids, kinds)) for _ in range(n)]
    if kind == "module":
        if any(isinstance(c, Static) for c in children):
            children = [c for c in children if not isinstance(c, Static)]
        statics = draw(
            st.lists(
                st.tuples(st.sampled_from(("n", "width")), st.integers(0, 9)),
                max_size=1,
                unique_by=lambda t: t[0],
            )
        )
        statics += draw(st.lists(st.just(("label", "layer")), max_size=1))
        return Module(
            draw(st.sampled_from(sorted(MODULE_TYPES))),
            tuple(zip(NAMES, children, strict=False)),
            tuple(statics),
            uid(),
        )
    if kind in ("nlist", "ndict"):
        # NNX containers hold NNX objects and arrays (no static strings).
        children = [c for c in children if not isinstance(c, Static)]
    if kind in ("dict", "ndict"):
        items = tuple(zip(NAMES, children, strict=False))
    else:
        items = tuple(enumerate(children))
    return Container(kind, items, uid())


def _has_state(d: Desc) -> bool:
    if isinstance(d, (Var, Rngs)):
        return True
    if isinstance(d, Module):
        return any(_has_state(c) for _, c in d.fields)
    if isinstance(d, Container):
        return any(_has_state(c) for _, c in d.items)
    return False


def _shareable(d: Desc, is_root: bool = True) -> list[int]:
    """uids of the NNX objects and Variables below the root (targets for a Ref)."""
    out: list[int] = []
    if isinstance(d, (Var, Rngs)):
        out.append(d.uid)
    graph_node = isinstance(d, Module) or (
        isinstance(d, Container) and d.kind in ("nlist", "ndict")
    )
    if graph_node and not is_root and _has_state(d):
        out.append(d.uid)
    children: tuple[tuple[Any, Any], ...] = ()
    if isinstance(d, Module):
        children = d.fields
    elif isinstance(d, Container):
        children = d.items
    for _, c in children:
        out += _shareable(c, False)
    return out


def _add_ref(root: Desc, ref: Ref) -> Desc:
    """``root`` with ``ref`` appended as its last child (built after its target)."""
    if isinstance(root, Module):
        free = [n for n in NAMES + ("e",) if n not in dict(root.fields)]
        return dataclasses.replace(root, fields=(*root.fields, (free[0], ref)))
    assert isinstance(root, Container)
    if root.kind in ("dict", "ndict"):
        key = next(n for n in NAMES + ("e",) if n not in dict(root.items))
    else:
        key = len(root.items)
    return dataclasses.replace(root, items=(*root.items, (key, ref)))


@st.composite
def ops(draw: Any, h: Handles, max_ops: int = 6, *, types: bool = False) -> tuple[Op, ...]:
    """A random program over the handles of a tree.

    ``types``: the program may also read which type a Variable has and which
    class a module has (outputs that change when ``__class__`` is replaced).
    """
    choices = []
    if h.variables:
        choices += ["read", "add", "double", "mix"] + (["type"] if types else [])
    if types and h.modules:
        choices += ["module"]
    if h.rngs:
        choices += ["draw"]
        if h.variables:
            choices += ["draw_into"]
    if h.statics:
        choices += ["static"]
    if h.arrays:
        choices += ["array"]
    if not choices:
        return ()
    program = []
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(choices))
        if kind in ("read", "add", "double", "mix", "type"):
            a = draw(st.integers(0, len(h.variables) - 1))
            b = draw(st.integers(0, len(h.variables) - 1))
            op = Op(
                kind,
                a,
                draw(st.integers(0, 1)),
                b,
                draw(st.integers(0, 1)),
                draw(st.integers(-3, 3)),
            )
        elif kind == "draw":
            op = Op(kind, draw(st.integers(0, len(h.rngs) - 1)), draw(st.integers(0, 1)))
        elif kind == "draw_into":
            op = Op(
                kind,
                draw(st.integers(0, len(h.rngs) - 1)),
                draw(st.integers(0, 1)),
                draw(st.integers(0, len(h.variables) - 1)),
                draw(st.integers(0, 1)),
            )
        elif kind == "static":
            op = Op(kind, draw(st.integers(0, len(h.statics) - 1)))
        elif kind == "module":
            op = Op(kind, draw(st.integers(0, len(h.modules) - 1)))
        else:
            op = Op(kind, draw(st.integers(0, len(h.arrays) - 1)))
        program.append(op)
    # Read every Variable the program wrote, so outputs depend on the new state.
    written = sorted(
        {o.a for o in program if o.kind in ("add", "double", "mix")}
        | {o.b for o in program if o.kind == "draw_into"}
    )
    program += [Op("read", i, 1) for i in written]
    return tuple(program)


@st.composite
def scenarios(
    draw: Any,
    *,
    shared: bool | None = False,
    max_depth: int = 3,
    var_kinds: tuple[str, ...] = tuple(VAR_TYPES),
    types: bool = False,
) -> Scenario:
    """A tree and a program.

    ``shared``: ``True`` always adds a second reference to some object,
    ``False`` never does, ``None`` lets hypothesis choose. ``types``: the
    program may read Variable types and module classes (see `ops`).
    """
    uids = [0]
    root_kind = draw(st.sampled_from(["module", "dict", "list", "tuple", "nlist", "eqx"]))
    n = draw(st.integers(1, 3))
    children = [draw(_tree(max_depth - 1, uids, var_kinds)) for _ in range(n)]
    uids[0] += 1
    if root_kind == "module":
        children = [c for c in children if not isinstance(c, Static)]
        tree: Desc = Module("node", tuple(zip(NAMES, children, strict=False)), (("n", 1),), uids[0])
    else:
        if root_kind == "nlist":
            children = [c for c in children if not isinstance(c, Static)]
        keys = NAMES if root_kind == "dict" else range(len(children))
        tree = Container(root_kind, tuple(zip(keys, children, strict=False)), uids[0])
    want_shared = draw(st.booleans()) if shared is None else shared
    is_shared = False
    if want_shared:
        targets = _shareable(tree)
        if not targets:
            # Make something to share.
            uids[0] += 1
            extra = Var("param", (1, 2), uids[0])
            tree = _add_ref(tree, extra)  # type: ignore[arg-type]
            targets = [extra.uid]
        if targets:
            target = draw(st.sampled_from(targets))
            tree = _add_ref(tree, Ref(target))
            is_shared = True
    h = handles(tree)
    return Scenario(tree, h, draw(ops(h, types=types)), is_shared)


# -- mutations between calls -----------------------------------------------------------

# Equal values of different types: a trace specialized on one is not the program
# of another (``x * 2`` is int32, ``x * 2.0`` float32, ``jnp.asarray(True)`` bool).
_SCALAR_TYPES = (int, float, complex, bool, np.int32, np.float32)


@st.composite
def static_scalar(draw: Any) -> Any:
    """A static number: 0, 1 or 2 as one of several equal-comparing types."""
    value = draw(st.integers(0, 2))
    kind = draw(st.sampled_from(_SCALAR_TYPES))
    if kind is bool:
        return bool(value > 0)
    return kind(value)


def static_value() -> st.SearchStrategy[Any]:
    """A static value: a number, or a (nested) tuple of numbers."""
    return st.recursive(
        static_scalar(), lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=3
    )


def static_value_sequence() -> st.SearchStrategy[list[Any]]:
    """Static values to set between calls; consecutive ones are often equal in value."""
    return st.lists(static_value(), min_size=2, max_size=5)


def metadata_value() -> st.SearchStrategy[Any]:
    """Variable metadata as NNX accepts it: lists, tuples, dicts and sets of names and numbers."""
    atom = st.sampled_from(["decay", "ema", "frozen"]) | st.integers(0, 2) | st.just(1.0)
    return st.recursive(
        atom,
        lambda inner: (
            st.lists(inner, max_size=2)
            | st.tuples(inner)
            | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)
            | st.frozensets(st.sampled_from(["x", "y"]), max_size=2)
        ),
        max_leaves=4,
    )


# Replaced ``__dict__`` and ``__class__``: the same objects, other contents or types.


@dataclasses.dataclass(frozen=True)
class Replace:
    """One replacement made between two calls (on the eager and the transformed copy)."""

    kind: str  # "dict" (an NNX object's __dict__), "variable_class", "module_class"
    target: int  # index into Handles.objects / Handles.variables / Handles.modules
    var_kind: str = "param"  # the new Variable type (a key of VAR_TYPES)


@st.composite
def replacements(draw: Any, h: Handles, max_size: int = 3) -> tuple[Replace, ...]:
    """Replacements of ``__dict__`` and ``__class__`` to make between two calls."""
    choices = []
    if h.objects:
        choices.append("dict")
    if h.variables:
        choices.append("variable_class")
    if h.modules:
        choices.append("module_class")
    if not choices:
        return ()
    out = []
    for _ in range(draw(st.integers(1, max_size))):
        kind = draw(st.sampled_from(choices))
        if kind == "dict":
            out.append(Replace(kind, draw(st.integers(0, len(h.objects) - 1))))
        elif kind == "variable_class":
            target = draw(st.integers(0, len(h.variables) - 1))
            out.append(Replace(kind, target, draw(st.sampled_from(sorted(VAR_TYPES)))))
        else:
            out.append(Replace(kind, draw(st.integers(0, len(h.modules) - 1))))
    return tuple(out)


def _renewed(v: Any) -> Any:
    """A new Variable of ``v``'s type and metadata, its value changed (keys: kept)."""
    value = v.get_raw_value()
    if not jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = value + jnp.asarray(1, value.dtype)
    return v.replace(value)


def replace(root: Any, h: Handles, r: Replace) -> None:
    """Make the replacement ``r`` in the tree ``root`` (built from ``h``'s tree)."""
    if r.kind == "dict":
        obj = resolve(root, h.objects[r.target])
        # The same attributes in a new dict, each Variable a new one: a call that
        # kept reading the old dict would read (and write) the old Variables.
        attrs = {k: _renewed(v) if isinstance(v, nnx.Variable) else v for k, v in vars(obj).items()}
        object.__setattr__(obj, "__dict__", attrs)
    elif r.kind == "variable_class":
        paths = h.variables[r.target][1]
        resolve(root, paths[0]).__class__ = VAR_TYPES[r.var_kind]
    else:
        module = resolve(root, h.modules[r.target])
        object.__setattr__(module, "__class__", Block if type(module) is Node else Node)


# -- a Variable's value changing layout between calls ------------------------------------

LAYOUTS = ("array", "scalar", "dict", "tuple", "nested", "none", "string")


def layout_value(kind: str, seed: int) -> Any:
    """A new value of layout ``kind`` (new arrays: a donated call deletes its inputs)."""
    base = jnp.arange(3.0) + seed
    if kind == "array":
        return base
    if kind == "scalar":
        return float(seed)
    if kind == "dict":
        return {"a": base, "b": jnp.full((2,), float(seed))}
    if kind == "tuple":
        return (base * 2,)
    if kind == "nested":
        return {"x": (base, {"y": jnp.ones(()) * seed})}
    if kind == "none":
        return None
    if kind == "string":
        return f"s{seed}"
    raise AssertionError(kind)  # pragma: no cover


@st.composite
def layout_changes(
    draw: Any, n_variables: int, n_calls: int = 4
) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per call after the first, the ``(variable index, layout, seed)`` changes to make."""
    calls = []
    for _ in range(n_calls - 1):
        k = draw(st.integers(0, n_variables))
        calls.append(
            tuple(
                (
                    draw(st.integers(0, n_variables - 1)),
                    draw(st.sampled_from(LAYOUTS)),
                    draw(st.integers(0, 5)),
                )
                for _ in range(k)
            )
        )
    return tuple(calls)


def layout_program(root: Any) -> jax.Array:
    """Reads every Variable of ``root`` whatever its layout; updates its array leaves."""
    total = jnp.zeros((), jnp.float32)
    for i, v in enumerate(variables_of(root)):
        value = v.get_raw_value()
        leaves = jax.tree_util.tree_leaves(value)
        arrays = [x for x in leaves if not isinstance(x, str)]
        total = total + (i + 1) * sum((jnp.sum(jnp.asarray(x, jnp.float32)) for x in arrays), 0.0)
        total = total + sum(len(x) for x in leaves if isinstance(x, str))
        if arrays and not any(isinstance(x, str) for x in leaves):
            v.set_raw_value(jax.tree_util.tree_map(lambda x: x + 1, value))
    return total
