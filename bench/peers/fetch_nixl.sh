#!/usr/bin/env bash
# Downloads the NIXL wheel (nixl-cu13 1.5.1, the PyPI build against CUDA 13), trims it to
# what the peer benchmark needs and packs it as one tar.xz small enough to copy to a GPU
# machine without network access.
#
#   bench/peers/fetch_nixl.sh [OUT.tar.xz]      (default: .carry/nixl_trim.tar.xz in the repository)
#
# Kept: the nixl_cu13 package, its bundled libraries and the UCX, LIBFABRIC and POSIX
# plugins. Removed: nixl_cu13-*.data/, nixl_ep_cu13/ (built against a newer PyTorch), the
# other plugins, the aws/azure/s2n libraries and UCX's perftest modules.
# On the GPU machine: mkdir -p /tmp/nixl && tar -xJf OUT.tar.xz -C /tmp/nixl, then
# python3 bench/peers/nixl_p2p.py --nixl-dir /tmp/nixl.
# Running it again rebuilds the archive from a fresh download, byte for byte the same.
set -euo pipefail

VERSION=1.5.1
PKG="nixl-cu13==${VERSION}"
KEEP_PLUGINS="UCX LIBFABRIC POSIX"

die() { echo "fetch_nixl: error: $*" >&2; exit 1; }
say() { echo "fetch_nixl: $*" >&2; }

root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.carry/nixl_trim.tar.xz}  # a relative OUT is taken from the current folder
case $out in /*) ;; *) out="$PWD/$out" ;; esac

for tool in unzip tar xz; do
    command -v "$tool" >/dev/null || die "'$tool' is not installed"
done
python=${PYTHON:-python3}
"$python" -m pip --version >/dev/null 2>&1 || die "'$python -m pip' is not available"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

say "downloading $PKG (wheel for CPython 3.12, manylinux_2_28_x86_64)"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --dest "$work/dl" "$PKG" \
    || die "pip download of $PKG failed (network or index problem?)"
shopt -s nullglob
wheels=("$work"/dl/nixl_cu13-"$VERSION"-*.whl)
[ ${#wheels[@]} -eq 1 ] || die "expected one nixl_cu13 $VERSION wheel, found ${#wheels[@]}"
say "wheel: $(basename "${wheels[0]}") ($(du -h "${wheels[0]}" | cut -f1))"

tree="$work/tree"
mkdir -p "$tree"
unzip -q "${wheels[0]}" -d "$tree" || die "could not unzip the wheel"
[ -d "$tree/nixl_cu13" ] || die "the wheel has no nixl_cu13/ package; layout changed?"

# nixl_cu13-*.data/ and nixl_ep_cu13/
rm -rf "$tree"/nixl_cu13-*.data "$tree"/nixl_ep_cu13

# plugins other than the kept ones, in both plugin folders
keep_plugin() {
    local base=$1 p
    for p in $KEEP_PLUGINS; do
        case $base in libplugin_"$p".so | libplugin_"$p".so.* | libplugin_"$p"-*.so*) return 0 ;; esac
    done
    return 1
}
nplugins=0
for dir in "$tree"/.nixl_cu13.mesonpy.libs/plugins "$tree"/nixl_cu13.libs/nixl; do
    [ -d "$dir" ] || { say "note: no plugin folder ${dir#"$tree"/}"; continue; }
    for f in "$dir"/libplugin_*; do
        if keep_plugin "$(basename "$f")"; then
            nplugins=$((nplugins + 1))
        else
            rm -rf "$f"
        fi
    done
done
[ "$nplugins" -gt 0 ] || die "no UCX/LIBFABRIC/POSIX plugin left after trimming; layout changed?"

# aws/azure/s2n libraries, UCX perftest modules
find "$tree" \( -iname '*aws*' -o -iname '*azure*' -o -iname '*s2n*' \) -prune -exec rm -rf {} +
find "$tree" -iname '*perftest*' -prune -exec rm -rf {} +

ls "$tree"/.nixl_cu13.mesonpy.libs/plugins/libplugin_UCX* "$tree"/nixl_cu13.libs/nixl/libplugin_UCX* \
    >/dev/null 2>&1 || die "the UCX plugin is missing after trimming"

mkdir -p "$(dirname "$out")"
say "packing $(du -sh "$tree" | cut -f1) into $out"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cJf "$out.tmp" -C "$tree" . \
    || die "tar failed"
mv -f "$out.tmp" "$out"
bytes=$(stat -c %s "$out")
say "wrote $out ($bytes bytes)"
[ "$bytes" -lt $((20 << 20)) ] || die "archive is $bytes bytes, over 20 MiB"
