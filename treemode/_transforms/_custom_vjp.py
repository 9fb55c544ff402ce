"""``treemode.custom_vjp``: ``jax.custom_vjp`` over Modules and pytrees.

The user's function, ``fwd`` and ``bwd`` are wrapped around one
``jax.custom_vjp`` of the flat dynamic arrays of the call:

- the primal function and ``fwd`` run through the core's pure function (fresh
  Variables, closure lifting, structure and alias checks, update detection);
- ``fwd`` saves the user's residuals (their arrays go to JAX, their other leaves
  are kept on the Python side) and the primal arrays, so that ``bwd`` can rebuild
  the ``nondiff_argnums`` arguments;
- ``bwd`` gets ``(*nondiff_args, residuals, output_cotangent)`` and returns one
  cotangent per differentiable argument, of the argument's own type; they are
  laid back out over the flat arrays (``float0`` for integer and key arrays, zeros
  for non-differentiable arguments and closure Variables).

JAX keeps ``fwd`` and ``bwd`` alive with the jaxpr it caches (and may trace
``fwd`` after the call returned; JAX 0.11 also keeps the primal function, which
its bwd equation refers to), so none of the three holds the ``Call`` once the
call returned: its arguments hold the tracers of the trace it was prepared in.
``fwd`` and ``bwd`` rebuild the call's structure from the primal arrays they
receive; the primal function reaches the ``Call`` only while the call runs.

Variable updates are an extra output of the JAX function and are written back.
Their cotangents reach ``bwd`` only if it asks for them, as Flax's tree mode
does: a ``bwd`` with a parameter named ``updates_g`` (or ``**kwargs``) gets
``updates_g=``, one entry per argument with the argument's structure, ``None``
everywhere except a Variable holding the cotangent of each Variable's new value.
Such a ``bwd`` accounts for the updates, so the function may change
differentiable Variables; a plain ``bwd(res, g)`` gets no cotangent for them,
so changing a differentiable Variable (a floating-point Variable of a
differentiable argument) then raises `MutationError`: the gradient through its
new value would be silently lost.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from .. import _compat
from .._errors import ClosureError, MutationError
from .._pipeline import _call, _core, _pure, _writeback
from .._tree import _graph
from .._tree._leaves import ARRAY_TYPES, is_variable
from ._grad import dynamic_like
from ._grad_wrt import DiffSplit, check_filter, float0_zeros, is_differentiable
from ._lifts import is_diff_state, refuse_lifts
from ._signature import as_tuple, resolve_argnums, suggests_keywords
from ._wrapped import Wrapped

P = ParamSpec("P")
R = TypeVar("R")


class CustomVjp(Wrapped[P, R]):
    """A function with a custom VJP, made by `treemode.custom_vjp`."""

    transform = "custom_vjp"

    def __init__(
        self,
        fn: Callable[P, R],
        nondiff_argnums: Sequence[int] = (),
        graph: bool = False,
        diff_filters: dict[int, Any] | None = None,
    ):
        self._wrap(fn)
        self.nondiff_argnums = tuple(sorted(set(nondiff_argnums)))
        # nnx.DiffState(i, filter) in nondiff_argnums: argument i is differentiated
        # with respect to the Variables the filter selects only.
        self.diff_filters = dict(diff_filters or {})
        self.graph = graph
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None
        self.bwd_takes_updates = False

    @property
    def fun(self) -> Callable[P, R]:
        """The primal function (Flax's name for `fn`)."""
        return self.fn

    def defvjp(
        self,
        fwd: Callable[..., tuple[Any, Any]],
        bwd: Callable[..., tuple[Any, ...]],
        symbolic_zeros: bool = False,
    ) -> None:
        """Define the forward and backward rules.

        **Arguments:**

        - `fwd`: takes the same arguments as the function and returns
          `(output, residuals)`. Residuals may hold Modules.
        - `bwd`: takes `(*nondiff_args, residuals, output_cotangent)` and returns a
          tuple with one cotangent per differentiable argument, of the argument's
          own type (a Module of the same class for a Module; `None` for zeros).
          If it has a parameter named `updates_g` (or `**kwargs`), it is also
          given `updates_g=`: the cotangents of the Variables the function
          changed, as a tuple with one entry per argument of the argument's
          structure (`None` in place of every other Variable and leaf), as in
          Flax's tree mode. The function may then change differentiable
          Variables; without it, that raises `MutationError`.
        - `symbolic_zeros`: not supported (must be `False`).

        **Returns:**

        `None`; the rules are stored on the function.

        ```python
        import jax
        import jax.numpy as jnp
        import treemode

        @treemode.custom_vjp
        def double(x):
            return 2 * x

        double.defvjp(lambda x: (2 * x, None), lambda res, g: (2 * g,))
        assert jax.grad(double)(1.0) == 2.0
        ```
        """
        if symbolic_zeros:
            raise NotImplementedError(
                "treemode.custom_vjp: symbolic_zeros=True is not supported; use "
                "jax.custom_vjp directly on arrays for that."
            )
        self.fwd = fwd
        self.bwd = bwd
        self.bwd_takes_updates = _takes_updates_g(bwd)

    # -- the closure search does not see through it (treemode._transforms._wrapped) ----

    # JAX keeps the rules with the jaxpr it caches, past the trace: copies of them
    # reaching an outer trace's modules would keep its tracers alive.
    _closure_refusal = (
        "a custom_vjp function, whose rules JAX keeps past the trace (treemode cannot "
        "hand them an outer trace's copy): pass the module as an argument of the "
        "custom_vjp function"
    )

    def _closure_reads(self) -> dict[str, Any] | None:
        return None

    @_compat.api_boundary
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.fwd is None or self.bwd is None:
            raise TypeError(
                f"treemode.custom_vjp: no rules defined for {getattr(self.fn, '__name__', '')}"
                "; call .defvjp(fwd, bwd) before calling the function."
            )
        args_t = _resolve_kwargs(self.fn, args, kwargs)
        for i in self.nondiff_argnums:
            if not 0 <= i < len(args_t):
                raise TypeError(
                    f"treemode.custom_vjp: nondiff_argnums contains {i}, but the function "
                    f"was called with {len(args_t)} positional argument(s)."
                )
        wrt: dict[int, Any] = {}
        for i, f in self.diff_filters.items():
            j = i + len(args_t) if i < 0 else i
            if not 0 <= j < len(args_t):
                raise TypeError(
                    f"treemode.custom_vjp: nondiff_argnums holds nnx.DiffState({i}, ...), "
                    f"but the function was called with {len(args_t)} positional "
                    "argument(s)."
                )
            wrt[j] = f
        call = _call.prepare("custom_vjp", self.fn, args_t, {}, graph=self.graph)
        diff_args = [i for i in range(len(args_t)) if i not in self.nondiff_argnums]
        split = DiffSplit(call, diff_args, "nondiff_argnums", wrt=wrt)
        # A bwd taking updates_g gets the updates' cotangents: updates are then allowed.
        takes_updates = self.bwd_takes_updates
        protected = [] if takes_updates else _protected_variables(call, split)
        primal = _pure.PureFunction(call)
        fwd_pure = _pure.PureFunction(call, allow_output_variables=True)
        fwd_pure.fn = self.fwd
        residual_structure: list[Any] = []
        user_bwd = self.bwd
        nondiff = self.nondiff_argnums
        graph = self.graph
        fn = self.fn
        key = call.key
        # JAX keeps fwd and bwd alive in the jaxpr it caches, so they must not
        # reach ``call``: its arguments hold the tracers of the current trace. They
        # rebuild the call from their own primal values (same structure, arrays of
        # the trace they run in) with this structure-only function instead.
        rebuilder = _pure.PureFunction(call)

        def call_from(dynamic: Sequence[Any], lift_closure: bool) -> _call.Call:
            # JAX may hand back a Python scalar for a primal that was one (jax.grad
            # of f(1.0)); as an array it stays dynamic, as it was in ``call``.
            dynamic = [x if isinstance(x, ARRAY_TYPES) else jnp.asarray(x) for x in dynamic]
            inputs = rebuilder.rebuild_inputs(dynamic)
            again = _call.prepare(
                "custom_vjp", fn, inputs.args, {}, graph=graph, lift_closure=lift_closure
            )
            if lift_closure and again.key.lifted != key.lifted:
                raise ClosureError(
                    "treemode.custom_vjp: the Variables the function reaches through its "
                    "closure changed (new, removed or replaced Variables) between the call "
                    "and the moment JAX traced its fwd rule.\nDo not change the structure "
                    "of closed-over modules while a transform of this function is running; "
                    "pass the module as an argument instead."
                )
            return again

        def run(pure: _pure.PureFunction, c: _call.Call, dynamic: Sequence[Any]) -> tuple[Any, Any]:
            with _core.bound(pure, c):
                out, updates = pure(*dynamic)
            _check_no_mutation(c, protected, updates)
            return out, updates

        # The primal function reaches ``call`` only while this call runs: JAX
        # traces (or runs) it inside the ``flat(...)`` below, but may keep the
        # function itself afterwards (JAX 0.11's bwd equation refers to it). Run
        # after the call, it rebuilds the call as fwd does.
        current = [call]

        @jax.custom_vjp
        def flat(*dynamic: Any) -> tuple[Any, Any]:
            c = current[0] if current else call_from(dynamic, lift_closure=True)
            return run(primal, c, dynamic)

        def flat_fwd(*primals: Any) -> tuple[Any, Any]:
            dynamic = [p.value for p in primals]
            fwd_call = call_from(dynamic, lift_closure=True)  # may run after the call
            _check_closure_not_differentiated(fwd_call, primals)
            out, updates = run(fwd_pure, fwd_call, dynamic)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    "treemode.custom_vjp: fwd must return a pair (output, residuals), got "
                    f"a {type(out).__name__}."
                )
            if graph:  # encode the residuals' sharing on their own, for bwd
                residuals = _graph.to_tree(_graph.from_tree(out)[1])
                out = out[0]
            else:
                out, residuals = out
            leaves, treedef = jax.tree_util.tree_flatten(residuals)
            is_arr = [isinstance(x, ARRAY_TYPES) for x in leaves]
            residual_structure[:] = [
                treedef,
                is_arr,
                [None if a else x for x, a in zip(leaves, is_arr, strict=True)],
            ]
            arrays = [x for x, a in zip(leaves, is_arr, strict=True) if a]
            return (out, updates), (arrays, list(dynamic))

        def flat_bwd(saved: Any, cotangents: Any) -> tuple[Any, ...]:
            arrays, dynamic = saved
            out_ct = jax.tree_util.tree_map(_instantiate, cotangents[0])
            treedef, is_arr, statics = residual_structure
            it = iter(arrays)
            residuals = treedef.unflatten(
                [next(it) if a else s for a, s in zip(is_arr, statics, strict=True)]
            )
            if graph:
                residuals = _graph.from_tree(residuals)
            bwd_call = call_from(dynamic, lift_closure=False)
            bwd_split = DiffSplit(bwd_call, diff_args, wrt=wrt)
            nondiff_args = [bwd_call.args[i] for i in nondiff]
            if graph:
                out_ct = _graph.from_tree(out_ct)
            extra: dict[str, Any] = {}
            if takes_updates:
                extra["updates_g"] = _updates_cotangents(bwd_call, cotangents[1])
            result = user_bwd(*nondiff_args, residuals, out_ct, **extra)
            if not isinstance(result, (tuple, list)) or len(result) != len(diff_args):
                got = (
                    f"a {type(result).__name__} of length {len(result)}"
                    if isinstance(result, (tuple, list))
                    else f"a {type(result).__name__}"
                )
                raise TypeError(
                    "treemode.custom_vjp: bwd must return a tuple with one cotangent per "
                    f"differentiable argument ({len(diff_args)}: args "
                    f"{diff_args}), but it returned {got}."
                )
            diff_cts = dynamic_like(
                bwd_call,
                bwd_split,
                list(result),
                transform="custom_vjp",
                what="cotangent",
                names=[f"args[{i}]" for i in diff_args],
            )
            cts: list[Any] = [
                float0_zeros(x) if not is_differentiable(x) else jnp.zeros_like(x) for x in dynamic
            ]
            for j, g in zip(bwd_split.diff, diff_cts, strict=True):
                cts[j] = g
            return tuple(cts)

        # symbolic_zeros: fwd learns which inputs the outer transform differentiates
        flat.defvjp(flat_fwd, flat_bwd, symbolic_zeros=True)

        def jax_call() -> tuple[Any, Any]:
            try:
                out, updates = flat(*call.dynamic)
            finally:
                current.clear()
            record = primal.findings.metadata_updates or fwd_pure.findings.metadata_updates
            return out, _writeback.WriteBack(call, updates, record)

        # ``flat`` binds the call itself (``run`` above), as its rules do.
        return _core.run(call, (), jax_call)


