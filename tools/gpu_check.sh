#!/usr/bin/env bash
# The device check of a GPU machine (JAX with CUDA installed, no internet), from
# the repository root: OUT=DIR tools/gpu_check.sh
#   1. treemode installed over the machine's JAX (no dependency touched; where
#      the machine's setuptools cannot build it, the extension is compiled by hand
#      and the checkout put on PYTHONPATH);
#   2. the GPU column of the benchmark (benchmarks/gpu.py) into $OUT/bench;
#   3. the test suite (tools/gpu_suite.sh) into $OUT/suite.
# About 8 minutes on 16 cores; BENCH_LIMIT_S and SUITE_LIMIT_S cut each part.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT/bench" "$OUT/suite"
if ! PIP_NO_INDEX=1 "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1; then
    echo "pip install failed (tail of install.log):"; tail -3 "$OUT/install.log"
    suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    include=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    gcc -O2 -shared -fPIC -I"$include" treemode/_accel/_guard*.c -o "treemode/_accel/_guard$suffix" \
        && echo "extension compiled by hand"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import jax, treemode; print(jax.devices(), treemode.extension_status())"
if [ -z "${SKIP_BENCH:-}" ]; then  # SKIP_BENCH=1: the suite alone
    (cd benchmarks && timeout "${BENCH_LIMIT_S:-260}" "$PY" gpu.py --out "$OUT/bench" >"$OUT/bench.log" 2>&1)
    echo "bench rc=$?"; grep -A14 "best sample" "$OUT/bench.log" | head -16
fi
PYTEST_STOP="${PYTEST_STOP-}" CPU_LIMIT_S="${CPU_LIMIT_S:-130}" GPU_LIMIT_S="${GPU_LIMIT_S:-45}" OUT="$OUT/suite" \
    timeout "${SUITE_LIMIT_S:-230}" bash tools/gpu_suite.sh >"$OUT/suite.log" 2>&1
echo "suite rc=$?"; tail -25 "$OUT/suite/summary.txt"
# Only what is read back (8 files at most come back from the device tool).
find "$OUT/suite" -type f ! -name summary.txt ! -name '*.txt' -delete
rm -f "$OUT/bench/loops_gpu.json"
