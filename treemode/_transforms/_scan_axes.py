"""What the `in_axes` and `out_axes` of `treemode.scan` say about its carry.

`Carry` marks the argument threaded from step to step (and the new carry among
the function's outputs). Here each spec is checked (`Carry` a whole entry, at
most once, every output axis an int: `top_carry`, `reject_nested_carry`,
`check_out_axes`), and `OutSpec` splits what the function returns into the new
carry and the stacked outputs, and joins them again. The transform is
`treemode._transforms._scan`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from .._errors import AxisError
from .._tree._leaves import is_variable
from ._axes import is_axis, is_int_axis


class Carry:
    """Marks the loop carry in the `in_axes` / `out_axes` of `treemode.scan`.

    The argument marked `Carry` is threaded from one step to the next; the
    function returns its new value at the `Carry` position of `out_axes`.
    `flax.nnx.Carry` is accepted as well.
    """

    def __init__(self) -> None:
        raise TypeError("treemode.Carry is a marker: use the class itself, not an instance.")


def is_carry(x: Any) -> bool:
    """Whether ``x`` is the carry marker (`treemode.Carry` or ``flax.nnx.Carry``)."""
    return x is Carry or x is nnx.Carry


def is_spec_leaf(x: Any) -> bool:
    """Whether ``x`` is a whole entry of a scan's axes: an axis or the carry marker."""
    return is_axis(x) or is_carry(x)


def reject_nested_carry(spec: Any, what: str) -> None:
    """Raise if ``Carry`` appears anywhere inside ``spec`` (it must be a whole entry)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        spec, is_leaf=lambda x: x is None or is_carry(x) or is_variable(x)
    )[0]
    for path, leaf in leaves:
        value = leaf.get_raw_value() if is_variable(leaf) else leaf
        if is_carry(value):
            raise AxisError(
                f"treemode.scan: treemode.Carry appears inside {what}{jax.tree_util.keystr(path)}."
                " Carry marks a whole argument (or the whole new carry in out_axes), it "
                "cannot be nested in a prefix. Use e.g. in_axes=(Carry, 0) and put "
                "everything that is carried in that one argument."
            )


def top_carry(spec: Any, what: str) -> int | None:
    """Index of the ``Carry`` entry of a tuple spec; checks it appears at most once."""
    found: int | None = None
    for i, entry in enumerate(spec):
        if is_carry(entry):
            if found is not None:
                raise AxisError(
                    f"treemode.scan: Found multiple Carry definitions: treemode.Carry appears "
                    f"twice in {what}, at {what}[{found}] and {what}[{i}]. A scan has one "
                    "carry: put everything that is carried in one argument (a tuple or a "
                    "module)."
                )
            found = i
        else:
            reject_nested_carry(entry, f"{what}[{i}]")
    return found


def check_out_axes(spec: Any) -> None:
    """Raise unless every entry of ``out_axes`` is an int axis or the carry marker."""
    leaves = jax.tree_util.tree_flatten_with_path(
        spec, is_leaf=lambda x: x is None or is_carry(x) or is_variable(x)
    )[0]
    for path, leaf in leaves:
        value = leaf.get_raw_value() if is_variable(leaf) else leaf
        if value is None:
            raise AxisError(
                f"treemode.scan: out_axes{jax.tree_util.keystr(path)} is None. Cannot "
                "broadcast output state: scan stacks every output along an axis (one slice "
                "per step). Give an int axis; to get a value out of the last step, return "
                "it in the carry."
            )
        if not (is_int_axis(value) or is_carry(value)):
            raise AxisError(
                f"treemode.scan: out_axes{jax.tree_util.keystr(path)} is {value!r}; each "
                "entry must be an int axis or treemode.Carry."
            )


class OutSpec:
    """What the scanned function returns: the new carry and/or the stacked outputs.

    ``kind`` is ``"carry"`` (the function returns the carry), ``"tuple"`` (one
    entry per output, the carry at position ``carry``) or ``"ys"`` (no carry).
    """

    __slots__ = ("kind", "carry", "axes")

    def __init__(self, kind: str, carry: int | None, axes: Any):
        self.kind = kind
        self.carry = carry
        self.axes = axes

    def split(self, out: Any) -> tuple[Any, Any]:
        """``(new carry, outputs)`` from what the function returned."""
        if self.kind == "carry":
            return out, None
        if self.kind == "ys":
            return None, out
        n = len(self.axes)
        if not isinstance(out, (tuple, list)) or len(out) != n:
            got = (
                f"a {type(out).__name__} of length {len(out)}"
                if isinstance(out, (tuple, list))
                else f"a {type(out).__name__}"
            )
            raise AxisError(
                f"treemode.scan: out_axes={self.axes!r} has {n} entries, so the function "
                f"must return a tuple of {n} values (the new carry at position "
                f"{self.carry}); it returned {got}."
            )
        c = self.carry
        assert c is not None
        return out[c], (*out[:c], *out[c + 1 :])

    def join(self, carry: Any, ys: Any) -> Any:
        if self.kind == "carry":
            return carry
        if self.kind == "ys":
            return ys
        c = self.carry
        assert c is not None
        return (*ys[:c], carry, *ys[c:])

    def ys_axes(self) -> Any:
        if self.kind == "tuple":
            c = self.carry
            assert c is not None
            return (*self.axes[:c], *self.axes[c + 1 :])
        return self.axes
