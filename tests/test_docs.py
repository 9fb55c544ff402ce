"""Every ```python block in the docs, the README and the public docstrings runs.

What is collected:

- every fenced block whose info string starts with ``python`` in ``docs/**/*.md``
  and ``README.md`` (test id ``docs/quickstart.md:42``, the line of the opening
  fence);
- every fenced ``python`` block in the docstring of each public name of
  ``treemode`` (``treemode.__all__`` or the names without a leading underscore)
  and of the public methods and properties of public classes (test id
  ``treemode.jit#1``, the block's position in that docstring).

Namespaces: each block runs on its own, in a fresh module namespace, exactly as
if it were pasted into a new Python file. Blocks therefore carry their own
imports and set-up, and a reader can copy any single block and run it. We chose
this over one namespace per page because a page's blocks are read (and copied)
one at a time, and because per-block isolation keeps a failure local to the
block that has it. Blocks of a page still run in page order when run serially.

Opting out: a block written as ```` ```python {.no-run} ```` is rendered like any
other block (the ``no-run`` becomes a CSS class) but is not executed. Use it only
for fragments that cannot run on this machine (for example code for a real TPU
pod); never for an example that claims a behaviour. A block whose info string
is anything but ``python`` (``py``, ``pycon``, ``text``, ``bash``) is not Python
in the sense of this collector and is not executed either.

Each block should ``assert`` what the surrounding text claims, so that a
behaviour change breaks the docs test instead of silently making the docs wrong.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import treemode

ROOT = Path(__file__).resolve().parent.parent

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, what it says, whether it runs."""

    id: str
    filename: str
    line: int  # 1-based line of the first code line in ``filename`` (0 if unknown)
    code: str
    run: bool


def _info_is_python(info: str) -> tuple[bool, bool]:
    """``(is python, is opted out)`` for a fence info string."""
    info = info.strip()
    words = info.split(None, 1)
    if not words:
        return False, False
    lang = words[0].lstrip(".").lower()
    if lang.startswith("{"):
        # ``{.python .no-run}`` attribute-list style.
        classes = [w.lstrip("{.").rstrip("}") for w in info.split()]
        return "python" in classes, "no-run" in classes
    rest = words[1] if len(words) > 1 else ""
    return lang == "python", bool(re.search(r"(^|[\s{.])no-run\b", rest))


