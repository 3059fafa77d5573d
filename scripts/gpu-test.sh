#!/usr/bin/env bash
# The GPU suite: GPU tests, then freight's GPU benchmarks beside NIXL and the measured
# ceilings, then a short table (printed last). Runs on a machine with two GPUs,
# PyTorch and CuPy installed, and no network:
#   - the freight wheel comes from dist/ (make wheel) or is built here with maturin;
#   - test tools come from .carry/wheels (pip download pytest) when pip cannot fetch;
#   - NIXL comes from .carry/nixl_trim.tar.xz (bench/peers/fetch_nixl.sh); without it the
#     NIXL columns say "not measured";
#   - libfabric (for the fabric tests and rows) comes from the system or .carry/debs
#     (scripts/carried-debs.sh).
# Results go to $OUT (default: build/gpu-results). SWEEP=1 also tries the copy kernel's
# launch shapes (bench/gpu_sweep.py); QUICK=1 runs fewer iterations; STREAM=0 skips the
# stream benchmarks (scripts/stream-bench.sh), ONLY=... picks some of them; P2P=0 skips
# the two-GPU transfer benchmarks (for a one-GPU machine); EP=0 skips the expert-parallel
# benchmarks (run with 2 and 4 ranks where there are that many GPUs); TESTS=expr runs the
# GPU tests that pytest -k expr selects, GPU_TESTS=0 none of them (benchmarks only); VLLM=0
# skips the vLLM connector benchmark (bench/vllm_gpu.py); KV=0 the KV server benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-results}"
mkdir -p "$OUT"
# Multi-GPU hosts here must not use NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"   # the interpreter that has PyTorch
SITE="${GPU_SITE:-/tmp/freight-gpu-site}"
log() { echo "[gpu-test] $*"; }
source scripts/carried-debs.sh

