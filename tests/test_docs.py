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

Shown output: a fenced block with the language ``output`` right after a python
block (only blank lines between them) is what that block prints. The test runs
the block with its standard output captured and fails if the printed text,
normalized (memory addresses become ``0x...``, paths inside this checkout become
relative, site-packages paths start at ``site-packages/``), differs from the
shown text. docs/errors.md uses it to show each error's full message. After a
message changes, regenerate every shown output (and the generated tables, see
``test_generated_sections_are_current``) with

    UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py -q

(``make docs-update``), which rewrites the output blocks in place instead of
failing; review the diff and commit it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fcntl
import importlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import treemode

ROOT = Path(__file__).resolve().parent.parent
UPDATE = bool(os.environ.get("UPDATE_DOCS"))

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, what it says, whether it runs."""

    id: str
    filename: str
    line: int  # 1-based line of the first code line in ``filename`` (0 if unknown)
    code: str
    run: bool
    output: str | None = None  # the text of the ```output block that follows, if any


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


def _fences(text: str) -> Iterator[tuple[int, int, str, list[str]]]:
    """``(index of the opening fence, index of the closing fence, info, dedented body)``."""
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
        yield start, i, info, body
        i += 1  # the closing fence


def extract_blocks(text: str) -> Iterator[tuple[int, str, bool]]:
    """``(line of the opening fence, dedented code, runs)`` for each python block."""
    for start, _, info, body in _fences(text):
        is_python, opted_out = _info_is_python(info)
        if is_python:
            yield start + 1, "\n".join(body) + "\n", not opted_out


def extract_outputs(text: str) -> dict[int, tuple[int, int, str]]:
    """For each python block followed by an ```output block: the python block's fence
    line (as in `extract_blocks`) -> ``(output fence index, its closing index, text)``."""
    lines = text.splitlines()
    fences = list(_fences(text))
    found: dict[int, tuple[int, int, str]] = {}
    for (start, end, info, _), (o_start, o_end, o_info, o_body) in zip(
        fences, fences[1:], strict=False
    ):
        between = lines[end + 1 : o_start]
        if (
            _info_is_python(info)[0]
            and o_info.split(None, 1)[:1] == ["output"]
            and all(not line.strip() for line in between)
        ):
            found[start + 1] = (o_start, o_end, "\n".join(o_body))
    return found


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
        text = path.read_text(encoding="utf-8")
        outputs = extract_outputs(text)
        for line, code, run in extract_blocks(text):
            output = outputs[line][2] if line in outputs else None
            blocks.append(Block(f"{rel}:{line}", str(path), line + 1, code, run, output))
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


def run_block(block: Block) -> str:
    """Execute ``block`` in a fresh module, with tracebacks pointing at its source.

    Returns what the block printed when it has an ```output block (its standard
    output is captured then), else ``""``.
    """
    name = "treemode_docs_block"
    module = types.ModuleType(name)
    module.__file__ = block.filename
    sys.modules[name] = module  # dataclasses / Equinox look classes' modules up here
    # Pad so that traceback line numbers are the line numbers in the markdown file.
    source = "\n" * max(block.line - 1, 0) + block.code
    printed = io.StringIO()
    capture = contextlib.redirect_stdout(printed) if block.output is not None else None
    try:
        with capture or contextlib.nullcontext():
            exec(compile(source, block.filename, "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return printed.getvalue()


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_SITE_PACKAGES = re.compile(r"(?:[A-Za-z]:)?[^\s'\"()]*[/\\]site-packages[/\\]")


def normalize_output(text: str) -> str:
    """What an ```output block shows of ``text``: no memory addresses, no machine paths,
    no trailing spaces."""
    text = text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")
    text = _SITE_PACKAGES.sub("site-packages/", text)
    text = _ADDRESS.sub("0x...", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize rewrites of one page between pytest-xdist workers."""
    name = re.sub(r"\W", "_", str(path))
    with open(Path(tempfile.gettempdir()) / f"treemode-docs-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def rewrite_output(block: Block, printed: str) -> None:
    """Replace the ```output block after ``block`` in its page with ``printed``."""
    path = Path(block.filename)
    with _locked(path):
        text = path.read_text(encoding="utf-8")
        outputs = extract_outputs(text)
        # Other blocks' outputs may have been rewritten since collection, shifting lines:
        # find this block by its code, nearest to where it was.
        candidates = [line for line, code, _ in extract_blocks(text) if code == block.code]
        candidates = [line for line in candidates if line in outputs]
        assert candidates, f"{block.id}: its ```output block is gone"
        fence = min(candidates, key=lambda line: abs(line + 1 - block.line))
        o_start, o_end, _ = outputs[fence]
        lines = text.splitlines(keepends=True)
        indent = re.match(r"[ \t]*", lines[o_start]).group(0)  # type: ignore[union-attr]
        body = [f"{indent}{line}".rstrip() + "\n" for line in printed.splitlines()]
        lines[o_start + 1 : o_end] = body
        path.write_text("".join(lines), encoding="utf-8")


def check_output(block: Block, printed: str) -> None:
    """The shown output of ``block`` is what it printed (or is rewritten, with UPDATE_DOCS)."""
    assert block.output is not None
    got, shown = normalize_output(printed), normalize_output(block.output)
    if got == shown:
        return
    if UPDATE:
        rewrite_output(block, got)
        return
    diff = "\n".join(
        difflib.unified_diff(
            shown.splitlines(), got.splitlines(), "shown", "printed now", lineterm=""
        )
    )
    raise AssertionError(
        f"{block.id}: the ```output block after this example differs from what it prints "
        f"now. Regenerate with `UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py` "
        f"(make docs-update) and review the diff.\n{diff}"
    )


_MARKDOWN = markdown_blocks()
_DOCSTRINGS = docstring_blocks()


@pytest.mark.parametrize("block", _MARKDOWN, ids=[b.id for b in _MARKDOWN])
def test_markdown_block(block: Block) -> None:
    if not block.run:
        # Opted out with ```python {.no-run}: only check that it is valid Python.
        compile(block.code, block.id, "exec")
        assert block.output is None, f"{block.id}: a block that is not run shows no output"
        return
    if "nnx.prefix(" in block.code and not hasattr(importlib.import_module("flax.nnx"), "prefix"):
        # A Flax API that the installed (older, supported) Flax does not have yet.
        compile(block.code, block.id, "exec")
        pytest.skip("this Flax has no nnx.prefix (the block shows how treemode reads it)")
    printed = run_block(block)
    if block.output is not None:
        check_output(block, printed)


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
    """docs/errors.md has a section per error class, with an example that raises it and
    the full message it prints."""
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
        shown = [text for _, _, text in extract_outputs(body).values()]
        assert any(text.startswith(f"{name}: ") for text in shown), (
            f"the {name} section of docs/errors.md needs an ```output block after its example "
            f'that shows the full message (print(f"{{type(e).__name__}}: {{e}}"))'
        )


_RST_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`")


def test_docstrings_use_markdown_not_rst_roles() -> None:
    """mkdocstrings renders RST roles (``:func:`x` ``) literally: use backticks."""
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "treemode").rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if _RST_ROLE.search(line)
    ]
    assert not offenders, "replace RST roles with `backticks` in: " + ", ".join(offenders)


# Generated sections: text between ``<!-- generated:NAME -->`` and ``<!-- generated:end -->``
# in a page is made by ``_GENERATORS[NAME]()`` and checked (or rewritten, with UPDATE_DOCS).
_GENERATED = re.compile(
    r"(?P<open><!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- generated:end -->)",
    flags=re.S,
)
_RESULTS = ROOT / "benchmarks" / "results" / "results.json"
_DISPATCH_PEERS = ["treemode.jit", "nnx.jit(graph=False)", "nnx.jit_partial"]


def dispatch_table() -> str:
    """The dispatch comparison of docs/choosing.md, from the last `make bench` run."""
    data = json.loads(_RESULTS.read_text(encoding="utf-8"))
    run, table = data["_run"], data["dispatch_median"]
    header = ["case", "`jax.jit`, flat tuple", *(f"`{peer}`" for peer in _DISPATCH_PEERS)]
    lines = [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for case, us in table["us"].items():
        floor = us[table["floor"]]
        cells = [f"{floor:.0f} µs"]
        cells += [f"{us[peer]:.0f} µs ({us[peer] / floor:.2f}×)" for peer in _DISPATCH_PEERS]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"*Time per call ({table['stat']} sample), and its ratio to the floor. Measured by "
        f"`make bench` on {run['date']}: {run['environment']}; from "
        "`benchmarks/results/results.json` (`dispatch_median`).*"
    )
    return "\n".join(lines) + "\n"


_GENERATORS = {"dispatch": dispatch_table}


def test_generated_sections_are_current() -> None:
    """Every generated section of the docs matches what its generator makes now."""
    stale: list[str] = []
    for path in _markdown_files():
        text = path.read_text(encoding="utf-8")

        def regenerate(m: re.Match[str], path: Path = path) -> str:
            name = m.group("name")
            assert name in _GENERATORS, f"{path}: unknown generated section {name!r}"
            body = _GENERATORS[name]()
            if body != m.group("body"):
                stale.append(f"{path.relative_to(ROOT)} ({name})")
            return m.group("open") + body + m.group("close")

        new = _GENERATED.sub(regenerate, text)
        if UPDATE and new != text:
            with _locked(path):
                path.write_text(new, encoding="utf-8")
    if not UPDATE:
        assert not stale, (
            "generated sections are out of date: " + ", ".join(stale) + "; regenerate with "
            "`UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py` (make docs-update)"
        )


def test_extract_outputs_and_normalize() -> None:
    """An ```output block belongs to the python block right before it; output is normalized."""
    text = "\n".join(
        [
            "```python",  # 1
            "print(1)",  # 2
            "```",  # 3
            "",  # 4
            "```output",  # 5
            "1",  # 6
            "```",  # 7
            "```python",  # 8
            "print(2)",  # 9
            "```",  # 10
            "text between",  # 11
            "```output",  # 12
            "2",  # 13
            "```",  # 14
        ]
    )
    assert extract_outputs(text) == {1: (4, 6, "1")}
    page = ROOT / "docs" / "x.md"
    raw = f"<function f at 0x7f3a2b1c0d40> in {page}  \n/usr/lib/site-packages/jax/a.py\n"
    assert normalize_output(raw) == "<function f at 0x...> in docs/x.md\nsite-packages/jax/a.py"


