"""treemode.custom_vjp: module-typed cotangents, nondiff_argnums, mutation rules."""

from __future__ import annotations

import gc
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Foo(nnx.Module):
    def __init__(self, x=1.0, y=2.0):
        self.x = nnx.Param(jnp.array(x))
        self.y = nnx.Param(jnp.array(y))
        self.calls = nnx.BatchStat(jnp.array(0, jnp.int32))


def make_f():
    """The FLIP 5310 example: f(m) = sin(m.x) * m.y with a hand-written VJP."""

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
    return f


def test_flip_example_gives_the_analytic_gradient():
    f = make_f()
    m = Foo(0.7, -1.5)
    np.testing.assert_allclose(f(m), jnp.sin(0.7) * -1.5, rtol=1e-6)
    grads = treemode.grad(f)(m)
    assert type(grads) is Foo
    np.testing.assert_allclose(grads.x[...], jnp.cos(0.7) * -1.5, rtol=1e-6)
    np.testing.assert_allclose(grads.y[...], jnp.sin(0.7), rtol=1e-6)
    assert grads.calls[...].dtype == jax.dtypes.float0


def test_flip_example_under_jit_and_with_jax_grad_of_arrays():
    f = make_f()
    m = Foo(0.7, -1.5)
    grads = treemode.jit(treemode.grad(f))(m)
    np.testing.assert_allclose(grads.x[...], jnp.cos(0.7) * -1.5, rtol=1e-6)

    # the fwd rule may also be traced lazily (grad of a jitted function)
    grads = treemode.grad(treemode.jit(lambda m: f(m) * 2.0))(m)
    np.testing.assert_allclose(grads.y[...], 2 * jnp.sin(0.7), rtol=1e-6)


def test_custom_rule_is_used_instead_of_autodiff():
    @treemode.custom_vjp
    def clip_gradient(m, x):
        return x * m.x[...]

    def fwd(m, x):
        return clip_gradient(m, x), (m, x)

    def bwd(res, g):
        m, x = res
        m_g = jax.tree.map(jnp.zeros_like, m)
        m_g.x[...] = jnp.clip(jnp.sum(g * x), -1.0, 1.0)
        return m_g, jnp.clip(g * m.x[...], -1.0, 1.0)

    clip_gradient.defvjp(fwd, bwd)
    m = Foo(3.0)
    g_m, g_x = treemode.grad(lambda m, x: jnp.sum(clip_gradient(m, x)), argnums=(0, 1))(
        m, jnp.array([2.0, -0.1])
    )
    np.testing.assert_allclose(g_m.x[...], 1.0)  # clipped from 1.9
    np.testing.assert_allclose(g_x, [1.0, 1.0])  # clipped from 3.0
    np.testing.assert_allclose(g_m.y[...], 0.0)


def test_nondiff_argnums_are_passed_first_to_bwd():
    seen = {}

    def f(scale_fn, m):
        return scale_fn(m.x[...])

    f = treemode.custom_vjp(f, nondiff_argnums=(0,))

    def fwd(scale_fn, m):
        return f(scale_fn, m), m.x[...]

    def bwd(scale_fn, x, g):
        seen["scale_fn"] = scale_fn
        m_g = jax.tree.map(jnp.zeros_like, Foo())
        m_g.x[...] = 10.0 * g
        return (m_g,)

    f.defvjp(fwd, bwd)
    double = lambda v: 2 * v
    grads = treemode.grad(lambda m: f(double, m), argnums=0)(Foo())
    assert seen["scale_fn"] is double
    np.testing.assert_allclose(grads.x[...], 10.0)


def test_nondiff_module_argument_may_be_mutated_and_is_written_back():
    @treemode.custom_vjp(nondiff_argnums=(0,))
    def f(stats, m):
        stats.calls[...] += 1
        stats.y[...] = m.x[...]  # a float Variable, but of a non-differentiable argument
        return m.x[...] * 3.0

    f.defvjp(lambda s, m: (f(s, m), None), lambda s, res, g: (None,))
    stats, m = Foo(), Foo(5.0)
    f(stats, m)
    assert int(stats.calls[...]) == 1
    np.testing.assert_allclose(stats.y[...], 5.0)