# Installed beside the interpreter's own packages (PyTorch, CuPy, numpy, pytest), not
# into it: --target plus PYTHONPATH.
wheel=$(ls -t dist/freight-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
    log "no wheel in dist/: building one"
    "$PY" -m pip install -q maturin && "$PY" -m maturin build --release -o dist || exit 1
    wheel=$(ls -t dist/freight-*.whl | head -1)
fi
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" || exit 1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .carry/wheels/*.whl || exit 1
fi
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | sed 's/^/[gpu-test] /'
gpus=$(nvidia-smi -L | wc -l)
machine="${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x${gpus}}"

tests_rc=0
if [ "${GPU_TESTS:-1}" = 1 ]; then
    log "GPU tests"
    # The KV client's tests that need PyTorch or a large memory run here too.
    (cd tests && "$PY" -m pytest -q -rfs -p no:cacheprovider ${TESTS:+-k "$TESTS"} test_gpu.py test_ep.py test_vllm_gpu.py \
        test_nixl_face.py::test_gpu_tensors_move_through_the_face_between_two_processes_over_cuda \
        test_py_kv.py::test_torch_tensors_go_in_and_come_out_on_the_cpu_and_a_gpu \
        test_py_kv.py::test_a_value_larger_than_a_gigabyte_round_trips) 2>&1 | tee "$OUT/tests.log"
    tests_rc=${PIPESTATUS[0]}
else
    log "GPU tests skipped (GPU_TESTS=0)"
fi

# Benchmarks that failed (or timed out); named at the end and in the exit status.
failed_benches=()
bench_done() { [ "$1" = 0 ] || failed_benches+=("$2 (exit $1)"); }

# The transfer benchmarks beside NIXL compare two GPUs; P2P=0 skips them.
nixl_json=""
if [ "${P2P:-1}" = 1 ]; then
    if [ -f .carry/nixl_trim.tar.xz ]; then
        mkdir -p /tmp/freight-nixl && tar -xJf .carry/nixl_trim.tar.xz -C /tmp/freight-nixl
        log "NIXL (same sizes)"
        timeout 400 "$PY" bench/peers/nixl_p2p.py --nixl-dir /tmp/freight-nixl --out "$OUT/nixl.json" ${QUICK:+--quick}
        rc=$?; bench_done $rc nixl; [ $rc = 0 ] && nixl_json="$OUT/nixl.json"
    else
        log "NIXL skipped: .carry/nixl_trim.tar.xz is missing (run bench/peers/fetch_nixl.sh)"
    fi
    log "ceilings"
    timeout 300 "$PY" bench/peers/ceilings.py --out "$OUT/ceilings.json" ${QUICK:+--quick}
    bench_done $? ceilings
    log "freight"
    timeout 400 "$PY" bench/gpu.py --out "$OUT/freight.json" ${QUICK:+--quick}
    bench_done $? freight
    if [ "${SWEEP:-0}" = 1 ]; then
        log "kernel launch shapes (SWEEP=1)"
        timeout 300 "$PY" bench/gpu_sweep.py --out "$OUT/sweep.json" --ceilings "$OUT/ceilings.json" ${QUICK:+--quick}
        bench_done $? sweep
    fi
fi

if [ "${EP:-1}" = 1 ] && [ "$gpus" -ge 2 ]; then
    log "expert parallelism beside NCCL"
    timeout 900 "$PY" bench/ep.py --machine "$machine" --out "$OUT/ep.json" --python "$PY" \
        2>&1 | tee "$OUT/ep.log"
    bench_done "${PIPESTATUS[0]}" ep
fi

if [ "${STREAM:-1}" = 1 ]; then
    log "stream benchmarks (pipe, channel, storage, cache engine)"
    DEVICE=cuda:0 bash scripts/stream-bench.sh "$OUT" | tee "$OUT/stream.log"
    bench_done "${PIPESTATUS[0]}" stream
fi

# The KV server beside Redis on this machine's CPUs; Redis comes from the Debian
# packages in .carry/redis (bench/peers/redis.sh download .carry/redis) where the
# machine has none. Then GETs into GPU memory beside GETs into host memory. KV=0 skips
# both.
if [ "${KV:-1}" = 1 ]; then
    if ls .carry/redis/*.deb >/dev/null 2>&1; then
        bash bench/peers/redis.sh unpack .carry/redis /tmp/freight-redis >/dev/null && export PATH="/tmp/freight-redis/bin:$PATH"
    fi
    if command -v redis-server >/dev/null; then
        log "KV server beside Redis ($(nproc) CPUs)"
        timeout 540 "$PY" bench/kv.py --machine "$machine host, $(nproc) CPUs" --out "$OUT/kv.json" \
            --freight "$PY -m freight" 2>&1 | tee "$OUT/kv.log"
        bench_done "${PIPESTATUS[0]}" kv
    else
        log "KV benchmark skipped: no Redis here (bench/peers/redis.sh download .carry/redis)"
    fi
    log "KV server: GETs into GPU memory"
    timeout 300 "$PY" bench/kv_gpu.py --machine "$machine" --out "$OUT/kv_gpu.json" --freight "$PY -m freight" \
        2>&1 | tee "$OUT/kv_gpu.log"
    bench_done "${PIPESTATUS[0]}" kv_gpu
fi

# FreightConnector's worker path (KV caches as vLLM lays them on GPUs) beside freight's
# raw cuda transfer, two processes on GPU 0. VLLM=0 skips it.
if [ "${VLLM:-1}" = 1 ]; then
    log "vLLM connector worker path beside raw cuda"
    timeout 300 "$PY" bench/vllm_gpu.py --machine "$machine" --out "$OUT/vllm_gpu.json" 2>&1 | tee "$OUT/vllm_gpu.log"
    bench_done "${PIPESTATUS[0]}" vllm_gpu
fi

[ "${STREAM:-1}" = 1 ] && sed -n "/^. benchmark/,\$p" "$OUT/stream.log"
for f in kv kv_gpu ep vllm_gpu; do [ -f "$OUT/$f.log" ] && grep "^|" "$OUT/$f.log"; done
if [ "${P2P:-1}" = 1 ]; then
    "$PY" bench/gpu_report.py --freight "$OUT/freight.json" ${nixl_json:+--nixl "$nixl_json"} \
        --ceilings "$OUT/ceilings.json" --out-md "$OUT/report.md" --plot "$OUT/gpu.png" --machine "$machine"
fi
log "benchmarks: $([ ${#failed_benches[@]} = 0 ] && echo PASSED || echo "FAILED: ${failed_benches[*]}")"
[ "${GPU_TESTS:-1}" = 1 ] && log "tests: $([ "$tests_rc" = 0 ] && echo PASSED || echo "FAILED (exit $tests_rc)")"
[ "$tests_rc" = 0 ] && [ ${#failed_benches[@]} = 0 ]
