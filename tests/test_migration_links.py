"""Error messages point at sections of docs/migration.md that exist.

Errors raised for a graph-mode pattern that tree mode rejects end with a pointer
``See docs/migration.md#<anchor>.``; the section with that anchor shows the
pattern and its tree-mode form. These tests collect every pointer in treemode's
source, check that each anchor is defined in docs/migration.md (an explicit
``{#anchor}`` on a heading, or the heading's generated id), and trigger each
error to check that its message carries the pointer.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import treemode

ROOT = Path(__file__).resolve().parent.parent
MIGRATION = ROOT / "docs" / "migration.md"
POINTER = re.compile(r"docs/migration\.md#([A-Za-z0-9_-]+)")


def _slug(title: str) -> str:
    """The id Python-Markdown's toc extension gives a heading without ``{#id}``."""
    text = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def migration_anchors() -> set[str]:
    anchors: set[str] = set()
    for line in MIGRATION.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$", line)
        if m:
            anchors.add(m.group(2) or _slug(m.group(1)))
    return anchors


def source_pointers() -> dict[str, list[str]]:
    """anchor -> the treemode files whose messages point at it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "treemode").rglob("*.py")):
        for anchor in POINTER.findall(path.read_text(encoding="utf-8")):
            found.setdefault(anchor, []).append(path.name)
    return found


def test_every_pointer_in_treemode_names_an_existing_section() -> None:
    anchors, pointers = migration_anchors(), source_pointers()
    expected = {
        "structural-changes",
        "shared-variables",
        "stateaxes",
        "diffstate",
        "modelandoptimizer",
    }
    assert expected <= set(pointers), f"messages lost their pointers: {expected - set(pointers)}"
    missing = {a: files for a, files in pointers.items() if a not in anchors}
    assert not missing, f"docs/migration.md has no section for these pointers: {missing}"


def test_links_inside_the_guide_resolve() -> None:
    text = MIGRATION.read_text(encoding="utf-8")
    links = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert links, "the guide's overview links to its sections"
    assert not links - migration_anchors(), links - migration_anchors()


def test_anchor_collection_can_fail() -> None:
    assert "structural-changes" in migration_anchors()
    assert "no-such-section" not in migration_anchors()
    assert _slug("`transform_metadata=`") == "transform_metadata"


class _Model(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones(3))
        self.count = nnx.BatchStat(jnp.zeros(4))


def _set_attribute(model: _Model) -> None:
    model.extra = nnx.Cache(jnp.zeros(1))


class _HoldsParams(nnx.Pytree):
    def __init__(self, model: _Model) -> None:
        self.params = nnx.data(nnx.variables(model, nnx.Param))


def _structure() -> None:
    treemode.jit(_set_attribute)(_Model())


def _alias() -> None:
    model = _Model()
    treemode.jit(lambda m, o: None)(model, _HoldsParams(model))


def _owner_alias() -> None:
    model = _Model()
    treemode.jit(lambda m, o: None)(model, nnx.ModelAndOptimizer(model, optax.sgd(0.1)))


def _state_axes() -> None:
    axes = nnx.StateAxes({nnx.BatchStat: 0, ...: None})
    treemode.vmap(lambda m, x: x, in_axes=(axes, 0))(_Model(), jnp.ones((4, 3)))


def _diff_state() -> None:
    # grad reads a DiffState; an axis specification refuses it
    treemode.vmap(lambda m: m, in_axes=(nnx.DiffState(0, nnx.Param),))(_Model())


@pytest.mark.parametrize(
    "trigger, error, anchor",
    [
        (_structure, treemode.StructureError, "structural-changes"),
        (_alias, treemode.AliasError, "shared-variables"),
        (_owner_alias, treemode.AliasError, "modelandoptimizer"),
        (_state_axes, treemode.AxisError, "stateaxes"),
        (_diff_state, treemode.AxisError, "diffstate"),
    ],
    ids=["StructureError", "AliasError", "OwnerAliasError", "StateAxes", "DiffState"],
)
def test_error_points_at_its_section(trigger, error, anchor) -> None:
    with pytest.raises(error) as info:
        trigger()
    assert POINTER.findall(str(info.value)) == [anchor], str(info.value)
    assert anchor in migration_anchors()
