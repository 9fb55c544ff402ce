from collections.abc import Callable, Sequence
from typing import Any

def holds(state: tuple[Any, ...], variables: Sequence[Any], /) -> bool: ...
def match_into(
    slots: tuple[Any, ...],
    objs: Sequence[Any],
    dynamic: list[Any],
    sources: list[Any],
    array_types: set[type],
    slow: Callable[[Any, Any], list[Any] | None],
    /,
) -> bool: ...
def reads_hold(
    reads: tuple[tuple[Any, ...], ...],
    kinds: dict[type, int],
    ignore: int,
    empty: object,
    ignored: object,
    /,
) -> bool: ...
def write_changed(variables: Sequence[Any], updates: Sequence[Any], /) -> int: ...
