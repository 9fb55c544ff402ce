"""Closure objects are rebuilt inside the trace and reached by the same routes.

The function traced is a copy of the user's that reaches rebuilt modules (new
Variables holding the traced values) by the route the closure search found
them: closure cells, globals, defaults, bound methods, partials and holders.
The caller's modules are never written while tracing; their updates are written
back after the call, as for arguments.
"""

from __future__ import annotations

import functools
import typing
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Tally(nnx.Module):
    def __init__(self, start: int = 0):
        self.count = nnx.BatchStat(jnp.array(start))
        self.scale = 2

    def __call__(self, x):
        self.count[...] += 1
        return x * self.scale


def _untouched_during_trace(module: Tally) -> typing.Callable[[], None]:
    """A check, run inside the function, that the caller's module holds no tracer."""
    ref = weakref.ref(module)  # weak references are not searched

    def check() -> None:
        raw = object.__getattribute__(ref().count, "_raw_value")
        assert not isinstance(raw, jax.core.Tracer)

    return check


GLOBAL_TALLY = Tally()
GLOBAL_TRACES = 0


def _uses_global(x):
    global GLOBAL_TRACES
    GLOBAL_TRACES += 1  # a global the function assigns while traced: kept
    return GLOBAL_TALLY(x)


def test_global_module_and_global_writes():
    before = GLOBAL_TRACES
    f = treemode.jit(_uses_global)
    start = int(GLOBAL_TALLY.count[...])
    assert float(f(jnp.array(1.0))) == 2.0
    assert float(f(jnp.array(1.0))) == 2.0
    assert int(GLOBAL_TALLY.count[...]) == start + 2
    assert GLOBAL_TRACES == before + 1
    assert isinstance(globals()["GLOBAL_TALLY"], Tally)
    assert globals()["GLOBAL_TALLY"] is GLOBAL_TALLY


def test_closure_cell_default_and_helper():
    tally = Tally()
    other = Tally()
    check = _untouched_during_trace(tally)

    def helper(x):
        check()
        return tally(x)

    @treemode.jit
    def f(x, m=other):
        return helper(x) + m(x)

    assert float(f(jnp.array(1.0))) == 4.0
    assert int(tally.count[...]) == 1 and int(other.count[...]) == 1


def test_recursive_helper():
    tally = Tally()

    def countdown(n, x):
        if n == 0:
            return x
        return countdown(n - 1, tally(x))

    f = treemode.jit(lambda x: countdown(3, x))
    assert float(f(jnp.array(1.0))) == 8.0
    assert int(tally.count[...]) == 3


def test_bound_methods_partials_and_modules_called_directly():
    tally = Tally()
    assert float(treemode.jit(tally)(jnp.array(1.0))) == 2.0
    assert float(treemode.jit(tally.__call__)(jnp.array(1.0))) == 2.0

    def apply(m, x):
        return m(x)

    assert float(treemode.jit(functools.partial(apply, tally))(jnp.array(1.0))) == 2.0
    assert int(tally.count[...]) == 3


class Trainer:
    def __init__(self, model):
        self.model = model
        self.steps_traced = 0

    def step(self, x):
        self.steps_traced += 1  # a plain attribute assigned while traced: kept
        return self.model(x)


def test_plain_object_holder():
    trainer = Trainer(Tally())
    step = treemode.jit(trainer.step)
    step(jnp.array(1.0))
    step(jnp.array(1.0))
    assert int(trainer.model.count[...]) == 2
    assert trainer.steps_traced == 1
    assert isinstance(trainer.model, Tally)


def test_lists_tuples_and_dicts():
    models = [Tally()]
    table = {"enc": Tally()}
    pair = (Tally(), 1.0)

    @treemode.jit
    def f(x):
        return models[0](x) + table["enc"](x) + pair[0](x) + pair[1]

    assert float(f(jnp.array(1.0))) == 7.0
    assert [int(m.count[...]) for m in (models[0], table["enc"], pair[0])] == [1, 1, 1]
    assert isinstance(models, list) and isinstance(table, dict)


