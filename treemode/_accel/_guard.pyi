from collections.abc import Callable, Sequence
from typing import Any

def configure(layout: tuple[Any, ...], call_path: tuple[Any, ...], /) -> None: ...
def holds(state: tuple[Any, ...], variables: Sequence[Any], top: Any, /) -> bool: ...
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

class SiteCallFields:
    site: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dynamic: Sequence[Any]
    sources: list[Any]
    _full: Any
    def __init__(
        self,
        site: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dynamic: Sequence[Any],
        sources: list[Any],
    ) -> None: ...

class MemoCall:
    _memo: Any
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def version_tags(containers: Sequence[Any], /) -> bytes | None: ...
