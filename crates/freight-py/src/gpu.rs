//! What Python can ask about the GPUs freight sees.

use pyo3::prelude::*;

/// ``(True, "")`` where CUDA is usable (driver loaded, a GPU present), else
/// ``(False, reason)``. Loads the driver on first call; never raises.
#[pyfunction]
pub fn cuda_status(py: Python<'_>) -> (bool, String) {
    py.detach(|| match freight_core::cuda::unavailable_reason() {
        None => (true, String::new()),
        Some(reason) => (false, reason),
    })
}

/// Compiles the batched copy kernel for `arch` (for example ``"sm_90"``) with NVRTC and
/// returns the size of the cubin. Needs NVRTC only, no GPU: a compile check.
#[pyfunction]
pub fn compile_copy_kernel(py: Python<'_>, arch: &str) -> PyResult<usize> {
    py.detach(|| freight_core::cuda::kernel::compile(arch)).map(|c| c.len()).map_err(crate::errors::to_py_err)
}
