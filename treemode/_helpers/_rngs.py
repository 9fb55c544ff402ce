"""``treemode.split_rngs`` and ``treemode.fork_rngs``.

Both return a copy of a node in which selected ``nnx.RngStream`` objects are
replaced by new streams (split: a batch of keys, for ``vmap``/``scan``; fork: a
fresh key); everything else in the copy (Variables, unselected streams) is the
same object as in the input, so updates made through the copy reach the input.
Each selected input stream is advanced once, exactly as calling it eagerly
(``stream.split(n)``, ``stream.fork()``) would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import filterlib

from .. import _compat
from .._errors import TraceContextError
from .._transforms._signature import suggests_keywords
from .._tree._flatten import check_no_aliases
from .._tree._graph import from_tree, to_tree
from .._tree._leaves import is_variable
from .._tree._paths import format_path, nnx_path

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")  # a node: its copy has its type
Splits = int | tuple[int, ...]


class _NoNode:
    """The default of ``node`` in `split_rngs`/`fork_rngs`: none given, so the call
    returns a decorator. Its repr is its name, so signatures read ``node=NO_NODE``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_NODE"

    def __reduce__(self) -> str:
        return "NO_NODE"


NO_NODE: Any = _NoNode()


def _is_stream(x: Any) -> bool:
    return isinstance(x, nnx.RngStream)


def _copy(node: Any, transform: str, graph: bool) -> Any:
    """New containers and streams around the same Variables (sharing kept if graph)."""
    if graph:
        return from_tree(to_tree(node))
    check_no_aliases(transform, node=node)
    return jax.tree_util.tree_map(lambda x: x, node, is_leaf=is_variable)