def _instantiate(x: Any) -> Any:
    if isinstance(x, SymbolicZero):
        aval: Any = x.aval
        if aval.dtype == jax.dtypes.float0:
            return np.zeros(aval.shape, dtype=jax.dtypes.float0)
        return jnp.zeros(aval.shape, aval.dtype)
    return x


def _takes_updates_g(bwd: Callable[..., Any]) -> bool:
    """Whether ``bwd`` asks for the updates' cotangents (``updates_g`` or ``**kwargs``)."""
    try:
        params = inspect.signature(bwd).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "updates_g" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


def _updates_cotangents(call: _call.Call, update_cts: Sequence[Any]) -> tuple[Any, ...]:
    """``updates_g``: per positional argument, its structure with ``None`` everywhere
    except a Variable (same type and metadata) holding the cotangent of each changed
    Variable's new value."""
    changed: dict[int, Any] = {}
    for var, ct in zip(call.variables, update_cts, strict=False):  # closure ones last
        if ct is not None:
            changed[id(var)] = var.replace(jax.tree_util.tree_map(_instantiate, ct))

    def mask(x: Any) -> Any:
        return changed.get(id(x)) if is_variable(x) else None

    return tuple(jax.tree_util.tree_map(mask, a, is_leaf=is_variable) for a in call.args)


