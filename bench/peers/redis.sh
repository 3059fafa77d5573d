#!/usr/bin/env bash
# Redis 7 from Debian's packages, for machines that cannot reach a package mirror.
#
#   bench/peers/redis.sh download DIR    # on Debian 12 with network: the .debs into DIR
#   bench/peers/redis.sh unpack DIR DEST  # anywhere: DEST/bin/redis-{server,cli,benchmark}
#
# The packages include their C library and loader, and the commands in DEST/bin start
# Redis through that loader (named by its real path: /lib64 holds an absolute link to
# the host's), so they run on any x86-64 Linux whatever its own libraries.
# bench/kv.py finds them on PATH.
set -euo pipefail
PACKAGES="redis-server redis-tools liblzf1 libjemalloc2 libssl3 libsystemd0 libatomic1 libstdc++6
          libgcc-s1 libcap2 libgcrypt20 liblzma5 libzstd1 liblz4-1 libgpg-error0 libc6"

case "${1:-}" in
download)
    mkdir -p "$2" && cd "$2"
    # shellcheck disable=SC2086 - one word per package
    apt-get download $PACKAGES
    ;;
unpack)
    src=$(cd "$2" && pwd) dest="$3"
    mkdir -p "$dest/root" "$dest/bin"
    for deb in "$src"/*.deb; do
        if command -v dpkg-deb >/dev/null; then
            dpkg-deb -x "$deb" "$dest/root"
        else
            (tmp=$(mktemp -d) && cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$dest/root" && rm -rf "$tmp")
        fi
    done
    root=$(cd "$dest/root" && pwd)
    for cmd in redis-server redis-cli redis-benchmark; do
        [ -e "$root/usr/bin/$cmd" ] || { echo "redis.sh: $cmd is not in the packages of $src" >&2; exit 1; }
        cat > "$dest/bin/$cmd" <<WRAP
#!/bin/sh
exec "$root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$root/lib/x86_64-linux-gnu:$root/usr/lib/x86_64-linux-gnu" "$root/usr/bin/$cmd" "\$@"
WRAP
        chmod +x "$dest/bin/$cmd"
    done
    "$dest/bin/redis-server" --version
    ;;
*)
    sed -n '2,10p' "$0" >&2
    exit 2
    ;;
esac
