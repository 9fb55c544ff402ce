"""The static part of a `treemode.Pytree` proxy: `PytreeDef`, and `ModuleKey`.

A `PytreeDef` holds the module's structure (the treedef of ``to_tree(module)``
with Variables as leaves) and one spec per leaf of it; it is hashable, compared
by value, and interned (`interned`), so equal static parts are one object and a
jit cache lookup hits the identity fast path. It says where each leaf of the
proxy sits (`LeafInfo`) and names it with a `ModuleKey`, the attribute path
inside the module. The proxy itself is `treemode._tree._pytree`.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
from jax.tree_util import GetAttrKey

from .. import _caches
from ._paths import format_key
from ._specs import DYNAMIC, StructureKey, VarSpec, dynamic_count

# --------------------------------------------------------------------------- keys


class ModuleKey(GetAttrKey):
    """Key of one leaf of a `Pytree`: the attribute path inside the module.

    It is a `jax.tree_util.GetAttrKey` whose `name` is the whole path
    (``layers[0].kernel``), so `jax.tree_util.keystr` prints
    ``.layers[0].kernel``; `parts` holds the individual key entries.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[Any, ...]):
        text = "".join(_format_key(k) for k in parts)
        super().__init__(text[1:] if text.startswith(".") else text)
        self.parts = parts

    def __str__(self) -> str:
        return "".join(_format_key(k) for k in self.parts)

    def __repr__(self) -> str:
        return f"ModuleKey({str(self)!r})"


def _format_key(key: Any) -> str:
    return str(key) if isinstance(key, ModuleKey) else format_key(key)


# ------------------------------------------------------------------ static part


def single_leaf(spec: VarSpec) -> bool:
    """Whether the Variable's value is one traced leaf (stored as it is)."""
    return spec.value_def is None


class LeafInfo(NamedTuple):
    """Where one leaf of a proxy sits: its key path, and its Variable (if any)."""

    path: tuple[Any, ...]
    spec: VarSpec | None  # None: an array outside any Variable
    var_index: int  # index of the owning Variable, -1 if none
    var_path: tuple[Any, ...]  # key path of the owning Variable


class PytreeDef(StructureKey):
    """The static part of a `Pytree`: hashable and compared by value.

    Holds the module's structure (the treedef of ``to_tree(module)`` with
    Variables as leaves; static attributes and shared references live there) and,
    per leaf of that treedef, a spec: the Variable's type, metadata and value
    structure, a traced non-Variable array, or a static value. Two proxies of
    modules with equal structure have equal ``PytreeDef``s, so they share one
    `jax.jit` cache entry.
    """

    __slots__ = (
        "num_leaves",
        "_keys",
        "_leaf_infos",
        "_var_slots",
        "_masks",
        "__weakref__",
    )

    def __init__(self, treedef: Any, specs: tuple[Any, ...]):
        self.treedef = treedef  # a jax PyTreeDef
        self.specs = specs
        self.num_leaves = sum(dynamic_count(s) for s in specs)
        self._static_types = None
        try:
            self._hash_fields()
        except TypeError as e:
            raise TypeError(
                "treemode.Pytree: the module holds an unhashable static attribute or "
                f"Variable metadata ({e}). The static part of a proxy is a jit cache key, "
                "so it must be hashable: store tuples instead of lists, or mark array "
                "containers with nnx.data(...)."
            ) from e
        self._keys: tuple[ModuleKey, ...] | None = None
        self._leaf_infos: tuple[LeafInfo, ...] | None = None
        self._var_slots: tuple[tuple[int, int, VarSpec], ...] | None = None
        self._masks: dict[Any, tuple[bool | None, ...]] = {}

    def __repr__(self) -> str:
        return f"PytreeDef({self.num_leaves} leaves)"

    def __reduce__(self) -> tuple[Any, ...]:
        return _unpickle_def, (self.treedef, self.specs)

    def leaf_infos(self) -> tuple[LeafInfo, ...]:
        """Per leaf: where it sits in the module and which Variable owns it."""
        if self._leaf_infos is None:
            placeholders = self.treedef.unflatten(list(range(len(self.specs))))
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(placeholders)[0]]
            infos: list[LeafInfo] = []
            var_index = 0
            for path, spec in zip(paths, self.specs, strict=True):
                if type(spec) is VarSpec:
                    var_path = tuple(path)
                    if single_leaf(spec):
                        infos.append(LeafInfo(var_path, spec, var_index, var_path))
                    else:
                        assert spec.value_def is not None
                        value = spec.value_def.unflatten(list(range(len(spec.value_static))))
                        sub = jax.tree_util.tree_flatten_with_path(value)[0]
                        for (p, _), static in zip(sub, spec.value_static, strict=True):
                            if static is None:
                                info = LeafInfo((*var_path, *p), spec, var_index, var_path)
                                infos.append(info)
                    var_index += 1
                elif spec is DYNAMIC:
                    infos.append(LeafInfo(tuple(path), None, -1, ()))
            self._leaf_infos = tuple(infos)
        return self._leaf_infos

    def keys(self) -> tuple[ModuleKey, ...]:
        """One `ModuleKey` per leaf."""
        if self._keys is None:
            self._keys = tuple(ModuleKey(info.path) for info in self.leaf_infos())
        return self._keys

    def var_slots(self) -> tuple[tuple[int, int, VarSpec], ...]:
        """Per Variable (in order): (first leaf index, number of leaves, spec)."""
        if self._var_slots is None:
            slots = []
            start = 0
            for spec in self.specs:
                n = dynamic_count(spec)
                if type(spec) is VarSpec:
                    slots.append((start, n, spec))
                start += n
            self._var_slots = tuple(slots)
        return self._var_slots


_interned: weakref.WeakValueDictionary[int, PytreeDef] = weakref.WeakValueDictionary()
_caches.register(_interned.clear)


def _unpickle_def(treedef: Any, specs: tuple[Any, ...]) -> PytreeDef:
    return interned(PytreeDef(treedef, specs))


def interned(pdef: PytreeDef) -> PytreeDef:
    """Reuse an equal ``PytreeDef`` so cache lookups hit the identity fast path."""
    old = _interned.get(pdef._hash)
    if old is not None and old == pdef:
        return old
    _interned[pdef._hash] = pdef
    return pdef
