#!/usr/bin/env bash
# Two "hosts" on this machine: network namespaces joined by veth pairs, each pair a NIC
# of its own with a subnet of its own. Traffic stays inside the two namespaces.
#
#   scripts/netns.sh up N [DELAY_MS]   # N pairs: 10.77.I.1 (side a) <-> 10.77.I.2 (side b),
#                                      # optional netem delay on side a (each direction's RTT
#                                      # grows by DELAY_MS)
#   scripts/netns.sh exec a|b CMD...   # run CMD in a side's namespace
#   scripts/netns.sh down              # remove both namespaces and their pairs
#
# FREIGHT_NETNS (default "freight") names the namespaces ($FREIGHT_NETNS-a, -b) and the
# interfaces (${FREIGHT_NETNS}a0 on side a, ${FREIGHT_NETNS}b0 on side b...), so that
# several sets can coexist. Needs root and iproute2 (tc for the delay).
set -euo pipefail
P="${FREIGHT_NETNS:-freight}"
A="$P-a" B="$P-b"

down() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
}

case "${1:-}" in
up)
    n="${2:?how many veth pairs}" delay="${3:-0}"
    [ "${#P}" -le 11 ] || { echo "netns.sh: FREIGHT_NETNS must be at most 11 characters" >&2; exit 2; }
    down
    trap 'down' ERR
    ip netns add "$A"
    ip netns add "$B"
    ip -n "$A" link set lo up
    ip -n "$B" link set lo up
    for ((i = 0; i < n; i++)); do
        ip link add "${P}a$i" netns "$A" type veth peer name "${P}b$i" netns "$B"
        ip -n "$A" addr add "10.77.$i.1/24" dev "${P}a$i"
        ip -n "$B" addr add "10.77.$i.2/24" dev "${P}b$i"
        ip -n "$A" link set "${P}a$i" up
        ip -n "$B" link set "${P}b$i" up
        if [ "$delay" != 0 ]; then
            ip netns exec "$A" tc qdisc add dev "${P}a$i" root netem delay "${delay}ms"
        fi
    done
    # A veth pair carries traffic a moment after both ends are up; programs that list
    # the interfaces that run (libfabric's providers do) must not start before.
    for ((t = 0; t < 50; t++)); do
        waiting=0
        for ((i = 0; i < n; i++)); do
            for side in a b; do
                ns="$A"; [ "$side" = b ] && ns="$B"
                ip -n "$ns" -br link show dev "${P}$side$i" | grep -q ' UP ' || waiting=1
            done
        done
        [ "$waiting" = 0 ] && break
        sleep 0.1
    done
    ;;
exec)
    side="${2:?a or b}"
    shift 2
    case "$side" in a) ns="$A" ;; b) ns="$B" ;; *) echo "netns.sh: side is a or b" >&2; exit 2 ;; esac
    exec ip netns exec "$ns" "$@"
    ;;
down)
    down
    ;;
*)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
