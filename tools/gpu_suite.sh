#!/usr/bin/env bash
# The test suite on a GPU machine that already has JAX (0.11) with CUDA installed.
#
# Run from the repository root:  OUT=/some/dir tools/gpu_suite.sh
#
# Needs no internet and installs nothing but treemode itself (pip install
# --no-build-isolation --no-deps -e .: the machine's JAX, Flax and CUDA plugin
# stay as they are). Then two runs of pytest (-q, and -x unless PYTEST_STOP= is
# set; no --timeout, which needs a plugin the machine may lack):
#   1. the whole suite on the CPU backend (JAX_PLATFORMS=cpu), -n 8 workers;
#   2. the tests where the backend matters on the GPU: donation, jit,
#      sharding (where the machine has 8 GPUs: the tests build 8-device meshes)
#      and the examples.
# Each run is cut at a time limit (CPU_LIMIT_S=190, GPU_LIMIT_S=80, and 10 s to
# stop; with the install and the probes about 5.5 minutes at most) so the script
# ends within 6 minutes on 16 cores.
# pytest, pytest-xdist, hypothesis, equinox, optax... may or may not be
# installed: a test file whose imports are missing is left out, and the summary
# says which and why. Results: $OUT/summary.txt (the short report), and per run
# the full pytest output and a JUnit XML file.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/gpu-suite-out}"
PY="${PYTHON:-python}"
CPU_WORKERS="${CPU_WORKERS:-8}"
CPU_LIMIT_S="${CPU_LIMIT_S:-190}"
GPU_LIMIT_S="${GPU_LIMIT_S:-80}"
PYTEST_STOP="${PYTEST_STOP--x}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
start=$(date +%s)

