"""The package's layers: no module imports upward, none re-exports another's names.

treemode's modules sit in layers, bottom first (docs/contributing.md, "Layers"):

- the top level of ``treemode/``: the foundations (errors, the Flax/JAX
  compatibility checks, the supported versions, the caches registry) and the
  public surface ``treemode/__init__.py``, which sits above everything;
- ``_accel``: the optional compiled extension and its one import site;
- ``_tree``: trees of objects (leaves, paths, specs, flattening, graphs,
  closure search, the Pytree proxy);
- ``_pipeline``: one transform call (prepare, the pure function, run, explain,
  write back, the trace caches);
- ``_transforms``: what is special about each JAX transform;
- ``_helpers``: user helpers (capture, clone, rngs, filters).

A module's layer is the subpackage it sits in. A module may import modules of
its own layer or of a lower one, never of a higher one; function-level and
``TYPE_CHECKING`` imports count. A name is imported from the module that
defines it: no module inside the package is a re-export hub (only
``treemode/__init__.py``, the public surface, re-exports).
"""

from __future__ import annotations

import ast
import pathlib

import treemode

PACKAGE = pathlib.Path(treemode.__file__).parent
ORDER = ["", "_accel", "_tree", "_pipeline", "_transforms", "_helpers"]  # "" = the top level
PUBLIC = "treemode"
FOUNDATIONS = {"_errors", "_compat", "_versions", "_caches"}
MAX_TOP_LEVEL = 12
EXTENSION = "_guard"  # the compiled extension's module name, in the `_accel` layer

# The layer of each module while the package is still flat (a module at the top level that
# is not a foundation). The re-layout moves every one of these into its subpackage, whose
# name then gives the layer, and empties this table.
_FLAT_LAYERS: dict[str, str] = {}

# What the flat layout still does that the re-layout removes (it empties both sets):
# (importer, imported) pairs that import upward, and (importer, hub, name) imports through
# a module that does not define the name.
_KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()
_KNOWN_HUBS: frozenset[str] = frozenset()


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES or name.rsplit(".", 1)[-1] == EXTENSION


def layer(module: str) -> int:
    """The index of ``module``'s layer in `ORDER` (the public surface is above all)."""
    if module == PUBLIC:
        return len(ORDER)
    parts = module.split(".")
    if len(parts) > 2:
        return ORDER.index(parts[1])
    name = parts[1]
    if name in _FLAT_LAYERS:
        return ORDER.index(_FLAT_LAYERS[name])
    if name in ORDER:  # a subpackage's __init__
        return ORDER.index(name)
    return 0


def _layer_name(module: str) -> str:
    i = layer(module)
    return "the public surface" if i == len(ORDER) else f"layer {ORDER[i] or 'top level'!r}"


def _package_of(module: str) -> list[str]:
    path = MODULES[module]
    parts = module.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def _from_module(module: str, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = _package_of(module)
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``module``."""
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            frm = _from_module(module, node)
            if not frm or not (frm == PUBLIC or frm.startswith(PUBLIC + ".")):
                continue
            for alias in node.names:
                sub = f"{frm}.{alias.name}"
                if _is_module(sub):
                    out.append((sub, None, node.lineno))
                else:
                    out.append((frm, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PUBLIC + "."):
                    out.append((alias.name, None, node.lineno))
    return out


def _definitions(module: str) -> tuple[set[str], dict[str, str]]:
    """The names ``module`` defines at module level, and those it imports from another
    treemode module (name -> that module), ``x = _mod.x`` aliases included."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    defined: set[str] = set()
    imported: dict[str, str] = {}
    local_modules: dict[str, str] = {}

    def visit(body: list[ast.stmt]) -> None:
        for s in body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(s.name)
            elif isinstance(s, ast.ImportFrom):
                frm = _from_module(module, s)
                ours = bool(frm) and (frm == PUBLIC or str(frm).startswith(PUBLIC + "."))
                for alias in s.names:
                    local = alias.asname or alias.name
                    if ours and _is_module(f"{frm}.{alias.name}"):
                        local_modules[local] = f"{frm}.{alias.name}"
                    elif ours:
                        imported[local] = str(frm)
                    else:
                        defined.add(local)
            elif isinstance(s, ast.Import):
                for alias in s.names:
                    defined.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                value = s.value
                for t in targets:
                    for n in ast.walk(t):
                        if not isinstance(n, ast.Name):
                            continue
                        if (
                            isinstance(value, ast.Attribute)
                            and isinstance(value.value, ast.Name)
                            and value.value.id in local_modules
                            and value.attr == n.id
                        ):
                            imported[n.id] = local_modules[value.value.id]
                        else:
                            defined.add(n.id)
            elif isinstance(s, (ast.If, ast.Try)):
                visit(s.body)
                visit(s.orelse)
                if isinstance(s, ast.Try):
                    for h in s.handlers:
                        visit(h.body)
                    visit(s.finalbody)
            elif isinstance(s, (ast.For, ast.With)):
                for n in ast.walk(s.target if isinstance(s, ast.For) else s):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        defined.add(n.id)
                visit(s.body)

    visit(tree.body)
    return defined, imported


def test_no_module_imports_a_higher_layer():
    upward = []
    for module in MODULES:
        for imported, _, line in _imports(module):
            if imported == module or not (imported in MODULES or _is_module(imported)):
                continue
            if layer(imported) > layer(module) and (module, imported) not in _KNOWN_UPWARD:
                upward.append(
                    f"{module} (line {line}, {_layer_name(module)}) imports {imported} "
                    f"({_layer_name(imported)})"
                )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_layer_test_sees_the_imports():
    """The walk finds module-level and function-level imports (a check of the check)."""
    jit = next(m for m in MODULES if m.endswith("._jit"))
    imported = {m for m, _, _ in _imports(jit)}
    assert any(m.endswith("._core") for m in imported)
    vmap = next(m for m in MODULES if m.endswith("._vmap"))
    tree = ast.parse(MODULES[vmap].read_text(encoding="utf-8"))
    nested = [
        n
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.ImportFrom) and n.level
    ]
    assert nested, "_vmap has a function-level import the walk must see"
    assert any(m.endswith("._axes") for m, _, line in _imports(vmap) if line == nested[0].lineno)


