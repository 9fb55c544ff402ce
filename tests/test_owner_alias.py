"""A module passed beside an object that owns it: the AliasError says so, with the fixes.

``train_step(model, optimizer)`` with ``optimizer = nnx.ModelAndOptimizer(model,
tx)`` (Flax's diffusion example, the jax-ai-stack VAE tutorial) reaches every
Variable of the model twice. Tree mode refuses it, by design; the message names
the owner, the path at which it holds the module, and the two fixes.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import treemode


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


X, Y = jnp.ones((4, 2)), jnp.zeros((4, 1))


def _graph_step(model, optimizer, x, y):
    optimizer.update(nnx.grad(_loss)(model, x, y))


def test_model_and_optimizer_beside_its_model_names_the_owner_and_the_fixes():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.ModelAndOptimizer(model, optax.sgd(0.1))
    before = model.kernel.get_raw_value()
    with pytest.raises(treemode.AliasError) as info:
        treemode.jit(_graph_step)(model, optimizer, X, Y)
    message = str(info.value)
    assert message.startswith(
        "treemode.jit: args[0] (model: Linear) is also reachable inside args[1] "
        "(optimizer: ModelAndOptimizer), as args[1].model: an object that owns the "
        "Linear was passed beside it"
    )
    assert "Fix: pass only args[1] and reach the Linear through it as args[1].model" in message
    assert "model = optimizer.model" in message
    assert "treemode.jit(..., graph=True)" in message
    assert "See docs/migration.md#modelandoptimizer." in message
    assert model.kernel.get_raw_value() is before  # nothing ran


def test_the_two_fixes_run_and_match_graph_mode():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.ModelAndOptimizer(model, optax.sgd(0.1))
    reference = copy.deepcopy(optimizer)
    nnx.jit(_graph_step)(reference.model, reference, X, Y)  # Flax's graph mode

    @treemode.jit
    def train_step(optimizer, x, y):  # fix 1: the optimizer only
        optimizer.update(nnx.grad(_loss)(optimizer.model, x, y))

    train_step(optimizer, X, Y)
    np.testing.assert_allclose(model.kernel[...], reference.model.kernel[...], rtol=1e-6)

    other = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    other_optimizer = nnx.ModelAndOptimizer(other, optax.sgd(0.1))
    treemode.jit(_graph_step, graph=True)(other, other_optimizer, X, Y)  # fix 2
    np.testing.assert_allclose(other.kernel[...], reference.model.kernel[...], rtol=1e-6)
    assert other_optimizer.model is other


class HoldsModel(nnx.Optimizer):
    """An nnx.Optimizer subclass that keeps the model, as some trainers do."""

    def __init__(self, model, tx):
        super().__init__(model, tx, wrt=nnx.Param)
        self.model = model


def test_any_owner_and_keyword_arguments_are_recognised():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = HoldsModel(model, optax.sgd(0.1))

    def step(model, *, opt):
        return None

    with pytest.raises(treemode.AliasError) as info:
        treemode.jit(step)(model, opt=optimizer)
    message = str(info.value)
    assert "args[0] (model: Linear) is also reachable inside kwargs['opt'] " in message
    assert "(opt: HoldsModel), as kwargs['opt'].model" in message
    assert "model = optimizer.model" not in message  # the ModelAndOptimizer hint only

    # A Variable passed beside the module holding it, through check_no_aliases.
    with pytest.raises(treemode.AliasError, match=r"args\[1\] \(Linear\), as args\[1\]\.bias"):
        treemode.check_no_aliases(args=(model.bias, model))


def test_two_arguments_sharing_a_submodule_keep_the_plain_alias_message():
    shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    class Holder(nnx.Module):
        def __init__(self, layer):
            self.layer = layer

    with pytest.raises(treemode.AliasError) as info:
        treemode.jit(lambda a, b: None)(Holder(shared), Holder(shared))
    message = str(info.value)
    assert "is reachable twice, found at paths args[0].layer" in message
    assert "owns" not in message and "docs/migration.md#shared-variables" in message
