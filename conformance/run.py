"""Run Flax's own NNX tests against treemode and write the conformance report.

Usage (from the repository root, with the project's virtual environment)::

    python conformance/run.py            # tree, drop-in, Flax without graph updates, Flax tree
    python conformance/run.py --ci       # tree mode only; fail if a baseline test regresses
    python conformance/run.py --modes tree --update-baseline

The Flax sdist matching the installed Flax is downloaded once with
``pip download --no-binary :all: --no-deps flax==<version>`` into
``conformance/.cache/`` (gitignored) and its ``tests/nnx/`` directory unpacked there.
Each test file runs in its own pytest process with ``conformance_plugin`` loaded,
which routes Flax's transform calls (see that module for the modes). The results
are classified against ``expected_differences.toml`` and written to
``conformance/results/report.md`` and ``report.json`` (``--results`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"
EXPECTED_FILE = HERE / "expected_differences.toml"
BASELINE_FILE = HERE / "baseline_tree.txt"

# Tree mode runs on Flax's transform tests; drop-in on every test file that calls a
# transform (found by scanning the sources, so a new Flax version is picked up).
TREE_FILES = ("transforms_test.py",)
_TRANSFORM_CALL = re.compile(
    r"\bnnx\.(jit|jit_partial|eval_shape|vmap|pmap|scan|while_loop|fori_loop|cond|switch|"
    r"checkify|grad|value_and_grad|vjp|jvp|custom_vjp|remat|shard_map|transform_metadata)\b"
)

PYTEST_INI = """\
# Written by treemode's conformance/run.py: Flax's tests run without Flax's own
# pytest configuration (which turns every warning into an error).
[pytest]
addopts = -p no:cacheprovider
"""

MODE_TITLES = {
    "tree": "tree mode: tree-mode calls routed to treemode",
    "dropin": "drop-in: every transform call routed to treemode",
    "flax-graph": "Flax with graph_updates=False forced on every transform call",
    "flax-tree": "Flax with graph=False forced on every transform call",
    "flax": "Flax unchanged",
}


# --- fetching Flax's tests ----------------------------------------------------------


def flax_version() -> str:
    return importlib.metadata.version("flax")


def fetch_tests(version: str) -> Path:
    """Download the Flax sdist (once) and unpack its ``tests/nnx`` into the cache."""
    sdist_dir = CACHE / "sdist"
    sdist = sdist_dir / f"flax-{version}.tar.gz"
    if not sdist.exists():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        print(f"conformance: downloading the flax=={version} sdist into {sdist_dir}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        cmd += [f"flax=={version}", "-d", str(sdist_dir)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        if not sdist.exists():
            raise SystemExit(f"conformance: pip download did not produce {sdist}")
    root = CACHE / f"flax-{version}"
    tests = root / "tests" / "nnx"
    if not (tests / "transforms_test.py").exists():
        prefix = f"flax-{version}/tests/nnx/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(f"flax-{version}/") :]
            tar.extractall(root, members=members, filter="data")
    (root / "pytest.ini").write_text(PYTEST_INI)
    return root


def test_files(root: Path, mode: str) -> list[str]:
    if mode == "tree":
        return [f"tests/nnx/{name}" for name in TREE_FILES]
    found = []
    for path in sorted((root / "tests" / "nnx").rglob("*_test.py")):
        if _TRANSFORM_CALL.search(path.read_text(encoding="utf-8")):
            found.append(path.relative_to(root).as_posix())
    return found


# --- running ------------------------------------------------------------------------


# Test files that could not be collected, per mode: {mode: {file: error}}.
NOT_RUN: dict[str, dict[str, str]] = defaultdict(dict)


def _load(out: Path, test_file: str) -> dict[str, Any]:
    data = json.loads(out.read_text())
    prefix = test_file.removeprefix("tests/nnx/")
    for error in data.get("collection_errors", {}).values():
        NOT_RUN[data["mode"]][prefix] = error
    return {f"{prefix}::{k.split('::', 1)[1]}": v for k, v in data["tests"].items()}


def run_file(
    root: Path, mode: str, test_file: str, out_dir: Path, reuse: bool = False
) -> dict[str, Any]:
    out = out_dir / f"{mode}__{test_file.replace('/', '__')}.json"
    if reuse:
        if not out.exists():
            print(f"conformance: --reuse: no previous {mode} results for {test_file}")
            NOT_RUN[mode][test_file.removeprefix("tests/nnx/")] = "no results (not run)"
            return {}
        return _load(out, test_file)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TREEMODE_CONFORMANCE_MODE"] = mode
    env["TREEMODE_CONFORMANCE_OUT"] = str(out)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    cmd = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root)]
    cmd += ["-p", "no:randomly", "-p", "no:xdist", "-p", "conformance_plugin", "-q"]
    cmd += ["--tb=no", "--no-header", "-rN", test_file]
    start = time.monotonic()
    # The plugin stops a process after a RecursionError (it can leave JAX's or Flax's
    # per-thread state corrupt): the tests not run yet go to a new process.
    merged: dict[str, Any] = {"tests": {}, "collection_errors": {}}
    deselect: list[str] = []
    while True:
        if out.exists():
            out.unlink()
        proc = subprocess.run(cmd + deselect, cwd=root, env=env, capture_output=True, text=True)
        if not out.exists():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"conformance: pytest wrote no results for {mode} {test_file}")
        data = json.loads(out.read_text())
        merged["mode"] = data["mode"]
        merged["tests"].update(data["tests"])
        merged["collection_errors"].update(data["collection_errors"])
        left = [n for n in data.get("collected", []) if n not in merged["tests"]]
        if not left:
            break
        deselect = [f"--deselect={n}" for n in merged["tests"]]
    out.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    elapsed = time.monotonic() - start
    tests = _load(out, test_file)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"conformance: {mode:9} {test_file}: {summary} ({elapsed:.0f} s)", flush=True)
    return tests


# --- classification -----------------------------------------------------------------


def load_expected(scope: str = "tree") -> list[dict[str, str]]:
    """The reviewed differences of one comparison: ``tree`` (tree mode, the default
    scope of an entry) or ``dropin`` (the drop-in against Flax's own graph mode,
    which also meets the tree-mode differences: pass ``all``)."""
    with open(EXPECTED_FILE, "rb") as f:
        entries = tomllib.load(f).get("difference", [])
    for e in entries:
        if e.get("kind") not in ("expected", "error-text", "gap"):
            raise SystemExit(f"conformance: {EXPECTED_FILE.name}: bad kind in {e}")
        if not e.get("reason"):
            raise SystemExit(f"conformance: {EXPECTED_FILE.name}: {e['test']} has no reason")
        if e.get("scope", "tree") not in ("tree", "dropin"):
            raise SystemExit(f"conformance: {EXPECTED_FILE.name}: bad scope in {e}")
    return [e for e in entries if scope == "all" or e.get("scope", "tree") == scope]


def match_entry(test: str, entries: list[dict[str, str]]) -> dict[str, str] | None:
    for e in entries:
        if fnmatch.fnmatchcase(test, e["test"]):
            return e
    return None


def routed(entry: dict[str, Any]) -> bool:
    return any(c["target"] == "treemode" for c in entry["calls"])


def calls_transform(entry: dict[str, Any]) -> bool:
    return bool(entry["calls"])


def classify(test: str, entry: dict[str, Any], entries: list[dict[str, str]]) -> dict[str, Any]:
    """The class of one routed failure: expected difference, error text only, or gap."""
    failure = entry.get("failure", {})
    listed = match_entry(test, entries)
    if listed is not None:
        return {"class": listed["kind"], "reason": listed["reason"], "listed": True}
    error_text = failure.get("text_mismatch") or (
        failure.get("inside_expected_raise")
        and failure.get("origin") == "treemode"
        and failure.get("type") != "AssertionError"
    )
    if error_text:
        return {"class": "error-text", "reason": "", "listed": False}
    return {"class": "gap", "reason": "", "listed": False}


def graph_kind(entry: dict[str, Any]) -> str:
    """Which graph= values the routed calls of a test used."""
    graphs = {c["graph"] for c in entry["calls"] if c["target"] == "treemode"}
    return (
        "both" if graphs == {True, False} else ("graph=True" if True in graphs else "graph=False")
    )


def summarize_tree(tests: dict[str, Any], entries: list[dict[str, str]]) -> dict[str, Any]:
    routed_tests = {k: v for k, v in tests.items() if routed(v)}
    failures = {}
    for test, entry in sorted(routed_tests.items()):
        if entry["outcome"] == "failed":
            failures[test] = {**entry.get("failure", {}), **classify(test, entry, entries)}
            failures[test]["graph"] = graph_kind(entry)
    passed = [k for k, v in routed_tests.items() if v["outcome"] == "passed"]
    skipped = [k for k, v in routed_tests.items() if v["outcome"] == "skipped"]
    classes = Counter(f["class"] for f in failures.values())
    # Listed tests that pass now: the entry is out of date (a gap was fixed, or a
    # difference went away).
    stale = sorted(k for k in passed if match_entry(k, entries) is not None)
    by_graph: dict[str, Counter[str]] = defaultdict(Counter)
    for entry in routed_tests.values():
        by_graph[graph_kind(entry)][entry["outcome"]] += 1
    return {
        "tests": len(tests),
        "routed": len(routed_tests),
        "passed": len(passed),
        "failed": len(failures),
        "skipped": len(skipped),
        "pass_rate": round(100 * len(passed) / max(1, len(routed_tests)), 1),
        "classes": dict(classes),
        "by_graph": {k: dict(v) for k, v in sorted(by_graph.items())},
        "failures": failures,
        "passing": sorted(passed),
        "stale_entries": stale,
        "unrouted_failures": sorted(
            k for k, v in tests.items() if not routed(v) and v["outcome"] == "failed"
        ),
    }


REFERENCES = ("flax-graph", "flax-tree")


def summarize_dropin(
    results: dict[str, dict[str, Any]], entries: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    """Drop-in against Flax on the same calls, over the tests that call a transform.

    The references: Flax's own graph mode without graph updates (``flax-graph``,
    like for like) and Flax with ``graph=False`` forced (``flax-tree``). A test
    that passes with a reference but not with treemode is a deliberate difference
    when ``entries`` (every entry of ``expected_differences.toml``) list it; an
    entry of the ``dropin`` scope whose test passes is stale.
    """
    entries = load_expected("all") if entries is None else entries
    dropin = results.get("dropin", {})
    refs = {m: results[m] for m in REFERENCES if m in results}
    # Only files that every run measured are compared.
    skipped = set(NOT_RUN["dropin"]).union(*(NOT_RUN[m] for m in refs))
    names = sorted(
        k
        for k in {k for r in (dropin, *refs.values()) for k, v in r.items() if calls_transform(v)}
        if k.split("::", 1)[0] not in skipped
    )
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    only_ref: dict[str, list[str]] = {m: [] for m in refs}
    only_treemode: dict[str, list[str]] = {m: [] for m in refs}
    failures = {}
    for name in names:
        d = dropin.get(name, {}).get("outcome") == "passed"
        file = name.split("::", 1)[0]
        per_file[file]["tests"] += 1
        per_file[file]["dropin"] += d
        for mode, ref in refs.items():
            f = ref.get(name, {}).get("outcome") == "passed"
            per_file[file][mode] += f
            if f and not d:
                only_ref[mode].append(name)
            if d and not f:
                only_treemode[mode].append(name)
        if not d and name in dropin:
            fail = dropin[name].get("failure", {})
            failures[name] = {k: fail.get(k) for k in ("type", "message", "origin")}
    graph_only = only_ref.get("flax-graph", [])
    listed = {n: e for n in graph_only if (e := match_entry(n, entries)) is not None}
    passing = {n for n in names if dropin.get(n, {}).get("outcome") == "passed"}
    return {
        "not_run": {m: dict(NOT_RUN[m]) for m in ("dropin", *refs) if NOT_RUN[m]},
        "references": list(refs),
        "tests": len(names),
        "dropin_passed": sum(c["dropin"] for c in per_file.values()),
        "flax_graph_passed": sum(c["flax-graph"] for c in per_file.values()),
        "flax_tree_passed": sum(c["flax-tree"] for c in per_file.values()),
        "per_file": {k: dict(v) for k, v in sorted(per_file.items())},
        "pass_only_with_flax_graph": graph_only,
        "pass_only_with_flax_tree": only_ref.get("flax-tree", []),
        "pass_only_with_treemode": only_treemode.get("flax-graph", []),
        "pass_only_with_treemode_vs_flax_tree": only_treemode.get("flax-tree", []),
        # Passing with Flax's graph mode, failing with treemode, and listed: deliberate.
        "deliberate": {n: {"kind": e["kind"], "reason": e["reason"]} for n, e in listed.items()},
        # Passing with Flax's graph mode, failing with treemode, not listed: gaps.
        "gaps": [n for n in graph_only if n not in listed],
        "stale_entries": sorted(
            n
            for n in passing
            if (e := match_entry(n, entries)) is not None and e.get("scope") == "dropin"
        ),
        "dropin_failures": failures,
    }


# --- the report ---------------------------------------------------------------------


def _cell(text: str, limit: int = 160) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "treemode"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return rev + (" (treemode/ modified)" if dirty else "")
    except OSError:
        return "unknown"


CLASS_TITLES = {
    "expected": "expected difference",
    "error-text": "error text only",
    "gap": "gap",
}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# treemode conformance with Flax {report['flax']}",
        "",
        f"Generated by `make conformance` ({report['date']}, treemode {report['revision']},"
        f" JAX {report['jax']}). See `docs/conformance.md` for what is measured.",
        "",
    ]
    if report.get("note"):
        lines += [report["note"], ""]
    tree = report.get("tree")
    if tree and NOT_RUN["tree"]:
        raise SystemExit(f"conformance: tree mode: test files not collected: {NOT_RUN['tree']}")
    if tree:
        c = tree["classes"]
        lines += [
            "## Tree mode: `tests/nnx/transforms_test.py`",
            "",
            "Tree-mode calls (`graph=False`, or `graph=True, graph_updates=False`) of Flax's",
            "transforms go to the treemode transform of the same name; graph-updates calls",
            "stay on Flax. A test is *routed* when at least one of its calls went to treemode.",
            "",
            "| tests | routed | passed | failed | pass rate |",
            "|---|---|---|---|---|",
            f"| {tree['tests']} | {tree['routed']} | {tree['passed']} | {tree['failed']}"
            f" | {tree['pass_rate']} % |",
            "",
            "| failures by class | count |",
            "|---|---|",
            *(f"| {CLASS_TITLES[k]} | {c.get(k, 0)} |" for k in CLASS_TITLES),
            "",
            "| routed calls used | passed | failed |",
            "|---|---|---|",
            *(
                f"| {k} | {v.get('passed', 0)} | {v.get('failed', 0)} |"
                for k, v in tree["by_graph"].items()
            ),
            "",
        ]
        if tree["unrouted_failures"]:
            lines += ["Unrouted tests that failed (harness problem):", ""]
            lines += [f"- `{t}`" for t in tree["unrouted_failures"]] + [""]
        if tree["stale_entries"]:
            lines += ["Listed in `expected_differences.toml` but passing (delete the entry):", ""]
            lines += [f"- `{t}`" for t in tree["stale_entries"]] + [""]
        gaps: dict[str, list[str]] = defaultdict(list)
        for test, f in tree["failures"].items():
            if f["class"] == "gap":
                gaps[f["reason"] or "(not reviewed yet)"].append(test.split("::", 1)[1])
        if gaps:
            lines += [f"### Gaps by cause ({c.get('gap', 0)})", ""]
            for reason, tests in sorted(gaps.items(), key=lambda kv: -len(kv[1])):
                lines.append(f"- **{len(tests)}**: {reason}")
                lines += [f"    - `{t}`" for t in tests]
            lines.append("")
        for cls in CLASS_TITLES:
            rows = {k: v for k, v in tree["failures"].items() if v["class"] == cls}
            if not rows:
                continue
            lines += [
                f"### Failures: {CLASS_TITLES[cls]} ({len(rows)})",
                "",
                "| test | graph | exception | first line | reason |",
                "|---|---|---|---|---|",
            ]
            for test, f in rows.items():
                reason = f["reason"] or ("(not reviewed)" if cls == "error-text" else "")
                lines.append(
                    f"| `{test.split('::', 1)[1]}` | {f['graph']} | `{f.get('type', '?')}`"
                    f" | {_cell(f.get('message', ''))} | {_cell(reason, 400)} |"
                )
            lines.append("")
    dropin = report.get("dropin")
    if dropin:
        lines += [
            "## Drop-in: graph-mode calls to treemode too",
            "",
            "Every transform call goes to treemode (`graph=True` for graph-mode calls),",
            "compared on the same calls with Flax's own graph mode without graph updates",
            "(`graph_updates=False` forced, `graph=` as the call asks: like for like), and",
            "with Flax with `graph=False` forced. Counted over the tests that call at",
            "least one transform.",
            "",
            "| file | tests | treemode drop-in passed | Flax `graph_updates=False` passed"
            " | Flax `graph=False` passed |",
            "|---|---|---|---|---|",
        ]
        for file, c in dropin["per_file"].items():
            lines.append(
                f"| `{file}` | {c['tests']} | {c['dropin']} | {c.get('flax-graph', 0)}"
                f" | {c.get('flax-tree', 0)} |"
            )
        lines += [
            f"| **all** | {dropin['tests']} | {dropin['dropin_passed']}"
            f" | {dropin['flax_graph_passed']} | {dropin['flax_tree_passed']} |",
            "",
            "Pass with Flax's graph mode without graph updates but not with treemode:"
            f" {len(dropin['pass_only_with_flax_graph'])}, of which"
            f" {len(dropin['deliberate'])} are listed deliberate differences and"
            f" {len(dropin['gaps'])} are gaps. Pass with treemode but not with that"
            f" reference: {len(dropin['pass_only_with_treemode'])}. Against Flax with"
            f" `graph=False` forced: {len(dropin['pass_only_with_treemode_vs_flax_tree'])}"
            f" pass with treemode only, {len(dropin['pass_only_with_flax_tree'])} with Flax"
            " only.",
            "",
        ]
        for mode, files in dropin["not_run"].items():
            for file, error in files.items():
                lines.append(f"Not compared: `{file}` ({mode}: {_cell(error)})")
            lines.append("")
        if dropin["stale_entries"]:
            lines += ["Listed as drop-in differences but passing (delete the entry):", ""]
            lines += [f"- `{t}`" for t in dropin["stale_entries"]] + [""]
        if dropin["gaps"]:
            lines += [
                "### Gaps: passing with Flax's graph mode without graph updates, failing"
                " with treemode",
                "",
                "| test | exception | first line |",
                "|---|---|---|",
            ]
            for test in dropin["gaps"]:
                f = dropin["dropin_failures"].get(test, {})
                lines.append(f"| `{test}` | `{f.get('type')}` | {_cell(f.get('message') or '')} |")
            lines.append("")
        if dropin["deliberate"]:
            lines += [
                "### Deliberate differences: passing with Flax's graph mode without graph"
                f" updates, failing with treemode ({len(dropin['deliberate'])})",
                "",
            ]
            by_reason: dict[str, list[str]] = defaultdict(list)
            for test, e in dropin["deliberate"].items():
                by_reason[e["reason"]].append(test)
            for reason, tests in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
                lines.append(f"- **{len(tests)}**: {_cell(reason, 600)}")
                for test in tests:
                    f = dropin["dropin_failures"].get(test, {})
                    lines.append(f"    - `{test}` (`{f.get('type')}`)")
            lines.append("")
    return "\n".join(lines) + "\n"


# --- baseline -----------------------------------------------------------------------


def read_baseline() -> tuple[str | None, set[str]]:
    if not BASELINE_FILE.exists():
        return None, set()
    version, tests = None, set()
    for line in BASELINE_FILE.read_text().splitlines():
        if line.startswith("# flax=="):
            version = line.removeprefix("# flax==").strip()
        elif line and not line.startswith("#"):
            tests.add(line.strip())
    return version, tests


def write_baseline(version: str, passing: list[str]) -> None:
    header = [
        f"# flax=={version}",
        "# Routed tree-mode tests of Flax's transforms_test.py that pass with treemode.",
        "# `.ci/run` fails when one of them stops passing. Regenerate after a fix with:",
        "#   .venv/bin/python conformance/run.py --modes tree --update-baseline",
    ]
    BASELINE_FILE.write_text("\n".join(header + sorted(passing)) + "\n")


def check_baseline(version: str, tree: dict[str, Any], tests: dict[str, Any]) -> int:
    base_version, baseline = read_baseline()
    if base_version != version:
        print(
            f"conformance: the baseline is for flax=={base_version}, the installed Flax is"
            f" {version}; not checked (regenerate it with --update-baseline)."
        )
        return 0
    passing = set(tree["passing"])
    regressed = sorted(baseline - passing)
    new = sorted(passing - baseline)
    for test in regressed:
        entry = tests.get(test)
        why = (
            "missing from the run"
            if entry is None
            else (
                "no longer routed"
                if not routed(entry)
                else f"{entry['outcome']}: {entry.get('failure', {}).get('type')}:"
                f" {entry.get('failure', {}).get('message')}"
            )
        )
        print(f"conformance: REGRESSION {test}: {why}")
    if new:
        print(
            f"conformance: {len(new)} routed test(s) pass that are not in the baseline; add"
            " them with --update-baseline:"
        )
        for test in new:
            print(f"  {test}")
    print(
        f"conformance: baseline check: {len(baseline) - len(regressed)} of {len(baseline)}"
        " baseline tests pass."
    )
    return 1 if regressed else 0


# --- main ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        default="tree,dropin,flax-graph,flax-tree",
        help="comma-separated: tree, dropin, flax-graph, flax-tree, flax (default: the first four)",
    )
    parser.add_argument("--files", default="", help="comma-separated test files (tests/nnx/x.py)")
    parser.add_argument("--ci", action="store_true", help="tree mode, then the baseline check")
    parser.add_argument("--update-baseline", action="store_true")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--note", default="", help="a line added to the report's header")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="classify the results of the previous run again instead of running the tests",
    )
    args = parser.parse_args(argv)

    modes = ["tree"] if args.ci else [m for m in args.modes.split(",") if m]
    version = flax_version()
    root = fetch_tests(version)
    entries = load_expected()
    raw_dir = CACHE / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, Any]] = {}
    runs = {}
    for mode in modes:
        files = [f for f in args.files.split(",") if f] or test_files(root, mode)
        start = time.monotonic()
        results[mode] = {}
        for test_file in files:
            results[mode].update(run_file(root, mode, test_file, raw_dir, args.reuse))
        runs[mode] = {"files": files, "seconds": time.monotonic() - start}

    import jax

    report: dict[str, Any] = {
        "flax": version,
        "jax": jax.__version__,
        "revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "runs": runs,
        "note": args.note,
    }
    if "tree" in results:
        report["tree"] = summarize_tree(results["tree"], entries)
    if "dropin" in results or any(m in results for m in REFERENCES):
        report["dropin"] = summarize_dropin(results)
    for mode in ("flax",):
        if mode in results:
            tests = results[mode]
            report[mode] = {
                "tests": len(tests),
                "passed": sum(v["outcome"] == "passed" for v in tests.values()),
            }

    text = markdown(report)
    if args.ci:
        tree = report["tree"]
        print(
            f"conformance: tree mode: {tree['passed']} of {tree['routed']} routed tests pass"
            f" ({tree['pass_rate']} %); failures: {tree['classes']}"
        )
        return check_baseline(version, tree, results["tree"])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "report.md").write_text(text)
    (args.results / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(text)
    if args.update_baseline and "tree" in report:
        write_baseline(version, report["tree"]["passing"])
        print(f"conformance: wrote {BASELINE_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