def _streams(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, stream)`` for each distinct stream, in flatten order."""
    out = []
    seen: set[int] = set()
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: _is_stream(x) or is_variable(x)
    )[0]
    for path, leaf in leaves:
        if _is_stream(leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((path, leaf))
    return out


def _replace_streams(
    node: Any,
    choose: Callable[[tuple[Any, ...], Any], tuple[bool, Splits | None]],
    make: Callable[[jax.Array, Any, Splits | None], tuple[jax.Array, jax.Array]],
    transform: str,
    graph: bool,
) -> Any:
    """Replace the chosen streams of a copy of ``node``; advance the originals once."""
    out = _copy(node, transform, graph)
    plans = []
    for path, stream in _streams(out):
        selected, splits = choose(nnx_path(path), stream)
        if not selected:
            continue
        count = stream.count
        if not _compat.trace_state_of(count).is_valid():
            raise TraceContextError(
                f"treemode.{transform}: the RngStream at {format_path(path, 'node')} was "
                "created outside the JAX transform that is tracing, so advancing its count "
                "here would leak a tracer. Split or fork the streams before the transform, "
                "or pass them to it as arguments (treemode.jit / treemode.vmap)."
            )
        base = jax.random.fold_in(stream.key[...], count[...])
        key, new_count = make(base, count[...], splits)
        plans.append((stream, key, new_count))
    # Everything computed: now advance the inputs and install the new streams.
    for stream, key, new_count in plans:
        stream.count[...] = stream.count[...] + 1
        stream.key = nnx.RngKey(key, tag=stream.tag)
        stream.count = nnx.RngCount(new_count, tag=stream.tag)
    return out


def _stream_predicate(only: Any) -> Callable[[tuple[Any, ...], Any], bool]:
    predicate = filterlib.to_predicate(only)

    def selected(path: tuple[Any, ...], stream: Any) -> bool:
        return bool(
            predicate((*path, "key"), stream.key) and predicate((*path, "count"), stream.count)
        )

    return selected


def _shape(splits: Splits) -> tuple[int, ...]:
    return (splits,) if isinstance(splits, int) else tuple(splits)


@overload
def split_rngs(
    node: None = None,
    /,
    *,
    splits: Splits,
    only: Any = ...,
    squeeze: bool = False,
    graph: bool = False,
) -> Callable[[F], F]: ...


@overload
def split_rngs(
    node: T,
    /,
    *,
    splits: Splits,
    only: Any = ...,
    squeeze: bool = False,
    graph: bool = False,
) -> T: ...


@suggests_keywords
def split_rngs(
    node: Any = NO_NODE,
    /,
    *,
    splits: Splits,
    only: Any = ...,
    squeeze: bool = False,
    graph: bool = False,
) -> Any:
    """A copy of ``node`` whose ``nnx.RngStream`` keys are split into a batch.

    Each selected stream of the copy holds `splits` keys (and zero counts of
    the same shape), ready to be mapped over by `treemode.vmap` or scanned over
    by `treemode.scan`; each selected input stream is advanced by one call, as
    an eager `stream.split(splits)` would. Variables and unselected streams are
    shared between `node` and the copy.

    **Arguments:**

    - `node`: an `nnx.Rngs`, or any pytree containing streams (a module). Omit it
      to get a decorator that splits the streams in a function's arguments.
    - `splits`: the number of keys, or a shape of keys.
    - `only`: an NNX filter selecting the streams (e.g. `'params'`); all by default.
    - `squeeze`: with `splits=1`, drop the split axis (a fresh unbatched key).
    - `graph`: if `True`, `node` may share streams (each is split once).

    **Returns:**

    The copy of `node`.

    ```python
    import treemode
    from flax import nnx

    rngs = nnx.Rngs(params=0, dropout=1)
    batch = treemode.split_rngs(rngs, splits=5, only="params")
    assert batch.params.key.shape == (5,) and batch.dropout.key.shape == ()
    assert rngs.params.count[...] == 1  # advanced like rngs.params.split(5)
    ```
    """
    if squeeze and splits != 1:
        raise ValueError(
            f"treemode.split_rngs: squeeze=True needs splits=1 (got splits={splits!r}); "
            "it produces one fresh key per stream without a batch axis."
        )
    if node is NO_NODE:
        return _decorator(
            functools.partial(split_rngs, splits=splits, only=only, squeeze=squeeze, graph=graph)
        )
    selected = _stream_predicate(only)

    def choose(path: tuple[Any, ...], stream: Any) -> tuple[bool, Splits | None]:
        return selected(path, stream), splits

    def make(base: jax.Array, count: jax.Array, n: Splits | None) -> Any:
        assert n is not None
        keys = jax.random.split(base, n)
        if squeeze:
            return keys[0], jnp.zeros_like(count)
        return keys, jnp.zeros((*_shape(n), *jnp.shape(count)), jnp.uint32)

    return _replace_streams(node, choose, make, "split_rngs", graph)


@overload
def fork_rngs(
    node: None = None,
    /,
    *,
    split: Mapping[Any, Splits | None] | Splits | None = None,
    graph: bool = False,
) -> Callable[[F], F]: ...


@overload
def fork_rngs(
    node: T,
    /,
    *,
    split: Mapping[Any, Splits | None] | Splits | None = None,
    graph: bool = False,
) -> T: ...


@suggests_keywords
def fork_rngs(
    node: Any = NO_NODE,
    /,
    *,
    split: Mapping[Any, Splits | None] | Splits | None = None,
    graph: bool = False,
) -> Any:
    """A copy of ``node`` whose ``nnx.RngStream`` objects are forked.

    A forked stream starts from a fresh key drawn from the input stream (which
    is advanced by one call, as an eager `stream.fork()` would), with a zero
    count; with `split`, that key is further split into a batch.

    **Arguments:**

    - `node`: an `nnx.Rngs` or any pytree containing streams; omit it to get a
      decorator.
    - `split`: `None` (fork every stream without splitting), an int/shape (split
      every stream), or a mapping from NNX filters to `None`/int/shape; the first
      matching filter decides, streams matching none are left as they are.
    - `graph`: if `True`, `node` may share streams.

    **Returns:**

    The copy of `node`.

    ```python
    import treemode
    from flax import nnx

    rngs = nnx.Rngs(params=0, dropout=1)
    forked = treemode.fork_rngs(rngs, split={"dropout": 4, ...: None})
    assert forked.dropout.key.shape == (4,) and forked.params.key.shape == ()
    assert forked.params.count[...] == 0 and rngs.params.count[...] == 1
    ```
    """
    if node is NO_NODE:
        return _decorator(functools.partial(fork_rngs, split=split, graph=graph))
    if split is None or isinstance(split, (int, tuple)):
        split = {...: split}
    rules = [(_stream_predicate(f), n) for f, n in split.items()]

    def choose(path: tuple[Any, ...], stream: Any) -> tuple[bool, Splits | None]:
        for selected, n in rules:
            if selected(path, stream):
                return True, n
        return False, None

    def make(base: jax.Array, count: jax.Array, n: Splits | None) -> Any:
        key = base if n is None else jax.random.split(base, n)
        return key, jnp.zeros(jnp.shape(key), jnp.uint32)

    return _replace_streams(node, choose, make, "fork_rngs", graph)


def _decorator(transform: Callable[[Any], Any]) -> Callable[[F], F]:
    def decorate(f: F) -> F:
        @functools.wraps(f)
        @_compat.api_boundary
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = transform((args, kwargs))
            return f(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


__all__ = ["fork_rngs", "split_rngs"]
