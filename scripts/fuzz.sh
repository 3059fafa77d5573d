#!/usr/bin/env bash
# Fuzzes every decoder that reads a peer's bytes (crates/freight-fuzz says what each
# target checks) with cargo fuzz: libFuzzer and the address sanitizer, on nightly.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]    each target for SECONDS (default 30), from
#                                            its committed corpus; what it finds new goes
#                                            to a scratch corpus under fuzz/target/
#   FUZZ_GROW=1 scripts/fuzz.sh 600          the same, adding what it finds to the
#                                            committed corpus, then minimizing that
#                                            (cargo fuzz cmin): how the corpora grow
#   FUZZ_JOBS=2                              targets run this many at a time (default 1)
#
# Installs the nightly toolchain (minimal profile) and cargo-fuzz where they are
# missing. A crash stops the run with its input under fuzz/artifacts/<target>/; add it
# to the corpus once fixed, so that `make test` replays it from then on.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECONDS_EACH="${1:-30}"
shift || true
TARGETS=("$@")
if [ "${#TARGETS[@]}" -eq 0 ]; then
    mapfile -t TARGETS < <(ls fuzz/fuzz_targets | sed 's/\.rs$//')
fi
JOBS="${FUZZ_JOBS:-1}"
# The sanitizer builds live in fuzz/target, never in the project's own target directory.
unset CARGO_TARGET_DIR

say() { printf '[fuzz] %s\n' "$*"; }

if [ -f "$HOME/.cargo/env" ] && ! command -v cargo >/dev/null 2>&1; then
    . "$HOME/.cargo/env"
fi
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    say "installing the nightly toolchain (cargo fuzz needs it)"
    rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    say "installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

say "building the targets"
cargo +nightly fuzz build

run_one() {
    local t="$1" log="fuzz/target/$1.log"
    local corpus=("fuzz/corpus/$t")
    if [ "${FUZZ_GROW:-0}" != "1" ]; then
        mkdir -p "fuzz/target/scratch/$t"
        corpus=("fuzz/target/scratch/$t" "fuzz/corpus/$t")
    fi
    # 2 GiB of memory at most, 64 KiB inputs at most, no leak detection (the engine keeps
    # process-wide tables on purpose).
    if cargo +nightly fuzz run "$t" "${corpus[@]}" -- \
        -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -max_len=65536 -detect_leaks=0 -print_final_stats=1 \
        >"$log" 2>&1; then
        local runs
        runs="$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')"
        say "$t: ${SECONDS_EACH}s, ${runs:-?} inputs, no crash"
    else
        say "$t: FAILED (see $log and fuzz/artifacts/$t/)"
        tail -40 "$log"
        return 1
    fi
    if [ "${FUZZ_GROW:-0}" = "1" ]; then
        cargo +nightly fuzz cmin "$t" "fuzz/corpus/$t" >/dev/null 2>&1
        say "$t: corpus minimized to $(ls "fuzz/corpus/$t" | wc -l) inputs"
    fi
}

mkdir -p fuzz/target
failed=0
running=0
for t in "${TARGETS[@]}"; do
    run_one "$t" &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then
        wait -n || failed=1
        running=$((running - 1))
    fi
done
while [ "$running" -gt 0 ]; do
    wait -n || failed=1
    running=$((running - 1))
done
exit "$failed"
