"""``treemode.Pytree``: a proxy that makes any NNX object a pytree of raw arrays.

A `Pytree` stores two things: a `PytreeDef` (the static part:
the structure of the module as produced by `treemode.to_tree`, with each
Variable's type and metadata) and a tuple of leaves (the raw arrays of the
Variables, plus any array that sits outside a Variable). Flattening returns the
stored tuple; unflattening stores whatever leaves it is given. The module is
only rebuilt ("materialized") when an attribute is read or a method is called,
and the rebuilt module is cached on the proxy.

A method call runs on the cached module and then re-captures the module's state
into the proxy, so the proxy a transform returns carries the new state (the
Equinox convention: ``model = step(model, x)``).

The static part is `treemode._tree._pytree_def`; taking a module apart into the
proxy's parts and building it again, `treemode._tree._pytree_capture`; a proxy a
transform changed but its function did not return, `treemode._tree._pytree_unreturned`.
This module holds the proxy, its pytree registration and the views of its submodules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import jax
from flax import nnx
from jax.core import Tracer

from .. import _compat
from .._compat import current_trace_ref
from .._errors import ProxyError, TraceContextError
from ._leaves import is_graph_node, is_variable
from ._pytree_capture import capture, materialize, unwrap
from ._pytree_def import PytreeDef, single_leaf

M = TypeVar("M")

_EDIT_HINT = (
    "Fix: edit the module inside a `with` block; the changes are written back to "
    "the proxy when the block exits:\n\n"
    "    with proxy as module:\n"
    "        {edit}\n"
)

_set = object.__setattr__


class Pytree(Generic[M]):
    """A proxy that makes an NNX module (or any NNX object) a plain pytree.

    Its leaves are the raw arrays of the module's Variables; its static part
    (structure, Variable types and metadata) is hashable and compared by value.
    Use it wherever a pytree is expected: as a field of an `eqx.Module`, with
    `eqx.filter_jit`, `eqx.filter_grad`, optax, `jax.lax.scan`, `jax.vmap`.

    - Wrapping copies nothing and shares no state: the proxy holds the arrays,
      the module you passed is not touched afterwards.
    - Reading an attribute (`proxy.layers[0].kernel`) rebuilds the module once,
      caches it, and returns values from it.
    - Calling the proxy or one of the module's methods (also on submodules:
      `proxy.bn(x)`) runs it on the cached module and captures the new state
      into the proxy, so BatchNorm statistics and RNG counters advance. Return
      the proxy (or the Equinox model holding it) from your transforms to get the
      new state out, as Equinox does.
    - `with proxy as module:` gives the module for manual edits, written back
      when the block exits (discarded if it raises). Setting attributes on the
      proxy itself raises `treemode.ProxyError`.
    - `proxy.to_module()` returns an ordinary, independent NNX module;
      `proxy.graphdef` and `proxy.state` are its `nnx.split` parts.

    Shared references inside the module (one submodule or Variable reachable
    twice) are kept: each shared Variable is a single leaf, and the module is
    rebuilt with the sharing.

    The names `to_module`, `graphdef` and `state` belong to the proxy; read module
    attributes with those names through `with proxy as module:`.

    Pass a proxy to transforms as an argument (or a field of one). A proxy read
    through the closure of a JAX transform (`jax.jit`, `jax.vmap`, `jax.lax.scan`)
    is a constant there: calling its stateless methods works, and a call that
    would store that transform's traced values in it (BatchNorm statistics, RNG
    counters) raises `treemode.TraceContextError` and leaves the proxy as it was.
    The module such a transform builds from the proxy is used inside that trace
    only: afterwards, eager reads, `with proxy as module:` edits and training
    calls work on a module built outside any trace.

    **Arguments:**

    - `module`: an NNX Module (or Rngs, Optimizer, List...), or another `Pytree`.

    ```python
    import jax
    import jax.numpy as jnp
    import treemode
    from flax import nnx

    module = treemode.Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    module = jax.tree.map(lambda x: x, module)
    assert module.kernel.shape == (2, 3)

    y = module(jnp.ones((1, 2)))
    assert y.shape == (1, 3)
    ```
    """

    __slots__ = (
        "_pt_def",
        "_pt_leaves",
        "_pt_module",
        "_pt_vars",
        "_pt_watch",
        "_pt_trace",
        "_pt_module_trace",
    )

    _pt_def: PytreeDef
    _pt_leaves: tuple[Any, ...]
    _pt_module: Any
    _pt_vars: list[Any] | None
    _pt_watch: tuple[int, ...] | list[int]
    _pt_trace: Any  # the JAX trace the proxy was made in (its weak reference)
    _pt_module_trace: Any  # the JAX trace the cached module was built in

    @_compat.api_boundary
    def __init__(self, module: M):
        if isinstance(module, Pytree):
            pdef, leaves = module._pt_flatten()
            _init(self, pdef, leaves)
            return
        if isinstance(module, _View):
            module = module._pt_target()
        if not is_graph_node(module):
            raise TypeError(
                "treemode.Pytree: expected an NNX object (nnx.Module, nnx.Rngs, "
                f"nnx.Optimizer, ...), got {type(module).__name__}. Equinox modules "
                "and other pytrees need no proxy: use them directly."
            )
        pdef, leaves, _ = capture(module)
        _init(self, pdef, leaves)

    # -- pytree protocol ------------------------------------------------------

    def _pt_flatten(self) -> tuple[PytreeDef, tuple[Any, ...]]:
        if self._pt_watch:
            self._pt_sync()
        return self._pt_def, self._pt_leaves

    # -- materialization ------------------------------------------------------

    def _pt_materialize(self) -> Any:
        """The module, cached for the JAX trace it is built in.

        Its Variables belong to that trace (NNX refuses to write them from
        another), so a module built inside a transform that reads the proxy
        through its closure is used there only: the next read outside that
        trace builds the module again from the proxy's leaves.
        """
        module = self._pt_module
        trace = current_trace_ref()
        if module is not None and self._pt_module_trace is not trace:
            if self._pt_watch and self._pt_module_trace is self._pt_trace:
                self._pt_sync()  # keep the edits made where the proxy lives
            module = None
        if module is None:
            module, variables = materialize(self._pt_def, self._pt_leaves, wrap=True)
            _set(self, "_pt_module", module)
            _set(self, "_pt_vars", variables)
            _set(self, "_pt_watch", ())
            _set(self, "_pt_module_trace", trace)
        return module

    def _pt_drop(self) -> None:
        """Forget the cached module (its edits are discarded)."""
        _set(self, "_pt_module", None)
        _set(self, "_pt_vars", None)
        _set(self, "_pt_watch", ())

    def _pt_recapture(self) -> None:
        module = self._pt_module
        if module is None:
            return
        old_vars = self._pt_vars or []
        watched = [old_vars[k] for k in self._pt_watch]
        pdef, leaves, variables = capture(module, self._pt_def)
        self._pt_check_trace(leaves)
        _set(self, "_pt_def", pdef)
        _set(self, "_pt_leaves", leaves)
        _set(self, "_pt_vars", variables)
        if watched:
            index = {id(v): k for k, v in enumerate(variables)}
            _set(self, "_pt_watch", [index[id(v)] for v in watched if id(v) in index])

    def _pt_check_trace(self, leaves: Sequence[Any]) -> None:
        """Refuse to store values traced by a JAX transform the proxy was not passed into.

        A proxy read through the closure of ``jax.jit``/``jax.vmap`` is a
        constant there: a method that changes its state would store that
        trace's tracers in it, which outlive the trace. As NNX does for a
        Variable mutated from another trace, raise instead (the proxy keeps its
        state: the module run in the trace is discarded).
        """
        if current_trace_ref() is self._pt_trace:
            return
        old = set(map(id, self._pt_leaves))
        if not any(isinstance(x, Tracer) and id(x) not in old for x in leaves):
            return
        name = type(self._pt_module).__name__
        self._pt_drop()
        raise TraceContextError(
            f"treemode.Pytree: a call changed the state of this {name} proxy (e.g. "
            "BatchNorm statistics, an RNG counter) inside a JAX transform that the proxy "
            "was not passed into (a closure of jax.jit, jax.vmap, jax.lax.scan, ...): "
            "storing that transform's traced values in the proxy would leak them. The "
            "proxy keeps its previous state.\nFix: pass the proxy as an argument of the "
            "transform and return it (model = step(model, x)), or call a method that "
            "does not change state there."
        )

    def _pt_run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        module = self._pt_module
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            if self._pt_module is module:
                self._pt_drop()
            raise
        self._pt_recapture()
        return out

    def _pt_watch_variable(self, var: Any) -> None:
        variables = self._pt_vars
        if variables is None:
            return
        for k, v in enumerate(variables):
            if v is var:
                if k not in self._pt_watch:
                    _set(self, "_pt_watch", [*self._pt_watch, k])
                return

    def _pt_sync(self) -> None:
        """Pick up direct edits of Variables handed out by attribute access."""
        variables = self._pt_vars
        if variables is None:
            return
        slots = self._pt_def.var_slots()
        leaves = self._pt_leaves
        new: list[Any] | None = None
        for k in self._pt_watch:
            start, n, spec = slots[k]
            var = variables[k]
            if single_leaf(spec):
                current = [unwrap(_compat.raw_value_of(var))]
            else:
                current = [
                    x
                    for x, s in zip(
                        jax.tree_util.tree_leaves(_compat.raw_value_of(var)),
                        spec.value_static,
                        strict=False,
                    )
                    if s is None
                ]
            if len(current) != n or any(
                a is not b for a, b in zip(current, leaves[start : start + n], strict=True)
            ):
                if new is None:
                    new = list(leaves)
                new[start : start + n] = current
        if new is not None:
            self._pt_check_trace(new)
            _set(self, "_pt_leaves", tuple(new))

    def _pt_expose(self, value: Any) -> Any:
        return _expose(self, value, self._pt_module)

    # -- public ---------------------------------------------------------------

    @_compat.api_boundary
    def to_module(self) -> M:
        """An ordinary NNX module with this proxy's state (a new, independent object).

        **Returns:**

        A new module; editing it does not change the proxy.

        ```python
        import treemode
        from flax import nnx

        proxy = treemode.Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        module = proxy.to_module()
        assert isinstance(module, nnx.Linear)
        assert module.kernel[...] is proxy.kernel[...]
        ```
        """
        pdef, leaves = self._pt_flatten()
        return materialize(pdef, leaves, wrap=False)[0]

    @property
    def graphdef(self) -> nnx.GraphDef[M]:
        """The `nnx.GraphDef` of the module (as `nnx.split(proxy.to_module())[0]`)."""
        return nnx.split(self.to_module())[0]

    @property
    def state(self) -> nnx.State:
        """The `nnx.State` of the module (as `nnx.split(proxy.to_module())[1]`).

        ```python
        import treemode
        from flax import nnx

        proxy = treemode.Pytree(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        module = nnx.merge(proxy.graphdef, proxy.state)
        assert module.kernel.shape == (2, 3)
        ```
        """
        return nnx.split(self.to_module())[1]

    @_compat.api_boundary
    def __enter__(self) -> M:
        return self._pt_materialize()

    @_compat.api_boundary
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self._pt_recapture()
        else:
            self._pt_drop()
        return False

    @_compat.api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._pt_materialize()
        return self._pt_run(module, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") or name.startswith("_pt_"):
            raise AttributeError(name)
        module = self._pt_materialize()
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"treemode.Pytree: the wrapped {type(module).__name__} has no attribute {name!r}."
            ) from None
        return self._pt_expose(value)

    def __getitem__(self, key: Any) -> Any:
        return self._pt_expose(self._pt_materialize()[key])

    def __len__(self) -> int:
        return len(self._pt_materialize())

    def __iter__(self) -> Iterator[Any]:
        return (self._pt_expose(x) for x in self._pt_materialize())

    def __bool__(self) -> bool:
        return True

    @_compat.api_boundary
    def __setattr__(self, name: str, value: Any) -> None:
        raise ProxyError(
            f"treemode.Pytree: cannot set attribute {name!r} on the proxy: it is a "
            "pytree, and its state changes only through method calls or a `with` "
            "block.\n" + _EDIT_HINT.format(edit=f"module.{name} = ...")
        )

    @_compat.api_boundary
    def __delattr__(self, name: str) -> None:
        raise ProxyError(
            f"treemode.Pytree: cannot delete attribute {name!r} on the proxy.\n"
            + _EDIT_HINT.format(edit=f"del module.{name}")
        )

    @_compat.api_boundary
    def __setitem__(self, key: Any, value: Any) -> None:
        raise ProxyError(
            f"treemode.Pytree: cannot assign proxy[{key!r}].\n"
            + _EDIT_HINT.format(edit=f"module[{key!r}] = ...")
        )

    def __repr__(self) -> str:
        try:
            inner = repr(self._pt_materialize())
        except Exception:
            inner = f"<{self._pt_def.num_leaves} leaves>"
        return f"treemode.Pytree({inner})"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Render as the wrapped module in treescope (and so in `nnx.display`).

        The module rendered is `to_module()`: the proxy's own state, and rendering
        it does not touch the proxy.
        """
        return subtree_renderer(self.to_module(), path=path)

    def __copy__(self) -> Pytree[M]:
        return from_parts(*self._pt_flatten())

    def __deepcopy__(self, memo: dict[int, Any]) -> Pytree[M]:
        import copy

        pdef, leaves = self._pt_flatten()
        return from_parts(pdef, copy.deepcopy(leaves, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return from_parts, self._pt_flatten()


def _init(p: Pytree[Any], pdef: PytreeDef, leaves: tuple[Any, ...]) -> None:
    _set(p, "_pt_def", pdef)
    _set(p, "_pt_leaves", leaves)
    _set(p, "_pt_module", None)
    _set(p, "_pt_vars", None)
    _set(p, "_pt_watch", ())
    _set(p, "_pt_trace", current_trace_ref())
    _set(p, "_pt_module_trace", None)


def from_parts(pdef: PytreeDef, leaves: Iterable[Any]) -> Pytree[Any]:
    """A proxy with the given static part and leaves (no checks, nothing rebuilt)."""
    p = object.__new__(Pytree)
    _init(p, pdef, tuple(leaves))
    return p


def _flatten(p: Pytree[Any]) -> tuple[tuple[Any, ...], PytreeDef]:
    if p._pt_watch:
        p._pt_sync()
    return p._pt_leaves, p._pt_def


def _flatten_with_keys(p: Pytree[Any]) -> tuple[list[tuple[Any, Any]], PytreeDef]:
    leaves, pdef = _flatten(p)
    return list(zip(pdef.keys(), leaves, strict=True)), pdef


jax.tree_util.register_pytree_with_keys(Pytree, _flatten_with_keys, from_parts, _flatten)


# ------------------------------------------------------------ submodule views


def _expose(root: Pytree[Any], value: Any, module: Any) -> Any:
    """What attribute access on a proxy (or a view) returns for ``value``."""
    if is_variable(value):
        root._pt_watch_variable(value)
        return value
    if is_graph_node(value):
        return _View(root, value, module)
    self_obj = getattr(value, "__self__", None)
    if self_obj is not None and callable(value) and is_graph_node(self_obj):
        return _bound(root, value, module)
    if isinstance(value, (tuple, list, dict)):
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_variable):
            if is_variable(leaf):
                root._pt_watch_variable(leaf)
    return value


def _bound(root: Pytree[Any], method: Callable[..., Any], module: Any) -> Callable[..., Any]:
    @functools.wraps(method)
    @_compat.api_boundary
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_fresh(root, module)
        return root._pt_run(method, args, kwargs)

    return call


def _check_fresh(root: Pytree[Any], module: Any) -> None:
    if root._pt_module is not module:
        raise ProxyError(
            "treemode.Pytree: this submodule reference is stale: the proxy discarded "
            "the module it came from (a method call or a `with` block raised). Read "
            "the submodule from the proxy again."
        )


class _View:
    """A submodule reached through a `Pytree`: calls on it update the proxy."""

    __slots__ = ("_pt_root", "_pt_obj", "_pt_module")

    def __init__(self, root: Pytree[Any], obj: Any, module: Any):
        _set(self, "_pt_root", root)
        _set(self, "_pt_obj", obj)
        _set(self, "_pt_module", module)

    def _pt_target(self) -> Any:
        _check_fresh(self._pt_root, self._pt_module)
        return self._pt_obj

    @_compat.api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._pt_root._pt_run(self._pt_target(), args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") or name.startswith("_pt_"):
            raise AttributeError(name)
        return _expose(self._pt_root, getattr(self._pt_target(), name), self._pt_module)

    def __getitem__(self, key: Any) -> Any:
        return _expose(self._pt_root, self._pt_target()[key], self._pt_module)

    def __len__(self) -> int:
        return len(self._pt_target())

    def __iter__(self) -> Iterator[Any]:
        root, module = self._pt_root, self._pt_module
        return (_expose(root, x, module) for x in self._pt_target())

    def __bool__(self) -> bool:
        return True

    @_compat.api_boundary
    def __setattr__(self, name: str, value: Any) -> None:
        raise ProxyError(
            f"treemode.Pytree: cannot set attribute {name!r} on a submodule read "
            "through the proxy.\n" + _EDIT_HINT.format(edit=f"module.<path>.{name} = ...")
        )

    @_compat.api_boundary
    def __delattr__(self, name: str) -> None:
        raise ProxyError(
            f"treemode.Pytree: cannot delete attribute {name!r} on a submodule read "
            "through the proxy.\n" + _EDIT_HINT.format(edit=f"del module.<path>.{name}")
        )

    @_compat.api_boundary
    def __setitem__(self, key: Any, value: Any) -> None:
        raise ProxyError(
            f"treemode.Pytree: cannot assign [{key!r}] on a submodule read through the "
            "proxy.\n" + _EDIT_HINT.format(edit=f"module.<path>[{key!r}] = ...")
        )

    def __repr__(self) -> str:
        return f"treemode.Pytree view of {self._pt_obj!r}"
