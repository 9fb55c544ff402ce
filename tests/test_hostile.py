"""Hostile and wrong inputs: each gives a treemode error naming the transform and the path.

Also the extremes: reference cycles, 1,000 nested levels and 100,000 Variables.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import treemode


class Counter(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.count = nnx.BatchStat(jnp.array(0))

    def bump(self, x):
        self.count[...] += 1
        return self.w[...] * x


def _values(module):
    """The raw value object of every Variable (identity: nothing was written)."""
    leaves = jax.tree_util.tree_leaves(module, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return [v.get_raw_value() for v in leaves]


def _unchanged(module, before):
    assert all(a is b for a, b in zip(_values(module), before, strict=True))


# -- jit arguments -------------------------------------------------------------------


def test_bound_method_to_jit_lifts_self_and_writes_back():
    m = Counter()
    f = treemode.jit(m.bump)
    np.testing.assert_array_equal(f(jnp.ones(2)), jnp.ones(2))
    f(jnp.ones(2))
    assert int(m.count[...]) == 2


def test_bound_method_to_jit_with_self_also_as_argument():
    m = Counter()
    before = _values(m)
    with pytest.raises(
        treemode.ClosureError, match=r"treemode\.jit: .*closure self\.w.*\(args\[0\]\)"
    ):
        treemode.jit(m.bump)(m.w)
    _unchanged(m, before)


def test_non_hashable_static_argument():
    m = Counter()
    f = treemode.jit(lambda m, s: m.w[...] * len(s), static_argnums=1)
    with pytest.raises(treemode.StaticArgumentError, match=r"treemode\.jit: .*args\[1\].*list"):
        f(m, [1, 2])


def test_static_argnums_out_of_range():
    with pytest.raises(treemode.StaticArgumentError, match=r"treemode\.jit: static_argnums .*5"):
        treemode.jit(lambda m, s: m.w[...], static_argnums=5)


def test_donating_a_static_argument():
    with pytest.raises(treemode.DonationError, match=r"treemode\.jit: argument\(s\) \[0\]"):
        treemode.jit(lambda m: m.w[...], static_argnums=0, donate_argnums=0)


# -- axes and carries ------------------------------------------------------------------


def test_vmap_axis_beyond_a_variables_rank():
    m = Counter()
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap: .*args\[0\]\.count"):
        treemode.vmap(lambda m, x: x, in_axes=(0, 0))(m, jnp.ones((2, 2)))


def test_vmap_mapped_sizes_disagree():
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap: .*args\[(0|1)\]"):
        treemode.vmap(lambda a, b: a + b)(jnp.ones(3), jnp.ones(4))


def test_vmap_in_axes_of_the_wrong_length():
    with pytest.raises(treemode.AxisError, match=r"treemode\.vmap: in_axes has 3 entries"):
        treemode.vmap(lambda m, x: x, in_axes=(0, 0, 0))(Counter(), jnp.ones((3, 2)))


def test_carry_nested_in_a_prefix():
    with pytest.raises(treemode.AxisError, match=r"treemode\.scan: .*in_axes\[0\]\[0\]"):
        treemode.scan(lambda c, x: (c, x), in_axes=((treemode.Carry, 0),))


def test_carry_in_in_axes_only():
    with pytest.raises(treemode.AxisError, match=r"treemode\.scan: in_axes has a treemode\.Carry"):
        treemode.scan(lambda c, x: (c, x), in_axes=(treemode.Carry, 0), out_axes=0)


def test_carry_in_the_wrong_place():
    """The module is scanned and the data is the carry: the module cannot be sliced."""
    m = Counter()
    before = _values(m)
    f = treemode.scan(
        lambda m, c: (c, m.w[...]),
        in_axes=(0, treemode.Carry),
        out_axes=(treemode.Carry, 0),
    )
    with pytest.raises(treemode.AxisError, match=r"treemode\.scan: .*args\[0\]\.count"):
        f(m, jnp.ones(2))
    _unchanged(m, before)


def test_carry_replaced_by_another_module():
    m = Counter()
    f = treemode.scan(lambda m, x: (Counter(), x), in_axes=(treemode.Carry, 0))
    with pytest.raises(treemode.StructureError, match=r"treemode\.scan: .*args\[0\]"):
        f(m, jnp.ones((2, 2)))


# -- returned Variables -------------------------------------------------------------------


@pytest.mark.parametrize(
    "run",
    [
        lambda f, m: treemode.jit(f)(m),
        lambda f, m: treemode.vmap(f, in_axes=None, axis_size=2)(m),
        lambda f, m: treemode.remat(f)(m),
        lambda f, m: treemode.cond(jnp.array(True), f, f, m),
        lambda f, m: treemode.eval_shape(f, m),
    ],
    ids=["jit", "vmap", "remat", "cond", "eval_shape"],
)
def test_returning_a_variable_of_an_input(run):
    m = Counter()
    before = _values(m)
    with pytest.raises(treemode.AliasError, match=r"treemode\.\w+: .*input args\[0\]\.w"):
        run(lambda m: m.w, m)
    _unchanged(m, before)


def test_returning_a_closed_over_variable():
    other = Counter()
    with pytest.raises(treemode.AliasError, match=r"treemode\.jit: .*closure other\.w"):
        treemode.jit(lambda x: other.w)(jnp.ones(2))


# -- traces ------------------------------------------------------------------------------


def test_module_closed_over_by_an_outer_jax_jit():
    m = Counter()
    before = _values(m)

    def outer(x):
        return treemode.jit(lambda m, x: m.bump(x))(m, x)

    with pytest.raises(treemode.TraceContextError, match=r"treemode\.jit: .*args\[0\]\.count"):
        jax.jit(outer)(jnp.ones(2))
    _unchanged(m, before)


def test_module_leaked_from_a_finished_trace():
    leaked = []

    @treemode.jit
    def make(x):
        leaked.append(Counter())
        return x

    with jax.check_tracer_leaks(False):  # the leak is the point (also under --tracer-leaks)
        make(jnp.ones(2))
    with pytest.raises(treemode.TraceContextError, match=r"treemode\.jit: .*args\[0\]\.count"):
        treemode.jit(lambda m: m.w[...] * 2)(leaked[0])


def test_closure_module_written_from_a_debug_callback_raises_and_is_left_alone():
    """A host callback that writes a closed-over module during a call.

    The callback runs while the compiled function executes, after tracing; the
    function (and so the callback it made) saw the trace-time copy of the module,
    as for an argument (tests/test_callback.py): the write is a MutationError,
    no tracer escapes, and the module stays usable.
    """
    m = Counter()

    def f(x):
        jax.debug.callback(lambda v: m.count.set_value(v), jnp.array(5))
        return x * 2

    with jax.check_tracer_leaks(False):
        with pytest.raises(treemode.MutationError, match=r"treemode\.jit: .*closure m\.count"):
            treemode.jit(f)(jnp.ones(2))
            jax.effects_barrier()
    assert int(m.count[...]) == 0
    assert not isinstance(m.count.get_raw_value(), jax.core.Tracer)
    treemode.jit(lambda m: m.bump(1.0))(m)
    assert int(m.count[...]) == 1


# -- donation ------------------------------------------------------------------------------


def test_deleted_buffers_reused():
    a = Counter()
    b = treemode.clone(a)  # shares a's buffers
    step = treemode.jit(lambda m: m.bump(1.0), donate_argnums=0)
    step(a)  # deletes the shared buffers
    with pytest.raises(treemode.DonationError, match=r"treemode\.jit: .*args\[0\]\.(w|count)"):
        treemode.jit(lambda m: m.bump(1.0))(b)
    step(a)  # the donated module itself got fresh buffers
    assert int(a.count[...]) == 2


# -- cycles, depth and width ---------------------------------------------------------------


def test_reference_cycle_with_graph_false():
    m = Counter()
    m.parent = m
    with pytest.raises(
        treemode.StructureError, match=r"treemode\.jit: reference cycle at args\[0\]\.parent"
    ):
        treemode.jit(lambda m: m.w[...])(m)
    assert sys.getrecursionlimit() < 5000  # restored
    # The interpreter is still healthy: a JAX RecursionError would have broken it.
    del m.parent
    assert float(treemode.jit(lambda m: m.w[...].sum())(m)) == 2.0


def test_reference_cycle_through_a_list_with_graph_false():
    m = Counter()
    m.items = nnx.data([1])
    m.items.append(m.items)
    with pytest.raises(
        treemode.StructureError, match=r"treemode\.vmap: reference cycle at args\[0\]\.items\[1\]"
    ):
        treemode.vmap(lambda m: m.w[...], in_axes=None, axis_size=1)(m)


def test_reference_cycle_with_graph_true():
    m = Counter()
    m.parent = m
    with pytest.raises(
        treemode.StructureError, match=r"treemode\.jit: reference cycle at args\[0\]\.parent"
    ):
        treemode.jit(lambda m: m.w[...], graph=True)(m)
    with pytest.raises(treemode.StructureError, match=r"treemode\.to_tree: reference cycle"):
        treemode.to_tree(m)


def test_shared_but_acyclic_objects_are_not_a_cycle():
    m = Counter()
    act = nnx.Module()
    m.a, m.b = nnx.data([act]), nnx.data([act])  # one stateless module twice: allowed
    assert float(treemode.jit(lambda m: m.w[...].sum())(m)) == 2.0


class Link(nnx.Module):
    def __init__(self, child):
        self.w = nnx.Param(jnp.zeros(()))
        self.child = child


def _chain(n):
    m = None
    for _ in range(n):
        m = Link(m)
    return m


def _assert_refused_cleanly(deep, limit, call):
    """``call`` fails with treemode's error, and leaves the model and the limit as they were."""
    with pytest.raises(treemode.StructureError, match="nested too deeply to flatten"):
        call()
    node = deep
    while node is not None:
        assert float(node.w[...]) == 0.0
        node = node.child
    assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize("graph", [False, True])
