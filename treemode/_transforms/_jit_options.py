"""`treemode.jit`'s options, resolved once per wrapper (`JitOptions`), and what an
entry's ``jax.jit`` functions are given from them for one call structure: the
keyword arguments, and the shardings of the flat arrays.

The options are spelled out where users see them (the signatures of ``jit`` and
``jit_partial``, and `JitOptionsDict` for the overloads); everywhere else they
travel as one frozen `JitOptions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict

import jax

from .._errors import DonationError
from .._pipeline import _call
from .._tree._flatten import ArgFlat
from .._tree._specs import DYNAMIC, VarSpec
from ._axes import graph_prefix_values
from ._prefix import broadcast_to_dynamic, decode_flax_prefixes, graph_output_prefix
from ._signature import UNSPECIFIED, as_tuple, resolve_argnums

_UNSET: Any = UNSPECIFIED


class JitOptionsDict(TypedDict, total=False):
    """The keyword options of `treemode.jit` (and `jit_partial`), for the overloads."""

    in_shardings: Any
    out_shardings: Any
    static_argnums: int | Sequence[int] | None
    static_argnames: str | Iterable[str] | None
    donate_argnums: int | Sequence[int] | None
    donate_argnames: str | Iterable[str] | None
    keep_unused: bool
    device: Any
    backend: str | None
    inline: bool
    compiler_options: dict[str, Any] | None
    graph: bool


# Each option's default (as in the signature of ``treemode.jit``).
DEFAULTS: dict[str, Any] = dict(
    in_shardings=UNSPECIFIED,
    out_shardings=UNSPECIFIED,
    static_argnums=None,
    static_argnames=None,
    donate_argnums=None,
    donate_argnames=None,
    keep_unused=False,
    device=None,
    backend=None,
    inline=False,
    compiler_options=None,
    graph=False,
)


def with_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every option ``treemode.jit`` takes (unknown ones refused)."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"treemode.jit: unexpected keyword argument(s) {sorted(unknown)}")
    return {**DEFAULTS, **options}


def options_key(options: dict[str, Any]) -> tuple[Any, ...]:
    """The options as given, as a key (``compiler_options`` by its items): what the
    wrappers of one function share their state under. May be unhashable."""
    return tuple(
        (name, tuple(sorted(value.items())) if isinstance(value, dict) else value)
        for name, value in sorted(options.items())
    )


@dataclasses.dataclass(frozen=True)
class JitOptions:
    """The options of one `treemode.jit` wrapper, resolved (`resolve`): argument
    numbers and names checked against the function, Flax prefixes decoded."""

    in_shardings: Any
    out_shardings: Any
    # What JAX matches against the outputs: with graph=True they are `to_tree`'s form.
    jax_out_shardings: Any
    static_argnums: frozenset[int]
    static_argnames: frozenset[str]
    donate_argnums: frozenset[int]
    donate_argnames: frozenset[str]
    keep_unused: bool
    device: Any
    backend: str | None
    inline: bool
    compiler_options: dict[str, Any] | None
    graph: bool

    @classmethod
    def resolve(cls, fn: Callable[..., Any], **options: Any) -> JitOptions:
        """``treemode.jit``'s keyword ``options`` for ``fn``, checked and resolved."""
        graph = options["graph"]
        # Flax's graph-mode prefixes (nnx.prefix(..., graph=True)) made module-shaped.
        in_shardings = decode_flax_prefixes(
            options["in_shardings"], transform="jit", what="in_shardings"
        )
        out_shardings = decode_flax_prefixes(
            options["out_shardings"], transform="jit", what="out_shardings"
        )
        static_nums, static_names = _resolve(
            fn, options["static_argnums"], options["static_argnames"], "static"
        )
        donate_nums, donate_names = _resolve(
            fn, options["donate_argnums"], options["donate_argnames"], "donate"
        )
        clash = (static_nums & donate_nums) or (static_names & donate_names)
        if clash:
            raise DonationError(
                f"treemode.jit: argument(s) {sorted(clash)} are both static and donated. "
                "A static argument has no buffers to donate; remove it from "
                "donate_argnums/donate_argnames."
            )
        return cls(
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            jax_out_shardings=graph_output_prefix(out_shardings) if graph else out_shardings,
            static_argnums=static_nums,
            static_argnames=static_names,
            donate_argnums=donate_nums,
            donate_argnames=donate_names,
            keep_unused=options["keep_unused"],
            device=options["device"],
            backend=options["backend"],
            inline=options["inline"],
            compiler_options=options["compiler_options"],
            graph=graph,
        )

    def jit_kwargs(self, call: _call.Call) -> tuple[dict[str, Any], list[Any] | None]:
        """The keyword arguments of an entry's ``jax.jit`` functions for ``call``'s
        structure, and the sharding of each of its arrays (``None``: unspecified)."""
        kwargs: dict[str, Any] = dict(keep_unused=self.keep_unused, inline=self.inline)
        if self.device is not None:
            kwargs["device"] = self.device
        if self.backend is not None:
            kwargs["backend"] = self.backend
        if self.compiler_options is not None:
            kwargs["compiler_options"] = self.compiler_options
        in_shardings = None
        if self.in_shardings is not _UNSET:
            in_shardings = self.flat_in_shardings(call)
        if self.out_shardings is not _UNSET or self.in_shardings is not _UNSET:
            out = None if self.out_shardings is _UNSET else self.jax_out_shardings
            kwargs["out_shardings"] = (out, tuple(self._variable_shardings(call, in_shardings)))
        return kwargs, in_shardings

    def flat_in_shardings(self, call: _call.Call) -> list[Any]:
        """``in_shardings`` broadcast to one sharding per array of ``call``."""
        n_traced_pos = len(call.args) - len(call.static_positional)
        spec = self.in_shardings
        if not isinstance(spec, (tuple, list)):
            spec = (spec,) * n_traced_pos
        elif len(spec) != n_traced_pos:
            raise ValueError(
                f"treemode.jit: in_shardings has {len(spec)} entries but the function "
                f"is called with {n_traced_pos} traced positional argument(s). Give one "
                "entry per positional argument (static arguments excluded), or a single "
                "sharding for all."
            )
        if call.graph:
            # Broadcast over the objects as passed (a module-shaped prefix matches
            # them, not their to_tree form); one sharding per shared Variable.
            flat_shardings = graph_prefix_values(
                call, list(spec), is_sharding, None, "in_shardings"
            )
            return flat_shardings + [None] * (len(call.dynamic) - len(flat_shardings))
        flat_shardings: list[Any] = []
        roots: list[tuple[ArgFlat, Any]] = list(
            zip(call.arg_flats, [t for _, t in call.arg_roots()], strict=True)
        )
        for k, (flat, tree) in enumerate(roots):
            if k < n_traced_pos:
                flat_shardings += broadcast_to_dynamic(
                    spec[k],
                    flat,
                    tree,
                    is_prefix_leaf=is_sharding,
                    where=f"args[{k}]",
                    what="treemode.jit: in_shardings",
                )
            else:
                flat_shardings += [None] * len(flat.dynamic)
        flat_shardings += [None] * (len(call.dynamic) - len(flat_shardings))
        return flat_shardings

    def _variable_shardings(self, call: _call.Call, per_dyn: list[Any] | None) -> list[Any]:
        """Updates come back with the sharding their Variable went in with."""
        if per_dyn is None:
            return [None] * len(call.variables)
        out: list[Any] = []
        k = 0
        for flat in call.arg_flats:
            for spec in flat.specs:
                if type(spec) is VarSpec:
                    n = spec.num_dynamic
                    out.append(per_dyn[k] if n == 1 else None)
                    k += n
                elif spec is DYNAMIC:
                    k += 1
        out += [None] * (len(call.variables) - len(out))
        return out


def _resolve(
    fn: Callable[..., Any], argnums: Any, argnames: Any, what: str
) -> tuple[frozenset[int], frozenset[str]]:
    return resolve_argnums("jit", fn, as_tuple(argnums), as_tuple(argnames), what)


def is_sharding(x: Any) -> bool:
    return isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


__all__ = [
    "DEFAULTS",
    "JitOptions",
    "JitOptionsDict",
    "is_sharding",
    "options_key",
    "with_defaults",
]
