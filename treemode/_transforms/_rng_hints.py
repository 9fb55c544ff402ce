"""What to say when a mapping transform meets an unsplit ``nnx.Rngs``.

A stream of an ``nnx.Rngs`` holds one key (an ``RngKey``) and one counter (an
``RngCount``); mapping it needs a batch of keys, which `treemode.split_rngs`
and `treemode.fork_rngs` make. Broadcasting it instead gives every example the
same key, so every example draws the same numbers.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from flax import nnx

from .._errors import PUBLIC_MODULE, user_stacklevel
from .._tree._specs import DYNAMIC, VarSpec

if TYPE_CHECKING:
    from .._pipeline._call import Call


def is_rng_variable(x: Any) -> bool:
    """Whether ``x`` is the key or the counter of an ``nnx.Rngs`` stream."""
    return isinstance(x, (nnx.RngKey, nnx.RngCount))


def dynamic_variables(call: Call) -> list[Any]:
    """Per dynamic array of ``call``, the Variable it belongs to (``None``: not one)."""
    owners: list[Any] = []
    for flat in call.arg_flats:
        for spec, leaf in zip(flat.specs, flat.leaves, strict=True):
            if type(spec) is VarSpec:
                owners += [leaf] * spec.num_dynamic
            elif spec is DYNAMIC:
                owners.append(None)
    for var, spec in zip(call.lifted, call.lifted_specs, strict=True):
        owners += [var] * spec.num_dynamic
    return owners


def stream_path(path: str) -> str:
    """``args[0].rngs.dropout.count`` -> ``args[0].rngs.dropout`` (the stream)."""
    for suffix in (".count", ".key"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def axis_hint(call: Call, index: int, path: str) -> str:
    """An extra sentence for a mapping error about dynamic array ``index`` at ``path``."""
    if not is_rng_variable(dynamic_variables(call)[index]):
        return ""
    return (
        f"\n{stream_path(path)} is a stream of an nnx.Rngs, which holds a single key: "
        "to map it, split it first, e.g. treemode.vmap(f)(treemode.split_rngs(rngs, "
        "splits=n), ...) (or treemode.fork_rngs(rngs, split=n)); to give every example "
        "the same key, broadcast it with in_axes=None."
    )


class BroadcastRngsWarning(UserWarning):
    """An ``nnx.Rngs`` broadcast into `treemode.vmap`/`pmap` was drawn from there.

    Broadcast (`in_axes=None`), every example reads the same key and counter, so
    every example draws the same numbers (the same dropout mask, say). Issued
    once per trace, naming the stream's path. Split the streams for the mapped
    axis with `treemode.split_rngs` (or `treemode.fork_rngs`), or filter this
    warning where the sharing is intended.

    ```python
    import warnings

    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    def noisy(rngs, x):
        return x + jax.random.normal(rngs(), ())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = treemode.vmap(noisy, in_axes=(None, 0))(nnx.Rngs(0), jnp.zeros(3))
    assert issubclass(caught[0].category, treemode.BroadcastRngsWarning)
    assert "args[0].default" in str(caught[0].message)
    assert len(set(same.tolist())) == 1

    rngs = treemode.split_rngs(nnx.Rngs(0), splits=3)
    different = treemode.vmap(noisy)(rngs, jnp.zeros(3))
    assert len(set(different.tolist())) == 3
    ```
    """

    __module__ = PUBLIC_MODULE  # shown as treemode.BroadcastRngsWarning


def warn_broadcast_draws(call: Call, variable_axes: Any, updates: Any, in_axes: Any) -> None:
    """Warn if a stream broadcast by a plain ``None`` axis was drawn from.

    Drawing advances the stream's ``RngCount``; broadcast, every example read
    the same key and counter, so they all got the same random numbers. A
    stream broadcast by a module-shaped ``in_axes`` prefix (a ``None`` chosen
    for it among other axes, e.g. with `treemode.prefix`) is deliberate and
    is not reported.
    """
    drawn = [
        i
        for i, (var, axis, update) in enumerate(
            zip(call.variables, variable_axes, updates, strict=True)
        )
        if axis is None and update is not None and isinstance(var, nnx.RngCount)
    ]
    if not drawn:
        return
    drawn = [i for i in drawn if _blanket_none(call, i, in_axes)]
    if not drawn:
        return
    paths = call.variable_paths()
    where = ", ".join(stream_path(paths[i]) for i in drawn)
    warnings.warn(
        f"treemode.{call.transform}: the nnx.Rngs stream(s) {where} are broadcast "
        "(in_axes None) and were drawn from inside the mapped function, so every "
        "example got the same random numbers. To draw different numbers per example, "
        "split them with treemode.split_rngs(rngs, splits=n) (or treemode.fork_rngs) "
        "and map them with in_axes=0; to broadcast on purpose, give the streams their "
        "None in a module-shaped in_axes (treemode.prefix) or filter "
        "treemode.BroadcastRngsWarning.",
        BroadcastRngsWarning,
        stacklevel=user_stacklevel(),
    )


def _blanket_none(call: Call, index: int, in_axes: Any) -> bool:
    """Whether Variable ``index`` is broadcast by a plain ``None`` for its whole argument."""
    roots = [k for k, rng in enumerate(call.root_variable_ranges()) if index in rng]
    if not roots:
        return True  # read through the closure: broadcast without being asked
    k = roots[0]
    positional = [i for i in range(len(call.args)) if i not in call.static_positional]
    if k >= len(positional):
        return False  # keyword arguments are mapped over axis 0
    if not isinstance(in_axes, (tuple, list)):
        return in_axes is None
    p = positional[k]
    return p < len(in_axes) and in_axes[p] is None
