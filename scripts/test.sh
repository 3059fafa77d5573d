#!/usr/bin/env bash
# Full test run: environment setup, Rust tests (release), Python tests.
# Exits non-zero if any step fails; prints one summary line at the end.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Share one cargo target dir (and release profile) with the wheel build in setup.sh.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
# maturin (in setup.sh) sets these for pyo3's build scripts; set the same values so
# `cargo test` reuses the pyo3 crates it compiled instead of rebuilding them.
# (The workspace already builds pyo3 with "extension-module", so the last one
# changes nothing about how the test binaries link.)
export PYO3_PYTHON="$ROOT/.venv/bin/python"
export PYTHON_SYS_EXECUTABLE="$PYO3_PYTHON"
export PYO3_BUILD_EXTENSION_MODULE=1

say() { printf '[test] %s\n' "$*"; }
start=$SECONDS
results=()
failed=0

record() { # record NAME RC
    if [ "$2" -eq 0 ]; then
        results+=("$1=ok")
    else
        results+=("$1=FAIL($2)")
        failed=1
    fi
}

summary() {
    local verdict=PASSED
    [ "$failed" -ne 0 ] && verdict=FAILED
    printf '[test] SUMMARY: %s  %s  (%ds)\n' "$verdict" "${results[*]}" "$((SECONDS - start))"
}

say "setup"
bash "$ROOT/scripts/setup.sh"
rc=$?
record setup "$rc"
if [ "$rc" -ne 0 ]; then
    summary
    exit 1
fi
if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
    . "$HOME/.cargo/env"
fi
if [ -z "${PYO3_ENVIRONMENT_SIGNATURE:-}" ]; then
    PYO3_ENVIRONMENT_SIGNATURE="$("$PYO3_PYTHON" -c 'import platform, struct, sys; print("%s-%d.%d-%dbit" % (platform.python_implementation().lower(), sys.version_info[0], sys.version_info[1], struct.calcsize("P") * 8))' 2>/dev/null || true)"
    export PYO3_ENVIRONMENT_SIGNATURE
fi

# NVRTC from the venv (setup.sh installs it) for the Rust kernel compile check; the
# Python tests find it themselves through `import freight`.
if [ -z "${FREIGHT_CUDA_LIB_DIRS:-}" ]; then
    FREIGHT_CUDA_LIB_DIRS="$("$PYO3_PYTHON" -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)"
    export FREIGHT_CUDA_LIB_DIRS
fi

# The layers: which crate may use what, and no import cycle among any crate's modules.
say "layers"
python3 "$ROOT/scripts/check-layers.py"
record layers $?

# Types: the package against the native module's stubs, the stubs against the module.
say "types (mypy, stubtest)"
"$PYO3_PYTHON" -m mypy && "$PYO3_PYTHON" -m mypy.stubtest freight._native
record types $?

say "cargo test --workspace --release"
cargo test --workspace --release
record cargo-test $?

# The release wheel as users get it: manylinux_2_28 (linked by zig), stripped, LICENSE
# inside, installed into clean virtualenvs of CPython 3.9 and 3.13 (make wheel).
say "wheel"
make -C "$ROOT" wheel
record wheel $?

# vLLM for CPUs, for the vLLM connector's tests (tests/test_vllm.py): built once and
# cached outside the checkout (scripts/vllm-env.sh), so later runs take it as it is.
# The newest supported vLLM runs every vLLM test; the older one (the GPU machines'
# torch) the P/D comparisons, after the main run.
say "vllm virtualenvs"
if FREIGHT_VLLM_VENV="$(bash "$ROOT/scripts/vllm-env.sh")"; then
    export FREIGHT_VLLM_VENV
    record vllm-env 0
else
    record vllm-env 1
fi
OLDER_VLLM_VENV="$(bash "$ROOT/scripts/vllm-env.sh" 0.26.0)"
record vllm-env-0.26 $?

say "pytest"
"$ROOT/.venv/bin/python" -m pytest -q tests
rc=$?
if [ "$rc" -eq 5 ]; then
    say "pytest collected no tests: treating as failure"
fi
record pytest "$rc"

if [ -n "$OLDER_VLLM_VENV" ]; then
    say "pytest: P/D with vLLM 0.26"
    FREIGHT_VLLM_VENV="$OLDER_VLLM_VENV" "$ROOT/.venv/bin/python" -m pytest -q tests/test_vllm.py -k "pd_output and freight"
    record pytest-vllm-0.26 $?
fi

summary
exit "$failed"