def extract_blocks(text: str) -> Iterator[tuple[int, str, bool]]:
    """``(line of the opening fence, dedented code, runs)`` for each python block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info")
        start = i
        i += 1
        body: list[str] = []
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while i < len(lines) and not closing.match(lines[i]):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1  # the closing fence
        is_python, opted_out = _info_is_python(info)
        if is_python:
            yield start + 1, "\n".join(body) + "\n", not opted_out


def _markdown_files() -> list[Path]:
    files = sorted((ROOT / "docs").rglob("*.md"))
    readme = ROOT / "README.md"
    if readme.exists():
        files.insert(0, readme)
    return files


def markdown_blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in _markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, code, run in extract_blocks(path.read_text(encoding="utf-8")):
            blocks.append(Block(f"{rel}:{line}", str(path), line + 1, code, run))
    return blocks


def public_objects() -> list[tuple[str, object]]:
    """``(qualified name, object)`` for every documented public object of treemode."""
    names = getattr(treemode, "__all__", None)
    if names is None:
        names = [n for n in vars(treemode) if not n.startswith("_")]
    seen: set[int] = set()
    out: list[tuple[str, object]] = []

    def add(qualname: str, obj: object) -> None:
        if id(obj) in seen or isinstance(obj, types.ModuleType):
            return
        seen.add(id(obj))
        out.append((qualname, obj))

    for name in sorted(names):
        obj = getattr(treemode, name)
        add(f"treemode.{name}", obj)
        if inspect.isclass(obj) and obj.__module__.startswith("treemode"):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr != "__call__":
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) or isinstance(member, property):
                    add(f"treemode.{name}.{attr}", member)
    return out


def docstring_blocks() -> list[Block]:
    blocks: list[Block] = []
    for qualname, obj in public_objects():
        doc = inspect.getdoc(obj) if not isinstance(obj, property) else obj.__doc__
        if not doc or (obj.__doc__ is None and not isinstance(obj, property)):
            continue
        doc = inspect.cleandoc(doc)
        try:
            filename = inspect.getsourcefile(obj.fget if isinstance(obj, property) else obj)  # type: ignore[arg-type]
        except TypeError:
            filename = None
        for k, (_, code, run) in enumerate(extract_blocks(doc), start=1):
            blocks.append(Block(f"{qualname}#{k}", filename or qualname, 0, code, run))
    return blocks


def run_block(block: Block) -> None:
    """Execute ``block`` in a fresh module, with tracebacks pointing at its source."""
    name = "treemode_docs_block"
    module = types.ModuleType(name)
    module.__file__ = block.filename
    sys.modules[name] = module  # dataclasses / Equinox look classes' modules up here
    # Pad so that traceback line numbers are the line numbers in the markdown file.
    source = "\n" * max(block.line - 1, 0) + block.code
    try:
        exec(compile(source, block.filename, "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)


_MARKDOWN = markdown_blocks()
_DOCSTRINGS = docstring_blocks()


@pytest.mark.parametrize("block", _MARKDOWN, ids=[b.id for b in _MARKDOWN])
def test_markdown_block(block: Block) -> None:
    if not block.run:
        # Opted out with ```python {.no-run}: only check that it is valid Python.
        compile(block.code, block.id, "exec")
        return
    run_block(block)


@pytest.mark.parametrize("block", _DOCSTRINGS, ids=[b.id for b in _DOCSTRINGS])
def test_docstring_block(block: Block) -> None:
    if not block.run:
        compile(block.code, block.id, "exec")
        return
    run_block(block)


def test_every_public_function_has_a_runnable_example() -> None:
    """Public functions document themselves with an executed example."""
    with_example = {b.id.split("#")[0] for b in _DOCSTRINGS if b.run}
    missing = [
        qualname
        for qualname, obj in public_objects()
        if qualname.count(".") == 1 and inspect.isfunction(obj) and qualname not in with_example
    ]
    assert not missing, (
        "these public functions have no ```python example in their docstring: " + ", ".join(missing)
    )


def test_extract_blocks_rules() -> None:
    """The collector's own rules: languages, opt-out marker, indentation, line numbers."""
    text = "\n".join(
        [
            "intro",  # 1
            "```python",  # 2
            "x = 1",  # 3
            "```",  # 4
            "```bash",  # 5
            "make test",  # 6
            "```",  # 7
            "```python {.no-run}",  # 8
            "tpu_only()",  # 9
            "```",  # 10
            "- item",  # 11
            "    ```python",  # 12
            "    y = 2",  # 13
            "    ```",  # 14
            "````python",  # 15
            "s = '''",  # 16
            "```",  # 17
            "'''",  # 18
            "````",  # 19
        ]
    )
    got = list(extract_blocks(text))
    assert got == [
        (2, "x = 1\n", True),
        (8, "tpu_only()\n", False),
        (12, "y = 2\n", True),
        (15, "s = '''\n```\n'''\n", True),
    ]


def test_api_reference_lists_every_public_name() -> None:
    """docs/api.md has a ``::: treemode.NAME`` entry for every public name."""
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: treemode\.(\w+)", api, flags=re.MULTILINE))
    names = getattr(treemode, "__all__", None) or [
        n for n in vars(treemode) if not n.startswith("_")
    ]
    public = {n for n in names if not isinstance(getattr(treemode, n), types.ModuleType)}
    missing = sorted(public - documented)
    assert not missing, f"add these to docs/api.md: {missing}"


def test_errors_page_covers_every_error_class() -> None:
    """docs/errors.md has a section per error class, with an example that raises it."""
    from treemode import _errors

    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    sections = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^## `(\w+)`\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S)
    }
    assert len(sections) >= 2, "docs/errors.md sections are headed ## `ErrorName`"
    missing = sorted(set(_errors.__all__) - set(sections))
    assert not missing, f"add a section to docs/errors.md for: {missing}"
    for name, body in sections.items():
        if name == "TreemodeError":
            continue
        codes = [code for _, code, run in extract_blocks(body) if run]
        assert any(f"treemode.{name}" in code for code in codes), (
            f"the {name} section of docs/errors.md needs a runnable example that triggers it"
        )
        assert "**Fix.**" in body, f"the {name} section of docs/errors.md needs a **Fix.**"


_RST_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`")


def test_docstrings_use_markdown_not_rst_roles() -> None:
    """mkdocstrings renders RST roles (``:func:`x` ``) literally: use backticks."""
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "treemode").glob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if _RST_ROLE.search(line)
    ]
    assert not offenders, "replace RST roles with `backticks` in: " + ", ".join(offenders)
