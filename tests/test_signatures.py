"""Every public transform's signature against JAX's and Flax's, programmatically.

Each transform takes its JAX function's parameters (names, order, kinds,
defaults) plus treemode's own (`graph`, `transform_metadata`, ...), which are
keyword-only so they never take one of JAX's positions. What deliberately
differs is listed below with its reason; the test fails both when a new
difference appears and when a listed one disappears.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import treemode

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)

JAX_FUNCTIONS: dict[str, Any] = {
    "jit": jax.jit,
    "vmap": jax.vmap,
    "pmap": jax.pmap,
    "scan": jax.lax.scan,
    "while_loop": jax.lax.while_loop,
    "fori_loop": jax.lax.fori_loop,
    "cond": jax.lax.cond,
    "switch": jax.lax.switch,
    "grad": jax.grad,
    "value_and_grad": jax.value_and_grad,
    "vjp": jax.vjp,
    "jvp": jax.jvp,
    "custom_vjp": jax.custom_vjp,
    "remat": jax.checkpoint,
    "checkpoint": jax.checkpoint,
    "eval_shape": jax.eval_shape,
    "checkify": checkify.checkify,
    "shard_map": getattr(jax, "shard_map", None),
}
if JAX_FUNCTIONS["shard_map"] is None:  # older JAX
    from jax.experimental.shard_map import shard_map as _shard_map

    JAX_FUNCTIONS["shard_map"] = _shard_map

FLAX_FUNCTIONS = [
    name
    for name in [*JAX_FUNCTIONS, "jit_partial", "split_rngs", "fork_rngs", "transform_metadata"]
    if hasattr(nnx, name)
]

# treemode's own parameters (keyword-only in every transform that has them).
OWN = {"graph", "transform_metadata", "in_axes", "out_axes"}

_DECORATOR = (
    "optional: called without the function it returns a decorator with these "
    "options, as Flax's transforms do"
)

# (transform, parameter, aspect) -> reason, against JAX.
JAX_DIFFERENCES: dict[tuple[str, str, str], str] = {
    **{
        (name, "fun", "default"): _DECORATOR
        for name in [
            "vmap",
            "pmap",
            "grad",
            "value_and_grad",
            "remat",
            "checkpoint",
            "vjp",
            "jvp",
        ]
    },
    ("scan", "f", "default"): _DECORATOR + " (treemode.scan(in_axes=...))",
    ("scan", "init", "default"): (
        "optional: treemode.scan(f, in_axes=...) returns the scanned function (Flax's "
        "form); with init it runs at once, as jax.lax.scan"
    ),
    ("jvp", "primals", "default"): _DECORATOR + " (treemode.jvp(f)(f, primals, tangents))",
    ("jvp", "tangents", "default"): _DECORATOR,
    ("scan", "_split_transpose", "missing"): "a private JAX parameter (leading underscore)",
    ("shard_map", "mesh", "default"): (
        "required: the mesh lays out each Variable's shards and its write-back "
        "(no context mesh is looked up)"
    ),
    ("shard_map", "in_specs", "default"): (
        "required: treemode gives each Variable its own spec through a module-shaped "
        "prefix, which cannot be inferred"
    ),
}

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# How the signatures of JAX's functions changed across the supported releases, and
# what each change means for treemode's. Each entry: (transform, parameter, aspect,
# which releases show the difference, reason); ``shown(version)`` is True or False
# where the releases are known (read in JAX's sources and on the JAX 0.11.2 run),
# None for a release between two known ones (the installed JAX's signature decides).
_Entry = tuple[str, str, str, Callable[[tuple[int, ...]], "bool | None"], str]


def _between(last_without: tuple[int, ...], first_with: tuple[int, ...]) -> Any:
    """A change first seen in ``first_with``, known absent up to ``last_without``."""
    return lambda v: False if v <= last_without else True if v >= first_with else None


_DIFFERENCES_BY_VERSION: list[_Entry] = [
    (
        "pmap",
        "global_arg_shapes",
        "missing",
        lambda v: v < (0, 10),  # removed from jax.pmap in JAX 0.10.0
        "deprecated and removed from jax.pmap in JAX 0.10; treemode follows the newer signature",
    ),
    *(
        (
            name,
            "concrete",
            "missing",
            lambda v: v < (0, 11),  # removed from jax.checkpoint in JAX 0.11.0
            "deprecated in JAX (which rejects any value for it) and removed in JAX 0.11",
        )
        for name in ("remat", "checkpoint")
    ),
    (
        "vjp",
        "saveable_args",
        "missing",
        lambda v: v >= (0, 11),  # new in JAX 0.11.0
        "JAX 0.11: marks primals whose saved values the caller restores on vjpfun.args_res; "
        "treemode's vjp function rebuilds Modules around JAX's and exposes no args_res",
    ),
    (
        "vjp",
        "in_nzs",
        "missing",
        _between((0, 11, 0), (0, 11, 2)),  # not in 0.11.0; in 0.11.2
        "JAX 0.11.1+: declares symbolically zero input tangents and exposes vjpfun.out_nzs; "
        "treemode's vjp function does not expose JAX's vjpfun attributes",
    ),
    (
        "custom_vjp",
        "fun",
        "default",
        # jax.custom_vjp's fun is required up to 0.11.0 and again in 0.12.0.1 (its
        # __new__ is gone); 0.11.2 defaults it to None
        lambda v: (
            True
            if v <= (0, 11, 0) or v >= (0, 12)
            else False
            if (0, 11, 2) <= v < (0, 12)
            else None
        ),
        _DECORATOR,
    ),
]


def _jax_shows(name: str, param: str, aspect: str) -> bool:
    """Whether the installed JAX's function shows the difference an entry describes."""
    params = inspect.signature(JAX_FUNCTIONS[name]).parameters
    if aspect == "missing":  # a JAX parameter that treemode does not take
        return param in params
    return params[param].default is P.empty  # "default": JAX's fun is required


