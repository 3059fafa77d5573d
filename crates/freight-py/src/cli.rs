//! The `freight` command line, reachable as `python -m freight` and the `freight` script.

use pyo3::prelude::*;

/// Runs the freight command line. `argv` is the full argument vector (`argv[0]` is the
/// program name); `self_command` is how the CLI starts more copies of itself (e.g.
/// [sys.executable, "-m", "freight"]). Returns the exit status (0 ok, 1 failure, 2 usage).
/// Blocks without holding the GIL.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<String>, self_command: Vec<String>) -> i32 {
    py.detach(move || freight_cli::run(argv, self_command))
}
