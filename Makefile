# freight developer entry points. `make test` is what CI (.ci/run) runs.
VENV := .venv
export CARGO_TARGET_DIR ?= $(CURDIR)/target

.PHONY: demo test gpu-test wheel bench fmt lint setup fuzz

setup:
	bash scripts/setup.sh

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

# GPU tests and benchmarks beside NIXL, on a machine with two GPUs (docs/bench-gpu.md)
gpu-test:
	bash scripts/gpu-test.sh

# The release wheel into dist/: abi3 (one wheel for CPython >= 3.9), manylinux_2_28
# (linked by zig against glibc 2.28, whatever this machine's glibc: Debian 11, RHEL 8,
# Amazon Linux 2023 ...), its library stripped, LICENSE inside; then checked
# (scripts/wheel-check.sh: auditwheel, a clean install and a transfer on 3.9 and 3.13).
# A target dir of its own: zig's C compiler would otherwise rebuild the tree's.
wheel:
	FREIGHT_SKIP_BUILD=1 bash scripts/setup.sh
	$(VENV)/bin/python -m pip install -q "ziglang>=0.13"
	rm -f dist/freight-*.whl
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR)/manylinux PATH="$(CURDIR)/$(VENV)/bin:$$PATH" \
		$(VENV)/bin/maturin build --release --zig --compatibility manylinux_2_28 -o dist
	bash scripts/wheel-check.sh

# every engine benchmark with its peer (iperf3, memcpy); see docs/bench-engine.md
bench: setup
	cargo build --release -p freight-cli
	python3 bench/engine.py --machine "$$(hostname)" --freight $(CARGO_TARGET_DIR)/release/freight

# a short pass of every fuzz target (nightly and cargo-fuzz, installed if missing;
# FUZZ_SECONDS each, default 30): docs/fuzzing.md
fuzz:
	bash scripts/fuzz.sh $(or $(FUZZ_SECONDS),30)

fmt:
	cargo fmt --all

lint:
	cargo clippy --workspace --all-targets
	cargo fmt --all --check
