"""JAX's messages name the user's arguments under vmap, pmap, shard_map, checkify and
the grad family, never treemode's or JAX's flat arrays.

Each test makes one user mistake (a Python ``if`` on a traced value, ``int(...)``,
``np.asarray(...)``, a leaked tracer) under a treemode transform and under the
plain JAX transform, and compares the two messages:

- treemode's names the parameter and path (``x``, ``model.kernel``) and never
  ``flat_args[N]``, ``args[N]`` or ``dynamic[N]``;
- where JAX's own transform names the argument, treemode's names the same one;
  where it names a flat one (``jax.pmap``: ``flat_args[1]``) or none
  (``jax.vmap``, eager ``jax.shard_map``, ``checkify``, ``jax.grad`` outside
  ``jit``), treemode's still names it (`treemode._transforms._named_errors`).

A JAX that names no argument even under ``jax.jit`` (detected by running it) makes
the naming tests skip, saying so, rather than fail.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

import treemode
from treemode import _compat

INTERNAL_NAMES = ("flat_args", "dynamic[", "args[", "donated_args", "kept_args", "<unknown>")


class Model(nnx.Module):
    def __init__(self) -> None:
        self.kernel = nnx.Param(jnp.ones(2))


def _params() -> dict[str, jax.Array]:
    return {"kernel": jnp.ones(2)}


# The mistakes, each on a value that depends on one argument (`on`).
def _branch(v: jax.Array) -> jax.Array:
    if v.sum() > 0:  # Python `if` on a traced value
        return v
    return -v


def _size(v: jax.Array) -> jax.Array:
    return jnp.zeros(int(v.sum() > 0)) + 1.0  # int() of a traced value


def _numpy(v: jax.Array) -> jax.Array:
    return jnp.asarray(np.asarray(v)) + 1.0  # a NumPy array of a traced value


MISTAKES = {
    "bool": (_branch, jax.errors.TracerBoolConversionError),
    "int": (_size, jax.errors.ConcretizationTypeError),
    "numpy": (_numpy, jax.errors.TracerArrayConversionError),
}


def _error(run: Callable[[], Any], kind: type[BaseException] = Exception) -> BaseException:
    with pytest.raises(kind) as info:
        run()
    return info.value


def _assert_no_internal_names(message: str) -> None:
    for internal in INTERNAL_NAMES:
        assert internal not in message, message


def _skip_unless_jax_names(mistake: str) -> None:
    """Skip, saying so, where this JAX names no argument even for ``jax.jit``."""
    if not _compat.NAMES_ARGUMENTS:
        pytest.skip(f"JAX {jax.__version__} does not take a function's argument names")
    bad, kind = MISTAKES[mistake]

    def f(x: jax.Array) -> jax.Array:
        return bad(x)

    message = str(_error(lambda: jax.jit(f)(jnp.ones(2)), kind))
    if "the argument x" not in message:
        pytest.skip(
            f"JAX {jax.__version__} names no argument in this error even under jax.jit: "
            + message.splitlines()[0]
        )


def _jax_names(message: str) -> str:
    """What JAX's message says the value depends on (for the failure text)."""
    found = re.search(r"depends on the values? of the arguments? ([^\n]*?)\.(\n|$)", message)
    return found.group(1) if found else "no argument"


@dataclass(frozen=True)
class Case:
    """One transform, called on the same mistake the plain JAX way and treemode's way.

    ``plain(fn)`` / ``ours(fn)`` run the transform of ``fn(model, x)`` (``model``
    a dict for JAX, a Module for treemode); ``on`` says which argument the
    mistake reads, ``name`` how treemode's message names it.
    """

    plain: Callable[[Callable[..., Any]], Any]
    ours: Callable[[Callable[..., Any]], Any]
    on: str = "x"
    name: str = "x"


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(jax.devices()[:2], ("d",))


def _stacked() -> Model:
    return treemode.vmap(lambda _: Model())(jnp.arange(2))


XS = jnp.ones((2, 2))
X = jnp.ones(2)


def _shard_map(transform: Callable[..., Any], fn: Callable[..., Any]) -> Any:
    return transform(fn, mesh=_mesh(), in_specs=(P(), P("d")), out_specs=P("d"))