def _applies(entry: _Entry) -> bool:
    name, param, aspect, shown, _ = entry
    known = shown(JAX_VERSION)
    return _jax_shows(name, param, aspect) if known is None else known


for _entry in _DIFFERENCES_BY_VERSION:
    if _applies(_entry):
        JAX_DIFFERENCES[_entry[:3]] = _entry[4]

_GRAPH = (
    "graph=False always: treemode has no global graph-mode switch (Flax's None reads "
    "nnx.set_graph_mode)"
)
_GRAPH_UPDATES = (
    "tree mode never propagates structural updates; treemode raises StructureError for them instead"
)
_FUN_NAME = "named after JAX's parameter (fun), which callers may pass by keyword"
_TRANSFORM_METADATA = "None and {} both mean no metadata"
_SHARDINGS = "JAX's default (unspecified: let XLA choose), not Flax's None"

# (transform, parameter, aspect) -> reason, against Flax.
FLAX_DIFFERENCES: dict[tuple[str, str, str], str] = {
    **{(name, "graph", "default"): _GRAPH for name in FLAX_FUNCTIONS},
    **{
        (name, "graph_updates", "missing"): _GRAPH_UPDATES
        for name in FLAX_FUNCTIONS
        if "graph_updates" in inspect.signature(getattr(nnx, name)).parameters
    },
    **{
        (name, "f", "name"): _FUN_NAME
        for name in ["vmap", "pmap", "grad", "value_and_grad", "remat", "vjp", "jvp", "eval_shape"]
    },
    **{
        (name, "transform_metadata", "default"): _TRANSFORM_METADATA
        for name in ["vmap", "pmap", "scan"]
    },
    **{
        (name, p, "default"): _SHARDINGS
        for name in ["jit", "jit_partial"]
        for p in ["in_shardings", "out_shardings"]
    },
    ("jit", "fun", "kind"): "positional-only, as in jax.jit",
    ("shard_map", "f", "kind"): "positional-only, as in jax.shard_map",
    ("checkify", "graph", "kind"): "keyword-only: treemode's own parameters never take a position",
    ("scan", "_split_transpose", "missing"): "a private JAX parameter (leading underscore)",
    ("scan", "in_axes", "default"): "treemode.Carry (nnx.Carry is accepted as well)",
    ("scan", "out_axes", "default"): "treemode.Carry (nnx.Carry is accepted as well)",
    ("transform_metadata", "partition", "default"): (
        "optional: metadata={nnx.PARTITION_NAME: name, ...} may give it instead"
    ),
}


def _is_plain(x: Any) -> bool:
    return x is P.empty or x is None or isinstance(x, (bool, int, float, str, tuple, frozenset))


