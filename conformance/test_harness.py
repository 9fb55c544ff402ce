"""Tests of the conformance harness itself (run first by `make conformance`).

They check that the router sends each call where its mode says, translating Flax's
arguments, and that failures are classified as documented; Flax's own tests are not
needed here.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

import treemode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import conformance_plugin as plugin  # noqa: E402
import run  # noqa: E402


@pytest.fixture
def routed(request):
    plugin.install(request.param)
    plugin._State.current = "test"
    try:
        yield request.param
    finally:
        plugin.uninstall()


def _targets() -> list[tuple[str, bool, bool, str]]:
    return sorted(plugin._State.calls.get("test", {}))


@pytest.mark.parametrize("routed", ["tree"], indirect=True)
def test_tree_mode_routes_tree_mode_calls_only(routed):
    def f(x):
        return x * 2

    assert isinstance(nnx.jit(f, graph=False), treemode.JitWrapped)
    assert isinstance(nnx.jit(graph=True, graph_updates=False)(f), treemode.JitWrapped)
    flax_jitted = nnx.jit(f)  # Flax's default: graph mode with graph updates
    assert not isinstance(flax_jitted, treemode.JitWrapped)
    # Recorded with the resolved values (graph_updates defaults to Flax's True).
    assert _targets() == [
        ("jit", False, True, "treemode"),
        ("jit", True, False, "treemode"),
        ("jit", True, True, "flax"),
    ]


@pytest.mark.parametrize("routed", ["tree"], indirect=True)
def test_tree_mode_follows_flax_global_mode(routed):
    with nnx.set_graph_mode(False):
        jitted = nnx.jit(lambda x: x)
    assert isinstance(jitted, treemode.JitWrapped)
    assert _targets() == [("jit", False, True, "treemode")]


@pytest.mark.parametrize("routed", ["tree"], indirect=True)
def test_routed_calls_run_in_treemode_and_write_back(routed):
    from flax.nnx import vmap  # imported after install: the router as well

    counter = nnx.BatchStat(jnp.zeros(3))

    def bump(c, x):
        c[...] += x
        return x

    out = vmap(bump, in_axes=(0, 0), graph=False)(counter, jnp.arange(3.0))
    assert out.tolist() == [0.0, 1.0, 2.0]
    assert counter[...].tolist() == [0.0, 1.0, 2.0]
    # Flax's keyword names and no-op arguments are translated.
    grads = nnx.grad(f=lambda p: p[...] ** 2, reduce_axes=(), graph=False)(
        nnx.Param(jnp.array(3.0))
    )
    assert float(grads[...]) == 6.0
    assert [t[0] for t in _targets()] == ["grad", "vmap"]


@pytest.mark.parametrize("routed", ["dropin"], indirect=True)
def test_dropin_sends_graph_mode_calls_with_graph_true(routed):
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    shared = nnx.Dict(a=m, b=m)  # sharing: fine with graph=True

    @nnx.jit
    def f(tree):
        return tree["a"](jnp.ones(2)) - tree["b"](jnp.ones(2))

    assert isinstance(f, treemode.JitWrapped)
    assert f(shared).tolist() == [0.0, 0.0]
    assert _targets() == [("jit", True, True, "treemode")]


@pytest.mark.parametrize("routed", ["flax-tree"], indirect=True)
def test_flax_tree_forces_graph_false_on_flax(routed):
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    shared = nnx.Dict(a=m, b=m)
    f = nnx.jit(lambda tree: tree["a"](jnp.ones(2)))
    assert not isinstance(f, treemode.JitWrapped)
    with pytest.raises(ValueError, match="Duplicate"):  # Flax's tree mode refuses sharing
        f(shared)


@pytest.mark.parametrize("routed", ["flax-graph"], indirect=True)
def test_flax_graph_keeps_graph_and_drops_graph_updates(routed):
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    shared = nnx.Dict(a=m, b=m)  # sharing: fine in Flax's graph mode

    @nnx.jit  # Flax's default: graph mode with graph updates
    def f(tree):
        tree["a"].bias[...] += 1  # a Variable update: written back without graph updates too
        return tree["a"](jnp.ones(2)) - tree["b"](jnp.ones(2))

    assert not isinstance(f, treemode.JitWrapped)
    assert f(shared).tolist() == [0.0, 0.0]
    assert m.bias[...].tolist() == [1.0, 1.0]
    nnx.jit(lambda x: x, graph=False)
    assert _targets() == [("jit", False, True, "flax-graph"), ("jit", True, True, "flax-graph")]


def test_dropin_summary_lists_deliberate_differences_and_gaps():
    def result(outcome):
        return {"outcome": outcome, "calls": [{"target": "x", "graph": True}]}

    results = {
        "dropin": {
            "t.py::A::a": result("passed"),
            "t.py::A::b": result("failed"),
            "t.py::A::c": result("failed"),
            "t.py::A::d": result("passed"),
        },
        "flax-graph": {
            "t.py::A::a": result("passed"),
            "t.py::A::b": result("passed"),
            "t.py::A::c": result("passed"),
            "t.py::A::d": result("failed"),
        },
        "flax-tree": {
            "t.py::A::a": result("failed"),
            "t.py::A::b": result("passed"),
            "t.py::A::c": result("failed"),
            "t.py::A::d": result("failed"),
        },
    }
    entries = [{"test": "t.py::A::b", "kind": "expected", "reason": "on purpose"}]
    summary = run.summarize_dropin(results, entries)
    assert (summary["dropin_passed"], summary["flax_graph_passed"]) == (2, 3)
    assert summary["flax_tree_passed"] == 1
    assert summary["pass_only_with_flax_graph"] == ["t.py::A::b", "t.py::A::c"]
    assert summary["deliberate"] == {"t.py::A::b": {"kind": "expected", "reason": "on purpose"}}
    assert summary["gaps"] == ["t.py::A::c"]
    assert summary["pass_only_with_treemode"] == ["t.py::A::d"]
    assert summary["pass_only_with_treemode_vs_flax_tree"] == ["t.py::A::a", "t.py::A::d"]
    assert "| **all** | 4 | 2 | 3 | 1 |" in run.markdown(
        {"flax": "x", "date": "d", "revision": "r", "jax": "j", "dropin": summary}
    )


def test_expected_differences_are_scoped():
    tree, dropin = run.load_expected("tree"), run.load_expected("dropin")
    assert tree and dropin
    assert all(e.get("scope") == "dropin" for e in dropin)
    assert len(run.load_expected("all")) == len(tree) + len(dropin)


def _failure(**kw):
    base = {"type": "ValueError", "origin": "treemode", "message": "x"}
    return {"outcome": "failed", "calls": [], "failure": {**base, **kw}}


def test_classification():
    entries = [
        {"test": "t.py::A::test_listed*", "kind": "expected", "reason": "on purpose"},
    ]
    listed = run.classify("t.py::A::test_listed1", _failure(), entries)
    assert (listed["class"], listed["reason"]) == ("expected", "on purpose")
    text = run.classify("t.py::A::b", _failure(type="AssertionError", text_mismatch=True), [])
    assert text["class"] == "error-text" and not text["listed"]
    other_type = run.classify("t.py::A::c", _failure(inside_expected_raise=True), [])
    assert other_type["class"] == "error-text"
    not_raised = _failure(type="AssertionError", inside_expected_raise=True, origin="test")
    assert run.classify("t.py::A::d", not_raised, [])["class"] == "gap"
    assert run.classify("t.py::A::e", _failure(), [])["class"] == "gap"


def test_expected_differences_file_is_valid():
    entries = run.load_expected()
    assert entries and all(e["reason"].strip() for e in entries)


def test_raises_lines(tmp_path):
    source = tmp_path / "x_test.py"
    source.write_text(
        textwrap.dedent(
            """\
            def test():
                a = 1
                with self.assertRaisesRegex(ValueError, 'x'):
                    f(a)
                    g(a)
                h(a)
            """
        )
    )
    assert plugin._raises_lines(str(source)) == frozenset({3, 4, 5})