def test_a_static_attribute_of_a_closure_module_is_part_of_the_key():
    tally = Tally()
    f = treemode.jit(lambda x: tally(x))
    assert float(f(jnp.array(1.0))) == 2.0
    tally.scale = 3
    assert float(f(jnp.array(1.0))) == 3.0
    tally.scale = 3.0  # equal value, another type: traced again
    assert f(jnp.array(1)).dtype == jnp.float32


def test_a_structural_change_of_a_closure_module_raises_and_leaves_it():
    tally = Tally()

    @treemode.jit
    def f(x):
        tally.extra = nnx.Param(x)
        return x

    with pytest.raises(treemode.StructureError, match=r"treemode\.jit: .*closure tally\.extra"):
        f(jnp.array(1.0))
    assert not hasattr(tally, "extra")
    assert int(tally.count[...]) == 0


def test_vmap_scan_and_grad_over_closures():
    tally = Tally()
    w = nnx.Param(jnp.array(3.0))

    out = treemode.vmap(lambda x: tally(x))(jnp.arange(3.0))
    np.testing.assert_allclose(out, [0.0, 2.0, 4.0])
    assert int(tally.count[...]) == 1  # broadcast: one update

    def body(c, x):
        return c + tally(x), None

    total, _ = treemode.scan(body)(jnp.array(0.0), jnp.arange(3.0))
    assert float(total) == 6.0
    assert int(tally.count[...]) == 4

    g = treemode.grad(lambda x: (w[...] * x) ** 2)(jnp.array(2.0))
    assert float(g) == 2 * 3.0 * 2.0 * 3.0


class Registry(dict):
    pass


class Stack(list):
    pass


def test_subclasses_of_dict_and_list():
    registry = Registry(enc=Tally())
    stack = Stack([Tally()])
    f = treemode.jit(lambda x: registry["enc"](x) + stack[0](x))
    assert float(f(jnp.array(1.0))) == 4.0
    assert int(registry["enc"].count[...]) == 1 and int(stack[0].count[...]) == 1
    assert type(registry) is Registry and type(stack) is Stack


def test_a_module_appended_to_an_empty_global_list_is_lifted():
    registry: list[Tally] = []
    f = treemode.jit(lambda x: registry[0](x) if registry else x)
    assert float(f(jnp.array(1.0))) == 1.0
    registry.append(Tally())
    assert float(f(jnp.array(1.0))) == 2.0
    assert int(registry[0].count[...]) == 1


def test_a_module_beyond_the_search_limits_warns():
    many = [0] * 300 + [Tally()]
    f = treemode.jit(lambda x: x + many[-1].scale)
    with pytest.warns(treemode.ClosureWarning, match=r"treemode\.jit: .*many.*Pass them"):
        f(jnp.array(1.0))


def test_globals_written_elsewhere_during_a_trace_are_kept():
    """Only what the function itself assigns while traced is copied back: a global
    another writer sets meanwhile in the real module dict is neither reverted nor
    deleted, and a dict the function fills through a copied holder is filled."""
    import sys

    real = sys.modules[__name__].__dict__  # a module: not searched, the real dict
    real.pop("LATE_GLOBAL", None)
    table = {"tally": GLOBAL_TALLY}

    def writer_elsewhere(x):
        global GLOBAL_TRACES
        sys.modules[__name__].__dict__["LATE_GLOBAL"] = "kept"
        GLOBAL_TRACES += 1
        table["seen"] = True  # through the copy of `table`: copied back
        return table["tally"](x) + GLOBAL_TALLY(x)

    before = GLOBAL_TRACES
    treemode.jit(writer_elsewhere)(jnp.array(1.0))
    assert real.pop("LATE_GLOBAL") == "kept"
    assert GLOBAL_TRACES == before + 1
    assert table["seen"] is True and table["tally"] is GLOBAL_TALLY
