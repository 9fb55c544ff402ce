"""Shared pieces of the public transforms' signatures.

Every transform takes JAX's parameters for its JAX function (names, order,
kinds, defaults) plus treemode's own (``graph``, ``transform_metadata``, ...);
``tests/test_signatures.py`` compares them with JAX's and Flax's.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Final, TypeVar

from .. import _compat
from .._errors import StaticArgumentError

F = TypeVar("F", bound=Callable[..., Any])


class _Unspecified:
    """Default of a parameter whose absence means something (as JAX's ``UnspecifiedValue``)."""

    __slots__ = ()
    _instance: _Unspecified | None = None

    def __new__(cls) -> _Unspecified:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSPECIFIED"

    def __reduce__(self) -> str:
        return "UNSPECIFIED"


UNSPECIFIED: Final[Any] = _Unspecified()


def check_reduce_axes(transform: str, reduce_axes: Any) -> None:
    """``reduce_axes`` is accepted for JAX's signature; JAX itself rejects a non-empty one."""
    if reduce_axes:
        raise NotImplementedError(
            f"treemode.{transform}: reduce_axes is not supported (JAX removed it from "
            f"jax.{transform}); reduce over the named axes with jax.lax.psum in the function."
        )


def legacy_operand(transform: str, operands: tuple[Any, ...], operand: Any) -> tuple[Any, ...]:
    """``cond``/``switch``: JAX's ``operand=x`` keyword, the same as one positional operand."""
    if operand is UNSPECIFIED:
        return operands
    if operands:
        raise TypeError(
            f"treemode.{transform}: operand= was given together with positional operands; "
            "pass the operands positionally only (operand=x is the same as one operand x)."
        )
    return (operand,)


def as_tuple(x: int | str | Iterable[Any] | None) -> tuple[Any, ...]:
    """``static_argnums=1``, ``("a", "b")``, ``None``, ... as a tuple."""
    if x is None:
        return ()
    if isinstance(x, (int, str)):
        return (x,)
    return tuple(x)


def resolve_argnums(
    transform: str,
    fn: Callable[..., Any],
    argnums: tuple[int, ...],
    argnames: tuple[str, ...],
    what: str,
) -> tuple[frozenset[int], frozenset[str]]:
    """Complete ``{what}_argnums`` from ``{what}_argnames`` and vice versa, as ``jax.jit`` does.

    Negative indices count from the end of ``fn``'s positional parameters.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset(argnums), frozenset(argnames)
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    names = set(argnames)
    nums = set()
    for i in argnums:
        if i < 0:
            i += len(positional)
        if i < 0 or (i >= len(positional) and not has_varargs):
            raise StaticArgumentError(
                f"treemode.{transform}: {what}_argnums contains {i}, but "
                f"{getattr(fn, '__name__', fn)} takes {len(positional)} positional "
                "argument(s). Fix the index, or name the argument with "
                f"{what}_argnames."
            )
        nums.add(i)
        if i < len(positional) and positional[i].kind is not inspect.Parameter.POSITIONAL_ONLY:
            names.add(positional[i].name)
    for name in argnames:
        for i, p in enumerate(positional):
            if p.name == name:
                nums.add(i)
    return frozenset(nums), frozenset(names)


def suggests_keywords(fn: F) -> F:
    """``fn``, which names the closest keyword when called with an unknown one.

    Python 3.11 only says ``jit() got an unexpected keyword argument
    'donate_argnum'``; the decorated function adds ``Did you mean
    'donate_argnums'?`` (close matches by ``difflib``, as Python does for
    misspelled names). A function taking ``**kwargs`` is returned unchanged.

    **Arguments:**

    - `fn`: a public transform.

    **Returns:**

    A function with ``fn``'s signature (``__wrapped__``) and behaviour.
    """
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _compat.api_boundary(fn)
    accepted = frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )

    @functools.wraps(fn)
    @_compat.api_boundary  # treemode's frames are left out of the traceback
    def checked(*args: Any, **kwargs: Any) -> Any:
        if kwargs and not accepted.issuperset(kwargs):
            raise unknown_keyword_error(
                fn.__name__, next(k for k in kwargs if k not in accepted), accepted
            )
        return fn(*args, **kwargs)

    return checked  # type: ignore[return-value]


def unknown_keyword_error(function: str, keyword: str, accepted: Iterable[str]) -> TypeError:
    """Python's error for an unexpected keyword argument, with the closest accepted ones."""
    message = f"{function}() got an unexpected keyword argument {keyword!r}"
    close = difflib.get_close_matches(keyword, sorted(accepted), n=1)
    if close:
        message += f". Did you mean {close[0]!r}?"
    return TypeError(message)
