"""Run the test suite against the oldest, an intermediate and the newest supported versions.

``make compat`` runs every case below; ``.ci/run`` runs ``--cases
oldest,newest,newest-py3.12 --jobs 2``: the lower bounds (on Python 3.11) and
the newest releases on Python 3.13 and 3.12 (``make test`` has just run the
newest on 3.11), two at a time.
Each case is a fresh virtual environment under ``.compat/`` (gitignored):

1. it first installs the case's exact versions of JAX, Flax and the extras, as
   a user's environment would hold them (none for ``newest``);
2. then installs treemode, with the ``test`` extra, from the sdist built from
   this checkout, *without* constraints, and checks that step 1's versions are
   unchanged: installing treemode must never rewrite a supported environment;
3. then runs the test suite of the unpacked sdist (so the sdist is checked to
   carry everything its tests need) against the installed package.

The lower bounds come from ``treemode/_versions.py``, the one source of the
supported ranges. A case whose Python is not on this machine is reported as
skipped (pyenv's ``~/.pyenv/versions`` and ``pythonX.Y`` on ``PATH`` are
searched). The results are printed and written to ``.compat/results-<cases>.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".compat"


def _load_versions():
    """``treemode/_versions.py`` alone (import-light), without importing treemode."""
    spec = importlib.util.spec_from_file_location("_versions", ROOT / "treemode" / "_versions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_versions = _load_versions()

WATCHED = ("jax", "jaxlib", "flax", "equinox", "optax", "numpy")


def _lowest(name: str) -> str:
    low, _ = {**_versions.REQUIRED, **_versions.OPTIONAL}[name]
    return ".".join(map(str, low))


@dataclass
class Case:
    name: str
    pythons: tuple[str, ...]  # the first one this machine has is used
    pins: dict[str, str] = field(default_factory=dict)
    note: str = ""


# The releases the registry served newest when the tested range was last moved
# (on Python 3.12 and 3.13; Python 3.11 gets jax 0.10.x at most): the ``newest``
# cases install whatever the registry serves, which were these when the suite
# last passed there. The top of each tested range in treemode/_versions.py is the
# minor release after these: tests/test_versions.py fails while the two disagree,
# and a ``newest`` case fails when the registry serves a release outside the
# tested range (test it, then move the range and this table together).
NEWEST: dict[str, str] = {
    "jax": "0.12.0.1",
    "jaxlib": "0.12.0.1",
    "flax": "0.12.12",
    "equinox": "0.13.8",
    "optax": "0.2.8",
}


def outside_tested_range(installed: dict[str, str]) -> list[str]:
    """The installed packages (name -> version) outside the tested ranges of
    treemode/_versions.py, in words; ``[]`` where all are inside."""
    out = []
    for name, (low, high) in {**_versions.REQUIRED, **_versions.OPTIONAL}.items():
        have = installed.get(name)
        if have is not None and not low <= _versions.parse(have) < high:
            out.append(f"{name} {have} (tested: {name}{_versions.tested_specifier(name)})")
    return out


CASES = [
    Case(
        "oldest",
        ("3.11", "3.12", "3.13"),
        {n: _lowest(n) for n in ("jax", "jaxlib", "flax", "equinox", "optax")},
        "the lower bound of every range",
    ),
    Case(
        "middle",
        ("3.12", "3.11"),
        {"jax": "0.9.2", "jaxlib": "0.9.2", "flax": "0.12.6"},
        "an environment set up before treemode (issue 17's done-criterion)",
    ),
    Case("newest", ("3.13",), {}, "whatever the registry serves, on Python 3.13"),
    Case("newest-py3.12", ("3.12",), {}, "whatever the registry serves, on Python 3.12"),
    Case("newest-py3.11", ("3.11",), {}, "whatever the registry serves, on Python 3.11"),
]


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``"3.12"``) on this machine, or ``None``."""
    candidates = sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")),
        reverse=True,
    )
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        candidates.insert(0, sys.executable)
    which = shutil.which(f"python{version}")
    if which:
        candidates.append(which)
    for exe in candidates:
        proc = subprocess.run(
            [exe, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0 and proc.stdout.strip() == version:
            return exe
    return None


def run(args: list[str], log: Path, cwd: Path = ROOT, env: dict | None = None) -> str:
    """Run a command, appending its output to ``log``; raise with the tail on failure."""
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(args)}\n")
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    with log.open("a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        # pytest's summary lines first (on CI their messages run long, the tail cuts them)
        failed = [ln[:300] for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        tail = "\n".join([*failed[:20], "...", output[-3000:]]) if failed else output[-3000:]
        raise RuntimeError(f"{' '.join(args[:4])} ... exited with {proc.returncode}:\n{tail}")
    return proc.stdout


def versions(python: Path, log: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m\n"
        f"for n in {WATCHED!r}:\n"
        "    try: print(n, m.version(n))\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    out = run([str(python), "-c", code], log)
    return dict(line.split() for line in out.splitlines() if line.strip())


def build_sdist(log: Path) -> tuple[Path, Path]:
    """Build the sdist of this checkout and unpack it; ``(sdist, unpacked dir)``.

    Each run gets its own folder under ``.compat/`` (removed when its cases pass),
    so that two runs can go on at once.
    """
    work = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
    run([sys.executable, "-m", "build", "--sdist", "--outdir", str(work), str(ROOT)], log)
    (sdist,) = work.glob("treemode-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "src", filter="data")
    (unpacked,) = (work / "src").iterdir()
    return sdist, unpacked


def run_case(case: Case, sdist: Path, tests: Path, workers: str, pytest_args: list[str]) -> dict:
    result: dict = {"case": case.name, "python": "", "note": case.note}
    found = next(((v, e) for v in case.pythons if (e := find_python(v)) is not None), None)
    if found is None:
        result["status"] = f"skipped: no Python {' or '.join(case.pythons)} on this machine"
        return result
    result["python"], exe = found
    env_dir = WORK / f"venv-{case.name}"
    log = WORK / f"{case.name}.log"
    log.write_text("")
    shutil.rmtree(env_dir, ignore_errors=True)
    start = time.perf_counter()
    try:
        run([exe, "-m", "venv", str(env_dir)], log)
        python = env_dir / "bin" / "python"
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        run([*pip, "install", "-q", "--upgrade", "pip"], log)
        if case.pins:
            run([*pip, "install", "-q", *(f"{n}=={v}" for n, v in case.pins.items())], log)
        before = versions(python, log)
        run([*pip, "install", "-q", f"{sdist}[test]"], log)
        after = versions(python, log)
        changed = {n: (before[n], after.get(n)) for n in before if after.get(n) != before[n]}
        watched_pins = {n for n in case.pins}
        rewritten = {n: c for n, c in changed.items() if n in watched_pins}
        result["versions"] = after
        if rewritten:
            raise RuntimeError(f"installing treemode changed pinned versions: {rewritten}")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        out = run(
            [str(env_dir / "bin" / "pytest"), "-n", workers, "-q", "-rf", "-p", "no:cacheprovider"]
            + pytest_args,
            log,
            cwd=tests,
            env=env,
        )
        lines = [ln for ln in out.splitlines() if re.search(r"\d+ passed", ln)]
        result["tests"] = lines[-1].strip("= ") if lines else "?"
        outside = outside_tested_range(after)
        if outside:
            raise RuntimeError(
                "the suite ran, but on releases outside treemode's tested range: "
                + ", ".join(outside)
                + ". If it passed, move the range in treemode/_versions.py and NEWEST in "
                "tools/compat.py to them (tests/test_versions.py checks that they agree)."
            )
        result["status"] = "ok"
    except RuntimeError as e:
        result["status"] = "FAILED"
        result["error"] = str(e)
    result["minutes"] = (time.perf_counter() - start) / 60
    return result


def report(results: list[dict]) -> str:
    rows = [
        "| Case | Python | jax | jaxlib | flax | equinox | optax | numpy | Result | Minutes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        v = r.get("versions", {})
        outcome = r.get("tests", "") if r["status"] == "ok" else r["status"]
        rows.append(
            f"| {r['case']} | {r['python']} | "
            + " | ".join(v.get(n, "") for n in WATCHED)
            + f" | {outcome} | {r.get('minutes', 0):.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--workers", default="2", help="pytest-xdist workers (-n) per case")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cases run at once (each in its own environment and log; default 1)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    chosen = args.cases.split(",")
    unknown = set(chosen) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in CASES]}")
    WORK.mkdir(exist_ok=True)
    sdist, tests = build_sdist(WORK / "build.log")
    cases = [c for c in CASES if c.name in chosen]

    def one(case: Case) -> dict:
        print(f"compat: {case.name} ({case.pins or 'newest'}) ...", flush=True)
        r = run_case(case, sdist, tests, args.workers, args.pytest_args)
        minutes = f"{r['minutes']:.1f} min" if "minutes" in r else ""
        print(f"compat: {case.name}: {r['status']} {r.get('tests', '')} {minutes}", flush=True)
        if "error" in r:
            print(r["error"], flush=True)
        return r

    # Each case has its own environment, log and pytest run (whose temporary
    # files pytest keeps apart per process), so cases may run at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, cases))
    table = report(results)
    (WORK / f"results-{'+'.join(chosen)}.md").write_text(table + "\n")
    print(table)
    passed = all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results)
    if passed:
        shutil.rmtree(sdist.parent, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
