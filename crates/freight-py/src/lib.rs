//! Python bindings for freight: `freight._native`, wrapped by the pure-Python package
//! `freight` (python/freight). The bindings only convert values, map errors and release
//! the GIL around every call that may block; conveniences live in Python.

use pyo3::prelude::*;

/// The engine's own allocations (descriptor lists, plans, compiled programs: megabytes
/// per request of 65,536 blocks) come from mimalloc, which keeps freed memory for the
/// next request instead of handing it back to the kernel and faulting it in again, as
/// glibc does for blocks this large: building such a request took 1.7 times as long
/// (docs/bench-engine.md). Python's own objects are not affected.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod agent;
mod cache;
mod cli;
mod config;
mod descs;
mod ep;
mod errors;
mod etcd;
mod gpu;
mod interrupt;
mod kv;
mod logging;
mod metadata;
mod request;
mod segment;
mod stream;
mod util;

/// Native core of freight. Use the `freight` package instead of this module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<agent::PyAgent>()?;
    m.add_class::<config::PyAgentConfig>()?;
    m.add("TRANSPORTS", pyo3::types::PyTuple::new(m.py(), config::TRANSPORTS)?)?;
    m.add_class::<descs::PyDescList>()?;
    m.add_class::<descs::PyPreparedLocal>()?;
    m.add_class::<descs::PyPreparedRemote>()?;
    m.add_class::<request::PyRequest>()?;
    m.add_class::<segment::PySharedSegment>()?;
    m.add_class::<etcd::PyEtcdDirectory>()?;
    m.add_class::<stream::PyPipeListener>()?;
    m.add_class::<stream::PyPipeReceiver>()?;
    m.add_class::<stream::PyMessage>()?;
    m.add_class::<stream::PyPipeSender>()?;
    m.add_class::<stream::PyChannelSender>()?;
    m.add_class::<stream::PyChannelReceiver>()?;
    m.add_class::<stream::PyReceived>()?;
    m.add_class::<stream::PyStoreSender>()?;
    m.add_class::<stream::PyStoreReceiver>()?;
    m.add_class::<stream::PyStoredObject>()?;
    m.add_class::<cache::PyCacheEngine>()?;
    // freight.kv.Server, as it is named there.
    m.add("KvServer", m.py().get_type::<kv::PyKvServer>())?;
    m.add_class::<kv::PyKvClient>()?;
    m.add_class::<ep::PyRankServer>()?;
    m.add_class::<ep::PyGroup>()?;
    m.add_class::<ep::PyBuffer>()?;
    m.add_function(wrap_pyfunction!(ep::compile_ep_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(logging::set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(logging::_init_logging_from_env, m)?)?;
    m.add_function(wrap_pyfunction!(logging::reload_log_levels, m)?)?;
    m.add_function(wrap_pyfunction!(logging::_flush_logs, m)?)?;
    logging::install(m.py())?;
    m.add_function(wrap_pyfunction!(cli::cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(metadata::inspect_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::compile_copy_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::copy_kernel_occupancy, m)?)?;
    m.add_function(wrap_pyfunction!(stream::release_pooled_memory, m)?)?;
    m.add_function(wrap_pyfunction!(host_has_spare_cores, m)?)?;
    m.add_function(wrap_pyfunction!(descs::normalize_kind, m)?)?;
    Ok(())
}

/// Whether this host has cores to spare for the engine's polling and copy threads: the
/// engine's own answer (`freight_core::poll`), where it is not, it sleeps instead of
/// polling and copies more on the posting thread.
#[pyfunction]
fn host_has_spare_cores() -> bool {
    freight_host::poll::polling_pays()
}