def _same_default(theirs: Any, ours: Any, function: bool) -> bool:
    if theirs is ours:
        return True
    if function and ours is None and not _is_plain(theirs):
        return True  # the function parameter: any "not given" marker means a decorator
    if _is_plain(theirs) and _is_plain(ours):
        return type(theirs) is type(ours) and theirs == ours
    # A sentinel on both sides (JAX's UnspecifiedValue / not-specified, Flax's
    # Missing, treemode's UNSPECIFIED): both optional, absence meaning the same.
    return not _is_plain(theirs) and not _is_plain(ours) and theirs is not P.empty


def signature_differences(theirs: Any, ours: Any, *, strict_kinds: bool) -> set[tuple[str, str]]:
    """``(parameter, aspect)`` pairs where ``ours`` differs from ``theirs``.

    Aspects: ``missing``, ``name`` (of the function parameter), ``kind``,
    ``default``, ``order`` (of the positional parameters), ``extra`` (an own
    parameter that is not keyword-only). With ``strict_kinds=False`` (Flax), a
    keyword-only parameter of theirs may be positional-or-keyword in ours (as
    in JAX): every call Flax accepts still works.
    """
    a = inspect.signature(theirs).parameters
    b = inspect.signature(ours).parameters
    first_b = next(iter(b))
    found: set[tuple[str, str]] = set()
    for i, (name, p) in enumerate(a.items()):
        ours_name = first_b if i == 0 else name
        if ours_name not in b:
            found.add((name, "missing"))
            continue
        q = b[ours_name]
        if i == 0 and name != ours_name and p.kind is not P.POSITIONAL_ONLY:
            found.add((name, "name"))
        if p.kind is not q.kind and (
            strict_kinds or not (p.kind is P.KEYWORD_ONLY and q.kind is P.POSITIONAL_OR_KEYWORD)
        ):
            found.add((name, "kind"))
        if not _same_default(p.default, q.default, function=i == 0):
            found.add((name, "default"))
    ours_positional = [n for n, q in b.items() if q.kind in POSITIONAL][1:]
    theirs_positional = [n for n, p in a.items() if p.kind in POSITIONAL][1:]
    theirs_positional = [n for n in theirs_positional if n in b]
    if strict_kinds and ours_positional[: len(theirs_positional)] != theirs_positional:
        found.add(("*", "order"))
    for name, q in list(b.items())[1:]:
        if name not in a and q.kind not in (P.KEYWORD_ONLY, P.VAR_KEYWORD):
            if strict_kinds or name in OWN:
                found.add((name, "extra"))
    return found


@pytest.mark.parametrize("name", list(JAX_FUNCTIONS))
def test_signature_matches_jax(name):
    found = signature_differences(JAX_FUNCTIONS[name], getattr(treemode, name), strict_kinds=True)
    listed = {(p, aspect) for (n, p, aspect) in JAX_DIFFERENCES if n == name}
    assert found == listed, (
        f"treemode.{name}: unlisted differences from JAX {sorted(found - listed)}, "
        f"listed but gone {sorted(listed - found)}"
    )


@pytest.mark.parametrize("name", FLAX_FUNCTIONS)
def test_signature_matches_flax(name):
    found = signature_differences(getattr(nnx, name), getattr(treemode, name), strict_kinds=False)
    listed = {(p, aspect) for (n, p, aspect) in FLAX_DIFFERENCES if n == name}
    assert found == listed, (
        f"treemode.{name}: unlisted differences from Flax {sorted(found - listed)}, "
        f"listed but gone {sorted(listed - found)}"
    )


def test_the_version_history_matches_the_installed_jax():
    """Each entry of the history agrees with what the installed JAX exposes: a
    release outside an entry's known range, or a wrong range, fails here."""
    for entry in _DIFFERENCES_BY_VERSION:
        name, param, aspect, _, _ = entry
        assert _applies(entry) == _jax_shows(name, param, aspect), (
            f"jax {jax.__version__}: {name}({param}) {aspect}: the history says "
            f"{_applies(entry)}, the installed JAX says {not _applies(entry)}"
        )


def test_every_difference_has_a_reason():
    for table in (JAX_DIFFERENCES, FLAX_DIFFERENCES):
        for key, reason in table.items():
            assert isinstance(reason, str) and len(reason) > 20, key


def test_own_parameters_are_keyword_only():
    for name in [*JAX_FUNCTIONS, "jit_partial", "transform_metadata", "split_rngs", "fork_rngs"]:
        params = inspect.signature(getattr(treemode, name)).parameters
        if "graph" in params:
            assert params["graph"].kind is P.KEYWORD_ONLY, name
            assert params["graph"].default is False, name
        if "transform_metadata" in params:
            assert params["transform_metadata"].kind is P.KEYWORD_ONLY, name


