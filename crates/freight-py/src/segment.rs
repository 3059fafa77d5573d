//! Shared segments handed to Python as the base object of `Agent.alloc` arrays.

use std::sync::Arc;

use freight_core::SharedSegment;
use pyo3::prelude::*;

/// Host memory in a shared segment (memfd) that same-host peers can map. This is the
/// `.base` of the numpy array returned by `Agent.alloc`: the memory lives as long as the
/// array, or as long as it is registered, whichever is longer.
#[pyclass(frozen, name = "SharedSegment", module = "freight")]
pub struct PySharedSegment {
    pub(crate) seg: Arc<SharedSegment>,
}

#[pymethods]
impl PySharedSegment {
    /// Address of the first byte in this process.
    #[getter]
    fn addr(&self) -> u64 {
        self.seg.addr()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.seg.len()
    }

    /// Process-local segment id.
    #[getter]
    fn id(&self) -> u64 {
        self.seg.id()
    }

    fn __len__(&self) -> usize {
        self.seg.len()
    }

    fn __repr__(&self) -> String {
        format!("<freight.SharedSegment id={} addr={:#x} nbytes={}>", self.seg.id(), self.seg.addr(), self.seg.len())
    }
}
