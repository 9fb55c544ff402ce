"""Equivalence by construction: every transform leaves the state eager code leaves.

Hypothesis draws a random tree (nested NNX modules, ``nnx.List``/``nnx.Dict``,
Python containers, Equinox modules, static fields, Variables of several types,
``nnx.Rngs``; optionally one object reachable twice) and a random program that
reads and mutates random Variables. The scenario is built twice: one copy runs
the program eagerly, the other through a treemode transform that runs it
exactly once (``vmap`` over a size-1 axis, ``scan`` of length 1, ``cond`` /
``switch`` selecting it, a loop of one iteration, ...). Both copies must end in
bit-identical states and the outputs must be equal.

The number of examples comes from the hypothesis profile (``tests/conftest.py``):
``ci`` (default, derandomized) or ``fuzz`` (``make fuzz``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import strategies as S
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treemode

BASE = settings().max_examples  # 20 in the ci profile


def examples(fraction: float) -> settings:
    return settings(
        max_examples=max(3, int(BASE * fraction)),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _total(outs: list[jax.Array]) -> jax.Array:
    total = jnp.zeros((), jnp.float32)
    for o in outs:
        total = total + jnp.sum(o)
    return total


def _zeros(template: list[jax.Array]) -> Callable[[Any], list[jax.Array]]:
    shapes = [(o.shape, o.dtype) for o in template]

    def branch(root: Any) -> list[jax.Array]:
        return [jnp.zeros(s, d) for s, d in shapes]

    return branch


def _unbatch(outs: list[jax.Array]) -> list[jax.Array]:
    return [o[0] for o in outs]


# Each runner runs ``program`` once through a transform and returns its outputs
# in the eager layout. ``template`` is the eager output (for branches that must
# return the same structure).
Runner = Callable[[Callable[..., Any], Any, list[jax.Array], bool], list[jax.Array]]


def run_jit(program, root, template, graph):
    return treemode.jit(program, graph=graph)(root)


def run_vmap(program, root, template, graph):
    f = treemode.vmap(program, in_axes=0, out_axes=0, axis_size=1, graph=graph)
    return _unbatch(f(root))


def run_scan_carry(program, root, template, graph):
    f = treemode.scan(
        lambda r: (r, program(r)),
        in_axes=(treemode.Carry,),
        out_axes=(treemode.Carry, 0),
        length=1,
        graph=graph,
    )
    carry, ys = f(root)
    assert S.variables_of(carry) == S.variables_of(root)  # the same Variable objects
    return _unbatch(ys)


def run_scan_xs(program, root, template, graph):
    f = treemode.scan(program, in_axes=(0,), out_axes=0, length=1, graph=graph)
    return _unbatch(f(root))


def run_cond(program, root, template, graph):
    return treemode.cond(jnp.array(True), program, _zeros(template), root, graph=graph)


def run_cond_false(program, root, template, graph):
    return treemode.cond(jnp.array(False), _zeros(template), program, root, graph=graph)


def run_switch(program, root, template, graph):
    zeros = _zeros(template)
    return treemode.switch(jnp.array(1), [zeros, program, zeros], root, graph=graph)


def run_while(program, root, template, graph):
    def body(val):
        r, i, _ = val
        return r, i + 1, program(r)

    init = (root, jnp.array(0), _zeros(template)(None))
    r, i, outs = treemode.while_loop(lambda v: v[1] < 1, body, init, graph=graph)
    assert int(i) == 1 and S.variables_of(r) == S.variables_of(root)
    return outs


def run_fori(program, root, template, graph):
    init = (root, _zeros(template)(None))
    r, outs = treemode.fori_loop(0, 1, lambda i, v: (v[0], program(v[0])), init, graph=graph)
    assert S.variables_of(r) == S.variables_of(root)
    return outs


def run_grad(program, root, template, graph):
    loss, grads = treemode.value_and_grad(lambda r: _total(program(r)), graph=graph)(root)
    if not graph:
        assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(root)
    return [loss]


def run_remat(program, root, template, graph):
    return treemode.remat(program, graph=graph)(root)


RUNNERS: dict[str, Runner] = {
    "jit": run_jit,
    "vmap": run_vmap,
    "scan_carry": run_scan_carry,
    "scan_xs": run_scan_xs,
    "cond": run_cond,
    "cond_false": run_cond_false,
    "switch": run_switch,
    "while_loop": run_while,
    "fori_loop": run_fori,
    "grad": run_grad,
    "remat": run_remat,
}
BATCHED = {"vmap", "scan_xs"}


def assert_same_state(expected: list[np.ndarray], actual: list[np.ndarray]) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert e.dtype == a.dtype, i
        np.testing.assert_array_equal(a, e, err_msg=f"Variable {i}")


def assert_same_outputs(expected: list[jax.Array], actual: list[jax.Array]) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert e.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_no_tracers(root: Any) -> None:
    for v in S.variables_of(root):
        assert not isinstance(v.get_raw_value(), jax.core.Tracer)


def check_equivalent(scenario: S.Scenario, transform: str, graph: bool) -> None:
    program = S.make_program(scenario)
    eager_root = S.build(scenario.tree)
    eager_out = program(eager_root)
    if transform == "grad":
        eager_out = [_total(eager_out)]
    batched = transform in BATCHED
    root = S.build(scenario.tree, batch=batched)
    variables = S.variables_of(root)
    out = RUNNERS[transform](program, root, eager_out if transform != "grad" else [], graph)
    assert S.variables_of(root) == variables  # updated in place, never replaced
    assert_no_tracers(root)
    assert_same_state(S.state_of(eager_root), S.state_of(root, unbatch=batched))
    assert_same_outputs(eager_out, out)


@pytest.mark.parametrize("transform", sorted(RUNNERS))
@examples(0.75)
@given(scenario=S.scenarios(shared=False), graph=st.booleans())
def test_transform_matches_eager(transform, scenario, graph):
    check_equivalent(scenario, transform, graph)


def test_jit_twice_matches_eager_twice():
    # A second call goes through the flatten cache and the compiled function.
    @examples(0.5)
    @given(scenario=S.scenarios(shared=None))
    def check(scenario):
        program = S.make_program(scenario)
        eager_root, root = S.build(scenario.tree), S.build(scenario.tree)
        f = treemode.jit(program, graph=scenario.shared)
        for _ in range(2):
            assert_same_outputs(program(eager_root), f(root))
            assert_same_state(S.state_of(eager_root), S.state_of(root))

    check()


@pytest.mark.parametrize("transform", sorted(RUNNERS))
@examples(0.4)
@given(scenario=S.scenarios(shared=True))
def test_shared_reference_with_graph_true_matches_eager(transform, scenario):
    check_equivalent(scenario, transform, graph=True)


@pytest.mark.parametrize("transform", sorted(RUNNERS))
@examples(0.25)
@given(scenario=S.scenarios(shared=True))
def test_shared_reference_with_graph_false_raises(transform, scenario):
    program = S.make_program(scenario)
    batched = transform in BATCHED
    root = S.build(scenario.tree, batch=batched)
    before = [v.get_raw_value() for v in S.variables_of(root)]
    with pytest.raises(
        treemode.AliasError, match=r"treemode\.\w+: Duplicate \w+: the same \w+ is reachable"
    ):
        RUNNERS[transform](program, root, [], False)
    assert [v.get_raw_value() for v in S.variables_of(root)] == before  # untouched


@examples(0.5)
@given(scenario=S.scenarios(shared=None))
def test_eval_shape_has_no_effect(scenario):
    program = S.make_program(scenario)
    eager_out = program(S.build(scenario.tree))
    root = S.build(scenario.tree)
    before = [v.get_raw_value() for v in S.variables_of(root)]
    out = treemode.eval_shape(program, root, graph=scenario.shared)
    assert [v.get_raw_value() for v in S.variables_of(root)] == before
    assert [(o.shape, o.dtype) for o in out] == [(o.shape, o.dtype) for o in eager_out]


def _object_paths(root: Any) -> dict[int, list[str]]:
    """Every NNX object and Variable, by identity, with the paths reaching it."""
    found: dict[int, list[str]] = {}

    def visit(path: tuple[Any, ...], x: Any) -> None:
        if treemode._tree._leaves.is_variable_or_graph_node(x):
            found.setdefault(id(x), []).append(jax.tree_util.keystr(path))
            if treemode._tree._leaves.is_variable(x):
                return
        children, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)
        if len(children) == 1 and children[0][0] == () and children[0][1] is x:
            return  # a leaf
        for p, c in children:
            visit((*path, *p), c)

    visit((), root)
    return found


@examples(2.5)
@given(scenario=S.scenarios(shared=None))
def test_to_tree_from_tree_round_trip(scenario):
    root = S.build(scenario.tree)
    tree = treemode.to_tree(root)
    treemode.check_no_aliases(tree=tree)  # the pure tree has no aliases
    restored = treemode.from_tree(tree)
    # structure and values
    is_var = treemode._tree._leaves.is_variable
    assert jax.tree_util.tree_structure(restored, is_leaf=is_var) == (
        jax.tree_util.tree_structure(root, is_leaf=is_var)
    )
    leaves = jax.tree_util.tree_leaves(root, is_leaf=is_var)
    new_leaves = jax.tree_util.tree_leaves(restored, is_leaf=is_var)
    assert all(a is b for a, b in zip(leaves, new_leaves, strict=True))
    # sharing: two paths reach one object before iff they do after
    groups = sorted(map(sorted, _object_paths(root).values()))
    assert groups == sorted(map(sorted, _object_paths(restored).values()))
    # a pure tree round-trips through a JAX transform too
    again = treemode.from_tree(jax.tree_util.tree_map(lambda x: x, tree))
    groups_again = sorted(map(sorted, _object_paths(again).values()))
    assert groups_again == groups


# -- regressions found by the tests above --------------------------------------------


def test_from_tree_shared_reference_after_a_plain_array():
    """A SharedRef used to resolve to the plain array preceding it in its module."""
    from flax import nnx

    class Node(nnx.Module):
        pass

    m = Node()
    m.a = jnp.zeros(2)  # a plain array attribute, flattened before b and c
    m.b = nnx.Param(jnp.array([1.0, 2.0]))
    m.c = m.b
    restored = treemode.from_tree(treemode.to_tree(m))
    assert restored.c is restored.b is m.b
    f = treemode.jit(lambda r: r.c[...] * 2, graph=True)
    np.testing.assert_array_equal(f(m), jnp.array([2.0, 4.0]))


def test_jit_donating_a_later_argument_keeps_the_argument_order():
    """The donated/kept reordering used to apply the permutation, not its inverse."""
    f = treemode.jit(lambda a, b: (a[0], a[1], b), donate_argnums=1)
    out = f((jnp.array(0.0), jnp.array(1.0)), jnp.array(2.0))
    assert [float(x) for x in out] == [0.0, 1.0, 2.0]


# -- mutations between calls: static values changing type, list metadata -----------


def _static_program(w: jax.Array, s: Any) -> list[jax.Array]:
    """Outputs whose dtype depends on the type of every number in ``s``."""
    numbers = jax.tree_util.tree_leaves(s)
    return [w * n for n in numbers] + [jnp.asarray(n) for n in numbers]


def _same_arrays(expected: list[jax.Array], actual: list[jax.Array]) -> None:
    assert [jnp.asarray(a).dtype for a in actual] == [jnp.asarray(e).dtype for e in expected]
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")  # eqx, NumPy scalars
@examples(1.0)
@given(
    values=S.static_value_sequence(),
    place=st.sampled_from(["attribute", "graph attribute", "static_argnums", "equinox"]),
)
def test_static_values_changing_type_between_calls_match_eager(values, place):
    """A cached trace is reused only for static values of the same value *and* types."""
    import equinox as eqx
    from flax import nnx

    w = jnp.arange(3, dtype=jnp.int32)

    class Holder(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(w)
            self.s = values[0]

    class EqxHolder(eqx.Module):
        w: jax.Array
        s: Any = eqx.field(static=True)

    holder = Holder()
    by_module = treemode.jit(lambda m: _static_program(m.w[...], m.s), graph=place != "attribute")
    by_argnum = treemode.jit(_static_program, static_argnums=1)
    by_eqx = treemode.jit(lambda e: _static_program(e.w, e.s))
    for s in values:
        expected = _static_program(w, s)
        if place == "static_argnums":
            actual = by_argnum(w, s)
        elif place == "equinox":
            actual = by_eqx(EqxHolder(w, s))
        else:
            holder.s = s  # the same module, its static attribute replaced
            actual = by_module(holder)
        _same_arrays(expected, actual)


@examples(1.0)
@given(metadata=st.lists(S.metadata_value(), min_size=1, max_size=4), graph=st.booleans())
def test_variable_metadata_of_any_kind_changing_between_calls_matches_eager(metadata, graph):
    """Unhashable metadata works, and a trace sees the metadata of its call."""
    from flax import nnx

    def program(v):
        v[...] += 1.0
        return v[...] * float(len(repr(v.tags)))

    eager = nnx.Param(jnp.ones(2), tags=metadata[0])
    jitted_var = nnx.Param(jnp.ones(2), tags=metadata[0])
    jitted = treemode.jit(program, graph=graph)
    for tags in metadata:
        eager.set_metadata(tags=tags)
        jitted_var.set_metadata(tags=tags)
        np.testing.assert_array_equal(jitted(jitted_var), program(eager))
        assert jitted_var.tags is tags  # the user's object is kept
    np.testing.assert_array_equal(jitted_var[...], eager[...])


# -- mutations between calls: metadata updates across input shapes, donation with faults


@examples(1.0)
@given(lengths=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=6))
def test_metadata_updates_across_input_shapes_match_eager(lengths):
    """A trace's metadata updates belong to its executable: calls alternating between
    input shapes (each shape its own trace) write what their own trace recorded."""
    from flax import nnx

    def program(v, x):
        v[...] += x.sum()
        if x.shape[0] % 2 == 0:  # only the even-length traces update the metadata
            v.set_metadata(last_even=x.shape[0])
        return v[...] * 2

    eager = nnx.Param(jnp.zeros(()), last_even=0)
    jitted_var = nnx.Param(jnp.zeros(()), last_even=0)
    jitted = treemode.jit(program)
    for n in lengths:
        x = jnp.ones(n)
        np.testing.assert_array_equal(jitted(jitted_var, x), program(eager, x))
        assert jitted_var.last_even == eager.last_even
    np.testing.assert_array_equal(jitted_var[...], eager[...])


class _Fault(BaseException):
    """Like KeyboardInterrupt: not an Exception."""


@settings(
    max_examples=BASE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    faults=st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=1, max_size=4),
    donate=st.booleans(),
)
def test_calls_with_faults_in_the_write_match_eager(hooks, faults, donate):
    """A write that fails at its k-th Variable (or not at all), call after call: the
    module always holds the state of the eager program after the steps that ran,
    never deleted buffers (a donated call's step counts as run)."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.zeros(2))
            self.b = nnx.BatchStat(jnp.zeros(2))
            self.c = nnx.Param(jnp.ones(2))

    def program(m, x):
        m.a[...] += x
        m.b[...] += 2 * x
        m.c[...] *= 2.0
        return m.a[...].sum()

    real = hooks.real_store
    eager, model = Model(), Model()
    f = treemode.jit(program, donate_argnums=0 if donate else ())
    for k in faults:
        seen: list[Any] = []

        def store(var, value, metadata=None, k=k, seen=seen):
            seen.append(var)
            if k is not None and len(seen) == k:
                raise _Fault(f"write {k}")
            real(var, value, metadata)

        hooks.store(store)
        try:
            f(model, jnp.ones(2))
            ran = True
        except _Fault:
            ran = donate  # a donated step's inputs are gone: it counts as done
        hooks.undo()
        if ran:
            program(eager, jnp.ones(2))
        for name in ("a", "b", "c"):
            value = getattr(model, name).get_raw_value()
            assert not value.is_deleted()
            np.testing.assert_array_equal(value, getattr(eager, name)[...])


# -- mutations between calls: replaced __dict__ and __class__ ----------------------


@pytest.mark.parametrize("how", ["jit", "jit graph=True", "jit_partial"])
@examples(0.75)
@given(data=st.data())
def test_replaced_dict_or_class_between_calls_matches_eager(how, data):
    """A cached call sees a replaced ``__dict__`` (read and written: the Variables
    the object holds now) and a replaced ``__class__`` (of a Variable or a module)."""
    scenario = data.draw(S.scenarios(shared=False, types=True))
    replacements = data.draw(S.replacements(scenario.handles))
    program = S.make_program(scenario)
    eager_root, root = S.build(scenario.tree), S.build(scenario.tree)
    if how == "jit_partial":
        bound = treemode.jit_partial(program, root)
        f = lambda r: bound()  # noqa: E731
    else:
        f = treemode.jit(program, graph=how == "jit graph=True")
    for step in range(3):
        if step == 1:
            for r in replacements:
                S.replace(eager_root, scenario.handles, r)
                S.replace(root, scenario.handles, r)
        assert_same_outputs(program(eager_root), f(root))
        assert_same_state(S.state_of(eager_root), S.state_of(root))
        assert [type(v) for v in S.variables_of(root)] == [
            type(v) for v in S.variables_of(eager_root)
        ]


# -- layout changes between calls: a Variable's value becomes a pytree, None, ... ---------


class _Layouts(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.zeros(3))
        self.b = nnx.Variable(jnp.ones(2))
        self.inner = nnx.Dict(c=nnx.BatchStat(jnp.zeros(())))


@pytest.mark.parametrize("how", ["jit", "jit graph=True", "jit donate", "jit_partial", "grad"])
@examples(0.4)
@given(data=st.data())
def test_layout_changes_between_calls_match_eager(how, data):
    """A warm transform retraces when a Variable's value changes layout (an array
    becomes a dict, a tuple, ``None``, a number, a string, or back) and matches eager."""
    eager, model = _Layouts(), _Layouts()
    n = len(S.variables_of(model))
    changes = data.draw(S.layout_changes(n))
    if how == "jit_partial":
        bound = treemode.jit_partial(S.layout_program, model)
        f = lambda m: bound()  # noqa: E731
    elif how == "grad":
        g = treemode.grad(lambda m: S.layout_program(m) * 0 + m.a[...].sum())
        f = lambda m: g(m).a[...]  # noqa: E731
    else:
        f = treemode.jit(
            S.layout_program,
            graph=how == "jit graph=True",
            donate_argnums=0 if how == "jit donate" else (),
        )
    program = S.layout_program if how != "grad" else (lambda m: jnp.ones(3))
    for step in range(len(changes) + 1):
        if step:
            for index, kind, seed in changes[step - 1]:
                if how in ("grad",) and index == 0:
                    continue  # grad reads ``a`` as an array
                if how == "jit donate" and kind == "string":
                    kind = "tuple"  # a donated Variable's value is an output: no strings
                for root in (eager, model):
                    S.variables_of(root)[index].set_raw_value(S.layout_value(kind, seed))
        expected, got = program(eager), f(model)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        if how != "grad":
            for x, y in zip(S.variables_of(eager), S.variables_of(model), strict=True):
                jax.tree.map(
                    lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                    x.get_raw_value(),
                    y.get_raw_value(),
                )
