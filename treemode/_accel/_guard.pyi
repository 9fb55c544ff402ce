from collections.abc import Sequence
from typing import Any

RECORD_VERSION: int
RECORD_FIELDS: tuple[str, ...]
CONFIGURE_FIELDS: tuple[str, ...]
GUARD_STATE_FIELDS: tuple[str, ...]

def configure(**fields: Any) -> None: ...
def holds(state: tuple[Any, ...], variables: Sequence[Any], top: Any, /) -> bool: ...
def reads_hold(reads: tuple[tuple[Any, ...], ...], /) -> bool: ...
def write_back(variables: Sequence[Any], updates: Sequence[Any], /) -> int: ...
def version_tags(containers: Sequence[Any], /) -> bytes | None: ...

class Guarded:
    arg: Any
    state: tuple[Any, ...]
    variables: tuple[Any, ...]
    flat: Any
    def __init__(
        self, arg: Any, state: tuple[Any, ...], variables: tuple[Any, ...], flat: Any
    ) -> None: ...

class FastRecord:
    slots: tuple[Any, ...]
    partial_args: tuple[Any, ...]
    kw_names: tuple[str, ...]
    closure_reads: tuple[tuple[Any, ...], ...]
    closure_holders: tuple[Any, ...]
    lifted_slots: tuple[Any, ...]
    jitted: Any
    donated: tuple[int, ...] | None
    kept: tuple[int, ...] | None
    trace: Any
    def __init__(self, **fields: Any) -> None: ...

class FastCall:
    _records: tuple[FastRecord, ...] | None
    _miss: Any
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
