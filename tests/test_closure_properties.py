"""Property: a closed-over module is read fresh (transformed ≡ eager) or named in a
`ClosureWarning`, whatever holds it; globals written through helpers during a trace
behave as under eager execution."""

from __future__ import annotations

import itertools
import sys
import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import treemode

# The routes to a module; the ones marked True are lifted by the closure search.
HOLDERS = {
    "cell": True,
    "global": True,
    "list": True,
    "dict": True,
    "tuple": True,
    "object": True,
    "slots": False,
    "classattr": False,
    "ordereddict": False,
    "namespace": False,
    "frozenset": False,
    "biglist": False,
    "lru": False,
}
WRITES = ["none", "helper sets", "function sets, helper reads", "read via sys.modules"]

_serial = itertools.count()


class _Slots:
    __slots__ = ("model",)


class _Plain:
    pass


def _reader(holder: str, depth: int, model: nnx.Module) -> tuple[object, str]:
    """A function of ``x`` that calls ``model`` through ``holder``, ``depth`` helpers
    deep, defined in this module's globals under fresh names; and the route name."""
    n = next(_serial)
    g = globals()
    name = f"_HELD_{n}"
    setup = {
        "global": (model, name),
        "list": ([model], f"{name}[0]"),
        "dict": ({"m": model}, f"{name}['m']"),
        "tuple": ((model,), f"{name}[0]"),
        "ordereddict": (__import__("collections").OrderedDict(m=model), f"{name}['m']"),
        "namespace": (__import__("types").SimpleNamespace(m=model), f"{name}.m"),
        "frozenset": (frozenset([model]), f"next(iter({name}))"),
        "biglist": ([0] * 600 + [model], f"{name}[600]"),
    }
    if holder == "object":
        obj = _Plain()
        obj.model = model
        setup[holder] = (obj, f"{name}.model")
    elif holder == "slots":
        obj = _Slots()
        obj.model = model
        setup[holder] = (obj, f"{name}.model")
    elif holder == "classattr":
        setup[holder] = (type(f"_Config{n}", (), {"model": model}), f"{name}.model")
    elif holder == "lru":
        import functools

        setup[holder] = (functools.cache(lambda: model), f"{name}()")
    if holder == "cell":
        source = f"def _outer_{n}(model):\n    def _r_{n}_0(x):\n        return model(x)\n"
        source += f"    return _r_{n}_0\n"
        exec(source, g)
        inner = g[f"_outer_{n}"](model)
        g[f"_r_{n}_0"] = inner
        route = "model"
    else:
        value, expression = setup[holder]
        if holder == "lru":
            value()
        g[name] = value
        exec(f"def _r_{n}_0(x):\n    return {expression}(x)\n", g)
        route = name
    for k in range(1, depth + 1):
        exec(f"def _r_{n}_{k}(x):\n    return _r_{n}_{k - 1}(x)\n", g)
    return g[f"_r_{n}_{depth}"], route


FLAG = 1.0


def _set_flag(value: float) -> None:
    global FLAG
    FLAG = value


def _get_flag() -> float:
    return FLAG


def _program(write: str, reader):
    def f(x):
        global FLAG
        y = reader(x).sum()
        if write == "helper sets":
            _set_flag(3.0)
            return y + FLAG
        if write == "function sets, helper reads":
            FLAG = 5.0
            return y + _get_flag()
        if write == "read via sys.modules":
            FLAG = 11.0
            return y + sys.modules[__name__].FLAG
        return y

    return f


@given(
    holder=st.sampled_from(sorted(HOLDERS)),
    depth=st.integers(0, 6),
    write=st.sampled_from(WRITES),
    transform=st.sampled_from(["jit", "vmap"]),
)
def test_closed_over_module_is_fresh_or_reported(holder, depth, write, transform):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    reader, route = _reader(holder, depth, model)
    f = _program(write, reader)
    wrapped = treemode.jit(f) if transform == "jit" else treemode.vmap(f)
    x = jnp.ones((3, 2)) if transform == "vmap" else jnp.ones(2)
    eager = (lambda x: jnp.stack([f(r) for r in x])) if transform == "vmap" else f

    reported = False
    for call in range(2):
        _set_flag(1.0)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = wrapped(x)
        flag_after = FLAG
        messages = [str(w.message) for w in record if w.category is treemode.ClosureWarning]
        reported = reported or any(route in m for m in messages)
        _set_flag(1.0)
        expected = eager(x)
        if call == 0 or transform == "vmap":  # a call that traces runs the Python code
            assert flag_after == FLAG, (flag_after, FLAG)  # globals as under eager execution
        if not reported:
            np.testing.assert_allclose(out, expected, rtol=1e-6)
        model.bias[...] = model.bias[...] + 1.0  # changed between calls
    if HOLDERS[holder] and depth <= 2:
        assert not reported, f"{holder} at depth {depth} is lifted: no warning expected"
    if not HOLDERS[holder] and transform == "jit":
        assert reported, f"{holder} at depth {depth}: a stale constant without a word"
