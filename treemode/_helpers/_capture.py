"""``treemode.capture``: collect ``Module.sow`` / ``Module.perturb`` values.

Flax's ``Module.sow`` and ``Module.perturb`` write into the ``__captures__``
attribute of a module when it exists (a tuple of Variables, one per collected
type, each holding a ``{name: value}`` dict). ``capture`` installs such a tuple
on every module reachable from the captured module for the duration of one call,
then gathers the dicts into ``nnx.State`` objects keyed by module path and removes
the attribute again, so the module's structure is unchanged afterwards and no
graph update is needed. ``init`` pre-fills the dicts: a ``perturb`` returns
``value + init_value``, which is how gradients of intermediates are taken.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, overload

from flax import errors as flax_errors
from flax import nnx

from .. import _compat
from .._errors import TreemodeError
from .._tree._flatten import check_no_aliases
from .._tree._leaves import is_graph_node, is_variable

_ATTR = "__captures__"
_MISSING = object()
_patch_lock = threading.RLock()


def _is_variable_type(x: Any) -> bool:
    return isinstance(x, type) and issubclass(x, nnx.Variable)


P = ParamSpec("P")


# For type checkers the captured function takes the function's (or the Module's
# `__call__`'s) parameters; what it returns depends on how many types are collected.
@overload
def capture(
    fn: type[nnx.Variable],
    /,
    *var_types: type[nnx.Variable],
    init: Mapping[Any, Any] | None = ...,
    method_outputs: type[nnx.Variable] | None = ...,
    graph: bool = ...,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]: ...


@overload
def capture(
    fn: Callable[P, Any],
    /,
    *var_types: type[nnx.Variable],
    init: Mapping[Any, Any] | None = ...,
    method_outputs: type[nnx.Variable] | None = ...,
    graph: bool = ...,
) -> Callable[P, Any]: ...


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def capture(
    fn: Any,
    *var_types: type[nnx.Variable],
    init: Mapping[Any, Any] | None = None,
    method_outputs: type[nnx.Variable] | None = None,
    graph: bool = False,
) -> Callable[..., Any]:
    """Run a function or Module and collect the values it ``sow``s and ``perturb``s.

    No graph updates are involved: the collected values are returned next to the
    output, as `nnx.State` objects keyed by module path, and the modules are left
    exactly as they were. This works inside `treemode.jit`, `treemode.grad` and
    the other transforms.

    **Arguments:**

    - `fn`: a Module (its `__call__` is run), a bound method of a Module, or a
      function whose first argument is the Module whose sub-modules may sow.
      Passing Variable types first (`capture(nnx.Intermediate)`) returns a
      decorator.
    - `*var_types`: the Variable types to collect (`nnx.Intermediate`,
      `nnx.Perturbation`, ...).
    - `init`: an `nnx.State` (e.g. the perturbations collected by an earlier
      `capture`) whose values pre-fill the collections; `Module.perturb` adds the
      pre-filled value to its input, so gradients with respect to `init` are the
      gradients of the intermediates.
    - `method_outputs`: a Variable type; if given, the output of every public
      method (and `__call__`) of every sub-module is sown under the method's name.
    - `graph`: if `True`, the module may contain shared sub-modules.

    **Returns:**

    A function returning `output` when no `var_types` are given,
    `(output, state)` for one type and `(output, state_1, state_2, ...)` for
    several, in the order of `var_types`.

    ```python
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    class Foo(nnx.Module):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "y_mean", jnp.mean(x))
            return x

    model = Foo()
    result, intermediates = treemode.capture(model, nnx.Intermediate)(jnp.arange(4.0))
    assert intermediates["y_mean"].get_value() == (1.5,)
    assert not hasattr(model, "__captures__")
    ```
    """
    if _is_variable_type(fn):
        types = (fn, *var_types)
        return lambda actual: capture(
            actual, *types, init=init, method_outputs=method_outputs, graph=graph
        )
    for t in var_types:
        if not _is_variable_type(t):
            raise TypeError(
                f"treemode.capture: var_types must be nnx.Variable subclasses "
                f"(e.g. nnx.Intermediate), got {t!r}."
            )
    if method_outputs is not None and method_outputs not in var_types:
        var_types = (*var_types, method_outputs)
    owner: Any = None
    if inspect.ismethod(fn) and is_graph_node(fn.__self__):
        owner = fn.__self__
    elif is_graph_node(fn):
        owner = fn

    @functools.wraps(fn)
    @_compat.api_boundary
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        module = owner
        if module is None:
            if not args or not is_graph_node(args[0]):
                raise TypeError(
                    "treemode.capture: the function's first argument must be the Module "
                    f"to capture from, got {type(args[0]).__name__ if args else 'nothing'}."
                    " Pass the Module itself (capture(model, ...)) or a bound method."
                )
            module = args[0]
        if not graph:
            check_no_aliases("capture", module=module)
        modules = _unique_modules(module, graph)
        by_path = _init_by_path(init) if init is not None else {}
        with _installed(modules, var_types, by_path) as captures:
            with _method_outputs(modules, method_outputs):
                result = fn(*args, **kwargs)
            states = _gather(captures, var_types)
        if not var_types:
            return result
        if len(var_types) == 1:
            return result, states[0]
        return (result, *states)

    return wrapper


def _unique_modules(module: Any, graph: bool) -> list[tuple[tuple[Any, ...], Any]]:
    seen: set[int] = set()
    out: list[tuple[tuple[Any, ...], Any]] = []
    for path, m in nnx.iter_modules(module, graph=graph):
        if id(m) not in seen:
            seen.add(id(m))
            out.append((tuple(path), m))
    return out


def _init_by_path(init: Mapping[Any, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """``{module path: {name: Variable}}`` from a nested mapping of Variables."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        for key, value in node.items():
            if is_variable(value):
                found.setdefault(path, {})[key] = value
            elif isinstance(value, Mapping):
                walk(value, (*path, key))
            else:
                raise TypeError(
                    f"treemode.capture: init must be a nested mapping of Variables (an "
                    f"nnx.State returned by capture), but {'/'.join(map(str, (*path, key)))}"
                    f" holds a {type(value).__name__}."
                )

    if not isinstance(init, Mapping):
        raise TypeError(
            "treemode.capture: init must be an nnx.State (nested mapping of Variables), "
            f"got {type(init).__name__}."
        )
    walk(init, ())
    return found