CASES = {
    "vmap": Case(
        lambda f: jax.vmap(f, in_axes=(None, 0))(_params(), XS),
        lambda f: treemode.vmap(f, in_axes=(None, 0))(Model(), XS),
    ),
    "vmap-module": Case(
        lambda f: jax.vmap(f)(jax.vmap(lambda _: _params())(jnp.arange(2)), XS),
        lambda f: treemode.vmap(f)(_stacked(), XS),
        on="kernel",
        name="model.kernel",
    ),
    "jit-vmap": Case(
        lambda f: jax.jit(jax.vmap(f, in_axes=(None, 0)))(_params(), XS),
        lambda f: treemode.jit(treemode.vmap(f, in_axes=(None, 0)))(Model(), XS),
    ),
    "pmap": Case(
        lambda f: jax.pmap(f, in_axes=(None, 0))(_params(), XS),
        lambda f: treemode.pmap(f, in_axes=(None, 0))(Model(), XS),
    ),
    "pmap-broadcast-module": Case(
        lambda f: jax.pmap(f, in_axes=(None, 0))(_params(), XS),
        lambda f: treemode.pmap(f, in_axes=(None, 0))(Model(), XS),
        on="kernel",
        name="model.kernel",
    ),
    "pmap-mapped-module": Case(
        lambda f: jax.pmap(f)(jax.vmap(lambda _: _params())(jnp.arange(2)), XS),
        lambda f: treemode.pmap(f)(_stacked(), XS),
        on="kernel",
        name="model.kernel",
    ),
    "shard_map": Case(
        lambda f: _shard_map(jax.shard_map, f)(_params(), XS),
        lambda f: _shard_map(treemode.shard_map, f)(Model(), XS),
    ),
    "jit-shard_map": Case(
        lambda f: jax.jit(_shard_map(jax.shard_map, f))(_params(), XS),
        lambda f: treemode.jit(_shard_map(treemode.shard_map, f))(Model(), XS),
    ),
    "checkify": Case(
        lambda f: checkify.checkify(f)(_params(), X),
        lambda f: treemode.checkify(f)(Model(), X),
    ),
}


