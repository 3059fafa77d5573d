#!/usr/bin/env bash
# The network benchmarks in one call, on a machine that may lack the Debian packages
# they need: bench/netns.py (tcp and fabric over 1, 2 and 4 veth pairs beside iperf3,
# delays where netem exists, the window / chunk size / pinning table), then
# `freight bench p2p --full-mesh` with 2 and 4 processes (a GPU each, in turn, where GPUs
# exist). Needs root. Results go to $OUT (default: build/net-results); MACHINE names the
# machine in them.
#
# iproute2, iperf3 and libfabric come from the system, or else from Debian packages in
# .carry/debs (apt-get download iproute2 iperf3 libiperf0 libsctp1 libfabric1
# libibverbs1 librdmacm1 ibverbs-providers libpsm-infinipath1 libpsm2-2 libnl-3-200
# libnl-route-3-200 libnuma1 libbpf1 libelf1 libmnl0 libcap2 libxtables12 libatomic1),
# unpacked under /tmp by scripts/carried-debs.sh (nothing is installed). The freight
# wheel comes from dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/net-results}"
MACHINE="${MACHINE:-$(nproc)-CPU $(uname -m) host}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
log() { echo "[net-bench] $*"; }

source scripts/carried-debs.sh
site=/tmp/freight-net-site
rm -rf "$site"
wheel=$(ls -t dist/freight-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { log "no wheel in dist/: build one with 'make wheel'"; exit 1; }
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -m freight doctor | sed -n '/libfabric/,$p'

"$PY" bench/netns.py --machine "$MACHINE" --freight "$PY -m freight" --out "$OUT/netns.json" | tee "$OUT/netns.txt"
for n in 2 4; do
    "$PY" -m freight bench p2p --full-mesh "$n" --block-sizes 64MiB --duration 3s --json > "$OUT/mesh-$n.json"
    "$PY" -m freight bench p2p --full-mesh "$n" --block-sizes 64MiB --duration 3s --transport tcp --json \
        > "$OUT/mesh-$n-tcp.json"
done
log "full mesh (GB/s sent per process, total):"
for f in "$OUT"/mesh-*.json; do
    "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit("/",1)[1], d["results"][0]["transport"], [round(r["gbps"],2) for r in d["results"]], round(d["total_gbps"],2), "verified" if d["verified"] else "NOT VERIFIED")' "$f"
done
tail -25 "$OUT/netns.txt"
