"""What users see when they print or display treemode's objects: treescope renders a
`treemode.Pytree` as its module, and no public signature shows a bare sentinel."""

from __future__ import annotations

import inspect
import pickle

import pytest
from flax import nnx

import treemode
from treemode._helpers import _rngs


def test_treescope_renders_a_pytree_as_its_module() -> None:
    treescope = pytest.importorskip("treescope")  # a dependency of Flax
    module = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    proxy = treemode.Pytree(module)
    text = treescope.render_to_text(proxy)
    assert text.startswith("Linear("), text[:200]
    assert "kernel=Param(" in text and "in_features=2" in text
    # The same lines as the module's own rendering (attributes may come in another order).
    assert sorted(text.splitlines()) == sorted(treescope.render_to_text(module).splitlines())
    # Rendering reads the proxy's state and leaves it as it was.
    assert proxy.kernel[...] is module.kernel[...]


def test_treescope_renders_a_nested_proxy_inside_a_pytree() -> None:
    treescope = pytest.importorskip("treescope")
    proxy = treemode.Pytree(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
    text = treescope.render_to_text({"bn": proxy})
    assert "BatchNorm(" in text and "BatchStat" in text


def test_public_signatures_show_readable_defaults() -> None:
    for name in [n for n in dir(treemode) if not n.startswith("_")]:
        obj = getattr(treemode, name)
        if not callable(obj):
            continue
        try:
            signature = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        assert "<object object at" not in signature, f"treemode.{name}{signature}"
    assert str(inspect.signature(treemode.split_rngs)).startswith("(node: 'Any' = NO_NODE,")
    assert "node: 'Any' = NO_NODE" in str(inspect.signature(treemode.fork_rngs))


def test_no_node_sentinel_is_one_object() -> None:
    assert repr(_rngs.NO_NODE) == "NO_NODE"
    assert pickle.loads(pickle.dumps(_rngs.NO_NODE)) is _rngs.NO_NODE
    # Without a node, split_rngs still returns a decorator.
    decorator = treemode.split_rngs(splits=2)
    assert callable(decorator)


def test_public_signatures_in_the_source_name_no_private_default() -> None:
    """The API page shows each default as written in the source: never a private name."""
    import ast
    import textwrap

    for name in [n for n in dir(treemode) if not n.startswith("_")]:
        obj = getattr(treemode, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        target = obj.__init__ if inspect.isclass(obj) else inspect.unwrap(obj)
        try:
            source = textwrap.dedent(inspect.getsource(target))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        node = tree.body[0]
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        for default in defaults:
            text = ast.unparse(default)
            assert not text.startswith("_"), f"treemode.{name}: default {text}"
