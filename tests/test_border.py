"""The C/Python border is defined once, in ``treemode/_accel/_border.py``.

``tools/gen_border.py`` generates the C header ``_border.h`` and the stub
``_guard.pyi`` from it: both committed files must be what it generates now, and
the built module must expose what the stub and the border name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from treemode._accel import _border, _compiled

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gen_border", ROOT / "tools/gen_border.py")
assert _spec is not None and _spec.loader is not None
gen_border = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_border)

try:
    COMPILED = importlib.import_module("treemode._accel._guard")
except ImportError:  # pragma: no cover - a build without a C compiler
    COMPILED = None


def test_the_header_is_generated_from_the_border():
    assert (ROOT / "treemode/_accel/_border.h").read_text() == gen_border.header(), (
        "treemode/_accel/_border.h is out of date: run python tools/gen_border.py"
    )


def test_the_stub_is_generated_from_the_border():
    assert (ROOT / "treemode/_accel/_guard.pyi").read_text() == gen_border.stub(), (
        "treemode/_accel/_guard.pyi is out of date: run python tools/gen_border.py"
    )


def test_every_structure_has_distinct_named_fields():
    for prefix, fields in _border.STRUCTURES.items():
        assert fields and len(set(fields)) == len(fields), prefix
        assert all(name.isidentifier() for name in fields), prefix
    assert not hasattr(_compiled, "RECORD_VERSION")  # one definition, in _border


def test_the_builders_follow_the_field_order():
    def order(fn):
        return tuple(inspect.signature(fn).parameters)

    assert order(_border.closure_reads) == _border.CLOSURE_READS_FIELDS
    assert order(_border.cell_read) == _border.CELL_READ_FIELDS
    assert order(_border.attribute_read) == _border.ATTRIBUTE_READ_FIELDS
    assert order(_border.hold_plan) == _border.HOLD_PLAN_FIELDS
    assert order(_border.signal_swap) == _border.SIGNAL_SWAP_FIELDS
    assert order(_border.entry_result) == _border.ENTRY_RESULT_FIELDS
    fields = _border.CLOSURE_READS_FIELDS
    assert _border.closure_reads(*fields) == fields


@pytest.mark.skipif(COMPILED is None, reason="the C extension is not built")
def test_the_built_module_matches_the_border_and_the_stub():
    assert COMPILED is not None
    assert COMPILED.RECORD_VERSION == _border.RECORD_VERSION
    assert COMPILED.RECORD_FIELDS == _border.RECORD_FIELDS
    assert COMPILED.CONFIGURE_FIELDS == _border.CONFIGURE_FIELDS
    assert COMPILED.GUARD_STATE_FIELDS == _border.GUARD_STATE_FIELDS
    stub = ast.parse((ROOT / "treemode/_accel/_guard.pyi").read_text())
    public = {n for n in dir(COMPILED) if not n.startswith("__")}
    named: set[str] = set()
    for node in stub.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            named.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            named.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members = [
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            ]
            cls = getattr(COMPILED, node.name)
            assert all(hasattr(cls, m) for m in members), node.name
            if node.name == "FastRecord":
                assert ("version", *members) == _border.RECORD_FIELDS
            if node.name == "Guarded":
                assert tuple(members) == _border.GUARDED_FIELDS
    assert named == public, named ^ public
