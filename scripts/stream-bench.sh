#!/usr/bin/env bash
# The disaggregated-prefill benchmarks (docs/stream.md): pipe, channel, storage and
# cache engine between two processes (on GPUs when there are: the receiver on the next
# one, or on the same one on a one-GPU machine), the seed's overlap run, and the cache
# engine against (pinned) host memory in one process. scripts/gpu-test.sh runs it with
# the seed's sizes; on a CPU-only machine, smaller ones do. Writes stream-*.json into
# $1 and prints a short table last.
#   NUM_OBJS (500), OBJ_SIZE (32MiB), ROUNDS (5), BUFFER (4GiB): the seed's sizes;
#   DEVICE (auto), TRANSPORT (auto: or shm, tcp, cuda), KV_LAYERS (32: 33.5 MB chunks);
#   FREIGHT: the command (default: python3 -m freight); ONLY: names of the benchmarks to
#   run (for example ONLY="cache-local pipe"; default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
N="${NUM_OBJS:-500}"
ROUNDS="${ROUNDS:-5}"
BUFFER="${BUFFER:-4GiB}"
DEVICE="${DEVICE:-auto}"
OBJ="${OBJ_SIZE:-32MiB}"
LAYERS="${KV_LAYERS:-32}"
read -r -a FREIGHT <<<"${FREIGHT:-$PY -m freight}"
rc=0
bench() { # bench NAME ARGS...
    local name=$1
    shift
    [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return
    echo "[stream-bench] freight bench $*"
    if ! timeout 300 "${FREIGHT[@]}" bench "$@" --json >"$OUT/stream-$name.json" 2>"$OUT/stream-$name.log"; then
        echo "[stream-bench] $name FAILED:"
        tail -20 "$OUT/stream-$name.log"
        rc=1
    fi
}
common=(--num-rounds "$ROUNDS" --buffer-size "$BUFFER" --device "$DEVICE" ${TRANSPORT:+--transport "$TRANSPORT"})
bench pipe pipe --num-objs "$N" --obj-size "$OBJ" "${common[@]}"
bench channel channel --num-objs "$N" --obj-size "$OBJ" --batch-size 32 "${common[@]}"
bench storage storage --num-objs "$N" --obj-size "$OBJ" --commit-size 128 "${common[@]}"
bench cache-engine cache-engine --num-chunks "$N" --kv-layers "$LAYERS" "${common[@]}"
bench cache-engine-paged cache-engine --num-chunks "$N" --kv-layers "$LAYERS" --block-size 16 "${common[@]}"
# The same with each commit waited for as soon as it is sealed: what overlapping commits gains.
bench cache-engine-serial cache-engine --num-chunks "$N" --kv-layers "$LAYERS" --commits-in-flight 0 "${common[@]}"
# And with two commits awaiting the receiver: whether a deeper pipeline than the default gains.
bench cache-engine-deep cache-engine --num-chunks "$N" --kv-layers "$LAYERS" --commits-in-flight 2 "${common[@]}"
bench cache-local cache-engine --role local --num-chunks "$N" --kv-layers "$LAYERS" --num-rounds "$ROUNDS" --device "$DEVICE"
bench pipe-work pipe --num-objs "$N" --obj-size "$OBJ" --simulate-work --num-rounds 2 --buffer-size "$BUFFER" \
    --device "$DEVICE" ${TRANSPORT:+--transport "$TRANSPORT"}
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
print("\n| benchmark | result |\n| --- | --- |")
for name in ["pipe", "channel", "storage", "cache-engine", "cache-engine-paged", "cache-engine-serial",
             "cache-engine-deep", "pipe-work",
             "cache-local"]:
    path = os.path.join(out, f"stream-{name}.json")
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        print(f"| {name} | no result |")
        continue
    if name == "cache-local":
        p = d.get("pinned_gbps")
        pinned = (f" of pinned {p['gpu_to_host']:.1f} / {p['host_to_gpu']:.1f}" if p else "")
        print(f"| {name} | store {d['store_gbps']['mean']:.1f}, retrieve {d['retrieve_gbps']['mean']:.1f} GB/s{pinned} |")
        continue
    t = d["throughput_gbps"]
    extra = f", pure transfer {d['pure_transfer_gbps']:.1f}" if d.get("pure_transfer_gbps") else ""
    print(f"| {name} | {t['mean']:.1f} +- {t['std']:.1f} GB/s over {len(t['rounds'])} rounds{extra} |")
PYEOF
exit "$rc"
