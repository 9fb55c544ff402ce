"""``nnx.cached_partial`` over treemode's wrappers, and ``jitted_fn`` through
``functools.wraps``/``functools.partial``.

``nnx.cached_partial`` binds clones of the graph nodes that share the original
Variables and leaves a cache for the Flax transform it calls to take. A treemode
wrapper takes it and runs the call as the plain partial would, with the same
results and write-back as ``nnx.cached_partial`` over ``nnx.jit`` in Flax's graph
mode; ``treemode.jit``'s repeated calls stay on the executor. The trainer is
shaped like google/tunix's (``functools.partial(nnx.cached_partial(jit(step),
model, opt))``, ``.func.jitted_fn._cache_size()``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import treemode

X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
Y = jnp.linspace(0.5, -0.5, 8).reshape(4, 2)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


def _arrays(*trees) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(trees))]


def _flax_trainer(steps: int, donate: bool) -> tuple[list[float], list[np.ndarray], int]:
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)

    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    jitted = nnx.jit(step, donate_argnums=(0, 1) if donate else ())
    train_step = functools.partial(nnx.cached_partial(jitted, model, opt))
    losses = [float(train_step(X, Y)) for _ in range(steps)]
    return losses, _arrays(model, opt), train_step.func.jitted_fn._cache_size()


def _step(model, opt, x, y):
    loss, grads = treemode.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_tunix_shaped_trainer_matches_flax_graph_mode(donate):
    steps = 4
    flax_losses, flax_state, flax_compiles = _flax_trainer(steps, donate)

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    jitted = treemode.jit(_step, donate_argnums=(0, 1) if donate else ())
    train_step = functools.partial(nnx.cached_partial(jitted, model, opt))
    losses = [float(train_step(X, Y)) for _ in range(steps)]

    np.testing.assert_allclose(losses, flax_losses, rtol=1e-6)
    # the caller's model and optimizer are written (BatchNorm statistics included)
    for got, want in zip(_arrays(model, opt), flax_state, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert int(opt.step[...]) == steps
    assert train_step.func.jitted_fn._cache_size() == flax_compiles == 1


def test_repeated_calls_run_on_the_executor(implementation):
    """The repeated call runs on the executor (C, or its Python twin), which takes
    Flax's cache itself (``_before_call``): no miss, and no Python frame of
    treemode's before it."""
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    jitted = treemode.jit(_step)
    train_step = nnx.cached_partial(jitted, model, opt)
    train_step(X, Y)
    train_step(X, Y)
    missed: list[object] = []
    assert jitted._records  # the executor (C, or its Python twin) runs the calls

    def miss(wrapper, error, args, kwargs):
        missed.append(error)
        return wrapper._on_miss(error, args, kwargs)

    jitted._miss = miss
    for _ in range(3):
        train_step(X, Y)
    assert missed == []
    assert jitted._before_call is not None  # set by the first call through cached_partial
    assert int(opt.step[...]) == 5
    # the same wrapper still runs direct calls, with its own objects
    other = Model(nnx.Rngs(1))
    other_opt = nnx.Optimizer(other, optax.sgd(0.1), wrt=nnx.Param)
    jitted(other, other_opt, X, Y)
    assert int(other_opt.step[...]) == 1
    assert int(opt.step[...]) == 5


def test_a_failing_call_leaves_the_modules_and_flax_context_clean():
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = _arrays(model, opt)

    def bad(model, opt, x):
        model.linear.kernel[...] = model.linear.kernel[...] * 2
        return model(x) @ jnp.ones((3, 3))  # shapes do not match

    train_step = nnx.cached_partial(treemode.jit(bad), model, opt)
    with pytest.raises(TypeError):
        train_step(X)
    for got, want in zip(_arrays(model, opt), before, strict=True):
        np.testing.assert_array_equal(got, want)
    # Flax's own cached_partial still works afterwards (nothing left in its context)
    flax_step = nnx.cached_partial(nnx.jit(lambda m, x: m(x)), Model(nnx.Rngs(0)))
    assert flax_step(X).shape == (4, 2)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: treemode.grad(f),
        lambda f: treemode.value_and_grad(f),
        lambda f: treemode.remat(f),
        lambda f: treemode.vmap(f, in_axes=(None, 0)),
    ],
    ids=["grad", "value_and_grad", "remat", "vmap"],
)
def test_the_other_wrappers_run_as_the_plain_partial(transform):
    def loss(model, x):
        return jnp.sum(model(x)) if x.ndim == 2 else jnp.sum(model(x[None]))

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    wrapped = transform(loss)
    expected = wrapped(model, X)
    cached = nnx.cached_partial(wrapped, model)
    for _ in range(2):
        got = cached(X)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
            got,
            expected,
        )


def test_jitted_fn_survives_functools_wraps_and_partial():
    jitted = treemode.jit(lambda m, x: m(x))
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    @functools.wraps(jitted)
    def wrapper(*args):
        return jitted(*args)

    wrapper(model, X)
    assert wrapper.jitted_fn._cache_size() == jitted.jitted_fn._cache_size() == 1
    assert functools.partial(wrapper, model).func.jitted_fn._cache_size() == 1
    # as Flax's: an attribute of the wrapper's own __dict__
    flax_jitted = nnx.jit(lambda m, x: m(x))
    assert "jitted_fn" in vars(flax_jitted) and "jitted_fn" in vars(jitted)
    # a wrapper made for a function already seen keeps its own view
    f = lambda x: x + 1  # noqa: E731
    a, b = treemode.jit(f), treemode.jit(f)
    assert a.jitted_fn._wrapped is a and b.jitted_fn._wrapped is b
