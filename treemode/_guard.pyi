from collections.abc import Sequence
from typing import Any

def holds(state: tuple[Any, ...], variables: Sequence[Any], /) -> bool: ...
