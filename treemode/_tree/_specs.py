"""Specs, structure keys and `rebuild`: what a flattened pytree's static part is made of.

A pytree flattened with Variables as leaves is described by its treedef and one
spec per leaf: a `VarSpec` (the Variable's type, metadata and value structure),
`DYNAMIC` (a traced array outside any Variable) or a `StaticLeaf` (a value
compared by equality). `StructureKey` holds the two, hashable; `rebuild` makes
a new tree (with new Variables) from a key and the traced leaves. The
flattening cache (``_flatten``), the pure function (``_pure``) and the
`treemode.Pytree` proxy (``_pytree``) share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.tree_util import PyTreeDef

from .. import _compat
from ._hashed import HashedKey
from ._leaves import (
    frozen_metadata,
    is_variable_value_leaf,
    same_static,
    same_treedef,
    treedef_static_types,
)


class _Dynamic:
    """Spec of a traced non-Variable leaf (an array in a plain container)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DYNAMIC"

    def __reduce__(self):
        return "DYNAMIC"


DYNAMIC = _Dynamic()


class StaticLeaf:
    """Spec of a non-array leaf (or a static argument): part of the cache key.

    Compared by value and by the types inside it (`same_static`), so ``2`` and
    ``2.0`` are different keys, as in ``jax.jit``'s ``static_argnums``.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is StaticLeaf and same_static(self.value, other.value)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"StaticLeaf({self.value!r})"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class VarSpec:
    """Spec of a Variable leaf: its type, metadata and the structure of its value.

    ``value_def`` is ``None`` when the value is a single array (the common case);
    otherwise it is the value's treedef, and ``value_static`` holds, per value
    leaf, ``None`` for a traced leaf or a ``StaticLeaf``.
    """

    var_type: type
    metadata: tuple[tuple[str, Any], ...]  # the user's values, sorted by name
    value_def: PyTreeDef | None = None  # pyright: ignore[reportInvalidTypeForm]
    value_static: tuple[StaticLeaf | None, ...] = ()
    # What is compared and hashed: the metadata in hashable, typed form.
    frozen: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.frozen and self.metadata:
            object.__setattr__(self, "frozen", frozen_metadata(dict(self.metadata)))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is VarSpec
            and self.var_type is other.var_type
            and self.frozen == other.frozen
            and self.value_static == other.value_static
            and same_treedef(self.value_def, other.value_def)
        )

    def __hash__(self) -> int:
        return hash((self.var_type, self.frozen, self.value_def, self.value_static))

    @property
    def num_dynamic(self) -> int:
        if self.value_def is None:
            return 1
        return sum(1 for s in self.value_static if s is None)

    def build(self, dynamic: Sequence[Any]) -> Any:
        """Rebuild a raw value from this spec's dynamic leaves."""
        if self.value_def is None:
            return dynamic[0]
        it = iter(dynamic)
        leaves = [next(it) if s is None else s.value for s in self.value_static]
        return self.value_def.unflatten(leaves)


Spec = VarSpec | StaticLeaf | _Dynamic


def variable_spec(var: Any) -> tuple[VarSpec, list[Any]]:
    """The spec of a Variable and its dynamic value leaves."""
    return value_spec(type(var), _compat.metadata_of(var), _compat.raw_value_of(var))


def value_spec(var_type: type, metadata: dict[str, Any], value: Any) -> tuple[VarSpec, list[Any]]:
    """The spec of a Variable of ``var_type`` holding ``value``, and its dynamic leaves."""
    metadata_key = tuple(sorted(metadata.items(), key=_first))
    if is_variable_value_leaf(value):
        return VarSpec(var_type, metadata_key), [value]
    leaves, value_def = jax.tree_util.tree_flatten(value)
    static: list[StaticLeaf | None] = []
    dynamic: list[Any] = []
    for leaf in leaves:
        if is_variable_value_leaf(leaf):
            static.append(None)
            dynamic.append(leaf)
        else:
            static.append(StaticLeaf(leaf))
    return VarSpec(var_type, metadata_key, value_def, tuple(static)), dynamic


def _first(item: tuple[str, Any]) -> str:
    return item[0]


def variable_dynamic(var: Any, spec: VarSpec) -> list[Any]:
    """The dynamic leaves of ``var``'s current value (laid out as ``spec``)."""
    if spec.value_def is None:
        return [_compat.raw_value_of(var)]
    leaves = jax.tree_util.tree_leaves(_compat.raw_value_of(var))
    return [x for x, s in zip(leaves, spec.value_static, strict=True) if s is None]


def dynamic_count(spec: Spec) -> int:
    """How many traced leaves one spec stands for."""
    if type(spec) is VarSpec:
        return spec.num_dynamic
    return 1 if spec is DYNAMIC else 0


class StructureKey(HashedKey):
    """A pytree's structure with Variables as leaves: its treedef and one spec per leaf.

    Hashable, with the hash computed once: the cache key of a flattened argument
    (and the base of a `treemode.Pytree` proxy's static part).
    """

    __slots__ = ("treedef", "specs", "_static_types")
    _fields = ("treedef", "specs")

    def __init__(
        self,
        treedef: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
        specs: tuple[Spec, ...],
    ):
        self.treedef = treedef
        self.specs = specs
        self._static_types: tuple[Any, ...] | None = None
        self._hash_fields()

    def __eq__(self, other: object) -> bool:
        # ``PyTreeDef.__eq__`` compares static fields with ``==`` (``2 == 2.0``):
        # their types are compared too, computed only when two distinct keys
        # are otherwise equal (a cached argument reuses its key object).
        if self is other:
            return True
        try:
            if not super().__eq__(other):
                return False
        except (ValueError, TypeError):  # a static field whose == fails (NumPy vs tuple)
            return False
        assert isinstance(other, StructureKey)
        return self.static_types() == other.static_types()

    __hash__ = HashedKey.__hash__

    def static_types(self) -> tuple[Any, ...]:
        """The types of the static values in ``treedef`` (see `treedef_static_types`)."""
        types = self._static_types
        if types is None:
            types = self._static_types = treedef_static_types(self.treedef)
        return types


def rebuild(
    flat_key: StructureKey,
    dynamic: Sequence[Any],
    wrap: Callable[[Any], Any] | None = None,
) -> tuple[Any, list[Any], list[Any]]:
    """Rebuild a pytree from a structure key and its dynamic leaves.

    Returns ``(tree, variables, leaves)``.

    Every Variable is a new object of the same type and metadata holding the new
    value, so it belongs to the current trace and can be mutated there.
    ``wrap``, if given, is applied to a Variable's value when it is one leaf.
    """
    leaves: list[Any] = []
    variables: list[Any] = []
    i = 0
    for spec in flat_key.specs:
        if type(spec) is VarSpec:
            n = spec.num_dynamic
            if wrap is not None and spec.value_def is None:
                value = wrap(dynamic[i])
            else:
                value = spec.build(dynamic[i : i + n])
            i += n
            var = spec.var_type.from_metadata(value, dict(spec.metadata))
            variables.append(var)
            leaves.append(var)
        elif spec is DYNAMIC:
            leaves.append(dynamic[i])
            i += 1
        else:
            assert isinstance(spec, StaticLeaf)
            leaves.append(spec.value)
    return flat_key.treedef.unflatten(leaves), variables, leaves


__all__ = [
    "DYNAMIC",
    "Spec",
    "StaticLeaf",
    "StructureKey",
    "VarSpec",
    "dynamic_count",
    "rebuild",
    "value_spec",
    "variable_dynamic",
    "variable_spec",
]
