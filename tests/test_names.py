"""JAX names what treemode compiles and traces after the user's function.

The lowered program of `treemode.jit(train_step)` is ``jit_train_step`` (as
with ``jax.jit``), every inner jaxpr (scan and loop bodies, branches, remat'd
and checkified functions) carries the user function's name and source line,
and JAX's own cache-miss messages (``jax_explain_cache_misses``) name the
user's function and never a treemode file, nor call a function "re-defined"
that the user defines once.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import api_util
from jax._src import config as jax_config
from jax.experimental import checkify

import treemode
from treemode._transforms import _names


class Model(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones(3))
        self.steps = nnx.BatchStat(jnp.array(0))


def train_step(model: Model, x: jax.Array) -> jax.Array:
    model.steps[...] += 1
    return jnp.sum(model.w[...] * x)


def scan_body(model: Model, x: jax.Array) -> tuple[Model, jax.Array]:
    model.steps[...] += 1
    return model, model.w[...] * x


def loss_with_scan(model: Model, xs: jax.Array) -> jax.Array:
    carry = (treemode.Carry, 0)
    _, ys = treemode.scan(scan_body, in_axes=carry, out_axes=carry)(model, xs)
    return ys.sum()


def when_positive(x: jax.Array) -> jax.Array:
    return x + 1


def when_negative(x: jax.Array) -> jax.Array:
    return x - 1


def keep_going(v: jax.Array) -> jax.Array:
    return v.sum() < 10


def loop_body(v: jax.Array) -> jax.Array:
    return v + 1


def fori_body(i: jax.Array, v: jax.Array) -> jax.Array:
    return v + i


def remat_body(m: Model, x: jax.Array) -> jax.Array:
    return jnp.sin(m.w[...] * x)


def checked_body(m: Model, x: jax.Array) -> jax.Array:
    checkify.check(jnp.all(x > -100), "too small")
    return m.w[...] * x


def everything(m: Model, x: jax.Array) -> jax.Array:
    y = treemode.cond(x.sum() > 0, when_positive, when_negative, x)
    y = treemode.while_loop(keep_going, loop_body, y)
    y = treemode.fori_loop(0, 2, fori_body, y)
    y = y + treemode.remat(remat_body)(m, y)
    _, z = treemode.checkify(checked_body)(m, y)
    return z


def _lowered_text(fn: Any, *args: Any) -> str:
    return fn.lower(*args).as_text()


_STABLE = pytest.mark.skipif(
    not _names.STABLE_STEPS,
    reason="JAX 0.9 keys a scan step's trace by the function object alone: treemode hands "
    "it one step per input types there, which JAX reports as never seen",
)


def test_jitted_program_is_named_after_the_function():
    text = _lowered_text(treemode.jit(train_step), Model(), jnp.ones(3))
    assert "module @jit_train_step" in text
    assert "_call_flat" not in text and "_call_split" not in text


def test_profile_op_names_start_with_the_function():
    # What a profile shows per operation: the name stack, from the program's name.
    lowered = treemode.jit(loss_with_scan).lower(Model(), jnp.ones((2, 3)))
    locations = set(re.findall(r'loc\("([^"]+)"', lowered.as_text(debug_info=True)))
    op_names = {n for n in locations if re.match(r"\w+\(", n)}  # not the file names
    assert op_names and all(n.startswith("jit(loss_with_scan)") for n in op_names), op_names
    assert "jit(loss_with_scan)/scan" in op_names


def test_donated_program_is_named_after_the_function():
    text = _lowered_text(treemode.jit(train_step, donate_argnums=0), Model(), jnp.ones(3))
    assert "module @jit_train_step" in text


def test_jit_partial_and_methods_keep_the_name():
    model = Model()
    text = _lowered_text(treemode.jit_partial(train_step, model), jnp.ones(3))
    assert "module @jit_train_step" in text

    class Holder(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(3))

        @treemode.jit
        def forward(self, x: jax.Array) -> jax.Array:
            return self.w[...] * x

    holder = Holder()
    assert "module @jit_forward" in _lowered_text(Holder.forward, holder, jnp.ones(3))


def _debug_infos(jaxpr: Any, out: list[Any]) -> list[Any]:
    """Every (traced_for, func_src_info) of ``jaxpr`` and the jaxprs inside it."""
    out.append((jaxpr.debug_info.traced_for, jaxpr.debug_info.func_src_info))
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                    _debug_infos(sub.jaxpr, out)
                elif hasattr(sub, "eqns"):
                    _debug_infos(sub, out)
    return out


def test_inner_jaxprs_name_the_user_functions():
    model = Model()
    closed = jax.make_jaxpr(lambda x: treemode.jit(everything)(model, x))(jnp.ones(3))
    infos = _debug_infos(closed.jaxpr, [])
    names = {src.split(" ")[0]: (kind, src) for kind, src in infos}
    for fn, kind in [
        (everything, "jit"),
        (when_positive, "cond"),
        (when_negative, "cond"),
        (keep_going, "while_cond"),
        (loop_body, "while_body"),
        (fori_body, "fori_loop"),
        (remat_body, "checkpoint / remat"),
    ]:
        assert fn.__name__ in names, (fn.__name__, infos)
        traced_for, src = names[fn.__name__]
        assert traced_for == kind
        line = fn.__code__.co_firstlineno
        assert src == f"{fn.__name__} at {__file__}:{line}"
    # No inner function is named after (or located in) treemode's own code.
    for _, src in infos:
        assert "treemode" + "/" not in src and "<unknown>" not in src, src


def test_scan_body_is_named_after_the_user_function():
    closed = jax.make_jaxpr(lambda x: treemode.jit(loss_with_scan)(Model(), x))(jnp.ones((4, 3)))
    sources = [src for kind, src in _debug_infos(closed.jaxpr, []) if kind == "scan"]
    assert sources == [f"scan_body at {__file__}:{scan_body.__code__.co_firstlineno}"]


def test_mapped_and_differentiated_functions_are_named(monkeypatch):
    # What JAX reads of the function handed to jax.vmap / jax.value_and_grad.
    seen: list[str] = []
    for name in ("vmap", "value_and_grad"):
        original = getattr(jax, name)

        def spy(f: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            seen.append(api_util.fun_sourceinfo(f))
            return _original(f, *args, **kwargs)

        monkeypatch.setattr(jax, name, spy)
    model = Model()
    treemode.vmap(remat_body, in_axes=(None, 0))(model, jnp.ones((2, 3)))
    treemode.grad(train_step)(model, jnp.ones(3))
    assert seen == [
        f"remat_body at {__file__}:{remat_body.__code__.co_firstlineno}",
        f"train_step at {__file__}:{train_step.__code__.co_firstlineno}",
    ]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def jax_messages():
    """JAX's cache-miss explanations while the test runs."""
    capture = _Capture()
    logger = logging.getLogger("jax")
    logger.addHandler(capture)
    previous = jax_config.explain_cache_misses.value
    jax.config.update("jax_explain_cache_misses", True)
    try:
        yield capture.messages
    finally:
        jax.config.update("jax_explain_cache_misses", previous)
        logger.removeHandler(capture)