def test_integer_variables_of_differentiable_arguments_are_written_back():
    @treemode.custom_vjp
    def f(m):
        m.calls[...] += 1
        return m.x[...] * 3.0

    f.defvjp(lambda m: (f(m), None), lambda res, g: (None,))
    m = Foo()
    f(m)
    assert int(m.calls[...]) == 1
    grads = treemode.grad(f)(m)
    np.testing.assert_allclose(grads.x[...], 0.0)  # bwd returned None: zeros
    assert int(m.calls[...]) == 2


def test_mutating_a_differentiable_variable_raises_and_leaves_inputs_unchanged():
    @treemode.custom_vjp
    def f(m):
        m.calls[...] += 1
        m.x[...] = m.x[...] + 1.0
        return m.x[...]

    f.defvjp(lambda m: (f(m), None), lambda res, g: (None,))
    m = Foo()
    with pytest.raises(
        treemode.MutationError,
        match=r"treemode\.custom_vjp: .*differentiable Param at args\[0\]\.x",
    ):
        f(m)
    assert float(m.x[...]) == 1.0
    assert int(m.calls[...]) == 0


def test_bwd_result_errors():
    @treemode.custom_vjp
    def f(m):
        return m.x[...] * 2.0

    f.defvjp(lambda m: (f(m), None), lambda res, g: None)
    with pytest.raises(TypeError, match=r"bwd must return a tuple with one cotangent per"):
        treemode.grad(f)(Foo())

    f.defvjp(lambda m: (f(m), None), lambda res, g: ({"x": g},))
    with pytest.raises(treemode.StructureError, match=r"cotangent for args\[0\]"):
        treemode.grad(f)(Foo())

    def wrong_shape(res, g):
        m_g = jax.tree.map(jnp.zeros_like, Foo())
        m_g.x = nnx.Param(jnp.zeros(3))
        return (m_g,)

    f.defvjp(lambda m: (f(m), None), wrong_shape)
    with pytest.raises(
        treemode.StructureError, match=r"cotangent at args\[0\]\.x has shape \(3,\)"
    ):
        treemode.grad(f)(Foo())


def test_missing_defvjp_and_aliases():
    f = treemode.custom_vjp(lambda a, b: a.x[...] * b.x[...])
    with pytest.raises(TypeError, match=r"call \.defvjp"):
        f(Foo(), Foo())
    f.defvjp(lambda a, b: (f(a, b), None), lambda res, g: (None, None))
    m = Foo()
    with pytest.raises(treemode.AliasError, match=r"treemode\.custom_vjp.*args\[0\].*args\[1\]"):
        f(m, m)


def test_graph_mode_shared_module():
    @treemode.custom_vjp
    def f(a, b):
        return a.x[...] * b.y[...]

    def bwd(res, g):
        a, b = res
        a_g = jax.tree.map(jnp.zeros_like, a)
        a_g.x[...] = g * b.y[...]
        a_g.y[...] = g * a.x[...]
        return a_g, None

    f = treemode.custom_vjp(f.fn, graph=True)
    f.defvjp(lambda a, b: (f(a, b), (a, b)), bwd)
    m = Foo(3.0, 4.0)
    assert float(f(m, m)) == 12.0
    grads = treemode.grad(lambda m: f(m, m))(m)
    np.testing.assert_allclose(grads.x[...], 4.0)
    np.testing.assert_allclose(grads.y[...], 3.0)


def test_differentiating_a_closed_over_module_raises():
    def loss(outer):
        @treemode.custom_vjp
        def f(m):
            return m.x[...] * outer.x[...]

        f.defvjp(lambda m: (f(m), None), lambda res, g: (None,))
        return f(Foo())

    # the closed-over module is a constant for the custom_vjp function: fine
    np.testing.assert_allclose(loss(Foo(2.0)), 2.0)
    # an outer gradient w.r.t. the closed-over module would be lost: error
    with pytest.raises(treemode.ClosureError, match=r"Param at closure outer\.x through"):
        treemode.grad(loss)(Foo(2.0))