# -- JAX's positional forms ------------------------------------------------------------


def test_vmap_positional_in_axes():
    out = treemode.vmap(lambda x, y: x * y, (0, None))(jnp.arange(3.0), 2.0)
    expected = jax.vmap(lambda x, y: x * y, (0, None))(jnp.arange(3.0), 2.0)
    np.testing.assert_array_equal(out, expected)
    assert out.dtype == expected.dtype


def test_pmap_positional_axis_name():
    n = jax.local_device_count()
    out = treemode.pmap(lambda x: jax.lax.psum(x, "i"), "i")(jnp.ones(n))
    np.testing.assert_array_equal(out, jax.pmap(lambda x: jax.lax.psum(x, "i"), "i")(jnp.ones(n)))


def test_scan_positional_length_reverse_unroll():
    def f(c, x):
        return c + 1, c

    carry, ys = treemode.scan(f, 0, None, 3, True, 2)
    jcarry, jys = jax.lax.scan(f, 0, None, 3, True, 2)
    assert int(carry) == int(jcarry) == 3
    np.testing.assert_array_equal(ys, jys)


def test_grad_positional_options():
    f = lambda x, y: (x * y, y)  # noqa: E731
    g, aux = treemode.grad(f, 1, True)(2.0, 3.0)
    jg, jaux = jax.grad(f, 1, True)(2.0, 3.0)
    assert float(g) == float(jg) == 2.0 and float(aux) == float(jaux)


def test_cond_and_switch_accept_jax_operand_keyword():
    assert int(treemode.cond(True, lambda x: x + 1, lambda x: x - 1, operand=1)) == 2
    assert int(treemode.switch(1, [lambda x: x, lambda x: x * 10], operand=2)) == 20
    with pytest.raises(TypeError, match=r"treemode\.cond: operand="):
        treemode.cond(True, lambda x: x, lambda x: x, 1, operand=1)


def test_reduce_axes_is_accepted_empty_and_rejected_otherwise():
    assert float(treemode.grad(lambda x: x * x, reduce_axes=())(3.0)) == 6.0
    with pytest.raises(NotImplementedError, match=r"treemode\.grad: reduce_axes"):
        treemode.grad(lambda x: x, reduce_axes=("i",))