say "tools/gpu_suite.sh on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib.metadata as m, sys
names = ["jax", "jaxlib", "flax", "numpy", "pytest", "pytest-xdist", "hypothesis",
         "equinox", "optax", "orbax-checkpoint", "treescope", "setuptools"]
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "missing"
print("python", sys.version.split()[0], "|", ", ".join(f"{n} {version(n)}" for n in names))
plugins = [d.metadata["Name"] for d in m.distributions()
           if (d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda", "jax-rocm"))]
print("jax plugins:", ", ".join(sorted(set(plugins))) or "none")
EOF

if ! "$PY" -c "import pytest" 2>/dev/null; then
    say "pytest is not installed: no test can run (this script installs nothing)."
    exit 2
fi

# -- treemode itself (editable, so the compiled extension sits beside the sources
# the tests import; no dependency is touched)
if PIP_NO_INDEX=1 "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1; then
    say "install: pip install --no-build-isolation --no-deps -e . ok"
else
    say "install: FAILED (see install.log; pyproject.toml's license field needs setuptools 77 or"
    say "  newer without build isolation); the tests run against the checkout as it is, where"
    say "  the compiled extension is active only if it was built there before"
    tail -5 "$OUT/install.log" | tee -a "$SUMMARY"
fi
"$PY" -c "import treemode; s = treemode.extension_status(); print('compiled extension:', 'active' if s.active else 'off', '-', s.reason)" 2>&1 | tail -1 | tee -a "$SUMMARY"

# -- test files whose imports are missing here (read from their import lines;
# the local helper modules under tests/ are followed)
"$PY" - >"$OUT/missing.txt" <<'EOF'
import ast, importlib.util, pathlib
tests = pathlib.Path("tests")
local = {p.stem for p in tests.glob("*.py")}
def roots(path, seen):
    if path in seen:
        return set()
    seen.add(path)
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in local:
                found |= roots(tests / f"{top}.py", seen)
            else:
                found.add(name)
    return found
def missing(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True
for path in sorted(tests.glob("test_*.py")):
    gone = sorted(n for n in roots(path, set()) if missing(n))
    if gone:
        print(f"{path}\t{', '.join(gone)}")
EOF
IGNORES=()
while IFS=$'\t' read -r path mods; do
    [ -n "$path" ] || continue
    IGNORES+=("--ignore=$path")
    say "left out: $path (not installed here: $mods)"
done <"$OUT/missing.txt"

XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$CPU_WORKERS")
else
    say "pytest-xdist is not installed: the CPU run is serial (and likely cut by its time limit)"
fi

# run NAME LIMIT ARGS...: one pytest run, cut at LIMIT seconds; its last line to the summary
run() {
    local name=$1 limit=$2
    shift 2
    local t0 rc line
    t0=$(date +%s)
    timeout -s INT -k 10 "$limit" "$PY" -m pytest -q $PYTEST_STOP -p no:cacheprovider -rfE \
        --junitxml="$OUT/$name.xml" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    line=$(grep -E "(passed|failed|error|no tests ran)" "$OUT/$name.txt" | tail -1)
    if grep -q "KeyboardInterrupt" "$OUT/$name.txt" || [ -z "$line" ]; then
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
            line="CUT at ${limit} s: ${line:-no summary}"
        fi
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        line="$line (finished; stopped at the ${limit} s limit while exiting)"
    fi
    say "$name: exit $rc in $(($(date +%s) - t0)) s: ${line:-see $name.txt}"
    grep -E "^(FAILED|ERROR) " "$OUT/$name.txt" | head -20 | sed 's/^/    /' | tee -a "$SUMMARY"
}

# -- 1. the whole suite on the CPU backend (the packaging tests build wheels and
# virtual environments from the package index: left out, no internet here)
JAX_PLATFORMS=cpu run cpu "$CPU_LIMIT_S" "${XDIST[@]}" -m "not packaging" "${IGNORES[@]}" tests

# -- 2. the backend-sensitive tests on the GPU
# (GPUS=n overrides the count: to try this script's GPU part on another machine)
gpus=${GPUS:-$(JAX_PLATFORMS="" "$PY" -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0)}
say "GPUs seen by JAX: ${gpus:-0} ($(JAX_PLATFORMS="" "$PY" -c "import jax; print(jax.devices()[0].device_kind)" 2>/dev/null || echo none))"
if [ "${gpus:-0}" -ge 1 ]; then
    GPU_FILES=()
    for f in tests/test_donation.py tests/test_jit.py tests/test_sharding.py tests/test_examples.py; do
        if grep -q "^$f	" "$OUT/missing.txt"; then
            continue
        fi
        if [ "$f" = tests/test_sharding.py ] && [ "$gpus" -lt 8 ]; then
            say "left out on the GPU: $f (its tests build meshes of 8 devices; $gpus GPU(s) here)"
            continue
        fi
        GPU_FILES+=("$f")
    done
    # test_example_runs starts each example in a process of its own, on the CPU
    # (tests/test_examples.py sets JAX_PLATFORMS=cpu there): the CPU run has them.
    DESELECT=(-k "not test_example_runs")
    say "left out on the GPU: test_examples.py::test_example_runs (its processes run on the CPU)"
    if [ "$gpus" -lt 8 ]; then
        DESELECT+=(--deselect tests/test_examples.py::test_fsdp_matches_flax_original)
        say "left out on the GPU: test_fsdp_matches_flax_original (a 2 x 4 mesh of 8 devices)"
        DESELECT+=(--deselect tests/test_jit.py::test_in_and_out_shardings_with_module_shaped_prefix)
        say "left out on the GPU: test_in_and_out_shardings_with_module_shaped_prefix (a mesh of 8 devices)"
    fi
    # JAX_PLATFORMS="" lets JAX pick the GPU (tests/conftest.py defaults it to cpu
    # only where it is unset). Full float32 matmuls: the tests compare losses with
    # Flax's to 1e-5, which TF32 (the GPU default) does not reach.
    JAX_PLATFORMS="" XLA_PYTHON_CLIENT_PREALLOCATE=false \
        JAX_DEFAULT_MATMUL_PRECISION="${JAX_DEFAULT_MATMUL_PRECISION:-highest}" \
        run gpu "$GPU_LIMIT_S" "${XDIST[@]:+-n}" "${XDIST[@]:+0}" "${DESELECT[@]}" "${GPU_FILES[@]}"
else
    say "gpu: not run (JAX sees no GPU: check the CUDA plugin with python -c 'import jax; print(jax.devices())')"
fi
say "total: $(($(date +%s) - start)) s; outputs in $OUT"
