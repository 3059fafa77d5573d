//! What Python can ask about the GPUs freight sees.

use std::collections::HashMap;

use pyo3::prelude::*;

/// ``(True, "")`` where CUDA is usable (driver loaded, a GPU present), else
/// ``(False, reason)``. Loads the driver on first call; never raises.
#[pyfunction]
pub fn cuda_status(py: Python<'_>) -> (bool, String) {
    py.detach(|| match freight_cuda::unavailable_reason() {
        None => (true, String::new()),
        Some(reason) => (false, reason),
    })
}

/// Compiles the batched copy kernel for `arch` (for example ``"sm_90"``) with NVRTC and
/// returns the size of the cubin. Needs NVRTC only, no GPU: a compile check.
#[pyfunction]
pub fn compile_copy_kernel(py: Python<'_>, arch: &str) -> PyResult<usize> {
    py.detach(|| freight_cuda::kernel::compile(arch)).map(|c| c.len()).map_err(crate::errors::to_py_err)
}

/// Blocks of each launch shape of the copy kernel that one SM of GPU ``device`` (as this
/// process numbers them) holds at once: ``{(mode, threads): blocks}``. A configured
/// ``cuda_kernel_blocks_per_sm`` above that launches only as many. Loads the kernel.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub fn copy_kernel_occupancy(py: Python<'_>, device: usize) -> PyResult<HashMap<(String, u32), u32>> {
    use freight_core::{KernelMode, LaunchShape};
    use freight_cuda::kernel::{Kernel, THREADS};
    py.detach(|| {
        let kernel = Kernel::on(freight_cuda::Device::get(device)?)?;
        let mut out = HashMap::new();
        for mode in KernelMode::ALL {
            for threads in THREADS {
                let shape = LaunchShape { mode, threads, blocks_per_sm: 1 };
                out.insert((mode.as_str().to_string(), threads), kernel.resident_per_sm(&shape));
            }
        }
        Ok(out)
    })
    .map_err(crate::errors::to_py_err)
}
