#!/usr/bin/env bash
# Prepared check for a machine with one NVIDIA GPU and no package index (issues 8 and 25).
# Writes under $OUT: env.txt (nvidia-smi, versions), pip.txt, doctor.json, unit.txt,
# conformance.txt/.xml, views.txt (vLLM 0.33's memory orders as CUDA views, cuda backend),
# order.txt (stores/loads ordered on torch's compute stream), bench_copy.json,
# bench_copy_kernel.json, summary.txt (one "step rc=N" line per step).
# Python: $KVHAL_PYTHON if set (kvhal[dev,cuda] installed), else a venv over the machine's own
# python3 (--system-site-packages: its torch, numpy, cuda-bindings, pytest) with kvhal installed
# editable offline; wheels the image lacks (cbor2) come from $WHEELHOUSE (default .whl; fetch
# them here with `pip download --no-deps --only-binary=:all: --python-version 3.12 ... cbor2`).
# Budget: every step has its own timeout; the whole script stays under ~9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
WHEELHOUSE=${WHEELHOUSE:-.whl}
mkdir -p "$OUT"
summary() { echo "$1 rc=$2" | tee -a "$OUT/summary.txt"; }

{ date -u; nvidia-smi || true; } > "$OUT/env.txt" 2>&1

if [ -n "${KVHAL_PYTHON:-}" ]; then
    PY=$KVHAL_PYTHON
else
    python3 -m venv --system-site-packages .venv-gpu && PY=$PWD/.venv-gpu/bin/python
    {
        if ls "$WHEELHOUSE"/*.whl > /dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps "$WHEELHOUSE"/*.whl
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    } > "$OUT/pip.txt" 2>&1
    summary install $?
fi
"$PY" -c 'import cuda.bindings, numpy, sys, torch; print(sys.version); print("cuda-bindings",
cuda.bindings.__version__, "numpy", numpy.__version__, "torch", torch.__version__,
"cuda", torch.cuda.is_available())' >> "$OUT/env.txt" 2>&1

timeout 60 "$PY" -m kvhal.cli doctor --json > "$OUT/doctor.json" 2>&1
summary doctor $?

PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
timeout 120 "${PYTEST[@]}" tests/backends > "$OUT/unit.txt" 2>&1
summary unit $?

timeout 200 "${PYTEST[@]}" conformance/ --kvhal-backend=cuda --junitxml="$OUT/conformance.xml" \
    > "$OUT/conformance.txt" 2>&1
summary conformance $?

# issue 25 point 2 on real CUDA tensors: vLLM 0.33's six memory orders and kernel blocks as
# CUDA views, stored and loaded through the cuda backend (the vLLM-source version of this test
# needs vLLM's Python dependencies, which this offline image lacks).
timeout 90 "${PYTEST[@]}" tests/layout/test_strided_cuda.py > "$OUT/views.txt" 2>&1
summary views $?

# issue 25 point 3 on real CUDA streams: torch's compute stream ordering stores and loads.
timeout 90 "${PYTEST[@]}" tests/engine/test_cuda_ordering.py tests/vllm/test_compute_ordering.py \
    > "$OUT/order.txt" 2>&1
summary order $?
for f in unit conformance views order; do
    echo "$f: $(tail -n 1 "$OUT/$f.txt")" | tee -a "$OUT/summary.txt"
done

timeout 100 "$PY" -m kvhal.cli bench copy --backend cuda --json > "$OUT/bench_copy.json" \
    2> "$OUT/bench_copy.err"
summary bench_copy $?

timeout 100 "$PY" -m kvhal.cli bench copy-kernel --backend cuda --json \
    > "$OUT/bench_copy_kernel.json" 2> "$OUT/bench_copy_kernel.err"
summary bench_copy_kernel $?
