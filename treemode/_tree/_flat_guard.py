"""The guard of a cached flattening: an identity snapshot of what it walked through.

`Guard` records every mutable object a flattening walked through (types,
``__dict__`` objects, lengths, dict values and keys, list items, Variable
metadata) and `Guard.holds` checks, with identity comparisons only, that they
still describe the argument: compiled where the extension is on (the guard
state, with the dict version tags), else its Python twin `Guard.holds_python`.
The flattening and its cache are in `treemode._tree._flatten`.
"""

from __future__ import annotations

import operator
from itertools import chain
from typing import Any

from .._accel import _compiled
from .._compat import metadata_of as _metadata_of

# The compiled guard (treemode._accel._compiled); None where it is off: the same checks in Python.
_compiled_holds = _compiled.holds
_GUARD_STATE_FIELDS = _compiled.GUARD_STATE_FIELDS
_version_tags = _compiled.version_tags


class Guard:
    """Identity snapshot of every mutable object a flattening walked through.

    Validation compares, with ``is`` only and in bulk (each check is one C-level
    pass), the current state of those objects against the snapshot:

    - the type of every NNX object, ``nnx.State``, dict or list walked (an exact
      ``dict`` or ``list`` needs no check: its class cannot be reassigned) and of
      every Variable, so that ``v.__class__ = nnx.BatchStat`` is seen;
    - the ``__dict__`` of every NNX object and State: the very same dict object,
      so that ``object.__setattr__(m, "__dict__", d)`` is seen;
    - their lengths, the values of every dict (NNX objects' ``__dict__`` and
      plain dicts), the keys of plain dicts, the items of lists, and each
      Variable's metadata: the very same dict, holding the very same keys and
      values. NNX objects replace their ``_pytree__nodes`` mapping (one of the
      values checked) whenever an attribute is added or deleted, so their keys
      need no separate check; the length check covers the rest.

    The top-level argument is not held (the cached flattening holds it weakly): its
    type and ``__dict__`` are checked on the object passed to `holds`.

    Where the compiled guard (``treemode/_accel/_guard_kernels.c``) is on, the same checks run
    there in one pass (`compiled_state`); it needs exact ``dict``/``list``
    containers, so that its iteration order is the snapshot's. The Python checks
    below decide exactly what it decides.
    """

    __slots__ = (
        "sized",
        "metadata",
        "nodes",
        "owners",
        "top_type",
        "top_dict",
        "n_variables",
        "expected_identities",
        "sized_all",
        "expected_lens",
        "contents",
        "expected_contents",
        "compiled_state",
    )

    def __init__(self, containers: list[Any], variables: list[Any], top: Any):
        dicts: list[dict[Any, Any]] = []
        ordered: list[Any] = []  # plain dicts (iterated: keys) and lists (items)
        # The top-level argument's type and __dict__ (None: not checked), then the
        # other objects walked whose type is checked, and those whose __dict__ is.
        self.top_type: type | None = None
        self.top_dict: dict[str, Any] | None = None
        nodes: list[Any] = []
        owners: list[Any] = []
        for obj in containers:
            if isinstance(obj, list):
                ordered.append(obj)
            elif isinstance(obj, dict):
                ordered.append(obj)
                dicts.append(obj)
            else:
                dicts.append(obj.__dict__)
                if obj is not top:
                    owners.append(obj)
            if obj is top:
                self.top_type = type(obj)
                if not isinstance(obj, (dict, list)):
                    self.top_dict = obj.__dict__
            elif type(obj) not in _FIXED_CLASS:
                nodes.append(obj)
        self.nodes = tuple(nodes)
        self.owners = tuple(owners)
        self.n_variables = len(variables)
        node_types = tuple(map(type, nodes))
        owner_dicts = tuple(map(_dict_of, owners))
        variable_types = tuple(map(type, variables))
        exact = (dict, list)
        compiled = _compiled_holds is not None and all(type(c) in exact for c in ordered)
        self.metadata = tuple(map(_metadata_of, variables))
        if compiled:
            # Version tags are read before the contents they vouch for: a change in
            # between makes a tag stale (a full comparison), never a content.
            tags = (
                ()
                if _version_tags is None
                else tuple(map(_version_tags, (dicts, ordered, self.metadata)))
            )
        self.sized = tuple(dicts + [obj for obj in ordered if isinstance(obj, list)])
        lens = tuple(map(len, self.sized))
        values = tuple(chain.from_iterable(map(dict.values, dicts)))
        items = tuple(chain.from_iterable(ordered))
        # What the Python `holds` compares, each group in one pass: the types and
        # __dict__ objects; the lengths (which keep the last pass aligned); every
        # object the containers and the metadata dicts hold. Values are read
        # through views made once (a view shows its dict's current values).
        self.expected_identities = node_types + owner_dicts + variable_types + self.metadata
        self.sized_all = (*self.sized, *self.metadata)
        self.expected_lens = [*lens, *map(len, self.metadata)]
        self.contents = (
            *map(dict.values, dicts),
            *ordered,
            *self.metadata,
            *map(dict.values, self.metadata),
        )
        self.expected_contents = (
            values
            + items
            + tuple(chain.from_iterable(self.metadata))
            + tuple(chain.from_iterable(map(dict.values, self.metadata)))
        )
        self.compiled_state: tuple[Any, ...] | None = None
        if compiled:
            entries = tuple(tuple(chain.from_iterable(m.items())) for m in self.metadata)
            fields = {
                "sized": self.sized,
                "lens": lens,
                "dicts": tuple(dicts),
                "values": values,
                "ordered": tuple(ordered),
                "items": items,
                "metadata": self.metadata,
                "metadata_entries": entries,
                "nodes": self.nodes,
                "node_types": node_types,
                "owners": self.owners,
                "owner_dicts": owner_dicts,
                "variable_types": variable_types,
                "top_type": self.top_type,
                "top_dict": self.top_dict,
            }
            if tags and None not in tags:
                fields.update(
                    zip(("dict_tags", "ordered_tags", "metadata_tags"), tags, strict=True)
                )
            # In the order the C code defines (``_guard.GUARD_STATE_FIELDS``).
            self.compiled_state = tuple(fields[name] for name in _GUARD_STATE_FIELDS[: len(fields)])

    def holds(self, variables: list[Any], top: Any) -> bool:
        """Whether the snapshot still describes the objects walked from ``top``.

        ``variables`` are the flattening's Variables and ``top`` the top-level
        argument (the object the cached flattening's weak reference points to).
        """
        if self.compiled_state is not None:
            return _compiled_holds(self.compiled_state, variables, top)  # type: ignore[misc]
        return self.holds_python(variables, top)

    def holds_python(self, variables: list[Any], top: Any) -> bool:
        """The Python twin of the compiled ``holds`` (tests/test_twins.py binds them)."""
        if (
            (self.top_type is not None and type(top) is not self.top_type)
            or (self.top_dict is not None and _dict_of(top) is not self.top_dict)
            or len(variables) != self.n_variables
        ):
            return False
        # Types and __dict__ objects first (the passes below read the saved dicts),
        # then the metadata dicts: read only once every Variable's type matched
        # (``all`` stops at the first difference).
        current = chain(
            map(type, self.nodes),
            map(_dict_of, self.owners),
            map(type, variables),
            map(_metadata_of, variables),
        )
        try:
            if not all(map(_is, current, self.expected_identities)):
                return False
        except AttributeError:  # no metadata any more: not the flattening's Variable
            return False
        # The lengths, then (aligned by them) every object held, by identity.
        return list(map(len, self.sized_all)) == self.expected_lens and all(
            map(_is, chain.from_iterable(self.contents), self.expected_contents)
        )


if _compiled_holds is None:  # no extension: the twin itself, one call less per check
    Guard.holds = Guard.holds_python  # type: ignore[method-assign]

# Containers whose class cannot be reassigned (``__class__`` assignment needs a
# class defined in Python): their type needs no check.
_FIXED_CLASS = frozenset((dict, list))
_dict_of = operator.attrgetter("__dict__")
_is = operator.is_
