#!/usr/bin/env bash
# Prepared check for a machine with one NVIDIA GPU and no package index: the cuda backend,
# its conformance, vLLM's memory orders as CUDA views, compute-stream ordering, copy benchmarks.
# Writes under $OUT: env.txt (nvidia-smi, versions), pip.txt, doctor.json, unit.txt,
# conformance.txt/.xml, views.txt (vLLM 0.33's memory orders as CUDA views, cuda backend),
# order.txt (stores/loads ordered on torch's compute stream), bench_copy.json (kvhal's copies
# next to numpy memcpy and to one plain cudaMemcpyAsync per block on the same buffers, with
# ratios), bench_copy_kernel.json, summary.txt (one "step rc=N" line per step, 124: timed out).
#
# Python: $KVHAL_PYTHON if set (kvhal[dev,cuda] installed there), else the machine's own python3
# (the one holding torch, numpy, cuda-bindings and pytest; on the lent H200 machines a venv at
# /opt/torch/.venv) with kvhal installed into it editable and offline. Where that environment
# is read-only, a venv of our own sees its packages through a .pth file (a venv made with
# --system-site-packages from a venv's python sees the base interpreter's packages, not that
# venv's). Wheels the image lacks (cbor2) come from $WHEELHOUSE (default .whl), fetched
# beforehand where pip reaches an index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl cbor2
# Budget: every step has its own timeout and they add up to at most 500 s (a test pins this:
# tests/backends/test_gpu_check_script.py), so the whole script ends within 9 minutes.
# What does not run there: tests/vllm/test_compute_ordering.py needs vLLM's Python package,
# which the image lacks, so the order step's CUDA streams are those of
# tests/engine/test_cuda_ordering.py (the connector-level CUDA tests skip, by that reason).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
export WHEELHOUSE=${WHEELHOUSE:-.whl}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
summary() { echo "$1 rc=$2" | tee -a "$OUT/summary.txt"; }

{ date -u; timeout 10 nvidia-smi || true; } > "$OUT/env.txt" 2>&1

install_kvhal() {   # $1: python; offline, no dependencies resolved (the image has them)
    if ls "$WHEELHOUSE"/*.whl > /dev/null 2>&1; then
        "$1" -m pip install -q --no-index --no-deps "$WHEELHOUSE"/*.whl || return
    fi
    "$1" -m pip install -q --no-index --no-deps --no-build-isolation -e .
}

if [ -n "${KVHAL_PYTHON:-}" ]; then
    PY=$KVHAL_PYTHON
else
    PY=$(command -v python3)
    {
        timeout 45 bash -c "$(declare -f install_kvhal); install_kvhal '$PY'" || {
            echo "installing into $PY's environment failed: a venv of our own over it"
            site=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
            timeout 20 "$PY" -m venv .venv-gpu && PY=$PWD/.venv-gpu/bin/python &&
                own=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') &&
                echo "$site" > "$own/_image_site.pth" &&
                timeout 35 bash -c "$(declare -f install_kvhal); install_kvhal '$PY'"
        }
    } > "$OUT/pip.txt" 2>&1
    summary install $?
fi
timeout 15 "$PY" -c 'import cuda.bindings, numpy, sys, torch; print(sys.executable, sys.version)
print("cuda-bindings", cuda.bindings.__version__, "numpy", numpy.__version__, "torch",
      torch.__version__, "cuda", torch.cuda.is_available())' >> "$OUT/env.txt" 2>&1

timeout 30 "$PY" -m kvhal.cli doctor --json > "$OUT/doctor.json" 2>&1
summary doctor $?

PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
timeout 50 "${PYTEST[@]}" tests/backends > "$OUT/unit.txt" 2>&1
summary unit $?

timeout 100 "${PYTEST[@]}" conformance/ --kvhal-backend=cuda --junitxml="$OUT/conformance.xml" \
    > "$OUT/conformance.txt" 2>&1
summary conformance $?

# On real CUDA tensors: vLLM 0.33's six memory orders and kernel blocks as
# CUDA views, stored and loaded through the cuda backend (the vLLM-source version of this test
# needs vLLM's Python dependencies, which this offline image lacks).
timeout 45 "${PYTEST[@]}" tests/layout/test_strided_cuda.py > "$OUT/views.txt" 2>&1
summary views $?

# On real CUDA streams: torch's compute stream ordering stores and loads.
timeout 50 "${PYTEST[@]}" tests/engine/test_cuda_ordering.py tests/vllm/test_compute_ordering.py \
    > "$OUT/order.txt" 2>&1
summary order $?
for f in unit conformance views order; do
    echo "$f: $(tail -n 1 "$OUT/$f.txt")" | tee -a "$OUT/summary.txt"
done

# Copy bandwidth: kvhal's batch copies vs one cudaMemcpyAsync per block (cuda-python), same
# buffers and streams, side by side; then DMA vs kvhal's copy kernel.
SIZES=(4KiB 64KiB 2MiB 16MiB)
timeout 50 "$PY" -m kvhal.cli bench copy --backend cuda --sizes "${SIZES[@]}" --json \
    > "$OUT/bench_copy.json" 2> "$OUT/bench_copy.err"
summary bench_copy $?

timeout 50 "$PY" -m kvhal.cli bench copy-kernel --backend cuda --sizes "${SIZES[@]}" --json \
    > "$OUT/bench_copy_kernel.json" 2> "$OUT/bench_copy_kernel.err"
summary bench_copy_kernel $?