def _jax_cache_misses(messages: list[str]) -> list[str]:
    return [m for m in messages if "TRACING CACHE MISS" in m]


def test_jax_retrace_messages_name_the_user_function(jax_messages):
    step = treemode.jit(train_step)
    model = Model()
    step(model, jnp.ones(3))
    step(model, jnp.ones((2, 3)))  # new shape: JAX and treemode both explain
    misses = _jax_cache_misses(jax_messages)
    assert misses, jax_messages
    for message in misses:
        assert "train_step" in message
        assert re.search(r"treemode[/\\]_\w+\.py", message) is None, message
        assert "_call_flat" not in message and "dynamic[" not in message


@_STABLE
def test_scan_in_a_jitted_model_is_not_reported_as_redefined(jax_messages):
    loss = treemode.jit(loss_with_scan)
    model = Model()
    for n in (2, 5, 2, 7, 3):
        loss(model, jnp.ones((n, 3)))
    eager = treemode.scan(scan_body, in_axes=(treemode.Carry, 0), out_axes=(treemode.Carry, 0))
    for n in (2, 5, 3):
        eager(model, jnp.ones((n, 3)))
    text = "\n".join(_jax_cache_misses(jax_messages))
    assert "re-defined" not in text
    assert "never seen function" not in text
    assert re.search(r"treemode[/\\]_\w+\.py", text) is None, text


