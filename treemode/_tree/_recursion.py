"""Deep and cyclic arguments: recursion headroom, and finding a reference cycle.

JAX flattens pytrees recursively, and a ``RecursionError`` inside its
flattening corrupts the interpreter's recursion counter, so treemode raises
Python's recursion limit (`recursion_headroom`) while it flattens, rebuilds or
checks arguments, and finds reference cycles without recursion (`find_cycle`)
before JAX sees them, to report them as a `StructureError` naming the path
(`recursion_error`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import jax

from .._errors import StructureError
from ._leaves import is_graph_node, is_variable
from ._paths import format_path


class CycleFound(RecursionError):
    """Raised (outside JAX's flattening) for an argument that contains itself."""


_headroom_lock = threading.Lock()
_saved_limit = 0  # the limit before treemode raised it; 0 while it is not raised
RECURSION_HEADROOM = 8_000


class _User:
    """One `recursion_headroom` in progress (alive while its frame is)."""

    __slots__ = ("__weakref__",)


_headroom_users: weakref.WeakSet[_User] = weakref.WeakSet()


@contextlib.contextmanager
def recursion_headroom() -> Iterator[None]:
    """Raise Python's recursion limit to ``RECURSION_HEADROOM`` while flattening.

    JAX flattens pytrees recursively (a few interpreter levels per nesting
    level), and a RecursionError inside its C++ flattening leaves the
    interpreter's recursion counter corrupted, so deep modules (hundreds of
    levels) must not hit the default limit of 1000. The limit is only ever
    raised, and restored when the last concurrent user leaves.

    The users are counted by weak references to a token each one holds: a
    user whose exit was cut short (an exception from a signal handler inside
    the bookkeeping below) stops counting when its frame is gone, so the next
    user to leave restores the limit.
    """
    global _saved_limit
    user = _User()
    with _headroom_lock:
        if not _headroom_users:
            current = sys.getrecursionlimit()
            if not (_saved_limit and current == RECURSION_HEADROOM):  # else: still raised by us
                _saved_limit = current if current < RECURSION_HEADROOM else 0
                if _saved_limit:
                    sys.setrecursionlimit(RECURSION_HEADROOM)
        _headroom_users.add(user)
    try:
        yield
    finally:
        with _headroom_lock:
            _headroom_users.discard(user)
            del user
            if not _headroom_users and _saved_limit:
                if sys.getrecursionlimit() == RECURSION_HEADROOM:  # not changed by the user since
                    sys.setrecursionlimit(_saved_limit)
                _saved_limit = 0


def below(x: Any) -> Any:
    """``is_leaf`` that flattens ``x`` one level (``x`` itself as a child is a leaf)."""
    root = [True]

    def is_leaf(child: Any) -> bool:
        if child is x and root[0]:
            root[0] = False
            return False
        return True

    return is_leaf


def _children(x: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` one level below a pytree node; ``[]`` for a leaf or a Variable."""
    if is_variable(x):
        return []
    flat, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=below(x))
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is x:
        return []
    return [(p[0], c) for p, c in flat]


def find_cycle(tree: Any) -> tuple[Any, ...] | None:
    """The path of the first object that contains itself, without recursion."""
    on_path: set[int] = set()
    stack: list[tuple[tuple[Any, ...], Any, bool]] = [((), tree, False)]
    while stack:
        path, x, done = stack.pop()
        if done:
            on_path.discard(id(x))
            continue
        if id(x) in on_path:
            return path
        if not (is_graph_node(x) or isinstance(x, (dict, list))):
            if not _children(x):
                continue
        on_path.add(id(x))
        stack.append((path, x, True))
        for key, child in reversed(_children(x)):
            stack.append(((*path, key), child, False))
    return None


# CPython 3.12.0 to 3.12.2 cap C-level recursion (about 1,500 levels) whatever
# sys.setrecursionlimit says; 3.12.3 raised the cap (gh-112215), 3.11 and 3.13
# follow the limit (docs/install.md, "Deep nesting").
CAPPED_C_RECURSION = ((3, 12, 0), (3, 12, 3))


def recursion_error(
    transform: str,
    roots: list[tuple[str, Any]],
    version: tuple[int, ...] = tuple(sys.version_info[:3]),
) -> StructureError:
    """A clear error for a RecursionError while flattening ``roots``.

    Names the reference cycle if there is one; otherwise the nesting is deeper
    than the interpreter allows JAX's (recursive) pytree flattening, and the
    advice is what helps on the running Python (``version``): raising the
    recursion limit, except on 3.12.0 to 3.12.2, where it cannot help.
    """
    for root, tree in roots:
        path = find_cycle(tree)
        if path is not None:
            return StructureError(
                f"treemode.{transform}: reference cycle at {format_path(path, root)}: the "
                "object contains itself, so it cannot be flattened into a pytree. Tree "
                "mode needs an acyclic structure; store the back-reference outside the "
                "module (or as a static non-NNX attribute)."
            )
    names = ", ".join(root for root, _ in roots)
    limit = max(sys.getrecursionlimit(), RECURSION_HEADROOM)
    low, high = CAPPED_C_RECURSION
    if low <= tuple(version) < high:
        shown = ".".join(map(str, version))
        return StructureError(
            f"treemode.{transform}: the inputs ({names}) are nested too deeply to flatten "
            f"on Python {shown}: JAX flattens pytrees recursively, each nesting level "
            "taking a few interpreter levels (about six with graph=True), and Python "
            "3.12.0 to 3.12.2 cap that recursion at about 1,500 levels whatever "
            "sys.setrecursionlimit says, so raising the limit cannot help here. Store "
            "deep stacks of layers in an nnx.List instead of nesting them, or run on "
            "Python 3.12.3 or later (or 3.11, 3.13), where the limit applies."
        )
    return StructureError(
        f"treemode.{transform}: the inputs ({names}) are nested too deeply to flatten "
        f"within a recursion limit of {limit}: JAX flattens pytrees recursively, each "
        "nesting level taking a few interpreter levels (about six with graph=True). "
        "Raise the limit before calling (sys.setrecursionlimit) or store deep stacks "
        "of layers in an nnx.List instead of nesting them."
    )


__all__ = [
    "CAPPED_C_RECURSION",
    "RECURSION_HEADROOM",
    "CycleFound",
    "below",
    "find_cycle",
    "recursion_error",
    "recursion_headroom",
]
