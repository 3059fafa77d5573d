//! The etcd metadata directory.

use std::sync::{Arc, PoisonError, RwLock};

use freight_core::exchange::etcd::EtcdDirectory;
use freight_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::errors::{invalid, to_py_err, OrRaise};
use crate::interrupt;
use crate::util::seconds;

/// A directory of agents' metadata in etcd. `endpoints` is one URL
/// ("http://127.0.0.1:2379"), a comma-separated string of them, or a list. Entries
/// published through this directory live under one lease of `ttl` seconds that a
/// background thread keeps alive: if this process dies, they vanish after `ttl`.
/// Every etcd call is bounded by `timeout` seconds. Use as a context manager, or call
/// `close()` to revoke the lease (withdrawing everything published) right away.
///
/// Raises EtcdError when etcd cannot be reached.
#[pyclass(frozen, name = "EtcdDirectory", module = "freight")]
pub struct PyEtcdDirectory {
    inner: RwLock<Option<Arc<EtcdDirectory>>>,
    endpoints: Vec<String>,
}

impl PyEtcdDirectory {
    fn get(&self) -> PyResult<Arc<EtcdDirectory>> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| to_py_err(Error::InvalidState("the etcd directory is closed".into())))
    }
}

impl Drop for PyEtcdDirectory {
    /// Revoking the lease may wait on etcd for up to `timeout`: not with the GIL held.
    fn drop(&mut self) {
        let dir = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if dir.is_some() {
            Python::attach(|py| py.detach(move || drop(dir)));
        }
    }
}

#[pymethods]
impl PyEtcdDirectory {
    #[new]
    #[pyo3(signature = (endpoints, prefix = "/freight/agents/", ttl = 10.0, timeout = 5.0))]
    fn new(py: Python<'_>, endpoints: &Bound<'_, PyAny>, prefix: &str, ttl: f64, timeout: f64) -> PyResult<Self> {
        let endpoints: Vec<String> = if let Ok(s) = endpoints.cast::<PyString>() {
            s.to_cow()?.split(',').map(str::trim).filter(|e| !e.is_empty()).map(str::to_owned).collect()
        } else {
            endpoints.extract().map_err(|_| invalid("endpoints must be a string or a list of strings"))?
        };
        let (ttl, timeout) = (seconds(ttl, "ttl")?, seconds(timeout, "timeout")?);
        let dir = py.detach(|| EtcdDirectory::connect(&endpoints, prefix, ttl, timeout)).or_raise()?;
        Ok(PyEtcdDirectory { inner: RwLock::new(Some(Arc::new(dir))), endpoints })
    }

    /// The key prefix (always ending in "/").
    #[getter]
    fn prefix(&self) -> PyResult<String> {
        Ok(self.get()?.prefix().to_string())
    }

    /// The etcd endpoints.
    #[getter]
    fn endpoints(&self) -> Vec<String> {
        self.endpoints.clone()
    }

    /// Puts `metadata` (bytes) under `prefix + name`, attached to this directory's lease.
    fn publish(&self, py: Python<'_>, name: &str, metadata: Vec<u8>) -> PyResult<()> {
        let dir = self.get()?;
        py.detach(move || dir.publish(name, &metadata)).or_raise()
    }

    /// The bytes under `prefix + name`, or None.
    fn fetch<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let dir = self.get()?;
        let v = py.detach(move || dir.fetch(name)).or_raise()?;
        Ok(v.map(|b| PyBytes::new(py, &b)))
    }

    /// Waits until `prefix + name` exists and returns its bytes; freight.TimeoutError
    /// after `timeout` seconds.
    #[pyo3(signature = (name, timeout = 10.0))]
    fn wait_for<'py>(&self, py: Python<'py>, name: &str, timeout: f64) -> PyResult<Bound<'py, PyBytes>> {
        let dir = self.get()?;
        let timeout = seconds(timeout, "timeout")?;
        let v = interrupt::detach(py, move || dir.wait_for(name, timeout))?;
        Ok(PyBytes::new(py, &v))
    }

    /// Deletes `prefix + name` (no error if absent) and stops re-publishing it.
    fn withdraw(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let dir = self.get()?;
        py.detach(move || dir.withdraw(name)).or_raise()
    }

    /// Names currently published under the prefix, sorted.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let dir = self.get()?;
        py.detach(move || dir.list()).or_raise()
    }

    /// Revokes the lease (everything published through this directory disappears) and
    /// disconnects. Idempotent.
    fn close(&self, py: Python<'_>) {
        let dir = self.inner.write().unwrap_or_else(PoisonError::into_inner).take();
        py.detach(|| drop(dir));
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let prefix = self.get().map(|d| d.prefix().to_string()).unwrap_or_else(|_| "<closed>".into());
        format!("<freight.EtcdDirectory {:?} prefix={prefix:?}>", self.endpoints)
    }
}