def test_unknown_keyword_names_the_transform():
    with pytest.raises(TypeError, match=r"^jit\(\) got an unexpected keyword argument 'statc'"):
        treemode.jit(lambda x: x, statc=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^vmap\(\) got an unexpected keyword argument"):
        treemode.vmap(lambda x: x, in_axis=0)  # type: ignore[call-overload]


# -- decorator forms with keywords only ------------------------------------------------


def test_decorators_with_keywords_only():
    x = jnp.arange(3.0)

    @treemode.jit(static_argnames="n")
    def jitted(x, n):
        return x * n

    @treemode.vmap(in_axes=0)
    def mapped(x):
        return x * 2

    @treemode.grad(has_aux=False)
    def grad_of(x):
        return jnp.sum(x**2)

    @treemode.value_and_grad(argnums=0)
    def vg(x):
        return jnp.sum(x**2)

    @treemode.remat(prevent_cse=False)
    def remat_of(x):
        return jnp.sin(x)

    @treemode.custom_vjp(nondiff_argnums=())
    def cv(x):
        return x * 2

    cv.defvjp(lambda x: (cv(x), None), lambda res, g: (g * 2,))

    @treemode.scan(length=3)
    def counted(c, _):
        return c + 1, c

    @treemode.transform_metadata(partition="p", graph=True)
    def with_metadata(x):
        return x

    @treemode.pmap(axis_name="i")
    def summed(x):
        return jax.lax.psum(x, "i")

    @treemode.checkpoint(static_argnums=1)
    def powered(x, n):
        return x**n

    n = jax.local_device_count()
    np.testing.assert_array_equal(summed(jnp.ones(n)), n * jnp.ones(n))
    np.testing.assert_array_equal(powered(x, 2), x**2)

    np.testing.assert_array_equal(jitted(x, 2), x * 2)
    np.testing.assert_array_equal(mapped(x), x * 2)
    np.testing.assert_array_equal(grad_of(x), 2 * x)
    np.testing.assert_array_equal(vg(x)[1], 2 * x)
    np.testing.assert_array_equal(remat_of(x), jnp.sin(x))
    np.testing.assert_array_equal(jax.grad(lambda x: cv(x).sum())(x), 2 * jnp.ones(3))
    assert int(counted(0, None)[0]) == 3
    np.testing.assert_array_equal(with_metadata(x), x)

    out, vjp_fn = treemode.vjp(graph=True)(lambda x: x * 3, x)
    np.testing.assert_array_equal(vjp_fn(jnp.ones(3))[0], 3 * jnp.ones(3))
    out, vjp_fn = treemode.vjp(has_aux=False)(lambda x: x * 3)(x)  # f bound first, as Flax
    np.testing.assert_array_equal(out, 3 * x)
    y, y_dot = treemode.jvp(graph=True)(lambda x: x * 3, (x,), (jnp.ones(3),))
    np.testing.assert_array_equal(y_dot, 3 * jnp.ones(3))


# -- new parameters actually work ------------------------------------------------------


def test_jit_compiler_options_reach_xla():
    f = treemode.jit(lambda x: x + 1, compiler_options={"xla_embed_ir_in_executable": True})
    np.testing.assert_array_equal(f(jnp.ones(2)), 2 * jnp.ones(2))
    # An option XLA does not know is reported by XLA: it was passed through.
    bad = treemode.jit(lambda x: x + 1, compiler_options={"not_an_xla_option": True})
    with pytest.raises(Exception, match="not_an_xla_option"):
        bad(jnp.ones(2))


def test_vmap_sum_match_as_in_jax():
    f = lambda x: x * 2  # noqa: E731
    out = treemode.vmap(f, out_axes=None, sum_match=True)(jnp.arange(3.0))
    expected = jax.vmap(f, out_axes=None, sum_match=True)(jnp.arange(3.0))
    assert float(out) == float(expected) == 6.0
    with pytest.raises(ValueError):
        treemode.vmap(f, out_axes=None)(jnp.arange(3.0))


def test_vmap_sum_match_still_protects_broadcast_variables():
    counter = nnx.Variable(jnp.zeros(()))

    def f(c, x):
        c[...] = x
        return x

    with pytest.raises(treemode.AxisError):
        treemode.vmap(f, in_axes=(None, 0), out_axes=None, sum_match=True)(counter, jnp.arange(3.0))
    assert float(counter[...]) == 0.0


def test_remat_static_argnames():
    traces = []

    def f(x, mode):
        traces.append(mode)
        return jnp.sin(x) if mode == "sin" else jnp.cos(x)

    r = treemode.remat(f, static_argnames="mode")
    np.testing.assert_allclose(r(jnp.ones(2), mode="sin"), jnp.sin(jnp.ones(2)))
    np.testing.assert_allclose(r(jnp.ones(2), "cos"), jnp.cos(jnp.ones(2)))  # by position too
    assert traces == ["sin", "cos"]  # a Python string: static, compared by value
    g = jax.grad(lambda x: r(x, mode="sin").sum())(jnp.ones(2))
    np.testing.assert_allclose(g, jnp.cos(jnp.ones(2)))


def test_custom_vjp_nondiff_argnames():
    @treemode.custom_vjp(nondiff_argnames=("scale",))
    def f(x, scale):
        return x * scale

    f.defvjp(lambda x, scale: (f(x, scale), None), lambda scale, res, g: (g * scale * 10,))

    # The name reaches bwd first, as nondiff_argnums=(1,) would.
    g = jax.grad(lambda x: f(x, 2.0))(1.0)
    assert float(g) == 20.0
    g = jax.grad(lambda x: f(x, scale=3.0))(1.0)
    assert float(g) == 30.0


def test_transform_metadata_graph_keyword():
    v = nnx.Param(jnp.ones((4,)), out_sharding=("p", "a"), eager_sharding=False)
    seen = []

    @treemode.transform_metadata(in_axes=0, out_axes=0, partition="p", graph=True)
    def shared(a, b):
        seen.append((a.out_sharding, b.out_sharding))

    shared(v, v)
    assert seen == [(("a",), ("a",))]  # the shared Variable lost the axis once
    assert v.out_sharding == ("p", "a")

    @treemode.transform_metadata(in_axes=0, out_axes=0, partition="p")
    def tree_mode(a, b):
        return None

    with pytest.raises(treemode.AliasError, match=r"found at paths args\[0\] and args\[1\]"):
        tree_mode(v, v)
    assert v.out_sharding == ("p", "a")
