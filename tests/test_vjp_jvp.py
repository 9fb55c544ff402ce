"""treemode.vjp / treemode.jvp against jax.vjp / jax.jvp on the raw arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter, state_arrays

import treemode

X = jnp.array([[0.5, -1.0], [1.5, 0.25]])


class Scaled(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([[1.0, -2.0, 0.5], [0.3, 0.7, -1.1]]))
        self.calls = nnx.BatchStat(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return jnp.sin(x @ self.w[...])


def raw(w, x):
    return jnp.sin(x @ w)


def test_vjp_matches_jax_and_cotangents_have_the_primal_types():
    model = Scaled()
    w = model.w[...]
    out, vjp_fn = treemode.vjp(lambda m, x: m(x), model, X)
    out_ref, vjp_ref = jax.vjp(raw, w, X)
    np.testing.assert_allclose(out, out_ref, rtol=1e-6)
    ct = jnp.arange(6.0).reshape(2, 3)
    m_ct, x_ct = vjp_fn(ct)
    w_ct_ref, x_ct_ref = vjp_ref(ct)
    assert type(m_ct) is Scaled and type(m_ct.w) is nnx.Param
    np.testing.assert_allclose(m_ct.w[...], w_ct_ref, rtol=1e-6)
    np.testing.assert_allclose(x_ct, x_ct_ref, rtol=1e-6)
    assert m_ct.calls[...].dtype == jax.dtypes.float0  # integer Variable: not differentiated


def test_vjp_writes_back_mutations_and_has_aux():
    model = Scaled()

    def f(m, x):
        y = m(x)
        return y, jnp.sum(y)

    out, vjp_fn, aux = treemode.vjp(f, model, X, has_aux=True)
    assert int(model.calls[...]) == 1
    np.testing.assert_allclose(aux, jnp.sum(out), rtol=1e-6)
    counter = Counter()
    treemode.vjp(lambda c, x: c(x), counter, jnp.ones(2))
    assert int(counter.count[...]) == 1
    np.testing.assert_allclose(counter.total[...], 2.0)


def test_jvp_matches_jax():
    model = Scaled()
    tangent = jax.tree.map(jnp.ones_like, model)  # int Variable tangent is ignored
    x_dot = jnp.full_like(X, 0.5)
    out, out_dot = treemode.jvp(lambda m, x: m(x), (model, X), (tangent, x_dot))
    out_ref, out_dot_ref = jax.jvp(raw, (model.w[...], X), (jnp.ones((2, 3)), x_dot))
    np.testing.assert_allclose(out, out_ref, rtol=1e-6)
    np.testing.assert_allclose(out_dot, out_dot_ref, rtol=1e-6)
    assert int(model.calls[...]) == 1  # written back


def test_jvp_none_tangent_and_has_aux():
    model = Scaled()
    out, out_dot, aux = treemode.jvp(
        lambda m, x: (m(x), m.calls[...]), (model, X), (None, jnp.ones_like(X)), has_aux=True
    )
    _, ref_dot = jax.jvp(lambda x: raw(model.w[...], x), (X,), (jnp.ones_like(X),))
    np.testing.assert_allclose(out_dot, ref_dot, rtol=1e-6)
    assert int(aux) == 1


def test_jvp_tangent_structure_errors():
    model = Scaled()
    with pytest.raises(
        treemode.StructureError, match=r"treemode\.jvp: the tangent for primals\[0\]"
    ):
        treemode.jvp(lambda m: m(X), (model,), ({"w": jnp.ones((2, 3))},))
    bad = jax.tree.map(lambda v: jnp.ones((5,)), model)
    with pytest.raises(treemode.StructureError, match=r"tangent at primals\[0\]\.w has shape"):
        treemode.jvp(lambda m: m(X), (model,), (bad,))
    with pytest.raises(TypeError, match=r"treemode\.jvp: got 1 primal\(s\) but 2"):
        treemode.jvp(lambda m: m(X), (model,), (None, None))
    assert int(model.calls[...]) == 0


def test_graph_mode_vjp_with_shared_variable():
    v = nnx.Param(jnp.array(2.0))
    pair = {"a": v, "b": v}
    out, vjp_fn = treemode.vjp(lambda p: p["a"][...] * p["b"][...], pair, graph=True)
    (ct,) = vjp_fn(jnp.array(1.0))
    assert ct["a"] is ct["b"]
    np.testing.assert_allclose(ct["a"][...], 4.0)  # d(v*v)/dv


def test_aliases_rejected():
    v = nnx.Param(jnp.ones(2))
    with pytest.raises(treemode.AliasError, match=r"treemode\.vjp.*args\[0\].*args\[1\]"):
        treemode.vjp(lambda a, b: a[...] * b[...], v, v)
    with pytest.raises(treemode.AliasError, match=r"treemode\.jvp"):
        treemode.jvp(lambda a, b: a[...] * b[...], (v, v), (None, None))


def test_raising_function_leaves_inputs_unchanged():
    model = Scaled()
    before = state_arrays(model)

    def f(m):
        m(X)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        treemode.vjp(f, model)
    with pytest.raises(RuntimeError, match="boom"):
        treemode.jvp(f, (model,), (None,))
    for a, b in zip(before, state_arrays(model), strict=True):
        np.testing.assert_array_equal(a, b)
