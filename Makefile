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

# abi3 release wheel (one wheel for CPython >= 3.9) into dist/
wheel:
	FREIGHT_SKIP_BUILD=1 bash scripts/setup.sh
	$(VENV)/bin/maturin build --release -o dist

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