def test_every_module_is_in_a_layer_and_the_top_level_is_small():
    top = sorted(m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in ORDER)
    unplaced = [m for m in top if m.split(".")[1] not in FOUNDATIONS | set(_FLAT_LAYERS)]
    assert not unplaced, (
        f"{unplaced}: put each new module in the subpackage of its layer (or, if it is a "
        "foundation every layer needs, add it to FOUNDATIONS)"
    )
    foundations = [m for m in top if m.split(".")[1] not in _FLAT_LAYERS]
    assert len(foundations) + 1 <= MAX_TOP_LEVEL, foundations


def test_no_module_re_exports_another_modules_names():
    """Only ``treemode/__init__.py`` re-exports: everything else imports a name from the
    module that defines it (``from ._pure import PureFunction``, not from ``_core``)."""
    tables = {m: _definitions(m) for m in MODULES}
    through = []
    for module in MODULES:
        text = MODULES[module].read_text(encoding="utf-8")
        tree = ast.parse(text)
        local_modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                frm = _from_module(module, node)
                if not frm or not (frm == PUBLIC or frm.startswith(PUBLIC + ".")):
                    continue
                for alias in node.names:
                    if _is_module(f"{frm}.{alias.name}"):
                        local_modules[alias.asname or alias.name] = f"{frm}.{alias.name}"
                    elif frm in tables and frm not in _KNOWN_HUBS:
                        defined, imported = tables[frm]
                        if alias.name in imported:
                            through.append(
                                f"{module} (line {node.lineno}) imports {alias.name} from "
                                f"{frm}, which only imports it from {imported[alias.name]}"
                            )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in local_modules
            ):
                frm = local_modules[node.value.id]
                if frm in tables and frm not in _KNOWN_HUBS and node.attr in tables[frm][1]:
                    through.append(
                        f"{module} (line {node.lineno}) reads {node.value.id}.{node.attr}, "
                        f"which {frm} only imports from {tables[frm][1][node.attr]}"
                    )
    assert not through, "import each name from its defining module:\n" + "\n".join(through)


def test_no_import_cycle():
    """No cycle among the package's modules (function-level imports included)."""
    graph = {
        m: {i for i, _, _ in _imports(m) if i in MODULES and i not in (m, PUBLIC)}
        for m in MODULES
        if m != PUBLIC
    }
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*stack, dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_treemode_file_is_library_code_for_the_closure_search_and_jax():
    """The closure search never follows treemode's own functions, and JAX's user frame
    is never inside treemode, whichever subpackage a module sits in."""
    import treemode
    from treemode._tree import _closure_code

    root = pathlib.Path(treemode.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    assert any(f.parent != root for f in files)  # there are subpackages
    for f in files:
        assert str(f).startswith(_closure_code.LIBRARY), f
        assert not _closure_code.code_plan(compile("0", str(f), "eval")).user_code, f