def test_thousand_nested_levels(graph):
    """1,000 nested modules: updated correctly, or refused with treemode's error.

    How deep JAX's recursive flattening may go depends on the interpreter, not on
    treemode: CPython 3.12.0 to 3.12.2 cap C-level recursion at about 1,500
    levels whatever ``sys.setrecursionlimit`` says (graph=True's flattening
    needs about six per nesting level, so it fails there), 3.12.3 raised that cap
    (gh-112215) and 3.13 has about 10,000; JAX's own flattening did not change
    (0.10.2 to 0.11.2). So either outcome is accepted here, each checked
    completely; `test_nesting_deeper_than_the_limit_is_refused_cleanly` checks
    the refusal on every interpreter.
    """
    deep = _chain(1000)
    limit = sys.getrecursionlimit()

    def touch(m):
        for _ in range(999):
            m = m.child
        m.w[...] += 1.0  # the innermost Variable

    f = treemode.jit(touch, graph=graph)
    try:
        f(deep)
    except treemode.StructureError:  # this interpreter's C recursion cap is lower
        _assert_refused_cleanly(deep, limit, lambda: f(deep))
        return
    f(deep)
    node = deep
    for _ in range(999):
        assert float(node.w[...]) == 0.0
        node = node.child
    assert float(node.w[...]) == 2.0
    assert sys.getrecursionlimit() == limit