@_STABLE
def test_a_new_input_type_keeps_the_scan_step(jax_messages):
    # A new carry dtype is a new trace of the same step: JAX compares the types
    # (it does not report a function it has never seen).
    carry = (treemode.Carry, 0)
    body = treemode.scan(lambda c, x: (c + x, c), in_axes=carry, out_axes=carry)
    body(jnp.zeros(3), jnp.ones((2, 3)))
    body(jnp.zeros(3, jnp.int32), jnp.ones((2, 3), jnp.int32))
    first, again = _jax_cache_misses(jax_messages)
    assert "never seen function" in first  # the first call: JAX has not seen the step yet
    assert "for <lambda> defined at" in again and "different input types" in again
    assert "re-defined" not in first + again


def test_scans_of_two_lengths_share_one_trace_and_its_metadata_updates():
    # One step object per structure: JAX reuses the trace for a new length, and
    # the second call still writes back the metadata update that trace recorded.
    class Tagged(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(3), tag=0)

    def body(m: Tagged, x: jax.Array) -> tuple[Tagged, jax.Array]:
        m.w.set_metadata("tag", 1)
        m.w[...] = m.w[...] + x
        return m, x

    carry = (treemode.Carry, 0)
    scanned = treemode.scan(body, in_axes=carry, out_axes=carry)
    for n in (2, 5):
        m = Tagged()
        scanned(m, jnp.ones((n, 3)))
        assert m.w.get_metadata("tag") == 1
        np.testing.assert_array_equal(m.w[...], np.full(3, 1.0 + n))


def test_a_profiler_trace_of_a_training_loop_names_the_users_functions(tmp_path):
    """A ``jax.profiler`` trace of donated train steps and an eval step holds the
    user's function names, and none of treemode's internal ones."""
    import optax

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def train_step(model, opt, x):
        def loss_fn(m):
            return (m(x) ** 2).mean()

        loss, grads = treemode.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    def eval_step(model, x):
        return model(x).sum()

    step = treemode.jit(train_step, donate_argnums=(0, 1))
    evaluate = treemode.jit(eval_step)
    x = jnp.ones((2, 4))
    step(model, opt, x)
    evaluate(model, x)
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            step(model, opt, x).block_until_ready()
        evaluate(model, x).block_until_ready()
    data = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert b"jit_train_step" in data and b"jit_eval_step" in data
    for internal in (b"_call_flat", b"_call_split", b"_JitEntry", b"treemode/_"):
        assert internal not in data, internal


# -- JAX's messages name the user's arguments (issue 40) ------------------------


class Stack(nnx.Module):
    def __init__(self) -> None:
        self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])


def _bool_error(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for internal in ("flat_args", "donated_args", "kept_args", "args["):
        assert internal not in message, message
    return message


@pytest.mark.parametrize("donate", [False, True])
def test_a_tracer_error_names_the_users_argument(implementation, donate):
    def h(model, x):
        if x.sum() > 0:
            return model(x)
        return x

    f = treemode.jit(h, donate_argnums=0 if donate else ())
    message = _bool_error(f, nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 2)))
    assert "depends on the value of the argument x." in message
    assert "tracing the function h at" in message


@pytest.mark.parametrize("donate", [False, True])
def test_a_tracer_error_names_the_path_in_a_module(donate):
    def h(model, x):
        if model.layers[1].kernel[...].sum() > 0:
            model.layers[0].bias[...] += 1
        return x

    f = treemode.jit(h, donate_argnums=0 if donate else ())
    message = _bool_error(f, Stack(), jnp.ones(2))
    assert "depends on the value of the argument model.layers[1].kernel." in message


