"""``treemode.grad`` / ``treemode.value_and_grad``, and the helpers every autodiff
transform of treemode shares to read the user's tangent and cotangent trees and
check a function's output (which arrays are differentiated, and the cotangents
rebuilt as trees of the arguments' own types, are `treemode._transforms._grad_wrt`).

How ``grad`` works: the core flattens the arguments (Variables as leaves) into a
list of dynamic arrays. Only the floating-point (or complex) arrays of the
``argnums`` arguments are handed to ``jax.value_and_grad`` as the differentiated
input; everything else (integer counters, PRNG keys, the other arguments,
Variables lifted from the function's closure) is passed as a second,
non-differentiated input. The Variable updates computed by the core ride along as
``aux`` and are written back after the call. The gradient of each argument is
rebuilt with the argument's own structure: a Module of the same class whose
Variables hold the cotangents, and ``float0`` zeros (JAX's tangent type for
integers and keys) in place of the non-differentiable Variables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, Protocol, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import filterlib

from .. import _compat
from .._errors import ArgnumsError, StructureError
from .._pipeline import _call, _core, _pure
from .._tree import _graph
from .._tree._aliases import first_duplicate
from .._tree._leaves import ARRAY_TYPES, is_graph_node, is_variable
from .._tree._paths import format_path
from .._tree._specs import DYNAMIC, StaticLeaf, VarSpec
from ._grad_wrt import DiffSplit, check_filter, is_differentiable
from ._lifts import is_diff_state, refuse_lifts
from ._named_errors import TRACER_ERRORS, at_top_level, raise_named, trace_named
from ._names import named
from ._signature import check_reduce_axes, suggests_keywords

# ---------------------------------------------------------------------------
# Shared helpers (used by _vjp, _custom_vjp): user trees, outputs
# ---------------------------------------------------------------------------


def dynamic_like(
    call: _call.Call,
    split: DiffSplit,
    trees: Sequence[Any],
    *,
    transform: str,
    what: str,
    names: Sequence[str],
) -> list[Any]:
    """Values for ``split.diff`` taken from user trees shaped like the root arguments.

    ``trees`` has one entry per root (a tangent or a cotangent with the
    argument's structure; ``None`` means zeros). Non-differentiable positions are
    ignored (the caller uses ``float0`` there).
    """
    trees = list(trees)
    if call.graph:
        # Encode sharing exactly as prepare() did: same positions, same order.
        pos = [a for i, a in enumerate(call.args) if i not in call.static_positional]
        kw = {n: call.kwargs[n] for n in call.kw_names}
        n_pos = len(pos)
        for k, t in zip(split.roots, trees, strict=True):
            if t is None:
                continue
            if k < n_pos:
                pos[k] = t
            else:
                kw[call.kw_names[k - n_pos]] = t
        pos, kw = _graph.to_tree((pos, kw))
        encoded = [*pos, *(kw[n] for n in call.kw_names)]
        trees = [None if t is None else encoded[k] for k, t in zip(split.roots, trees, strict=True)]
    ranges = call.root_dynamic_ranges()
    values: dict[int, Any] = {}
    for name, k, tree in zip(names, split.roots, trees, strict=True):
        flat = call.arg_flats[k]
        start = ranges[k].start
        if tree is None:
            for j in ranges[k]:
                values[j] = jnp.zeros_like(call.dynamic[j])
            continue
        try:
            leaves = flat.treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as e:
            if call.graph:
                _raise_unshared(call, k, name, transform, what)
            raise StructureError(
                f"treemode.{transform}: the {what} for {name} does not have the structure "
                f"of the argument ({type(tree).__name__} given for a "
                f"{type(call.arg_roots()[k][1]).__name__}).\n"
                f"Give a {what} of the argument's own type (for a Module: a Module of the "
                f"same class, e.g. built with jax.tree.map over it), or None for zeros.\n"
                f"Details: {e}"
            ) from None
        j = start
        for index, (spec, leaf) in enumerate(zip(flat.specs, leaves, strict=True)):
            if type(spec) is VarSpec:
                raw = leaf.get_raw_value() if is_variable(leaf) else leaf
                if spec.value_def is None:
                    parts = [raw]
                else:
                    sub = jax.tree_util.tree_leaves(raw)
                    if len(sub) != len(spec.value_static):
                        _raise_leaf(call, k, index, name, transform, what, "wrong structure")
                    parts = [x for x, s in zip(sub, spec.value_static, strict=True) if s is None]
                for x in parts:
                    values[j] = _checked(call, k, index, name, transform, what, x, j)
                    j += 1
            elif spec is DYNAMIC:
                values[j] = _checked(call, k, index, name, transform, what, leaf, j)
                j += 1
            else:
                assert isinstance(spec, StaticLeaf)
    return [values[j] for j in split.diff]


def _checked(
    call: _call.Call, k: int, index: int, name: str, transform: str, what: str, x: Any, j: int
) -> Any:
    primal = call.dynamic[j]
    if not is_differentiable(primal):
        return None  # float0 is used by the caller
    if x is None:
        return jnp.zeros_like(primal)
    if np.shape(x) != np.shape(primal):
        _raise_leaf(
            call,
            k,
            index,
            name,
            transform,
            what,
            f"shape {np.shape(x)} where the argument has shape {np.shape(primal)}",
        )
    return x


def _raise_unshared(call: _call.Call, k: int, name: str, transform: str, what: str) -> None:
    """``graph=True``: a tangent/cotangent that does not share objects as its primal does.

    Returns if the primal has no shared Variable (the plain structure error applies).
    """
    primal = _graph.original_roots(call)[k][1]
    shared = first_duplicate([(name, primal)])
    if shared is None:
        return
    var, first, second = shared
    raise StructureError(
        f"treemode.{transform}: the {what} for {name} does not share objects as the "
        f"argument does: in graph mode the {type(var).__name__} at {first} is also at "
        f"{second}, so the {what} must hold one object at both paths too (a {what} built "
        f"with jax.tree.map over a {type(primal).__name__} holds two separate copies).\n"
        f"Build the {what} from a copy that keeps the sharing, e.g. "
        "`t = nnx.clone(m); nnx.update(t, jax.tree.map(jnp.ones_like, nnx.state(t)))`, "
        "or pass None for zeros."
    ) from None


def _raise_leaf(
    call: _call.Call, k: int, index: int, name: str, transform: str, what: str, problem: str
) -> None:
    root, tree = call.arg_roots()[k]
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
    path = format_path(flat[index][0], name) if index < len(flat) else name
    raise StructureError(
        f"treemode.{transform}: the {what} at {path} has {problem}.\n"
        f"Each {what} must match the value it belongs to (same shape; for a Module, "
        "a Module of the same class)."
    )


def to_array_args(args: tuple[Any, ...], positions: Sequence[int]) -> tuple[Any, ...]:
    """Python numbers among the differentiated arguments become arrays, as in JAX."""
    out = list(args)
    for i in positions:
        if i < len(out):
            out[i] = _numbers_to_arrays(out[i])
    return tuple(out)


def _numbers_to_arrays(x: Any) -> Any:
    # ``device_put`` keeps a Python number weakly typed, as ``jax.grad`` does.
    if isinstance(x, (float, complex, int)) and not isinstance(x, bool):
        return jax.device_put(x)
    if isinstance(x, (tuple, list, dict)):
        return jax.tree_util.tree_map(
            lambda v: (
                jax.device_put(v)
                if isinstance(v, (float, complex, int)) and not isinstance(v, bool)
                else v
            ),
            x,
            is_leaf=lambda v: is_variable(v) or is_graph_node(v),
        )
    return x


def check_scalar(transform: str, loss: Any, holomorphic: bool) -> None:
    """``grad`` needs a real (or, holomorphic, complex) scalar output."""
    try:
        shape: tuple[int, ...] | None = jnp.shape(loss)
    except TypeError:
        shape = None
    if shape != ():
        got = f"shape {shape}" if shape is not None else f"a {type(loss).__name__}"
        raise TypeError(
            f"treemode.{transform}: the function must return a scalar (shape ()) to be "
            f"differentiated, but it returned {got}.\nReduce the output (e.g. "
            "jnp.mean(...)), return (loss, aux) with has_aux=True, or use treemode.vjp "
            "for non-scalar outputs."
        )
    dtype = jnp.result_type(loss)
    if not holomorphic and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"treemode.{transform}: the function must return a real floating-point scalar, "
            f"but it returned dtype {dtype}. Cast the loss (e.g. loss.astype(jnp.float32)), "
            "or pass holomorphic=True for complex functions."
        )


def split_aux(transform: str, out: Any) -> tuple[Any, Any]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"treemode.{transform}: with has_aux=True the function must return a pair "
            f"(output, aux), but it returned a {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            + ". Return (loss, aux), or drop has_aux=True."
        )
    return out[0], out[1]


# ---------------------------------------------------------------------------
# grad / value_and_grad
# ---------------------------------------------------------------------------


Argnums = int | nnx.DiffState | Sequence[int | nnx.DiffState]


def _normalize_argnums(
    name: str, argnums: Argnums, wrt: filterlib.Filter
) -> tuple[tuple[int, ...], bool, tuple[Any, ...]]:
    """``argnums`` as ``(positions, single, filters)``: one filter per position,
    the ``nnx.DiffState``'s own or else ``wrt``."""
    if isinstance(argnums, int) or is_diff_state(argnums):
        items: tuple[Any, ...] = (argnums,)
        single = True
    else:
        assert not isinstance(argnums, nnx.DiffState)
        node = is_graph_node(argnums) or is_variable(argnums)
        items = () if node else tuple(argnums)
        single = False
        if not items or not all(isinstance(i, int) or is_diff_state(i) for i in items):
            shown = f"a {type(argnums).__name__} (a graph node)" if node else repr(argnums)
            raise ArgnumsError(
                f"treemode.{name}: argnums must be an int, an nnx.DiffState or a non-empty "
                f"tuple of them, got {shown}."
                + (
                    " Graph nodes are not allowed as prefixes: argnums selects whole arguments."
                    if node
                    else ""
                )
                + " To differentiate only some Variables of an argument, pass "
                "wrt=<filter> (e.g. wrt=nnx.LoRAParam) or nnx.DiffState(i, <filter>): "
                "see docs/migration.md#diffstate."
            )
    nums = tuple(i.argnum if is_diff_state(i) else i for i in items)
    filters = tuple(i.filter if is_diff_state(i) else wrt for i in items)
    for f in filters:
        check_filter(name, f)
    seen: set[int] = set()
    for i, item in zip(nums, items, strict=True):
        if is_diff_state(item) and not isinstance(i, int):
            raise ArgnumsError(
                f"treemode.{name}: nnx.DiffState's argnum must be an int, got {i!r}."
            )
        if i in seen and any(is_diff_state(x) for x in items):
            raise ArgnumsError(
                f"treemode.{name}: argnum {i} is repeated in argnums. Give each argument "
                "once, with one nnx.DiffState filter (combine filters with nnx.Any)."
            )
        seen.add(i)
    return nums, single, filters


def _grad_transform(
    fn: Callable[..., Any],
    argnums: Argnums,
    has_aux: bool,
    holomorphic: bool,
    allow_int: bool,
    graph: bool,
    return_value: bool,
    wrt: filterlib.Filter = ...,
) -> Callable[..., Any]:
    name = "value_and_grad" if return_value else "grad"
    nums, single, filters = _normalize_argnums(name, argnums, wrt)
    filtered = any(f is not ... for f in filters)

    @functools.wraps(fn)
    @_compat.api_boundary
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        positions = []
        for i in nums:
            j = i + len(args) if i < 0 else i
            if not 0 <= j < len(args):
                raise TypeError(
                    f"treemode.{name}: argnums contains {i}, but the function was called "
                    f"with {len(args)} positional argument(s). Differentiated arguments "
                    "must be passed positionally."
                )
            positions.append(j)
        args = to_array_args(args, positions)
        for i in positions:
            a = args[i]
            if not allow_int and isinstance(a, ARRAY_TYPES) and not is_differentiable(a):
                raise TypeError(
                    f"treemode.{name}: args[{i}] has dtype {a.dtype}; grad needs floating "
                    "point (or complex) inputs. Pass allow_int=True to get a float0 "
                    "gradient for it, or do not list it in argnums. (Integer and key "
                    "Variables inside modules are skipped automatically.)"
                )
        call = _call.prepare(name, fn, args, kwargs, graph=graph)
        chosen = None
        if filtered:
            chosen = {j: f for j, f in zip(positions, filters, strict=True) if f is not ...}
        split = DiffSplit(call, positions, wrt=chosen)
        pure = _pure.PureFunction(call)

        def differentiated(diff: list[Any], other: list[Any]) -> tuple[Any, Any]:
            out, updates = pure(*split.merge(diff, other))
            if has_aux:
                loss, aux = split_aux(name, out)
            else:
                loss, aux = out, None
            check_scalar(name, loss, holomorphic)
            return loss, (aux, updates)

        def jax_call() -> tuple[Any, Any]:
            try:
                (loss, (aux, updates)), diff_grads = jax.value_and_grad(
                    named(differentiated, fn), argnums=0, has_aux=True, holomorphic=holomorphic
                )(split.diff_values(), split.other_values())
            except TRACER_ERRORS as e:
                if at_top_level(call):  # under jit, jit's trace names the argument
                    raise_named(e, lambda: trace_named(name, pure, call))
                raise
            return (loss, aux, diff_grads), updates

        loss, aux, diff_grads = _core.run(call, pure, jax_call, finish=False)
        grad_trees = split.cotangent_trees(diff_grads)
        grads = grad_trees[0] if single else tuple(grad_trees)
        if has_aux:
            aux = _core.finish(call, aux)
            return ((loss, aux), grads) if return_value else (grads, aux)
        return (loss, grads) if return_value else grads

    return wrapper


P = ParamSpec("P")


class _Differentiating(Protocol):
    """What ``treemode.grad(argnums=...)`` returns, for type checkers: a decorator whose
    result takes the decorated function's parameters."""

    def __call__(self, fun: Callable[P, Any], /) -> Callable[P, Any]: ...


# The function's parameters are kept for type checkers (the result is the
# gradients' pytree, or a tuple with it: `Any`), as jax.grad's callers expect.
@overload
def grad(
    fun: Callable[P, Any],
    argnums: Argnums = ...,
    has_aux: bool = ...,
    holomorphic: bool = ...,
    allow_int: bool = ...,
    reduce_axes: Sequence[Any] = ...,
    *,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> Callable[P, Any]: ...


@overload
def grad(
    fun: None = None,
    argnums: Argnums = ...,
    has_aux: bool = ...,
    holomorphic: bool = ...,
    allow_int: bool = ...,
    reduce_axes: Sequence[Any] = ...,
    *,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> _Differentiating: ...


@suggests_keywords
def grad(
    fun: Callable[..., Any] | None = None,
    argnums: Argnums = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
    *,
    wrt: filterlib.Filter = ...,
    graph: bool = False,
) -> Callable[..., Any]:
    """Gradient of ``fn`` with respect to its ``argnums`` arguments, with write-back.

    Like `jax.grad`, the gradient of an argument has the argument's own type: for
    a Module, a Module of the same class whose Variables hold the cotangents (so
    `optimizer.update(model, grads)` works). Every floating-point (or complex)
    array of the argument is differentiated. Integer, boolean and PRNG-key
    Variables (the `nnx.Rngs` streams of a Dropout, step counters) are not: their
    entries in the gradient are `float0` zeros, JAX's tangent type for integers,
    so the gradient keeps the argument's structure and `allow_int` is not needed.
    Variables that the function changes (BatchNorm statistics, Rngs counters) are
    written back to the inputs.

    To differentiate only some Variables (a LoRA fine-tune), pass `wrt=` a Flax
    filter, or `argnums=nnx.DiffState(i, filter)` for one argument: the other
    Variables are constants of the differentiated function (no cotangent is
    computed for them) and their entries in the gradient are `float0` zeros,
    which take no memory, so `nnx.Optimizer(model, tx, wrt=filter).update(model,
    grads)` takes the gradient as it is.

    **Arguments:**

    - `fun`: function returning a real scalar (or `(scalar, aux)` with `has_aux`).
      Omit it to use `grad(argnums=...)` as a decorator.
    - `argnums`: the positional arguments to differentiate: an int, an
      `nnx.DiffState(i, filter)` (argument `i`, with `wrt=filter`), or a tuple
      of them.
    - `has_aux`: `fn` returns `(loss, aux)`; `aux` is returned next to the gradient.
    - `holomorphic`: as in `jax.grad` (complex inputs and output).
    - `allow_int`: accept a bare integer array in `argnums` (its gradient is
      `float0`). Integer Variables inside modules never need it.
    - `reduce_axes`: accepted for `jax.grad`'s signature; must be empty (JAX
      no longer supports it either).
    - `wrt`: a Flax filter selecting the Variables of the `argnums` arguments to
      differentiate: a Variable type (`nnx.LoRAParam`), a tuple of them,
      `nnx.Any`/`nnx.All`/`nnx.Not`, `nnx.PathContains(...)`, a
      `(path, variable) -> bool` callable (paths start at the argument). Arrays
      outside Variables are differentiated either way. The default `...`
      differentiates every floating-point Variable. An `nnx.DiffState` in
      `argnums` gives its argument its own filter instead.
    - `graph`: if `True`, inputs may share Modules/Variables (see `to_tree`).

    **Returns:**

    A function returning the gradient (a tuple of gradients when `argnums` is a
    tuple), or `(gradient, aux)` with `has_aux`.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 2))

    def loss_fn(model):
        return jnp.mean(model(x) ** 2)

    grads = treemode.grad(loss_fn)(model)
    assert type(grads) is nnx.Linear
    assert grads.kernel.shape == (2, 1)

    # Only the kernel: the bias's gradient is a float0 placeholder.
    grads = treemode.grad(loss_fn, wrt=nnx.PathContains("kernel"))(model)
    assert grads.kernel.dtype == jnp.float32
    assert grads.bias.dtype == jax.dtypes.float0
    ```
    """
    check_reduce_axes("grad", reduce_axes)
    refuse_lifts(
        argnums,
        transform="grad",
        what="argnums",
        graph=graph,
        accepted=frozenset({"DiffState"}),
    )
    if fun is None:
        return functools.partial(
            grad,
            argnums=argnums,
            has_aux=has_aux,
            holomorphic=holomorphic,
            allow_int=allow_int,
            wrt=wrt,
            graph=graph,
        )
    return _grad_transform(fun, argnums, has_aux, holomorphic, allow_int, graph, False, wrt)


@overload
def value_and_grad(
    fun: Callable[P, Any],
    argnums: Argnums = ...,
    has_aux: bool = ...,
    holomorphic: bool = ...,
    allow_int: bool = ...,
    reduce_axes: Sequence[Any] = ...,
    *,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> Callable[P, tuple[Any, Any]]: ...


@overload
def value_and_grad(
    fun: None = None,
    argnums: Argnums = ...,
    has_aux: bool = ...,
    holomorphic: bool = ...,
    allow_int: bool = ...,
    reduce_axes: Sequence[Any] = ...,
    *,
    wrt: filterlib.Filter = ...,
    graph: bool = ...,
) -> _Differentiating: ...


@suggests_keywords
def value_and_grad(
    fun: Callable[..., Any] | None = None,
    argnums: Argnums = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
    *,
    wrt: filterlib.Filter = ...,
    graph: bool = False,
) -> Callable[..., Any]:
    """Value and gradient of ``fn``; see `treemode.grad` for the semantics.

    **Arguments:**

    Same as `treemode.grad`.

    **Returns:**

    A function returning `(value, gradient)`, or `((value, aux), gradient)` with
    `has_aux`.

    ```python
    import jax.numpy as jnp
    import optax
    import treemode
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))

    @treemode.jit
    def step(model, optimizer):
        loss, grads = treemode.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    first = step(model, optimizer)
    assert step(model, optimizer) < first
    ```
    """
    check_reduce_axes("value_and_grad", reduce_axes)
    refuse_lifts(
        argnums,
        transform="value_and_grad",
        what="argnums",
        graph=graph,
        accepted=frozenset({"DiffState"}),
    )
    if fun is None:
        return functools.partial(
            value_and_grad,
            argnums=argnums,
            has_aux=has_aux,
            holomorphic=holomorphic,
            allow_int=allow_int,
            wrt=wrt,
            graph=graph,
        )
    return _grad_transform(fun, argnums, has_aux, holomorphic, allow_int, graph, True, wrt)
