"""What treemode's transforms return, against what Flax's return, programmatically.

Libraries read attributes of the objects Flax's transforms return (tunix logs
``train_step.jitted_fn._cache_size()``). Every public attribute of a Flax
wrapper must exist on treemode's wrapper for the same transform, or be listed
below with the reason it deliberately does not; the test fails both when a new
Flax attribute appears and when a listed one exists after all. Also here: the
``repr`` of each wrapper, and close-match suggestions for misspelled keywords.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import treemode


def f(x):
    return x


def _mesh() -> Any:
    return jax.make_mesh((1,), ("d",))


# transform -> (Flax's wrapper for graph=True/False, treemode's wrapper)
WRAPPERS: dict[str, tuple[Callable[[bool], Any], Callable[[], Any]]] = {
    "jit": (lambda g: nnx.jit(f, graph=g), lambda: treemode.jit(f)),
    "jit_partial": (
        lambda g: nnx.jit_partial(f, graph=g, graph_updates=False),
        lambda: treemode.jit_partial(f),
    ),
    "vmap": (lambda g: nnx.vmap(f, graph=g), lambda: treemode.vmap(f)),
    "pmap": (lambda g: nnx.pmap(f, graph=g), lambda: treemode.pmap(f)),
    "scan": (lambda g: nnx.scan(f, graph=g), lambda: treemode.scan(f)),
    "grad": (lambda g: nnx.grad(f, graph=g), lambda: treemode.grad(f)),
    "value_and_grad": (
        lambda g: nnx.value_and_grad(f, graph=g),
        lambda: treemode.value_and_grad(f),
    ),
    "remat": (lambda g: nnx.remat(f, graph=g), lambda: treemode.remat(f)),
    "checkify": (lambda g: nnx.checkify(f, graph=g), lambda: treemode.checkify(f)),
    "custom_vjp": (lambda g: nnx.custom_vjp(f, graph=g), lambda: treemode.custom_vjp(f)),
    "shard_map": (
        lambda g: nnx.shard_map(f, mesh=_mesh(), in_specs=jax.P(), out_specs=jax.P(), graph=g),
        lambda: treemode.shard_map(f, mesh=_mesh(), in_specs=jax.P(), out_specs=jax.P()),
    ),
}

_PER_STRUCTURE = (
    "Flax builds one jax.jit function for every call; treemode builds one per call "
    "structure, so there is no single one to show"
)

# (transform, attribute) -> reason
DIFFERENCES: dict[tuple[str, str], str] = {
    ("jit", "jax_in_shardings"): (
        "Flax's graph mode keeps the shardings in its own pure-tree form for jax.jit; "
        "treemode builds per-array shardings for each call structure (" + _PER_STRUCTURE + ")"
    ),
    ("jit", "jax_out_shardings"): "as jax_in_shardings",
    ("jit", "kwarg_shardings"): (
        "Flax's graph mode derives it from in_shardings; treemode.jit takes no "
        "kwarg_shardings (keyword arguments are placed as jax.jit places them)"
    ),
    ("custom_vjp", "ctxtag"): "Flax's graph-mode context tag, internal to its graph updates",
    ("custom_vjp", "diff_filter"): (
        "Flax's graph mode selects the differentiated state with a filter; tree mode "
        "differentiates whole arguments (nondiff_argnums)"
    ),
    ("custom_vjp", "jax_nondiff_argnums"): (
        "Flax's argument indices after its own flattening; treemode's are the user's "
        "(nondiff_argnums)"
    ),
    ("custom_vjp", "symbolic_zeros"): (
        "treemode.custom_vjp takes no symbolic_zeros: cotangents of unchanged Variables "
        "are zeros of their own types"
    ),
    ("custom_vjp", "custom_vjp_fn"): (
        "the jax.custom_vjp function: " + _PER_STRUCTURE + " (one per call structure)"
    ),
    ("shard_map", "inner"): "the jax.shard_map function: " + _PER_STRUCTURE,
}


def public(obj: Any) -> set[str]:
    return {a for a in dir(obj) if not a.startswith("_")}


def _flax_attributes(name: str) -> set[str]:
    make_flax, _ = WRAPPERS[name]
    return public(make_flax(True)) | public(make_flax(False))


def _treemode_attributes(name: str) -> set[str]:
    return public(WRAPPERS[name][1]())


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_flax_wrapper_attributes_exist_or_are_listed(name):
    missing = _flax_attributes(name) - _treemode_attributes(name)
    listed = {a for (t, a) in DIFFERENCES if t == name}
    assert missing == listed, (
        f"{name}: Flax's wrapper has {sorted(missing - listed)} that treemode's lacks "
        f"(add them, or list them with a reason); listed but present: {sorted(listed - missing)}"
    )


def test_every_listed_difference_is_a_flax_attribute():
    for name, attribute in DIFFERENCES:
        assert attribute in _flax_attributes(name), (name, attribute)
        assert DIFFERENCES[(name, attribute)].strip()


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_wrappers_keep_the_function_metadata(name):
    wrapper = WRAPPERS[name][1]()
    assert wrapper.__name__ == "f"
    assert wrapper.__wrapped__ is f
    assert wrapper.__doc__ == f.__doc__


# -- jit: what tunix and JAX users read ---------------------------------------------------


class Model(nnx.Module):
    def __init__(self, n: int) -> None:
        self.w = nnx.Param(jnp.ones(n))


def step(model: Model, x: jax.Array) -> jax.Array:
    return model.w[...] * x


def test_jitted_fn_cache_size_counts_executables():
    jitted = treemode.jit(step)
    assert jitted.jitted_fn._cache_size() == 0
    assert jitted._cache_size() == 0
    jitted(Model(3), jnp.ones(3))
    jitted(Model(3), jnp.ones(3))  # same structure and shapes: no new executable
    assert jitted.jitted_fn._cache_size() == 1
    jitted(Model(3), jnp.ones((2, 3)))  # a new shape: a new executable, same structure
    jitted(Model(4), jnp.ones(4))  # a new Variable shape
    assert jitted.jitted_fn._cache_size() == 3
    assert len(jitted.jitted_fn) == 1  # one call structure
    assert len(jitted.jitted_fn.functions) == 1
    assert jitted._cache_size() == 3


def test_jitted_fn_counts_every_call_structure():
    jitted = treemode.jit(lambda a, b: a)
    jitted(jnp.ones(2), jnp.ones(2))
    jitted(jnp.ones(2), {"b": jnp.ones(2)})  # another structure: another jax.jit
    assert len(jitted.jitted_fn) == 2
    assert jitted.jitted_fn._cache_size() == 2


def test_clear_cache_drops_every_executable():
    jitted = treemode.jit(step)
    jitted(Model(3), jnp.ones(3))
    functions = jitted.jitted_fn.functions
    jitted.jitted_fn.clear_cache()
    assert jitted.jitted_fn._cache_size() == 0
    assert all(fn._cache_size() == 0 for fn in functions)
    assert float(jitted(Model(3), jnp.ones(3)).sum()) == 3.0
    assert jitted._cache_size() == 1


def test_fun_is_the_compiled_function():
    assert treemode.jit(step).fun is step
    assert treemode.custom_vjp(f).fun is f


def test_jit_stages_are_available_as_on_flax():
    jitted = treemode.jit(step)
    model, x = Model(3), jnp.ones(3)
    assert jitted.eval_shape(model, x).shape == (3,)
    assert "module @jit_step" in jitted.trace(model, x).lower().as_text()
    assert float(jitted.lower(model, x).compile()(model, x).sum()) == 3.0


REPRS = [
    (lambda: treemode.jit(f), "jit"),
    (lambda: treemode.vmap(f), "vmap"),
    (lambda: treemode.pmap(f), "pmap"),
    (lambda: treemode.scan(f), "scan"),
    (lambda: treemode.custom_vjp(f), "custom_vjp"),
    (
        lambda: treemode.shard_map(f, mesh=_mesh(), in_specs=jax.P(), out_specs=jax.P()),
        "shard_map",
    ),
]


@pytest.mark.parametrize("make, name", REPRS, ids=[n for _, n in REPRS])
def test_repr_names_the_transform_and_the_function(make, name):
    text = repr(make())
    assert re.fullmatch(rf"<treemode\.{name} of <function f at 0x[0-9a-f]+>>", text), text


def test_jit_partial_repr_counts_the_bound_arguments():
    text = repr(treemode.jit_partial(step, Model(3)))
    assert re.fullmatch(
        r"<treemode\.jit of <function step at 0x[0-9a-f]+> with 1 bound argument\(s\)>", text
    )
    assert "jax.jit functions of <treemode.jit of <function step" in repr(
        treemode.jit(step).jitted_fn
    )


# -- misspelled keywords -------------------------------------------------------------------


# (transform, a call taking the keyword arguments, the misspelled keyword, the right one)
MISSPELLED: list[tuple[str, Callable[..., Any], str, str]] = [
    ("jit", lambda **kw: treemode.jit(f, **kw), "donate_argnum", "donate_argnums"),
    ("jit_partial", lambda **kw: treemode.jit_partial(f, **kw), "static_argnum", "static_argnums"),
    ("vmap", lambda **kw: treemode.vmap(f, **kw), "in_axis", "in_axes"),
    ("pmap", lambda **kw: treemode.pmap(f, **kw), "axis_nme", "axis_name"),
    ("scan", lambda **kw: treemode.scan(f, **kw), "lenght", "length"),
    ("grad", lambda **kw: treemode.grad(f, **kw), "argnum", "argnums"),
    ("value_and_grad", lambda **kw: treemode.value_and_grad(f, **kw), "has_aux_", "has_aux"),
    ("remat", lambda **kw: treemode.remat(f, **kw), "polcy", "policy"),
    ("checkify", lambda **kw: treemode.checkify(f, **kw), "error", "errors"),
    ("custom_vjp", lambda **kw: treemode.custom_vjp(f, **kw), "nondiff_argnum", "nondiff_argnums"),
    ("cond", lambda **kw: treemode.cond(True, f, f, 1, **kw), "grap", "graph"),
    ("fori_loop", lambda **kw: treemode.fori_loop(0, 1, f, 0, **kw), "unrol", "unroll"),
    ("split_rngs", lambda **kw: treemode.split_rngs(**kw), "split", "splits"),
]


@pytest.mark.parametrize(
    "name, call, wrong, right", MISSPELLED, ids=[c[0] + "-" + c[2] for c in MISSPELLED]
)
def test_misspelled_keyword_suggests_the_close_match(name, call, wrong, right):
    with pytest.raises(TypeError) as info:
        call(**{wrong: 0})
    assert str(info.value) == (
        f"{name}() got an unexpected keyword argument {wrong!r}. Did you mean {right!r}?"
    )


def test_unknown_keyword_without_close_match_reads_as_python():
    with pytest.raises(TypeError) as info:
        treemode.jit(f, **{"zzz": 1})
    assert str(info.value) == "jit() got an unexpected keyword argument 'zzz'"
