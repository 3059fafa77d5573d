#!/usr/bin/env bash
# Set up the environment (quietly, to stderr) and run `freight demo` with any arguments.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash "$ROOT/scripts/setup.sh" >&2
exec "$ROOT/.venv/bin/freight" demo "$@"
