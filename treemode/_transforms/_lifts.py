"""Flax's graph-mode lift objects, and Variable prefixes, refused when a transform is made.

Flax's graph mode selects state for a transform with filter objects:
``nnx.StateAxes`` (per-state ``in_axes``), ``nnx.StateSharding`` (per-state
shardings) and ``nnx.DiffState`` (per-state ``argnums``). Tree mode has no
such objects: the same selection is a module-shaped prefix built with
`treemode.prefix`. The grad family reads ``nnx.DiffState`` (``accepted``
below): it means the argument differentiated with ``wrt=`` its filter. Given
to a treemode transform they would fail at the first call with an unrelated
error (``'DiffState' object is not iterable``), or not at all, so
`refuse_lifts` checks a specification when the transform is created and
names the object, where it is, and the treemode form to use instead.

An axis specification may not hold a Variable either (``in_axes=(nnx.Param(0),)``,
or ``jax.tree.map(lambda _: 0, model)``, which keeps the Variables): an axis
applies to a whole Variable, so the prefix gives the axis in the Variable's
place (`treemode.prefix` builds that). Shardings are different: Flax's own
``nnx.get_partition_spec`` / ``nnx.get_named_sharding`` return Variables
holding the shardings, and treemode accepts those as they are.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import jax
from flax import nnx

from .._errors import AxisError
from .._tree._leaves import is_variable

_LIFT_NAMES = ("StateAxes", "StateSharding", "DiffState")
_LIFTS: tuple[type, ...] = tuple(
    t for t in (getattr(nnx, name, None) for name in _LIFT_NAMES) if isinstance(t, type)
)


def is_diff_state(x: Any) -> TypeGuard[nnx.DiffState]:
    """Whether ``x`` is an ``nnx.DiffState``: read (not refused) by the grad family,
    where it means argument ``argnum`` differentiated with ``wrt=filter``."""
    return isinstance(x, nnx.DiffState)


# The treemode form of each lift object, by the keyword it was given to.
_FIX = {
    "StateAxes": (
        "give a module-shaped prefix, with an axis in place of each Variable, as that "
        "argument's entry: treemode.prefix(model, {{nnx.BatchStat: 0, ...: None}}). "
        "See docs/migration.md#stateaxes."
    ),
    "StateSharding": (
        "give a module-shaped prefix of shardings as that argument's entry: "
        "treemode.prefix(model, {{nnx.Param: sharding, ...: None}}), or "
        "treemode.sharding_of(model, mesh). See docs/migration.md#statesharding."
    ),
    "DiffState": (
        "a DiffState chooses what to differentiate: give it to treemode.grad or "
        "value_and_grad as argnums (argnums=nnx.DiffState(0, nnx.LoRAParam), or "
        "wrt=nnx.LoRAParam), or to treemode.custom_vjp's nondiff_argnums; here "
        "select whole arguments by position ({what}=(1,)). See "
        "docs/migration.md#diffstate."
    ),
}


def _is_lift(x: Any) -> bool:
    return isinstance(x, _LIFTS)


def _is_sharding_value(x: Any) -> bool:
    """What a Variable of a sharding prefix may hold: a sharding, a spec, or None."""
    return x is None or isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


def refuse_lifts(
    spec: Any,
    *,
    transform: str,
    what: str,
    graph: bool,
    variables: bool = False,
    shardings: bool = False,
    graph_lifts: frozenset[str] = frozenset({"DiffState"}),
    accepted: frozenset[str] = frozenset(),
) -> None:
    """Raise `AxisError` if ``spec`` holds a Flax lift object (or, with
    ``variables=True``, a Variable) that ``transform`` cannot take.

    **Arguments:**

    - `spec`: the user's specification (``in_axes``, ``in_shardings``, ``argnums``, ...).
    - `transform`, `what`: the transform's and the keyword's names, for the message.
    - `graph`: the transform's ``graph=`` flag. Every lift object is refused
      with ``graph=False``; with ``graph=True`` only those named in `graph_lifts`
      (``StateAxes`` and ``StateSharding`` are then resolved against the object
      graph when the function is called, which names each Variable they reach).
    - `variables`: refuse Variables in the specification (axis specifications).
    - `shardings`: refuse Variables that hold no sharding (sharding specifications:
      Flax's ``nnx.get_named_sharding`` gives Variables holding shardings).
    - `accepted`: the lift objects the transform reads itself, in both modes
      (``{"DiffState"}`` for ``grad``'s ``argnums``).
    """
    if not _LIFTS and not variables and not shardings:
        return
    try:
        leaves = jax.tree_util.tree_flatten_with_path(
            spec,
            is_leaf=lambda x: _is_lift(x) or ((variables or shardings) and is_variable(x)),
        )[0]
    except Exception:  # an unflattenable spec: the call reports it with its path
        return
    for path, leaf in leaves:
        where = f"{what}{jax.tree_util.keystr(path)}"
        if _is_lift(leaf):
            name = type(leaf).__name__
            if name in accepted or (graph and name not in graph_lifts):
                continue
            mode = " in tree mode (graph=False)" if not graph else ""
            raise AxisError(
                f"treemode.{transform}: `{what}` cannot contain `{name}` objects{mode}: "
                f"{where} is an nnx.{name}, Flax's way to select state for its graph mode "
                "with graph updates, which treemode does not read. Fix: "
                + _FIX.get(name, _FIX["StateAxes"]).format(what=what)
            )
        if variables and is_variable(leaf):
            value = leaf.get_raw_value()
            kind = f"nnx.{type(leaf).__name__}"
            short = len(repr(value)) <= 40
            shown = repr(value) if short else f"a {type(value).__name__}"
            instead = f" ({shown} instead of {kind}({shown}))" if short else ""
            raise AxisError(
                f"treemode.{transform}: {where} is an {kind} holding {shown}. Variables "
                "prefixes are not supported: an axis applies to a whole Variable. Graph "
                "nodes are not allowed as prefixes unless an axis takes each Variable's "
                f"place. Fix: put the axis itself in the Variable's place{instead}; for a "
                "module, build the prefix with treemode.prefix(model, {filter: axis, ...}) "
                "rather than jax.tree.map, which keeps the Variables."
            )
        if shardings and is_variable(leaf) and not _is_sharding_value(leaf.get_raw_value()):
            value = leaf.get_raw_value()
            shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
            raise AxisError(
                f"treemode.{transform}: {where} is an nnx.{type(leaf).__name__} holding "
                f"{shown}, not a sharding. Graph nodes are not allowed as prefixes unless "
                "each Variable in them holds its sharding (as nnx.get_named_sharding "
                "returns) or is replaced by it. Fix: give a module-shaped prefix of "
                "shardings: treemode.sharding_of(model, mesh), or treemode.prefix(model, "
                "{nnx.Param: sharding, ...: None})."
            )
