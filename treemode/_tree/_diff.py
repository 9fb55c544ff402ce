"""Where two trees first differ: the walk behind every "the structure changed at ..." message.

Two places name the first structural difference between two trees: the check
after a trace that the function left its inputs' structure alone
(`treemode._pipeline._pure.describe_structure_change`, compared on the live
objects, raised as a `StructureError`), and the explanation of a retrace
(`treemode._pipeline._retrace`, compared on two cache keys rebuilt with their
specs as leaves, logged while ``jax_explain_cache_misses`` is on). They differ
in what a leaf is and in their words; the walk is the same, and is
`TreeDiff.first`: depth first, children in order, the first difference wins.
"""

from __future__ import annotations

from typing import Any, NamedTuple

Path = tuple[Any, ...]
# Where the trees differ (a key path from the roots) and how, in words.
Change = tuple[Path, str]


class Node(NamedTuple):
    """One level of a tree: its node type, its static part, and its ``(key, child)`` pairs."""

    type: type
    static: Any
    children: list[tuple[Any, Any]]


class Nodes(NamedTuple):
    """Two nodes to compare level by level (`TreeDiff.leaf` found no leaf)."""

    before: Node
    after: Node


def replaced(path: Path, before: type, after: type) -> Change:
    return path, f"a {before.__name__} was replaced by a {after.__name__}"


class TreeDiff:
    """The first structural difference between two trees (`first`).

    A subclass says what a leaf is (`leaf`), when two nodes' static parts
    differ and how to say so (`static_equal`, `static_change`), and names a key
    that only one side has (`added`, `removed`); with `reordered` set, the
    same keys in another order are a difference, otherwise their children
    are compared by position.
    """

    added: str  # at a key only the second tree has
    removed: str  # at a key only the first tree has
    reordered: str | None = None  # formatted with the keys before and after

    def leaf(self, path: Path, a: Any, b: Any) -> Change | Nodes | None:
        """Compare ``a`` and ``b`` at ``path`` where either is a leaf: the change,
        or ``None`` (no difference here); both nodes: their `Nodes`."""
        raise NotImplementedError

    def static_equal(self, a: Any, b: Any) -> bool:
        return a == b

    def static_change(self, path: Path, a: Any, b: Any, node: Node) -> Change:
        """How the static parts of nodes ``a`` and ``b`` differ (``node`` is ``a``'s level)."""
        raise NotImplementedError

    def first(self, a: Any, b: Any, path: Path = ()) -> Change | None:
        """The first place where ``b`` differs from ``a`` (``None``: nowhere)."""
        found = self.leaf(path, a, b)
        if not isinstance(found, Nodes):
            return found
        before, after = found
        if before.type is not after.type:
            return replaced(path, before.type, after.type)
        keys_a = [k for k, _ in before.children]
        keys_b = [k for k, _ in after.children]
        if keys_a != keys_b:
            for k in keys_b:
                if k not in keys_a:
                    return (*path, k), self.added
            for k in keys_a:
                if k not in keys_b:
                    return (*path, k), self.removed
            if self.reordered is not None:
                return path, self.reordered.format(keys_a, keys_b)
        for (k, x), (_, y) in zip(before.children, after.children, strict=True):
            found = self.first(x, y, (*path, k))
            if found is not None:
                return found
        if not self.static_equal(before.static, after.static):
            return self.static_change(path, a, b, before)
        return None


__all__ = ["Change", "Node", "Nodes", "Path", "TreeDiff", "replaced"]
