"""A module reachable through the closure and as an argument is one set of objects.

The pattern of google/tunix's ``PeftTrainer``: a trainer object holds
``self.model`` and ``self.optimizer`` and jits its bound method
``self._train_step(model, optimizer, inputs)``, passing those same objects. The
trace hands the closure's route the argument's rebuilt object, so reads and
writes through either route are the same, and the updates are written back
once, through the argument.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Counter

import treemode

# A closure object that is an argument's is known, not reported as unlifted.
pytestmark = pytest.mark.filterwarnings("error::treemode.ClosureWarning")


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(10, 4, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)
        self.steps = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        return self.out(self.emb(x))


def _loss(model, inputs):
    return jnp.mean(model(inputs) ** 2)


class Trainer:
    """The shape of tunix's PeftTrainer: the step is a bound method that takes the
    model and optimizer it also holds."""

    def __init__(self, model, optimizer, jit=True, **jit_kwargs):
        self.model = model
        self.optimizer = optimizer
        self.seen = []
        self.step = treemode.jit(self._train_step, **jit_kwargs) if jit else self._train_step

    def _train_step(self, model, optimizer, inputs):
        self.seen.append(model is self.model and optimizer is self.optimizer)
        loss, grads = nnx.value_and_grad(_loss)(model, inputs)
        optimizer.update(model, grads)
        model.steps[...] += 1
        # A read through the closure after the writes through the argument sees them.
        return loss, self.model.steps[...], self.optimizer.step[...]


def _state(*nodes):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(nodes))]


@pytest.mark.parametrize(
    "jit_kwargs", [{}, {"donate_argnames": ("model", "optimizer")}], ids=["plain", "donated"]
)
def test_trainer_holding_the_model_it_passes_matches_eager(jit_kwargs):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    eager_model, eager_optimizer = copy.deepcopy((model, optimizer))
    trainer = Trainer(model, optimizer, **jit_kwargs)
    eager = Trainer(eager_model, eager_optimizer, jit=False)
    inputs = jnp.arange(3)
    for _ in range(3):
        got = trainer.step(trainer.model, trainer.optimizer, inputs)
        want = eager.step(eager.model, eager.optimizer, inputs)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
        assert int(got[1]) == int(want[1]) and int(got[2]) == int(want[2])
    for a, b in zip(_state(model, optimizer), _state(eager_model, eager_optimizer), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(model.steps[...]) == 3 and int(optimizer.step[...]) == 3
    # Inside the trace the closure's self.model *is* the argument (traced once).
    assert trainer.seen == [True]
    assert trainer.model is model and trainer.optimizer is optimizer


def test_closure_object_inside_the_argument_is_the_arguments_object():
    # The fix the AliasError suggests for ModelAndOptimizer, in a trainer: pass the
    # optimizer only; the trainer's self.model is optimizer.model.
    model = Model(nnx.Rngs(0))
    optimizer = nnx.ModelAndOptimizer(model, optax.sgd(0.1))
    eager_optimizer = copy.deepcopy(optimizer)

    class OwnerTrainer:
        def __init__(self, optimizer):
            self.model = optimizer.model
            self.optimizer = optimizer

        def step(self, optimizer, inputs):
            grads = nnx.grad(_loss)(optimizer.model, inputs)
            optimizer.update(grads)
            self.model.steps[...] += 1  # through the closure
            return self.model is optimizer.model

    trainer = OwnerTrainer(optimizer)
    assert bool(treemode.jit(trainer.step)(optimizer, jnp.arange(3)))
    OwnerTrainer(eager_optimizer).step(eager_optimizer, jnp.arange(3))
    for a, b in zip(_state(optimizer), _state(eager_optimizer), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(model.steps[...]) == 1


def test_closure_alias_follows_the_objects_passed():
    # The same wrapper called with another model: the closure's module is lifted on
    # its own then, and each is updated once.
    first, second = Counter(), Counter()

    @treemode.jit
    def step(c, x):
        return first(x) + c(x)

    step(first, jnp.ones(2))
    assert int(first.count[...]) == 2
    step(second, jnp.ones(2))
    assert int(first.count[...]) == 3 and int(second.count[...]) == 1
    step(first, jnp.ones(2))
    assert int(first.count[...]) == 5 and int(second.count[...]) == 1


def test_closure_alias_under_grad_and_vmap():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def loss(m, x):  # reads the module through the closure and the argument
        return jnp.sum(model(x)) + jnp.sum(m(x))

    grads = treemode.grad(loss)(model, jnp.ones((1, 2)))
    eager = nnx.grad(lambda m, x: jnp.sum(m(x)) * 2)(model, jnp.ones((1, 2)))
    np.testing.assert_allclose(grads.kernel[...], eager.kernel[...])

    counter = Counter()

    def tick(c, x):
        counter.count[...] += 1  # through the closure: the broadcast argument's
        return c.total[...] + x

    out = treemode.vmap(tick, in_axes=(None, 0))(counter, jnp.ones((3, 2)))
    assert out.shape == (3, 2) and int(counter.count[...]) == 1


def test_closure_object_that_holds_the_argument_is_still_refused():
    # The closure object holds the argument but is not one of its objects: lifting
    # it would make a second copy of the argument's Variables.
    model = Model(nnx.Rngs(0))
    optimizer = nnx.ModelAndOptimizer(model, optax.sgd(0.1))
    before = _state(model, optimizer)

    @treemode.jit
    def step(m, x):
        optimizer.update(nnx.grad(_loss)(m, x))

    with pytest.raises(treemode.ClosureError) as info:
        step(model, jnp.arange(3))
    message = str(info.value)
    assert "closure optimizer.model" in message and "args[0]" in message
    assert "pass it as an argument instead of the module" in message
    for a, b in zip(before, _state(model, optimizer), strict=True):
        np.testing.assert_array_equal(a, b)


def test_graph_mode_closure_alias_is_the_arguments_object():
    class Tied(nnx.Module):
        def __init__(self):
            self.encoder = Counter()
            self.decoder = self.encoder  # shared: graph=True

    model, eager = Tied(), Tied()

    def step(m, x):
        model.encoder(x)  # through the closure
        return m.decoder(x) + model.decoder.count[...]  # sees both updates

    def eager_step(m, x):
        eager.encoder(x)
        return m.decoder(x) + eager.decoder.count[...]

    out = treemode.jit(step, graph=True)(model, jnp.ones(2))
    np.testing.assert_array_equal(out, eager_step(eager, jnp.ones(2)))
    assert int(model.encoder.count[...]) == int(eager.encoder.count[...]) == 2
    assert model.decoder is model.encoder