def _check_closure_not_differentiated(call: _call.Call, primals: Sequence[Any]) -> None:
    """JAX cannot differentiate a custom_vjp function w.r.t. values it closes over."""
    n_args = sum(len(f.dynamic) for f in call.arg_flats)
    closure = call.variable_dynamic_ranges()[len(call.variables) - len(call.lifted) :]
    for i, r in enumerate(closure):
        if any(primals[j].perturbed and is_differentiable(primals[j].value) for j in r):
            assert r.start >= n_args
            var = call.lifted[i]
            path = call.variable_paths()[len(call.variables) - len(call.lifted) + i]
            raise ClosureError(
                f"treemode.custom_vjp: the function reads the {type(var).__name__} at "
                f"{path} through its closure, and an outer transform differentiates it. "
                "A custom VJP rule only gives cotangents for the function's arguments, so "
                "that gradient would be lost.\nPass the module as an argument of the "
                "custom_vjp function and return its cotangent from bwd."
            )


def _protected_variables(call: _call.Call, split: DiffSplit) -> list[int]:
    """Indices (``call.variables`` order) of the differentiable Variables."""
    diff = set(split.diff)
    return [i for i, r in enumerate(call.variable_dynamic_ranges()) if any(j in diff for j in r)]


def _check_no_mutation(call: _call.Call, protected: list[int], updates: Sequence[Any]) -> None:
    changed = [i for i in protected if updates[i] is not None]
    if changed:
        path = call.variable_paths()[changed[0]]
        var = call.variables[changed[0]]
        raise MutationError(
            f"treemode.custom_vjp: the function changed the differentiable "
            f"{type(var).__name__} at {path}. Its new value would have no cotangent, so "
            "the gradient would be silently wrong.\nGive bwd a parameter named "
            "updates_g to receive the cotangents of the updates (bwd(res, g, updates_g)) "
            "and account for them; or update differentiable Variables outside the "
            "function, or pass the state you need to update in an argument listed in "
            "nondiff_argnums (or as integer Variables, which are not differentiated)."
        )


