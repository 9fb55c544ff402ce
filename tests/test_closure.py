"""Variables reached through the closure are lifted: fresh reads, written-back writes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Counter

import treemode

GLOBAL_COUNTER = Counter()


def test_closure_reads_are_never_stale():
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    traces = []

    @treemode.jit
    def forward(x):
        traces.append(1)
        return m(x)

    x = jnp.ones((1, 2))
    np.testing.assert_allclose(forward(x), m(x))
    m.kernel[...] = m.kernel[...] * 3
    np.testing.assert_allclose(forward(x), m(x))
    assert len(traces) == 1


def test_closure_writes_are_written_back():
    counter = Counter()

    @treemode.jit
    def step(x):
        return counter(x)

    step(jnp.ones(2))
    step(jnp.ones(2))
    assert int(counter.count[...]) == 2
    assert float(counter.total[...]) == 4.0


def test_global_module_is_lifted():
    def step(x):
        return GLOBAL_COUNTER(x)

    before = int(GLOBAL_COUNTER.count[...])
    treemode.jit(step)(jnp.ones(2))
    assert int(GLOBAL_COUNTER.count[...]) == before + 1


def test_bound_method_and_callable_module():
    counter = Counter()
    treemode.jit(counter.__call__)(jnp.ones(2))
    treemode.jit(counter)(jnp.ones(2))
    treemode.jit(functools.partial(lambda c, x: c(x), counter))(jnp.ones(2))
    assert int(counter.count[...]) == 3


def test_module_both_argument_and_closure_is_one_set_of_objects():
    # Reachable through the closure and as an argument: the trace gives both routes
    # the argument's rebuilt module, so the two updates add up, as eagerly.
    counter, eager = Counter(), Counter()

    def step(c, x):
        return counter(x) + c(x)

    def eager_step(c, x):
        return eager(x) + c(x)

    out = treemode.jit(step)(counter, jnp.ones(2))
    np.testing.assert_array_equal(out, eager_step(eager, jnp.ones(2)))
    assert int(counter.count[...]) == int(eager.count[...]) == 2
    assert float(counter.total[...]) == float(eager.total[...]) == 4.0


def test_closure_restored_after_error():
    counter = Counter()
    before = counter.count.get_raw_value()

    @treemode.jit
    def step(x):
        counter(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        step(jnp.ones(2))
    assert counter.count.get_raw_value() is before
    assert isinstance(counter.count.get_raw_value(), jax.Array)
    counter(jnp.ones(2))  # still usable eagerly
    assert int(counter.count[...]) == 1


def test_closed_over_module_mutated_inside_jax_jit_is_reported(tracer_leaks):
    counter = Counter()

    @jax.jit
    def outer(x):
        return treemode.jit(lambda x: x + 1)(x), counter.count[...]

    outer(jnp.ones(2))  # reading an outer Variable inside jax.jit is fine

    @jax.jit
    def outer_mutating(x):
        return treemode.jit(lambda x: counter(x))(x)

    with pytest.raises(treemode.TraceContextError, match=r"closure counter\.count"):
        outer_mutating(jnp.ones(2))
    assert isinstance(counter.count.get_raw_value(), jax.Array)
    assert int(counter.count[...]) == 0


c = Counter()  # a global whose name is also used as an attribute name below


def test_attribute_names_are_not_mistaken_for_globals():
    class Holder(nnx.Module):
        def __init__(self):
            self.c = Counter()

    holder = Holder()

    @treemode.jit
    def step(h, x):
        return h.c(x)  # `.c` is an attribute access, not the global `c`

    step(holder, jnp.ones(2))
    assert int(holder.c.count[...]) == 1
    assert int(c.count[...]) == 0


def test_globals_used_in_nested_comprehension_are_lifted():
    def step(x):
        return [GLOBAL_COUNTER(x) for _ in range(2)][-1]

    before = int(GLOBAL_COUNTER.count[...])
    treemode.jit(step)(jnp.ones(2))
    assert int(GLOBAL_COUNTER.count[...]) == before + 2


# -- modules held in lists, dicts, plain objects and default arguments ---------

GLOBAL_MODELS: list = []


def _read_global_list(x):
    return GLOBAL_MODELS[0](x)


@pytest.fixture
def global_models():
    GLOBAL_MODELS[:] = [nnx.Linear(2, 2, rngs=nnx.Rngs(0))]
    yield GLOBAL_MODELS
    GLOBAL_MODELS.clear()


def test_module_in_a_global_list_is_read_fresh_and_replaced_in_place(global_models):
    f = treemode.jit(_read_global_list)
    x = jnp.zeros((1, 2))
    first = global_models[0]
    np.testing.assert_array_equal(f(x), first(x))
    first.bias[...] = jnp.ones(2)
    np.testing.assert_array_equal(f(x), [[1.0, 1.0]])  # not a stale constant
    other = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    other.bias[...] = 3 * jnp.ones(2)
    global_models[0] = other  # the list changes in place; no binding the search read does
    np.testing.assert_allclose(f(x), [[3.0, 3.0]])


class Trainer:
    """A plain Python object (not an NNX module) holding a model."""

    def __init__(self, model):
        self.model = model
        self.history = {"models": [model]}

    def step(self, x):
        self.model.bias[...] += 1.0
        return self.model(x)


def test_bound_method_of_a_plain_object_lifts_its_model_and_writes_back():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    trainer = Trainer(model)
    step = treemode.jit(trainer.step)
    x = jnp.zeros((1, 2))
    np.testing.assert_allclose(step(x), [[1.0, 1.0]])
    np.testing.assert_allclose(step(x), [[2.0, 2.0]])
    np.testing.assert_allclose(model.bias[...], [2.0, 2.0])  # written back, not lost
    trainer.model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # the attribute is rebound
    step(x)
    np.testing.assert_allclose(trainer.model.bias[...], [1.0, 1.0])
    np.testing.assert_allclose(model.bias[...], [2.0, 2.0])


def test_module_as_a_default_argument_is_lifted_unless_passed():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def forward(x, m=model):
        return m(x)

    f = treemode.jit(forward)
    x = jnp.zeros((1, 2))
    f(x)
    model.bias[...] = 5 * jnp.ones(2)
    np.testing.assert_allclose(f(x), [[5.0, 5.0]])
    np.testing.assert_allclose(f(x, model), [[5.0, 5.0]])  # passed: an argument, no alias
    np.testing.assert_allclose(f(x, m=model), [[5.0, 5.0]])


def test_module_in_a_closure_dict_is_updated():
    counters = {"a": Counter()}

    @treemode.jit
    def tick(x):
        return counters["a"](x)

    tick(jnp.ones(2))
    tick(jnp.ones(2))
    assert int(counters["a"].count[...]) == 2


def test_a_closure_search_through_holders_is_redone_every_call():
    from treemode._tree import _closure

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    holder = [model]

    def forward(x):
        return holder[0](x)

    assert _closure.closure_objects(forward) == [("holder[0]", model)]
    assert _closure.closure_snapshot(forward) is None  # never cached: lists change in place
    plain = []

    def reads_an_empty_list(x):
        return plain, x

    # An empty list may be filled later (a registry): searched again every call.
    assert _closure.closure_objects(reads_an_empty_list) == []
    assert _closure.closure_snapshot(reads_an_empty_list) is None
    sizes = [64, 64]

    def reads_a_list_of_numbers(x):
        return sizes, x

    assert _closure.closure_objects(reads_a_list_of_numbers) == []
    assert _closure.closure_snapshot(reads_a_list_of_numbers) is not None
