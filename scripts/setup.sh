#!/usr/bin/env bash
# Prepare a development environment for freight. Idempotent: safe to run many times.
#
#   1. system packages (Debian/Ubuntu, apt-get): protoc, etcd, iperf3, iproute2, libfabric, C toolchain,
#      pkg-config
#   2. Rust toolchain check (cargo >= 1.80)
#   3. Python virtualenv at .venv with maturin, numpy, pytest, pytest-timeout, aiohttp, prometheus_client,
#      mypy (type checks of the package and its native stubs)
#   4. build the extension and install it into .venv (maturin develop --release)
#
# Environment:
#   FREIGHT_SKIP_APT=1    do not touch system packages
#   FREIGHT_SKIP_BUILD=1  do not build/install the wheel (step 4)
#   PYTHON=python3.x      interpreter used to create .venv (default: python3)
#   CARGO_TARGET_DIR      shared cargo target dir (default: <repo>/target)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
MIN_CARGO="1.80"
# One target dir for `maturin develop`, `maturin build` and `cargo test`.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"

say()  { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] WARNING: %s\n' "$*" >&2; }
die()  { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- 1. system packages
have() { command -v "$1" >/dev/null 2>&1; }

pkg_installed() {
    have dpkg-query || return 1
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

missing_pkgs=()
need_pkg() { # need_pkg PACKAGE [COMMAND-THAT-IT-PROVIDES]
    local pkg="$1" cmd="${2:-}"
    if [ -n "$cmd" ] && have "$cmd"; then return 0; fi
    if pkg_installed "$pkg"; then return 0; fi
    missing_pkgs+=("$pkg")
}

if [ "${FREIGHT_SKIP_APT:-0}" = "1" ]; then
    say "FREIGHT_SKIP_APT=1: skipping system packages"
else
    need_pkg protobuf-compiler protoc    # etcd-client build (prost/tonic)
    need_pkg etcd-server etcd            # metadata exchange tests
    need_pkg iperf3 iperf3               # benchmark reference
    need_pkg iproute2 ip                 # two hosts in network namespaces (scripts/netns.sh)
    need_pkg libfabric1                  # the fabric transport's tests (tcp and shm providers)
    if ! have cc || ! have make; then need_pkg build-essential; fi
    need_pkg pkg-config pkg-config
    # Debian's python3 needs python3-venv for `python3 -m venv` (ensurepip).
    if [ "$(command -v "$PYTHON" 2>/dev/null || true)" = "/usr/bin/python3" ] \
        && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        need_pkg python3-venv
    fi

    if [ "${#missing_pkgs[@]}" -eq 0 ]; then
        say "system packages: ok"
    elif ! have apt-get; then
        warn "no apt-get; please install these yourself: ${missing_pkgs[*]}"
    else
        SUDO=()
        if [ "$(id -u)" -ne 0 ]; then
            if have sudo; then
                SUDO=(sudo)
            else
                die "not root and no sudo; install: ${missing_pkgs[*]} (or set FREIGHT_SKIP_APT=1)"
            fi
        fi
        say "installing system packages: ${missing_pkgs[*]}"
        ${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        ${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}" >/dev/null
        say "system packages: installed"
    fi
fi

# ---------------------------------------------------------------- 2. Rust toolchain
if ! have cargo && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
rust_help() {
    cat >&2 <<'EOF'
[setup] freight needs Rust (cargo) >= 1.80. Install or update it with rustup:
[setup]     curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
[setup]     . "$HOME/.cargo/env"        # or open a new shell
[setup]     rustup update stable         # if rustup is already installed
EOF
}
if ! have cargo; then
    printf '[setup] ERROR: cargo not found\n' >&2
    rust_help
    exit 1
fi
cargo_version="$(cargo --version 2>/dev/null | awk '{print $2}')"
cargo_version="${cargo_version%%-*}"   # 1.80.0-nightly -> 1.80.0
ver_ge() { # ver_ge A B: A >= B (dotted numbers)
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}
if [ -z "$cargo_version" ] || ! ver_ge "$cargo_version" "$MIN_CARGO"; then
    printf '[setup] ERROR: cargo %s is too old (need >= %s)\n' "${cargo_version:-?}" "$MIN_CARGO" >&2
    rust_help
    exit 1
fi
say "cargo $cargo_version: ok"

# ---------------------------------------------------------------- 3. virtualenv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    have "$PYTHON" || die "$PYTHON not found (set PYTHON=/path/to/python3 >= 3.9)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
        || die "$PYTHON is older than 3.9"
    [ -e "$VENV" ] && { say "removing broken $VENV"; rm -rf "$VENV"; }
    say "creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV" \
        || die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

if "$VENV/bin/python" - >/dev/null 2>&1 <<'EOF'
import importlib.metadata as md, sys
def v(name):
    return tuple(int(p) for p in md.version(name).split(".")[:2] if p.isdigit())
import numpy, pytest, pytest_timeout, aiohttp, prometheus_client, mypy  # noqa: F401
ok = (1, 5) <= v("maturin") < (2, 0) and v("numpy") >= (1, 22) and v("pytest") >= (7,) and v("mypy") >= (1, 18)
sys.exit(0 if ok else 1)
EOF
then
    say "python tools in .venv: ok"
else
    say "installing python tools into .venv (maturin, numpy, pytest, pytest-timeout, mypy; aiohttp and prometheus_client for the P/D proxy)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "maturin>=1.5,<2" "numpy>=1.22" "pytest>=7" pytest-timeout \
        "aiohttp>=3.9" "prometheus_client>=0.16" "mypy>=1.18"
fi

# NVRTC from PyPI (no GPU needed): the tests compile the GPU copy kernel with it, so a
# kernel that stops compiling fails CI on machines without a GPU.
if [ "$(uname -m)" = "x86_64" ] && ! "$VENV/bin/python" -c 'import nvidia.cuda_nvrtc' >/dev/null 2>&1; then
    say "installing NVRTC into .venv (nvidia-cuda-nvrtc-cu12, for the kernel compile check)"
    "$VENV/bin/python" -m pip install -q "nvidia-cuda-nvrtc-cu12>=12.4" \
        || say "warning: NVRTC could not be installed; the kernel compile check will skip"
fi

# ---------------------------------------------------------------- 4. build + install
if [ "${FREIGHT_SKIP_BUILD:-0}" = "1" ]; then
    say "FREIGHT_SKIP_BUILD=1: skipping the wheel build"
    exit 0
fi

say "building freight (maturin develop --release, target dir $CARGO_TARGET_DIR)"
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
# Same interpreter for pyo3's build script here and in `cargo test` (scripts/test.sh),
# so the two builds share compiled dependencies.
export PYO3_PYTHON="$VENV/bin/python"
"$VENV/bin/maturin" develop --release -q
"$VENV/bin/python" -c 'import freight._native as n; print("[setup] freight._native", n.__version__, "installed")'
