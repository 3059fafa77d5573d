#!/usr/bin/env bash
# Checks a release wheel as a user's machine would see it:
#   1. auditwheel: its platform tag holds (manylinux_2_28: glibc 2.28 and the libraries
#      every such system has; nothing else linked);
#   2. LICENSE is in it, and its library carries no debug info (its size is printed);
#   3. it installs with pip into a clean virtualenv of the oldest and of the newest
#      CPython it claims (3.9 and 3.13; each found on PATH or under pyenv, skipped with a
#      message where absent), and a smoke test passes there: import, a transfer between
#      two agents checked byte for byte, the `freight` command.
# Usage: scripts/wheel-check.sh [WHEEL]   (default: the newest dist/freight-*.whl)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
say() { printf '[wheel-check] %s\n' "$*"; }
fail() { say "FAILED: $*"; exit 1; }

WHEEL="${1:-$(ls -t "$ROOT"/dist/freight-*.whl 2>/dev/null | head -1)}"
[ -n "$WHEEL" ] && [ -f "$WHEEL" ] || fail "no wheel given and none in dist/ (make wheel builds one)"
say "wheel: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
case "$(basename "$WHEEL")" in
    *manylinux_2_28_x86_64*|*manylinux2014*|*manylinux_2_17*) ;;
    *) fail "the wheel is not tagged manylinux_2_28 or older: $(basename "$WHEEL")" ;;
esac

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# 1. auditwheel, in a virtualenv of its own.
python3 -m venv "$WORK/audit"
"$WORK/audit/bin/python" -m pip install -q auditwheel
"$WORK/audit/bin/auditwheel" show "$WHEEL" | tee "$WORK/audit.txt"
# (auditwheel wraps its lines: compare with the whitespace folded.)
tr -s ' \n' '  ' < "$WORK/audit.txt" | grep -q 'is consistent with the following platform tag: "manylinux_2_28_x86_64"' \
    || fail "auditwheel does not find the wheel consistent with manylinux_2_28"

# 2. LICENSE, and a library without debug info.
python3 - "$WHEEL" "$WORK/lib.so" <<'EOF' || fail "LICENSE or the library"
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
assert lic, "no LICENSE in the wheel's dist-info: " + ", ".join(n for n in names if ".dist-info/" in n)
assert "Apache License" in z.read(lic[0]).decode(), "LICENSE is not the Apache License"
so = [n for n in names if n.endswith(".so")]
assert len(so) == 1, so
open(sys.argv[2], "wb").write(z.read(so[0]))
print(f"[wheel-check] {so[0]}: {z.getinfo(so[0]).file_size / 2**20:.1f} MiB; {lic[0]}")
EOF
# No debug sections or symbol table left (its strings may still name them: std's symbolizer).
if readelf -SW "$WORK/lib.so" | grep -Eq '\.debug_|\.symtab'; then
    fail "the library keeps debug info or symbols: $(readelf -SW "$WORK/lib.so" | grep -Eo '\.(debug_[a-z_]+|symtab)' | tr '\n' ' ')"
fi

# 3. A clean virtualenv of each end of the supported range.
find_python() {  # an interpreter of version $1 that runs (a pyenv shim may not)
    local v="$1" root="${PYENV_ROOT:-$HOME/.pyenv}" py
    for py in $(ls -d "$root"/versions/"$v".*/bin/python 2>/dev/null | sort -V -r) $(command -v "python$v" 2>/dev/null); do
        if "$py" -c 'import sys, venv; sys.exit(0)' >/dev/null 2>&1; then
            echo "$py"
            return
        fi
    done
}
SMOKE='
import numpy as np, freight
with freight.Agent("smoke-target") as t, freight.Agent("smoke-initiator") as i:
    dst = t.alloc(1 << 20); t.register(dst)
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8); i.register(src)
    i.add_peer(t.metadata())
    i.transfer("WRITE", [src], "smoke-target", [dst]).wait(timeout=30)
    assert bytes(np.frombuffer(dst, np.uint8)) == src.tobytes(), "the bytes differ"
print("smoke ok:", freight.__version__)
'
tested=0
for v in 3.9 3.13; do
    py="$(find_python "$v" || true)"
    if [ -z "$py" ]; then
        say "no CPython $v on this machine: not tested there"
        continue
    fi
    say "CPython $v ($py): a clean virtualenv"
    "$py" -m venv "$WORK/py$v"
    "$WORK/py$v/bin/python" -m pip install -q "$WHEEL"
    (cd "$WORK" && "$WORK/py$v/bin/python" -c "$SMOKE") || fail "the smoke test on CPython $v"
    (cd "$WORK" && "$WORK/py$v/bin/freight" --version) || fail "the freight command on CPython $v"
    tested=$((tested + 1))
done
[ "$tested" -gt 0 ] || fail "no CPython to test the wheel in"
say "passed ($tested interpreters)"