def _resolve_kwargs(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    if not kwargs:
        return tuple(args)
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"treemode.custom_vjp: {e}") from None
    bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(
            "treemode.custom_vjp: keyword-only arguments "
            f"{sorted(bound.kwargs)} are not supported; make them positional."
        )
    return tuple(bound.args)


@overload
def custom_vjp(
    fun: Callable[P, R],
    nondiff_argnums: Sequence[int | nnx.DiffState] = ...,
    nondiff_argnames: Sequence[str] = ...,
    *,
    graph: bool = ...,
) -> CustomVjp[P, R]: ...


@overload
def custom_vjp(
    fun: None = None,
    nondiff_argnums: Sequence[int | nnx.DiffState] = ...,
    nondiff_argnames: Sequence[str] = ...,
    *,
    graph: bool = ...,
) -> Callable[[Callable[P, R]], CustomVjp[P, R]]: ...


@suggests_keywords
def custom_vjp(
    fun: Callable[P, R] | None = None,
    nondiff_argnums: Sequence[int | nnx.DiffState] = (),
    nondiff_argnames: Sequence[str] = (),
    *,
    graph: bool = False,
) -> Any:
    """``jax.custom_vjp`` for functions of Modules and pytrees.

    The backward rule returns cotangents of the inputs' own types: for a Module
    argument, a Module of the same class holding the cotangents in its Variables
    (as `jax.custom_vjp` does for any pytree). Integer and key Variables need no
    cotangent (whatever `bwd` puts there is replaced by `float0` zeros).
    Variables changed by the function are written back, except that changing a
    differentiable Variable (floating point, in a differentiable argument) raises
    `MutationError`: its update would have no gradient. Variables the function
    reaches through its closure are constants for the custom rule; if an outer
    transform differentiates them, a `TypeError` says so (as JAX does for
    closed-over tracers) instead of dropping that gradient.

    **Arguments:**

    - `fun`: the function. Omit it to use `custom_vjp(nondiff_argnums=...)` as a
      decorator.
    - `nondiff_argnums`, `nondiff_argnames`: arguments (by position or by name)
      that are not differentiated; they are passed first to `bwd`, in
      positional order, as in JAX. An `nnx.DiffState(i, filter)` among
      `nondiff_argnums` keeps argument `i` differentiated, with respect to the
      Variables `filter` selects only (as Flax's graph mode reads it): the
      others are constants of the rule, may be changed by the function, and
      whatever `bwd` returns at their places is ignored.
    - `graph`: if `True`, inputs may share Modules/Variables (see `to_tree`).

    **Returns:**

    A `CustomVjp` callable; define its rules with `.defvjp(fwd, bwd)`.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Foo(nnx.Module):
        def __init__(self):
            self.x = nnx.Param(jnp.array(1.0))
            self.y = nnx.Param(jnp.array(2.0))

    @treemode.custom_vjp
    def f(m: Foo):
        return jnp.sin(m.x[...]) * m.y[...]

    def f_fwd(m: Foo):
        return f(m), (jnp.cos(m.x[...]), jnp.sin(m.x[...]), m)

    def f_bwd(res, g):
        cos_x, sin_x, m = res
        m_g = nnx.clone(m)
        m_g.x[...] = cos_x * g * m.y[...]
        m_g.y[...] = sin_x * g
        return (m_g,)

    f.defvjp(f_fwd, f_bwd)
    grads = treemode.grad(f)(Foo())
    assert jnp.allclose(grads.x[...], jnp.cos(1.0) * 2.0)
    assert jnp.allclose(grads.y[...], jnp.sin(1.0))
    ```
    """

    refuse_lifts(
        nondiff_argnums,
        transform="custom_vjp",
        what="nondiff_argnums",
        graph=graph,
        accepted=frozenset({"DiffState"}),
    )
    ints = tuple(i for i in nondiff_argnums if isinstance(i, int))
    for d in nondiff_argnums:
        if not isinstance(d, int) and not is_diff_state(d):
            raise TypeError(
                "treemode.custom_vjp: nondiff_argnums holds ints and nnx.DiffState "
                f"objects, got {d!r}."
            )
    diff_filters: dict[int, Any] = {}
    for d in nondiff_argnums:
        if is_diff_state(d):
            check_filter("custom_vjp", d.filter, "nnx.DiffState filter")
            if d.argnum in diff_filters or d.argnum in ints:
                raise ValueError(
                    f"treemode.custom_vjp: argnum {d.argnum} is repeated in nondiff_argnums."
                )
            diff_filters[d.argnum] = d.filter

    def make(f: Callable[P, R]) -> CustomVjp[P, R]:
        nums, _ = resolve_argnums("custom_vjp", f, ints, as_tuple(nondiff_argnames), "nondiff")
        return CustomVjp(f, tuple(nums), graph, diff_filters)

    if fun is None:
        return make
    return make(fun)