def test_a_tracer_error_names_keywords_varargs_methods_and_partials():
    def h(a, *rest, scale, **options):
        checked = {"options": options["bias"].sum(), "rest": rest[1], "scale": scale}
        if checked[options["check"]] > 0:
            return a
        return a

    f = treemode.jit(h, static_argnames="check")
    args = (1.0, 2.0, 3.0)
    kwargs = {"scale": 1.0, "bias": jnp.ones(2)}
    assert "the argument options['bias']." in _bool_error(f, *args, **kwargs, check="options")
    assert "the argument rest[1]." in _bool_error(f, *args, **kwargs, check="rest")
    assert "the argument scale." in _bool_error(f, *args, **kwargs, check="scale")

    class Model(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(2))

        @treemode.jit
        def check(self, limit):
            if self.w[...].sum() > limit:
                return self.w[...]
            return -self.w[...]

    assert "the arguments self.w and limit." in _bool_error(Model().check, 1.0)

    def step(model, x):
        if model.kernel[...].sum() > 0:
            return x
        return x

    bound = treemode.jit_partial(step, nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    assert "the argument model.kernel." in _bool_error(bound, jnp.ones(2))


def test_an_entry_keeps_the_names_of_the_call_that_built_it():
    # Two wrappers of one function share its entries (the call structure is the
    # key): each entry names the arrays as the call that built it did.
    def h(a, b):
        if b.sum() > 0:
            return a
        return b

    _bool_error(treemode.jit(h), jnp.ones(2), jnp.ones(2))
    assert "the argument b." in _bool_error(treemode.jit(h), jnp.ones(2), b=jnp.ones(2))
    assert "the argument b." in _bool_error(treemode.jit(h), a=jnp.ones(2), b=jnp.ones(2))


def test_a_concretization_error_names_the_argument():
    def h(n, x):
        return jnp.zeros(int(n)) + x

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        treemode.jit(h)(3, 1.0)
    assert "the argument n" in str(info.value) and "flat_args" not in str(info.value)


def _checks_x(model, x):
    if x.sum() > 0:
        return model(x)
    return model(x)


def _loss_checks_kernel(model, x):
    if model.kernel[...].sum() > 0:
        return model(x).sum()
    return model(x).sum()


_LINEAR = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
_X = jnp.ones((1, 2))


@pytest.mark.parametrize(
    "run, named",
    [
        (lambda: treemode.eval_shape(_checks_x, _LINEAR, _X), "x"),
        (lambda: treemode.cond(True, _checks_x, _checks_x, _LINEAR, _X), "x"),
        (lambda: treemode.switch(0, [_checks_x], _LINEAR, _X), "x"),
        (
            lambda: treemode.fori_loop(
                0, 2, lambda i, state: (state[0], _checks_x(*state)), (_LINEAR, _X)
            ),
            "state[1]",
        ),
        (
            lambda: treemode.while_loop(
                lambda s: False, lambda carry: (carry[0], _checks_x(*carry)), (_LINEAR, _X)
            ),
            "carry[1]",
        ),
        (
            lambda: treemode.scan(
                lambda model, x: (model, _checks_x(model, x)),
                in_axes=(treemode.Carry, 0),
                out_axes=(treemode.Carry, 0),
            )(_LINEAR, jnp.ones((3, 1, 2))),
            "x",
        ),
        (lambda: treemode.remat(_checks_x)(_LINEAR, _X), "x"),
        (lambda: treemode.jit(treemode.remat(_checks_x))(_LINEAR, _X), "x"),
        (lambda: treemode.jit(treemode.grad(_loss_checks_kernel))(_LINEAR, _X), "model.kernel"),
        (
            lambda: treemode.jit(lambda m, x: treemode.value_and_grad(_loss_checks_kernel)(m, x))(
                _LINEAR, _X
            ),
            "m.kernel",
        ),
    ],
    ids=[
        "eval_shape",
        "cond",
        "switch",
        "fori_loop",
        "while_loop",
        "scan",
        "remat",
        "jit-remat",
        "jit-grad",
        "jit-value_and_grad",
    ],
)
def test_tracer_errors_name_the_users_argument_under_each_transform(run, named):
    message = _bool_error(run)
    assert f"depends on the value of the argument {named}." in message
    assert "dynamic[" not in message
