"""Which arrays of a call an autodiff transform differentiates.

`DiffSplit` splits a call's dynamic arrays into the differentiated ones and the
others: the floating-point (or complex, `is_differentiable`) arrays of the
differentiated arguments, less the Variables a Flax filter (``wrt=``, or an
``nnx.DiffState``'s, checked by `check_filter`) leaves out; and it rebuilds the
cotangents as trees of the arguments' own types, with `float0_zeros` where an
array was not differentiated. Shared by ``grad``, ``vjp`` and ``custom_vjp``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.nnx import filterlib

from .._pipeline import _call, _pure
from .._tree import _graph
from .._tree._leaves import is_variable
from .._tree._paths import nnx_path
from ._prefix import variables_once


def is_differentiable(x: Any) -> bool:
    """Whether a dynamic array is differentiated: floating point or complex.

    Integers, booleans and PRNG keys (``nnx.Rngs`` streams and counters) are not.
    A Python ``float`` or ``complex`` (``nnx.Param(1.0)``) is: under ``jit`` it
    is traced as a weakly typed float32 (complex64), and eager must agree.
    """
    if isinstance(x, (float, complex)):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def float0_zeros(x: Any) -> np.ndarray:
    """JAX's cotangent for an integer/boolean/key array: ``float0`` zeros."""
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


class DiffSplit:
    """Which dynamic arrays of a call are differentiated.

    ``roots`` are indices into ``call.arg_flats``: the differentiated arguments.
    Within them, `is_differentiable` arrays form ``diff``, except the values of
    Variables that ``wrt`` leaves out; all other dynamic arrays of the call
    (including the closure's) form ``other``.

    ``wrt`` maps a root to a Flax filter (``nnx.LoRAParam``, ``nnx.Not(...)``, a
    ``(path, variable)`` predicate): only the Variables of that argument the
    filter selects (paths from the argument, as Flax gives them) are
    differentiated; its arrays outside Variables are, as without a filter. A
    root not in ``wrt`` is differentiated whole.
    """

    def __init__(
        self,
        call: _call.Call,
        roots: Sequence[int],
        what: str = "argnums",
        wrt: Mapping[int, Any] | None = None,
    ):
        self.call = call
        self.roots = tuple(roots)
        selected = {k: _selected(call, k, f) for k, f in wrt.items()} if wrt else {}
        n_args = len(call.arg_flats)
        if call.graph and n_args > 1 and (n_args > len(self.roots) or selected):
            _check_shared_roots(call, self.roots, what, selected)
        ranges = call.root_dynamic_ranges()
        in_root = [False] * len(call.dynamic)
        for k in self.roots:
            for j in ranges[k]:
                in_root[j] = True
        self.in_root = in_root
        held = _held(call, selected) if selected else set()
        self.diff: list[int] = []
        self.other: list[int] = []
        for j, x in enumerate(call.dynamic):
            chosen = in_root[j] and j not in held and is_differentiable(x)
            (self.diff if chosen else self.other).append(j)

    def diff_values(self) -> list[Any]:
        return [self.call.dynamic[j] for j in self.diff]

    def other_values(self) -> list[Any]:
        return [self.call.dynamic[j] for j in self.other]

    def merge(self, diff: Sequence[Any], other: Sequence[Any]) -> list[Any]:
        """The full dynamic list from its two parts."""
        full: list[Any] = [None] * (len(self.diff) + len(self.other))
        for j, x in zip(self.diff, diff, strict=True):
            full[j] = x
        for j, x in zip(self.other, other, strict=True):
            full[j] = x
        return full

    def cotangent_trees(self, diff_cotangents: Sequence[Any]) -> list[Any]:
        """Per root, the cotangent rebuilt with the root argument's own structure.

        Arrays that were not differentiated (integers, keys, Variables that
        ``wrt`` leaves out) get ``float0`` zeros, which take no memory.
        """
        full = list(self.call.dynamic)  # arguments that are not roots keep their values
        for j, x in enumerate(full):
            if self.in_root[j]:
                full[j] = float0_zeros(x)
        for j, g in zip(self.diff, diff_cotangents, strict=True):
            full[j] = g
        trees = rebuild_arg_trees(self.call, full)
        return [trees[k] for k in self.roots]


def _selected(call: _call.Call, k: int, wrt: Any) -> dict[int, bool]:
    """Per Variable of traced argument ``k`` (by id): whether the filter ``wrt``
    selects it, at its first path in the argument as passed."""
    predicate = filterlib.to_predicate(wrt)
    root = _graph.original_roots(call)[k][1]
    return {id(var): bool(predicate(nnx_path(path), var)) for path, var in variables_once(root)}


def _held(call: _call.Call, selected: Mapping[int, dict[int, bool]]) -> set[int]:
    """The dynamic positions of the Variables that ``selected`` leaves out."""
    held: set[int] = set()
    var_ranges = call.root_variable_ranges()
    dynamic_ranges = call.variable_dynamic_ranges()
    for k, flags in selected.items():
        for v in var_ranges[k]:
            if not flags.get(id(call.variables[v]), True):
                held.update(dynamic_ranges[v])
    return held


def _check_shared_roots(
    call: _call.Call,
    roots: tuple[int, ...],
    what: str,
    selected: Mapping[int, dict[int, bool]],
) -> None:
    """``graph=True``: a Variable shared by a differentiated and another argument
    (or left out by ``wrt`` at one of its places) is an error."""
    per_root = []
    for k, (name, original) in enumerate(_graph.original_roots(call)):
        leaves = jax.tree_util.tree_leaves(original, is_leaf=is_variable)
        flags = selected.get(k, {})
        diff = k in roots
        per_root.append((name, original, [diff and flags.get(id(x), True) for x in leaves]))
    _graph.check_one_spec_per_variable(
        call.transform,
        what,
        per_root,
        describe=lambda diff: "differentiated" if diff else "not differentiated",
    )


def rebuild_arg_trees(call: _call.Call, dynamic: Sequence[Any]) -> list[Any]:
    """Per traced argument (``arg_flats`` order), the tree rebuilt from ``dynamic``.

    Variables are new objects of the original types and metadata. With
    ``graph=True`` the shared references are restored.
    """
    inputs = _pure.PureFunction(call).rebuild_inputs(dynamic)
    trees = [a for i, a in enumerate(inputs.args) if i not in call.static_positional]
    trees += [inputs.kwargs[name] for name in call.kw_names]
    return trees


def check_filter(transform: str, wrt: Any, what: str = "wrt") -> None:
    """Raise ``TypeError`` if ``wrt`` is not a Flax filter."""
    if wrt is ...:
        return
    try:
        filterlib.to_predicate(wrt)
    except Exception as e:
        raise TypeError(
            f"treemode.{transform}: {what}={wrt!r} is not a Flax filter ({e}). Give a "
            "Variable type (nnx.LoRAParam), a tuple of them, a tag string, "
            "nnx.PathContains(...), nnx.Any/All/Not(...), a (path, variable) -> bool "
            "callable, or ... for every Variable."
        ) from None
