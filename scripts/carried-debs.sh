# Sourced by the device-side scripts: where the system lacks iproute2, iperf3 or
# libfabric, unpacks the Debian packages in .carry/debs under /tmp (nothing is
# installed) and puts them on PATH and LD_LIBRARY_PATH. The list to download is in
# scripts/net-bench.sh.
if ! command -v ip >/dev/null || ! command -v iperf3 >/dev/null || ! "$(command -v ldconfig || echo /sbin/ldconfig)" -p | grep -q libfabric.so.1; then
    if ls .carry/debs/*.deb >/dev/null 2>&1; then
        root=/tmp/freight-debs
        echo "[debs] unpacking .carry/debs into $root"
        for d in .carry/debs/*.deb; do dpkg-deb -x "$d" "$root"; done
        export PATH="$root/usr/bin:$root/usr/sbin:$root/bin:$root/sbin:$PATH"
        export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
        echo "[debs] no .carry/debs: tools and libraries the system lacks stay missing"
    fi
fi
