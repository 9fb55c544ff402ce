"""treemode.remat / treemode.checkpoint: same values, policy applied, write-back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter, state_arrays
from jax.ad_checkpoint import checkpoint_name

import treemode

X = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])


def block(m, x):
    h = checkpoint_name(jnp.sin(m(x)), "h")
    return jnp.sum(jnp.cos(jnp.sin(h)))


def test_values_and_gradients_equal_without_remat():
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    out = treemode.remat(block)(model, X)
    np.testing.assert_allclose(out, block(model, X), rtol=1e-6)
    g_remat = treemode.grad(treemode.remat(block))(model, X)
    g_plain = treemode.grad(block)(model, X)
    np.testing.assert_allclose(g_remat.kernel[...], g_plain.kernel[...], rtol=1e-6)
    np.testing.assert_allclose(g_remat.bias[...], g_plain.bias[...], rtol=1e-6)


def saved_residuals(capsys, fn, *args) -> str:
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return capsys.readouterr().out


def test_policy_is_applied(capsys):
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def loss_with(policy):
        fn = treemode.remat(block, policy=policy)
        return lambda x: fn(model, x)

    names = jax.checkpoint_policies.save_only_these_names("h")
    saved_h = saved_residuals(capsys, loss_with(names), X)
    saved_none = saved_residuals(capsys, loss_with(jax.checkpoint_policies.nothing_saveable), X)
    unrematted = saved_residuals(capsys, lambda x: block(model, x), X)
    # JAX 0.10 names the saved residual; older releases show checkpoint_name's
    # primitive (reduce_precision) instead.
    assert "named 'h'" in saved_h or "reduce_precision" in saved_h
    assert "named 'h'" not in saved_none and "reduce_precision" not in saved_none
    assert "sin" in unrematted and "sin" not in saved_none  # recomputed, not saved
    # the jaxpr of the gradient holds the checkpoint with its policy
    jaxpr = str(jax.make_jaxpr(jax.grad(loss_with(names)))(X))
    assert "remat" in jaxpr
    assert "SaveOnlyTheseNames" in jaxpr or "save_only_these_names" in jaxpr


def test_prevent_cse_is_forwarded():
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    for flag in (True, False):
        jaxpr = str(
            jax.make_jaxpr(lambda x, f=flag: treemode.remat(block, prevent_cse=f)(model, x))(X)
        )
        assert f"prevent_cse={flag}" in jaxpr


def test_static_argnums_and_checkpoint_alias():
    assert treemode.checkpoint is treemode.remat
    traces = []

    def f(x, power):
        traces.append(power)
        return x**power

    g = treemode.checkpoint(f, static_argnums=(1,))
    np.testing.assert_allclose(g(jnp.array(3.0), 2), 9.0)
    np.testing.assert_allclose(jax.grad(g)(jnp.array(3.0), 3), 27.0)
    assert traces == [2, 3]
    with pytest.raises(treemode.StaticArgumentError, match=r"treemode\.remat.*not hashable"):
        g(jnp.array(3.0), [2])


def test_mutations_written_back_and_method_decorator():
    class Net(nnx.Module):
        def __init__(self):
            self.counter = Counter()

        @treemode.remat
        def __call__(self, x):
            return self.counter(x) * 2

    net = Net()
    y = net(jnp.ones(2))
    np.testing.assert_allclose(y, 4.0)
    assert int(net.counter.count[...]) == 1
    g = treemode.grad(lambda n, x: jnp.sum(n(x)), argnums=1)(net, jnp.ones(2))
    np.testing.assert_allclose(g, 2.0)
    assert int(net.counter.count[...]) == 2


def test_aliases_rejected_and_raising_leaves_inputs_unchanged():
    v = nnx.Param(jnp.ones(2))
    with pytest.raises(treemode.AliasError, match=r"treemode\.remat.*args\[0\].*args\[1\]"):
        treemode.remat(lambda a, b: a[...] * b[...])(v, v)
    counter = Counter()
    before = state_arrays(counter)

    def bad(c, x):
        c(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        treemode.remat(bad)(counter, jnp.ones(2))
    for a, b in zip(before, state_arrays(counter), strict=True):
        np.testing.assert_array_equal(a, b)