def test_nesting_deeper_than_the_limit_is_refused_cleanly(monkeypatch):
    """Where the limit does not allow the depth, the call fails with treemode's error
    and changes nothing. The limit is made low here (no headroom above the current
    limit), so this holds on every interpreter: graph=True's flattening recurses
    through Python frames, which count against ``sys.getrecursionlimit`` everywhere."""
    from treemode._tree import _recursion

    limit = sys.getrecursionlimit()
    monkeypatch.setattr(_recursion, "RECURSION_HEADROOM", limit)
    deep = _chain(limit)

    def touch(m):
        while m.child is not None:
            m = m.child
        m.w[...] += 1.0

    f = treemode.jit(touch, graph=True)
    _assert_refused_cleanly(deep, limit, lambda: f(deep))
    monkeypatch.undo()
    assert float(treemode.jit(lambda m: m.w[...] + 1.0)(_chain(3))) == 1.0  # still works


def test_hundred_thousand_variables(hooks):
    n = 100_000
    values = np.zeros((n, 1), np.float32)

    class Wide(nnx.Module):
        def __init__(self):
            self.params = nnx.data([nnx.Param(values[i]) for i in range(n)])

    wide = Wide()
    specs = hooks.calls("value_spec")

    def f(m):
        m.params[n - 1][...] += 1.0
        return m.params[0][...]

    g = treemode.jit(f)
    g(wide)
    assert len(specs) == n  # one spec per Variable: linear work on the first call
    g(wide)
    assert len(specs) == n  # the second call reuses the cached flattening
    assert float(wide.params[n - 1][...][0]) == 2.0