# The longest code line that fits the article column of the site at 1280 px (measured
# with tools/check_layout.py: 86 characters scroll by a few pixels, with a classic
# scrollbar).
CODE_LINE_LIMIT = 84


def test_code_blocks_fit_the_page() -> None:
    """Code blocks of the site's pages need no sideways scrolling at 1280 px.

    ```output blocks are exempt: they wrap (docs/stylesheets/extra.css).
    """
    long_lines = [
        f"{path.relative_to(ROOT)}:{start + 2 + k} ({len(line)} characters)"
        for path in sorted((ROOT / "docs").rglob("*.md"))
        for start, _, info, body in _fences(path.read_text(encoding="utf-8"))
        if info.split(None, 1)[:1] != ["output"]
        for k, line in enumerate(body)
        if len(line) > CODE_LINE_LIMIT
    ]
    assert not long_lines, (
        f"wrap these code lines to {CODE_LINE_LIMIT} characters (they scroll sideways at "
        "1280 px): " + ", ".join(long_lines)
    )


def _mkdocs_config() -> dict:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may use !!python/name tags (Material's emoji); read them as strings.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def test_site_config_links_out_and_searches_dotted_names() -> None:
    """repo_url is set, the API page shows one signature per name (no overloads with
    ``= ...`` defaults), and the search splits dotted names into their parts."""
    config = _mkdocs_config()
    assert config["repo_url"].startswith("https://")
    plugins = {next(iter(p)) if isinstance(p, dict) else p: p for p in config["plugins"]}
    options = plugins["mkdocstrings"]["mkdocstrings"]["handlers"]["python"]["options"]
    assert options["show_overloads"] is False
    separator = plugins["search"]["search"]["separator"]
    words = [w for w in re.split(separator, "treemode.jit(f) nnx.Rngs jax.random.key") if w]
    for part in ("treemode", "jit", "nnx", "Rngs", "random", "key"):
        assert part in words, (part, words)
    assert "3.14" in [w for w in re.split(separator, "pi is 3.14.") if w]  # numbers stay whole
    nav = json.dumps(config["nav"])
    assert "guides/checkpointing.md" in nav


def test_flip_5310_is_linked_wherever_it_is_named() -> None:
    """Every mention of FLIP 5310 in the docs' prose is a link to the FLIP."""
    unlinked = []
    for path in _markdown_files():
        text = path.read_text()
        if "<!-- results:begin -->" in text:
            text = text.split("<!-- results:begin -->")[0]
        prose = re.sub(r"^(`{3,}|~{3,}).*?^\1", "", text, flags=re.S | re.M)
        for m in re.finditer(r"FLIP 5310", prose):
            before = prose[: m.start()]
            if not (before.endswith("[") and prose[m.end() :].startswith("](http")):
                unlinked.append(f"{path.relative_to(ROOT)}: ...{prose[m.start() - 40 : m.end()]}")
    assert not unlinked, unlinked


# -- What the public docstrings claim about donation, closures and caching ----------
#
# `help(treemode.jit)` is read as often as the guides, so it must state each rule as
# the guides do. A rule is checked in a form a test can decide: the guide states it
# in its words (`guide_says`, so that a new rule in the guide fails here until the
# docstrings follow); the docstrings that state it say so (`must`, per public
# object); and no public docstring, no doc page and no README line keeps a retired
# wording of an old rule (`retired`). Text is compared with its whitespace and
# Markdown emphasis collapsed, so line breaks do not matter.


@dataclasses.dataclass(frozen=True)
class DocRule:
    topic: str
    guide: str  # the page of docs/ that states the rule
    guide_says: tuple[str, ...]
    must: dict[str, tuple[str, ...]]  # public object -> phrases its docstring holds
    retired: tuple[str, ...] = ()


DOC_RULES = [
    DocRule(
        "donation by effect",
        "guides/jit.md",
        (
            "a donated argument donates exactly what the function writes: the buffers "
            "of the Variables it changes",
            "A donated model's read-only Variables keep their buffers: they are passed undonated",
        ),
        {
            "treemode.jit": (
                "donates the buffers of the Variables the function writes",
                "its read-only Variables are passed undonated and keep their buffers",
            ),
        },
        retired=(
            "Their Variables are refreshed with the output buffers",
            "every Variable of a donated argument is donated",
        ),
    ),
    DocRule(
        "closures are read fresh",
        "concepts.md",
        (
            "Reads see the current values on every call (never a stale constant baked "
            "into the compiled code) and writes are written back",
        ),
        {
            "treemode.jit": (
                "reaches through its closure",
                "read fresh on every call",
                "written back",
            ),
        },
        retired=("closed-over modules are constants of the compiled code",),
    ),
    DocRule(
        "caching: one trace per call structure",
        "guides/jit.md",
        (
            "A call compiles a new version exactly when something the compiled code "
            "depends on, other than array values, is new",
        ),
        {
            "treemode.jit": ("traced and compiled once per call structure", "traces again"),
            "treemode.clear_caches": ("the next call of each transform traces again",),
        },
    ),
]


def _flat(text: str) -> str:
    return " ".join(text.replace("**", "").replace("`", "").split())


def _public_docstrings() -> dict[str, str]:
    out = {}
    for qualname, obj in public_objects():
        doc = inspect.getdoc(obj) if not isinstance(obj, property) else obj.__doc__
        out[qualname] = _flat(doc or "")
    return out


@pytest.mark.parametrize("rule", DOC_RULES, ids=lambda r: r.topic)
def test_docstrings_state_the_rules_of_the_guides(rule: DocRule) -> None:
    guide = _flat((ROOT / "docs" / rule.guide).read_text(encoding="utf-8"))
    for phrase in rule.guide_says:
        assert _flat(phrase) in guide, (
            f"docs/{rule.guide} no longer says {phrase!r}: update DOC_RULES and the "
            "docstrings that state the rule"
        )
    docs = _public_docstrings()
    for qualname, phrases in rule.must.items():
        for phrase in phrases:
            assert _flat(phrase) in docs[qualname], (
                f"help({qualname}) must state {rule.topic} as docs/{rule.guide} does: "
                f"missing {phrase!r}"
            )
    pages = {
        str(p.relative_to(ROOT)): _flat(p.read_text(encoding="utf-8")) for p in _markdown_files()
    }
    for phrase in rule.retired:
        stale = [name for name, text in {**docs, **pages}.items() if _flat(phrase) in text]
        assert not stale, f"retired wording {phrase!r} ({rule.topic}) still in {stale}"


def test_doc_rules_can_fail() -> None:
    """The retired wording really was in help(treemode.jit) (the check would have
    found it), and `_flat` ignores line breaks and emphasis."""
    old = (
        "arguments whose buffers XLA may reuse.\n      Their Variables are refreshed with "
        "the output buffers, so the modules stay\n      usable."
    )
    assert _flat(DOC_RULES[0].retired[0]) in _flat(old)
    assert _flat("**a donated argument\ndonates exactly**") == "a donated argument donates exactly"