def test_unused_outputs_get_zero_cotangents_in_bwd():
    seen = {}

    @treemode.custom_vjp
    def f(m):
        return m.x[...] * 2.0, m.y[...] * 3.0

    def bwd(res, g):
        seen["g"] = g
        m_g = jax.tree.map(jnp.zeros_like, res)
        m_g.x[...] = 2.0 * g[0]
        m_g.y[...] = 3.0 * g[1]
        return (m_g,)

    f.defvjp(lambda m: (f(m), m), bwd)
    grads = treemode.grad(lambda m: f(m)[0])(Foo())
    np.testing.assert_allclose(grads.x[...], 2.0)
    np.testing.assert_allclose(grads.y[...], 0.0)
    np.testing.assert_allclose(seen["g"][1], 0.0)  # a plain zero array, not a symbolic zero


def test_fwd_and_bwd_keep_no_tracer_alive(tracer_leaks):
    """JAX caches fwd and bwd with the jaxpr: they must not hold the call's tracers.

    Runs under ``jax.check_tracer_leaks``: every trace below fails on exit if a
    tracer of it is still referenced (e.g. through the arguments of the call).
    """
    f = make_f()
    m = Foo(0.7, -1.5)

    grads = treemode.jit(treemode.grad(f))(m)  # fwd and bwd traced inside jit
    np.testing.assert_allclose(grads.x[...], jnp.cos(0.7) * -1.5, rtol=1e-6)
    grads = treemode.grad(treemode.jit(lambda m: f(m) * 2.0))(m)  # fwd traced lazily
    np.testing.assert_allclose(grads.y[...], 2 * jnp.sin(0.7), rtol=1e-6)

    # nondiff module argument written back, a closed-over module, graph mode sharing
    outer = Foo(2.0)

    @treemode.custom_vjp(nondiff_argnums=(0,), graph=True)
    def g(stats, a, b):
        stats.calls[...] += 1
        return a.x[...] * b.y[...] * outer.x[...]

    def g_bwd(stats, res, ct):
        a, b = res
        a_g = jax.tree.map(jnp.zeros_like, a)
        a_g.x[...] = ct * b.y[...] * outer.x[...]
        return a_g, None

    g.defvjp(lambda stats, a, b: (g(stats, a, b), (a, b)), g_bwd)
    stats, shared = Foo(), Foo(3.0, 4.0)
    grads = treemode.jit(treemode.grad(lambda m, s: g(s, m, m)))(shared, stats)
    np.testing.assert_allclose(grads.x[...], 4.0 * 2.0)
    assert int(stats.calls[...]) == 1
    # inside plain JAX transforms, with modules created inside them
    inner = lambda x: treemode.grad(lambda m: g(Foo(), m, m))(Foo(x, x)).x[...]
    np.testing.assert_allclose(jax.jit(jax.grad(inner))(3.0), 2.0)  # inner(x) = x * outer.x
    assert not any(isinstance(v[...], jax.core.Tracer) for v in (stats.calls, outer.x))


