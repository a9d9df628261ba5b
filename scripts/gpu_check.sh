#!/usr/bin/env bash
# Prepared check for a machine with an NVIDIA GPU (issue 8). Writes everything under $OUT:
#   env.txt (nvidia-smi, versions), doctor.json, unit.txt, conformance.txt/.xml,
#   bench_copy.json, bench_copy_kernel.json, summary.txt (one "step rc=N" line per step).
# Python environment, first that works:
#   1. $KVHAL_PYTHON (an interpreter that already has kvhal[dev,cuda,cuda-nvrtc] installed);
#   2. a fresh .venv-gpu installed from $WHEELHOUSE (offline: pip --no-index --find-links);
#   3. a fresh .venv-gpu installed from PyPI.
# Budget: every step has its own timeout; the whole script stays under ~9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
summary() { echo "$1 rc=$2" | tee -a "$OUT/summary.txt"; }

{ date -u; nvidia-smi || true; } > "$OUT/env.txt" 2>&1

if [ -n "${KVHAL_PYTHON:-}" ]; then
    PY=$KVHAL_PYTHON
else
    python3 -m venv .venv-gpu && PY=$PWD/.venv-gpu/bin/python
    if [ -n "${WHEELHOUSE:-}" ]; then
        PIP_ARGS=(--no-index --find-links "$WHEELHOUSE")
    else
        PIP_ARGS=()
    fi
    timeout 240 "$PY" -m pip install -q "${PIP_ARGS[@]}" -e '.[dev,cuda,cuda-nvrtc]' \
        > "$OUT/pip.txt" 2>&1
    summary install $?
fi
"$PY" -c 'import cuda.bindings, numpy, sys; print(sys.version); print("cuda-bindings",
cuda.bindings.__version__, "numpy", numpy.__version__)' >> "$OUT/env.txt" 2>&1

timeout 60 "$PY" -m kvhal.cli doctor --json > "$OUT/doctor.json" 2>&1
summary doctor $?

timeout 120 "$PY" -m pytest tests/backends -q -rs -p no:cacheprovider > "$OUT/unit.txt" 2>&1
summary unit $?

timeout 240 "$PY" -m pytest conformance/ --kvhal-backend=cuda -q -rs -p no:cacheprovider \
    --junitxml="$OUT/conformance.xml" > "$OUT/conformance.txt" 2>&1
summary conformance $?
# rc 0 also when every test skipped (no usable GPU): record the counts line too
echo "conformance: $(tail -n 1 "$OUT/conformance.txt")" | tee -a "$OUT/summary.txt"
echo "unit: $(tail -n 1 "$OUT/unit.txt")" | tee -a "$OUT/summary.txt"

timeout 150 "$PY" -m kvhal.cli bench copy --backend cuda --json > "$OUT/bench_copy.json" \
    2> "$OUT/bench_copy.err"
summary bench_copy $?

timeout 150 "$PY" -m kvhal.cli bench copy-kernel --backend cuda --json \
    > "$OUT/bench_copy_kernel.json" 2> "$OUT/bench_copy_kernel.err"
summary bench_copy_kernel $?