def test_recursion_limit_restored_after_an_exit_cut_short(monkeypatch):
    # An exception from a signal handler can land inside the headroom's own
    # bookkeeping (its ``finally``): the next call that leaves restores the limit.
    from treemode._tree import _recursion

    limit = sys.getrecursionlimit()
    real_lock = _recursion._headroom_lock

    class CutOnExit:
        entered = 0

        def __enter__(self):
            CutOnExit.entered += 1
            if CutOnExit.entered == 2:  # the ``finally`` of the first user
                raise KeyboardInterrupt
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    monkeypatch.setattr(_recursion, "_headroom_lock", CutOnExit())
    with pytest.raises(KeyboardInterrupt):
        with _recursion.recursion_headroom():
            assert sys.getrecursionlimit() == _recursion.RECURSION_HEADROOM
    assert sys.getrecursionlimit() == _recursion.RECURSION_HEADROOM  # left raised
    monkeypatch.setattr(_recursion, "_headroom_lock", real_lock)
    m = Counter()
    assert float(treemode.jit(lambda m: m.w[...].sum())(m)) == 2.0
    assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize(
    ("version", "helps"),
    [
        ((3, 11, 7), True),
        ((3, 12, 0), False),
        ((3, 12, 2), False),
        ((3, 12, 3), True),
        ((3, 13, 0), True),
    ],
)
def test_the_deep_nesting_error_says_what_helps_on_each_python(version, helps):
    """On CPython 3.12.0 to 3.12.2 raising the recursion limit cannot help (C-level
    recursion is capped whatever it says): the error says so there, and advises
    ``sys.setrecursionlimit`` elsewhere."""
    from treemode._tree import _recursion

    message = str(_recursion.recursion_error("jit", [("args[0]", _chain(3))], version))
    assert "nested too deeply to flatten" in message
    assert "nnx.List" in message
    if helps:
        assert "Raise the limit before calling (sys.setrecursionlimit)" in message
        assert "cannot help" not in message
    else:
        shown = ".".join(map(str, version))
        assert f"on Python {shown}" in message
        assert "sys.setrecursionlimit says, so raising the limit cannot help here" in message
        assert "Raise the limit" not in message


def test_the_deep_nesting_error_raised_here_fits_the_running_python(monkeypatch):
    from treemode._tree import _recursion

    limit = sys.getrecursionlimit()
    monkeypatch.setattr(_recursion, "RECURSION_HEADROOM", limit)
    with pytest.raises(treemode.StructureError) as info:
        treemode.jit(lambda m: 0, graph=True)(_chain(limit))
    low, high = _recursion.CAPPED_C_RECURSION
    capped = low <= tuple(sys.version_info[:3]) < high
    assert ("cannot help here" in str(info.value)) == capped, str(info.value)
