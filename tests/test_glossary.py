"""The glossary of docs/contributing.md, kept true of the code.

One word per idea: every name the glossary gives exists in the package; no
identifier (Python or C) uses a retired word; an identifier naming a record
names the fast-path record; no two classes share a name; each pipeline
module's docstring numbers its step as the pipeline list does.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "treemode"
CONTRIBUTING = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
PY_FILES = sorted(PACKAGE.rglob("*.py"))
C_FILES = sorted([*PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")])

# What a Python identifier with "record" in it may be: the fast-path record, its
# module-level names and the attributes that hold records.
RECORD_NAMES = {
    "FastRecord",
    "Record",  # its Python twin (_pipeline/_executor.py)
    "RECORDS_BOUND",
    "_record_of",
    "_executor_record",
    "fast_record",
    "record",
    "records",
    "_record",
    "_records",
    "RECORD_VERSION",
    "RECORD_FIELDS",
    "RECORD",  # the prefix of the record's generated C names (_border.STRUCTURES)
}


def _section(title: str) -> str:
    start = CONTRIBUTING.index(f"## {title}\n")
    end = CONTRIBUTING.find("\n## ", start + 1)
    return CONTRIBUTING[start : end if end >= 0 else None]


GLOSSARY = _section("Glossary")


def _glossary_names() -> list[str]:
    names = []
    for line in GLOSSARY.splitlines():
        if not line.startswith("| ") or line.startswith("| term"):
            continue
        code_column = line.rstrip(" |").rsplit(" | ", 1)[-1]
        names += re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", code_column)
    return names


def _retired() -> tuple[list[str], list[str]]:
    """(retired words, retired names) as the glossary lists them."""
    paragraph = GLOSSARY[GLOSSARY.index("Retired words") :].split("\n\n")[0]
    words = re.findall(r"\*\*([a-z]+)\*\*", paragraph)
    names = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", paragraph)
    return words, names


def _python_identifiers(path: Path) -> set[str]:
    """The names a module binds or reads: definitions, arguments, names, attributes."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add((node.asname or node.name).rsplit(".", 1)[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # __slots__ entries and __all__ names are identifiers too.
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", node.value):
                found.add(node.value)
    return found


def _c_identifiers(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # comments
    text = re.sub(r'"(?:\\.|[^"\\])*"', " ", text)  # string literals (messages, docstrings)
    return set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", text))


PY_IDENTIFIERS = {path: _python_identifiers(path) for path in PY_FILES}
C_IDENTIFIERS = {path: _c_identifiers(path) for path in C_FILES}
ALL_IDENTIFIERS = set().union(*PY_IDENTIFIERS.values(), *C_IDENTIFIERS.values())


def test_the_glossary_names_things_that_exist():
    names = _glossary_names()
    assert len(names) > 30  # the table was read
    missing = [n for n in names if n not in ALL_IDENTIFIERS]
    assert not missing, f"the glossary names what the code does not have: {missing}"


def test_no_identifier_uses_a_retired_word():
    words, names = _retired()
    assert "layout" in words and "write_all" in names  # the paragraph was read
    offenders = []
    for path, identifiers in [*PY_IDENTIFIERS.items(), *C_IDENTIFIERS.items()]:
        for identifier in sorted(identifiers):
            lowered = identifier.lower()
            if identifier in names or any(word in lowered for word in words):
                offenders.append(f"{path.relative_to(ROOT)}: {identifier}")
    assert not offenders, "retired words (docs/contributing.md#glossary):\n" + "\n".join(offenders)


def test_record_means_the_fast_path_record():
    offenders = [
        f"{path.relative_to(ROOT)}: {identifier}"
        for path, identifiers in PY_IDENTIFIERS.items()
        for identifier in sorted(identifiers)
        if "record" in identifier.lower() and identifier not in RECORD_NAMES
    ]
    assert not offenders, "a record that is not the fast-path record:\n" + "\n".join(offenders)


def test_no_two_classes_share_a_name():
    classes = Counter(
        node.name
        for path in PY_FILES
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
    )
    assert not [name for name, n in classes.items() if n > 1]


def _pipeline_steps() -> dict[str, int]:
    """Module path -> step number, from the numbered list of "The pipeline"."""
    steps = {}
    for match in re.finditer(
        r"^(\d)\. \*\*[^*]+\*\*[^`]*`(treemode/[\w/]+\.py)`", _section("The pipeline"), flags=re.M
    ):
        steps.setdefault(match.group(2), int(match.group(1)))
    return steps


def test_the_pipeline_list_is_read():
    steps = _pipeline_steps()
    assert steps["treemode/_pipeline/_call.py"] == 1
    assert steps["treemode/_pipeline/_writeback.py"] == 5
    assert len(steps) >= 5


@pytest.mark.parametrize("module, step", sorted(_pipeline_steps().items()))
def test_each_pipeline_module_numbers_its_step_as_the_docs_do(module, step):
    docstring = ast.get_docstring(ast.parse((ROOT / module).read_text(encoding="utf-8"))) or ""
    numbers = {int(n) for n in re.findall(r"\bsteps? (\d)\b", docstring.split("\n\n")[0])}
    assert numbers and step in numbers, (
        f"{module}'s docstring should say it is step {step} of the pipeline"
    )
