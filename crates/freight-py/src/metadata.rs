//! Read-only view of metadata bytes (what a peer advertises).

use freight_proto::metadata::AgentMetadata;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::OrRaise;

/// Decodes and validates agent metadata (MetadataError if malformed) and returns what
/// it advertises: name, agent_id, addresses, transports, host (hostname, pid) and
/// regions, a list of dicts (key, kind, addr, length, device, shared). The secret it
/// carries is not returned.
#[pyfunction]
pub fn inspect_metadata<'py>(py: Python<'py>, metadata: Vec<u8>) -> PyResult<Bound<'py, PyDict>> {
    let md = py.detach(|| AgentMetadata::decode(&metadata)).or_raise()?;
    let d = PyDict::new(py);
    d.set_item("name", &md.name)?;
    d.set_item("agent_id", md.agent_id)?;
    d.set_item("addresses", &md.addresses)?;
    d.set_item("transports", &md.transports)?;
    d.set_item("hostname", &md.host.hostname)?;
    d.set_item("pid", md.host.pid)?;
    let mut regions = Vec::with_capacity(md.regions.len());
    for r in &md.regions {
        let rd = PyDict::new(py);
        rd.set_item("key", r.key)?;
        rd.set_item("kind", r.kind.as_str())?;
        rd.set_item("addr", r.addr)?;
        rd.set_item("length", r.len)?;
        rd.set_item("device", r.dev)?;
        rd.set_item("shared", r.shared.is_some())?;
        regions.push(rd);
    }
    d.set_item("regions", regions)?;
    Ok(d)
}