def _set(m: Any, value: Any) -> None:
    try:
        setattr(m, _ATTR, nnx.data(value))
    except flax_errors.TraceContextError:
        # A module created outside the current JAX trace (e.g. read through a
        # closure): Flax refuses a regular attribute assignment there. The
        # attribute only lives for the duration of the call, so set it directly.
        object.__setattr__(m, _ATTR, value)


@contextlib.contextmanager
def _installed(
    modules: list[tuple[tuple[Any, ...], Any]],
    var_types: tuple[type[nnx.Variable], ...],
    by_path: dict[tuple[Any, ...], dict[str, Any]],
) -> Iterator[list[tuple[tuple[Any, ...], Any]]]:
    """Give every module a fresh ``__captures__`` tuple; restore on exit."""
    unknown = set(by_path) - {p for p, _ in modules}
    if unknown:
        raise TreemodeError(
            "treemode.capture: init has values for module path(s) "
            f"{sorted('/'.join(map(str, p)) or '<root>' for p in unknown)} that do not "
            "exist in the captured module. Pass the state returned by capture on the "
            "same module."
        )
    previous: list[tuple[Any, Any]] = []
    captures: list[tuple[tuple[Any, ...], Any]] = []
    try:
        for path, m in modules:
            dicts: dict[type, dict[str, Any]] = {t: {} for t in var_types}
            for name, var in by_path.get(path, {}).items():
                dicts.setdefault(type(var), {})[name] = var.get_value()
            tup = tuple(t(d) for t, d in dicts.items())
            previous.append((m, vars(m).get(_ATTR, _MISSING)))
            _set(m, tup)
            captures.append((path, tup))
        yield captures
    finally:
        for m, old in reversed(previous):
            if old is _MISSING:
                if _ATTR in vars(m):
                    try:
                        delattr(m, _ATTR)
                    except flax_errors.TraceContextError:  # pragma: no cover
                        object.__delattr__(m, _ATTR)
            else:
                _set(m, old)


def _gather(
    captures: list[tuple[tuple[Any, ...], Any]], var_types: tuple[type[nnx.Variable], ...]
) -> list[nnx.State]:
    nested: list[dict[Any, Any]] = [{} for _ in var_types]
    index = {t: i for i, t in enumerate(var_types)}
    for path, tup in captures:
        for var in tup:
            i = index.get(type(var))
            if i is None:
                continue
            entries = var.get_value()
            if not entries:
                continue
            node = nested[i]
            for key in path:
                node = node.setdefault(key, {})
            for name, value in entries.items():
                node[name] = type(var)(value)
    return [nnx.State(n) for n in nested]


@contextlib.contextmanager
def _method_outputs(
    modules: list[tuple[tuple[Any, ...], Any]], var_type: type[nnx.Variable] | None
) -> Iterator[None]:
    """Sow the output of every public method of the modules' classes."""
    if var_type is None:
        yield
        return
    patched: list[tuple[type, str, Any]] = []
    with _patch_lock:
        try:
            for cls in {type(m) for _, m in modules}:
                for klass in cls.__mro__:
                    if klass in (nnx.Module, nnx.Pytree, object) or not issubclass(
                        klass, nnx.Module
                    ):
                        continue
                    for name, method in list(vars(klass).items()):
                        if not inspect.isfunction(method) or getattr(
                            method, "_treemode_sows", False
                        ):
                            continue
                        if name.startswith("_") and name != "__call__":
                            continue
                        setattr(klass, name, _sowing(method, name, var_type))
                        patched.append((klass, name, method))
            yield
        finally:
            for klass, name, method in reversed(patched):
                setattr(klass, name, method)


def _sowing(method: Callable[..., Any], name: str, var_type: type[nnx.Variable]) -> Any:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs)
        if _ATTR in vars(self):
            self.sow(var_type, name, out)
        return out

    wrapper._treemode_sows = True  # type: ignore[attr-defined]
    return wrapper