def _functions(mistake: str, on: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    bad, _ = MISTAKES[mistake]

    def plain(model: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return bad(model["kernel"] if on == "kernel" else x) + x

    def ours(model: Model, x: jax.Array) -> jax.Array:
        return bad(model.kernel[...] if on == "kernel" else x) + x

    return plain, ours


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
@pytest.mark.parametrize("transform", sorted(CASES))
def test_a_tracer_error_names_the_argument_under_each_transform(transform, mistake):
    case = CASES[transform]
    kind = MISTAKES[mistake][1]
    plain, ours = _functions(mistake, case.on)
    try:
        case.plain(plain)
    except kind as error:
        theirs = error
    else:  # checkify closes over the (concrete) arguments: NumPy takes them
        case.ours(ours)
        return
    mine = _error(lambda: case.ours(ours), kind)
    assert type(mine) is type(theirs), (mine, theirs)
    message = str(mine)
    _assert_no_internal_names(message)
    _skip_unless_jax_names(mistake)
    assert f"depends on the value of the argument {case.name}.\n" in message, (
        f"jax.{transform} names {_jax_names(str(theirs))}; treemode's message:\n{message}"
    )
    assert "tracing the function ours at" in message


# -- the grad family outside jit ------------------------------------------------------


def test_a_branch_on_a_differentiated_value_works_outside_jit_as_with_jax_grad():
    # jax.grad outside jit traces with concrete primals: a Python `if` works.
    def plain(params, x):
        return _branch(params["kernel"]).sum() * x.sum()

    def ours(model, x):
        return _branch(model.kernel[...]).sum() * x.sum()

    expected = jax.grad(plain)(_params(), X)["kernel"]
    assert jnp.allclose(treemode.grad(ours)(Model(), X).kernel[...], expected)


def _loss(model: Model, x: jax.Array) -> jax.Array:
    return (jnp.asarray(np.asarray(model.kernel[...])) * x).sum()


def _plain_loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return (jnp.asarray(np.asarray(params["kernel"])) * x).sum()


GRAD_FAMILY = {
    "grad": (
        lambda: jax.grad(_plain_loss)(_params(), X),
        lambda: treemode.grad(_loss)(Model(), X),
        "model.kernel",
    ),
    "value_and_grad": (
        lambda: jax.value_and_grad(_plain_loss)(_params(), X),
        lambda: treemode.value_and_grad(_loss)(Model(), X),
        "model.kernel",
    ),
    "vjp": (
        lambda: jax.vjp(_plain_loss, _params(), X),
        lambda: treemode.vjp(_loss, Model(), X),
        "model.kernel",
    ),
    "jvp": (
        lambda: jax.jvp(lambda p: _plain_loss(p, X), (_params(),), (_params(),)),
        lambda: treemode.jvp(_loss, (Model(), X), (Model(), X)),
        "model.kernel",
    ),
}


@pytest.mark.parametrize("transform", sorted(GRAD_FAMILY))
def test_the_grad_family_outside_jit_names_a_differentiated_argument(transform):
    plain, ours, name = GRAD_FAMILY[transform]
    kind = jax.errors.TracerArrayConversionError
    theirs, mine = _error(plain, kind), _error(ours, kind)
    message = str(mine)
    _assert_no_internal_names(message)
    _skip_unless_jax_names("numpy")
    assert f"depends on the value of the argument {name}.\n" in message, (
        f"JAX's jax.{transform} names {_jax_names(str(theirs))}; treemode's message:\n{message}"
    )
    assert "tracing the function _loss at" in message and f"for {transform}." in message


def test_under_jit_the_grad_family_keeps_jits_names():
    def loss(model, x):
        if model.kernel[...].sum() > 0:
            return (model.kernel[...] * x).sum()
        return x.sum()

    message = str(
        _error(
            lambda: treemode.jit(lambda m, x: treemode.grad(loss)(m, x))(Model(), X),
            jax.errors.TracerBoolConversionError,
        )
    )
    _assert_no_internal_names(message)
    _skip_unless_jax_names("bool")
    assert "depends on the value of the argument m.kernel." in message
    assert "for jit." in message


# -- only the same failure is named ---------------------------------------------------


def test_a_value_the_transform_had_concrete_keeps_the_transforms_error():
    # Under an eager vmap a broadcast argument is concrete: its branch works, and
    # the failure is the next branch's. A trace where every value is abstract
    # would fail at the first branch (another place): JAX's own vmap error stands.
    def f(model, x):
        if model.kernel[...].sum() > 0:
            x = x * 2
        if x.sum() > 0:
            return x
        return -x

    def same_line(model, x):
        return x + int(model.kernel[...].sum() > 0) + int(x.sum() > 0)

    for fn in (f, same_line):
        message = str(_error(lambda fn=fn: treemode.vmap(fn, in_axes=(None, 0))(Model(), XS)))
        assert "model.kernel" not in message, message
        assert "Tracer with object id" in message  # jax.vmap's own words
        _assert_no_internal_names(message)

    def loss(model, x):  # x is not differentiated: concrete under jax.grad
        host = np.asarray(x)
        return (jnp.asarray(np.asarray(model.kernel[...])) * host).sum()

    message = str(_error(lambda: treemode.grad(loss)(Model(), X)))
    assert "argument x" not in message, message


def test_a_call_that_succeeds_traces_the_function_once():
    traces = []

    def f(model, x):
        traces.append(1)
        return model.kernel[...] * x

    treemode.vmap(f, in_axes=(None, 0))(Model(), XS)
    treemode.pmap(f)(_stacked(), XS)
    treemode.checkify(f)(Model(), X)
    treemode.grad(lambda m, x: f(m, x).sum())(Model(), X)
    treemode.shard_map(f, mesh=_mesh(), in_specs=(P(), P("d")), out_specs=P("d"))(Model(), XS)
    assert len(traces) == 5


# -- the probes before a call ----------------------------------------------------------


def test_the_checks_of_broadcast_variables_name_the_argument():
    # treemode.pmap (and vmap with sum_match) first trace the function under vmap to
    # find a broadcast Variable given a per-device value: that trace names the
    # argument and the transform (it said `dynamic[0]` of `<unknown>` for jit).
    def f(model, x):
        if model.kernel[...].sum() > 0:
            return x
        return -x

    for run, transform in [
        (lambda: treemode.pmap(f, in_axes=(None, 0))(Model(), XS), "pmap"),
        (lambda: treemode.vmap(f, in_axes=(None, 0), sum_match=True)(Model(), XS), "vmap"),
    ]:
        message = str(_error(run, jax.errors.TracerBoolConversionError))
        _assert_no_internal_names(message)
        _skip_unless_jax_names("bool")
        assert "depends on the value of the argument model.kernel." in message
        assert "tracing the function f at" in message and f"for {transform}." in message


def test_treemodes_own_traces_are_not_explained_as_cache_misses(caplog):
    def f(model, x):
        return model.kernel[...] * x

    wrapped = treemode.pmap(f, in_axes=(None, 0))
    with jax.explain_cache_misses(True), caplog.at_level(logging.WARNING):
        wrapped(Model(), XS)
        wrapped(Model(), XS)
    assert "never seen function" not in caplog.text


# -- leaked tracers, jax.debug.print, checkify ------------------------------------------


def test_a_leaked_tracer_names_the_argument_like_jax_shard_map():
    leaked: list[Any] = []

    def plain(params, x):
        leaked.append(x)
        return x * 2

    def ours(model, x):
        leaked.append(x)
        return x * 2

    with jax.checking_leaks():
        theirs = _error(lambda: jax.jit(_shard_map(jax.shard_map, plain))(_params(), XS))
        mine = _error(lambda: treemode.jit(_shard_map(treemode.shard_map, ours))(Model(), XS))
    leaked.clear()
    assert type(mine) is type(theirs)
    _assert_no_internal_names(str(mine))
    if "the argument x" in str(theirs):
        assert "the argument x" in str(mine), str(mine)

    def use_after(transform):
        leaked.clear()
        with jax.check_tracer_leaks(False):  # the leak is the point
            transform()
        with pytest.raises(jax.errors.UnexpectedTracerError) as info:
            leaked[0] + 1
        leaked.clear()
        return str(info.value)

    theirs = use_after(lambda: jax.jit(_shard_map(jax.shard_map, plain))(_params(), XS))
    mine = use_after(lambda: treemode.jit(_shard_map(treemode.shard_map, ours))(Model(), XS))
    assert "leaked was plain at" in theirs
    assert "leaked was ours at" in mine and "traced for shard_map" in mine


def test_a_tracer_leaked_from_pmap_says_what_jax_pmap_says():
    # jax.pmap traces inside its own function (`_fun` of jax/_src/pmap.py); a tracer
    # used after the call is reported by JAX, naming that function, as for jax.pmap.
    leaked: list[Any] = []

    def plain(params, x):
        leaked.append(x)
        return x * 2

    def ours(model, x):
        leaked.append(x)
        return x * 2

    messages = []
    for run in (
        lambda: jax.pmap(plain)(jax.vmap(lambda _: _params())(jnp.arange(2)), XS),
        lambda: treemode.pmap(ours)(_stacked(), XS),
    ):
        leaked.clear()
        with jax.check_tracer_leaks(False):  # the leak is the point
            run()
        with pytest.raises(jax.errors.UnexpectedTracerError) as info:
            leaked[-1] + 1
        messages.append(str(info.value))
    leaked.clear()
    theirs, mine = messages
    _assert_no_internal_names(mine)
    function = re.search(r"leaked was (\S+) at", theirs)
    if function is not None:
        assert f"leaked was {function.group(1)} at" in mine


def test_debug_print_and_checkify_messages_match_jax(capfd):
    def plain(params, x):
        jax.debug.print("x={x} kernel={k}", x=x, k=params["kernel"])
        checkify.check(jnp.all(x < 0), "x must be negative, got {}", x)
        return params["kernel"][5] + x

    def ours(model, x):
        jax.debug.print("x={x} kernel={k}", x=x, k=model.kernel[...])
        checkify.check(jnp.all(x < 0), "x must be negative, got {}", x)
        return model.kernel[...][5] + x

    errors = checkify.all_checks
    their_error, _ = checkify.checkify(plain, errors=errors)(_params(), X)
    jax.effects_barrier()
    their_print = capfd.readouterr().out
    my_error, _ = treemode.checkify(ours, errors=errors)(Model(), X)
    jax.effects_barrier()
    assert capfd.readouterr().out == their_print
    assert my_error.get() == their_error.get()
    their_error, _ = checkify.checkify(jax.vmap(plain, in_axes=(None, 0)))(_params(), XS)
    my_error, _ = treemode.checkify(treemode.vmap(ours, in_axes=(None, 0)))(Model(), XS)
    assert my_error.get() == their_error.get()