class _Recording:
    """Records every function treemode hands ``jax.custom_vjp``: the primal, fwd, bwd."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.handed: list[Any] = []
        real = jax.custom_vjp
        handed = self.handed

        class Recorded(real):  # type: ignore[misc, valid-type]
            def __init__(self, fun, *args, **kwargs):
                handed.append(fun)
                super().__init__(fun, *args, **kwargs)

            def defvjp(self, fwd, bwd, *args, **kwargs):
                handed.extend([fwd, bwd])
                return super().defvjp(fwd, bwd, *args, **kwargs)

        monkeypatch.setattr(jax, "custom_vjp", Recorded)


def _reachable_tracers(roots: list[Any], budget: int = 200_000) -> list[str]:
    """What JAX would keep alive by keeping ``roots``: the tracers among it.

    Walks ``gc.get_referents`` from the roots, following a function's closure
    cells, defaults and ``__dict__`` (not its module globals, which reach
    everything), and not into modules or classes.
    """
    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(r, getattr(r, "__qualname__", repr(r))) for r in roots]
    while stack:
        x, where = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        assert len(seen) < budget, "the walk reached too much; narrow it"
        if isinstance(x, jax.core.Tracer):
            found.append(f"{type(x).__name__} via {where}")
            continue
        if isinstance(x, (types.ModuleType, type)):
            continue
        if isinstance(x, types.FunctionType):
            children: list[tuple[Any, str]] = []
            for name, cell in zip(x.__code__.co_freevars, x.__closure__ or (), strict=True):
                try:
                    children.append((cell.cell_contents, f"{where} -> {name}"))
                except ValueError:  # an empty cell
                    pass
            extra = [x.__defaults__, x.__kwdefaults__, x.__dict__]
            children += [(c, where) for c in extra if c]
        else:
            children = [(c, f"{where} -> {type(c).__name__}") for c in gc.get_referents(x)]
        stack.extend(children)
    return found


def test_no_tracer_is_reachable_from_the_rules_handed_to_jax(monkeypatch):
    """The primal, fwd and bwd functions treemode gives ``jax.custom_vjp`` hold no
    tracer once the call returned: JAX may keep any of them in a cached jaxpr
    (JAX 0.11 keeps bwd in the equation, and bwd refers to the primal function).
    Checked directly, on any JAX, by walking what those functions reference."""
    recording = _Recording(monkeypatch)
    f = make_f()
    m = Foo(0.7, -1.5)

    grads = treemode.jit(treemode.grad(f))(m)
    np.testing.assert_allclose(grads.x[...], jnp.cos(0.7) * -1.5, rtol=1e-6)
    grads = treemode.grad(treemode.jit(lambda m: f(m) * 2.0))(m)  # fwd traced lazily
    np.testing.assert_allclose(grads.y[...], 2 * jnp.sin(0.7), rtol=1e-6)

    @treemode.custom_vjp(nondiff_argnums=(0,), graph=True)
    def g(stats, a, b):
        stats.calls[...] += 1
        return a.x[...] * b.y[...]

    def g_bwd(stats, res, ct):
        a, b = res
        a_g = jax.tree.map(jnp.zeros_like, a)
        a_g.x[...] = ct * b.y[...]
        return a_g, None

    g.defvjp(lambda stats, a, b: (g(stats, a, b), (a, b)), g_bwd)
    stats, shared = Foo(), Foo(3.0, 4.0)
    grads = treemode.jit(treemode.grad(lambda m, s: g(s, m, m)))(shared, stats)
    np.testing.assert_allclose(grads.x[...], 4.0)
    assert int(stats.calls[...]) == 1

    # a primal, fwd and bwd per call (fwd rules calling the function add calls)
    assert len(recording.handed) >= 9 and len(recording.handed) % 3 == 0
    assert _reachable_tracers(recording.handed) == []
    # Run after its call (as JAX may), the primal function rebuilds the call.
    primal = recording.handed[0]  # f's, from the first call
    out, updates = primal(*jax.tree.leaves(Foo(0.7, -1.5)))
    np.testing.assert_allclose(out, jnp.sin(0.7) * -1.5, rtol=1e-6)
    assert all(u is None for u in updates)


def test_python_scalar_primal_under_jax_grad():
    """jax.grad of f(1.0): JAX may pass the primal back as a Python float."""

    @treemode.custom_vjp
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, None), lambda res, g: (3 * g,))
    assert jax.grad(double)(1.0) == 3.0
    assert treemode.grad(double)(1.0) == 3.0
    assert jax.grad(lambda x: double(x) + double(2 * x))(1.0) == 9.0


def _updating_f(graph: bool, record: dict, bwd_kind: str = "named"):
    """f(m): m.x <- 3 x, m.calls += 1, returns 3 x y; bwd takes the updates' cotangents."""

    @treemode.custom_vjp(graph=graph)
    def f(m):
        m.calls[...] += 1
        m.x[...] = 3.0 * m.x[...]
        return m.x[...] * m.y[...]

    def f_fwd(m):
        x0 = m.x[...]
        return f(m), (x0, m.y[...])

    def rule(res, g, updates_g):
        x0, y = res
        record["updates_g"] = updates_g
        (m_up,) = updates_g
        ct = Foo()
        ct.x[...] = g * 3.0 * y + 3.0 * m_up.x[...]  # through the output and the new x
        ct.y[...] = g * 3.0 * x0
        return (ct,)

    if bwd_kind == "named":
        f.defvjp(f_fwd, lambda res, g, updates_g: rule(res, g, updates_g))
    else:  # **kwargs
        f.defvjp(f_fwd, lambda res, g, **kw: rule(res, g, kw["updates_g"]))
    return f


@pytest.mark.parametrize("bwd_kind", ["named", "kwargs"])
@pytest.mark.parametrize("graph", [False, True])
def test_bwd_with_updates_g_gets_the_updates_cotangents(graph, bwd_kind):
    record: dict = {}
    f = _updating_f(graph, record, bwd_kind)

    def loss(m):
        return f(m) + 10.0 * m.x[...]  # reads the new x: its cotangent is 10

    m = Foo()
    grads = treemode.grad(loss, graph=graph)(m)
    # loss(x, y) = 3xy + 30x: d/dx = 3y + 30 = 36, d/dy = 3x = 3
    np.testing.assert_allclose(grads.x[...], 36.0)
    np.testing.assert_allclose(grads.y[...], 3.0)
    assert float(m.x[...]) == 3.0 and int(m.calls[...]) == 1  # updates written back
    updates_g = record["updates_g"]
    assert isinstance(updates_g, tuple) and len(updates_g) == 1
    (m_up,) = updates_g
    assert type(m_up) is Foo and m_up.y is None  # y was not changed
    assert type(m_up.x) is nnx.Param
    np.testing.assert_allclose(m_up.x[...], 10.0)
    assert type(m_up.calls) is nnx.BatchStat  # an integer update: a float0 cotangent
    assert m_up.calls[...].dtype == jax.dtypes.float0
    assert len(jax.tree.leaves(m_up)) == 2


def test_updates_g_has_an_entry_per_argument_nondiff_ones_included():
    record: dict = {}

    @treemode.custom_vjp(nondiff_argnums=(0,))
    def f(stats, m):
        stats.calls[...] += 1
        return m.x[...] * 2.0

    def f_bwd(stats, res, g, updates_g):
        record["updates_g"] = updates_g
        ct = jax.tree.map(jnp.zeros_like, res)
        ct.x[...] = 2.0 * g
        return (ct,)

    f.defvjp(lambda stats, m: (f(stats, m), m), f_bwd)
    stats, m = Foo(), Foo()
    grads = treemode.grad(lambda m: f(stats, m))(m)
    np.testing.assert_allclose(grads.x[...], 2.0)
    assert int(stats.calls[...]) == 1
    stats_up, m_up = record["updates_g"]
    assert type(stats_up.calls) is nnx.BatchStat and stats_up.x is None
    assert jax.tree.leaves(m_up) == []  # nothing of m changed


def test_plain_bwd_still_refuses_differentiable_updates_and_updates_g_allows_them():
    # The same function: with bwd(res, g) the update of m.x has no cotangent.
    record: dict = {}
    allowed = _updating_f(False, record)
    m = Foo()
    treemode.grad(allowed)(m)
    assert float(m.x[...]) == 3.0

    @treemode.custom_vjp
    def refused(m):
        m.x[...] = 3.0 * m.x[...]
        return m.x[...]

    refused.defvjp(lambda m: (refused(m), None), lambda res, g: (None,))
    m = Foo()
    with pytest.raises(treemode.MutationError, match=r"differentiable Param at args\[0\]\.x"):
        treemode.grad(refused)(m)
    assert float(m.x[...]) == 1.0

    # A positional-only parameter named updates_g is not the keyword: plain form.
    def positional_only(res, g, updates_g=None, /):
        return (None,)

    refused.defvjp(lambda m: (refused(m), None), positional_only)
    with pytest.raises(treemode.MutationError):
        treemode.grad(refused)(m)
