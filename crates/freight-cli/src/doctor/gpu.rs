//! GPUs as the CUDA driver reports them (loaded at run time: a machine without one gets
//! the reason), where each sits on the PCI tree, which NICs are closest to it, and which
//! GPUs can address each other's memory.

use freight_cuda::{driver, Device};
use serde::Serialize;

use super::host::{closeness, pci_device, Closeness, Nic, Root};

#[derive(Debug, Serialize)]
pub struct Cuda {
    pub available: bool,
    /// Why CUDA cannot be used here, where it cannot.
    pub reason: Option<String>,
    /// The CUDA version the driver supports ("12.8").
    pub driver: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct NearNic {
    pub nic: String,
    pub closeness: Closeness,
}

#[derive(Debug, Serialize)]
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    pub pci: String,
    pub compute_capability: String,
    pub multiprocessors: u32,
    pub numa_node: Option<u32>,
    /// NICs with a PCI function, closest first.
    pub nics: Vec<NearNic>,
}

#[derive(Debug, Serialize)]
pub struct Gpus {
    pub cuda: Cuda,
    pub gpus: Vec<Gpu>,
    /// `peer_access[i][j]`: GPU i can address GPU j's memory (NVLink or PCIe P2P).
    pub peer_access: Vec<Vec<bool>>,
}

pub fn probe(root: &Root, nics: &[Nic]) -> Gpus {
    let none = |reason: String| Gpus {
        cuda: Cuda { available: false, reason: Some(reason), driver: None },
        gpus: Vec::new(),
        peer_access: Vec::new(),
    };
    if let Some(reason) = freight_cuda::unavailable_reason() {
        return none(reason);
    }
    let devices: Vec<&Device> = match driver::device_count().and_then(|n| (0..n).map(Device::get).collect()) {
        Ok(d) => d,
        Err(e) => return none(e.to_string()),
    };
    let gpus = devices
        .iter()
        .map(|d| {
            let place = pci_device(root, &d.bus_id);
            let mut near: Vec<NearNic> = match &place {
                Some(gpu) => nics
                    .iter()
                    .filter_map(|n| Some(NearNic { nic: n.name.clone(), closeness: closeness(gpu, n.pci.as_ref()?) }))
                    .collect(),
                None => Vec::new(),
            };
            near.sort_by(|a, b| a.closeness.cmp(&b.closeness).then_with(|| a.nic.cmp(&b.nic)));
            Gpu {
                ordinal: d.ordinal,
                name: d.name.clone(),
                pci: d.bus_id.clone(),
                compute_capability: format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                multiprocessors: d.multiprocessors,
                numa_node: place.and_then(|p| p.numa_node),
                nics: near,
            }
        })
        .collect();
    let peer_access =
        devices.iter().map(|a| devices.iter().map(|b| a.can_access(b).unwrap_or(false)).collect()).collect();
    let driver = driver::driver_version().ok().map(|(major, minor)| format!("{major}.{minor}"));
    Gpus { cuda: Cuda { available: true, reason: None, driver }, gpus, peer_access }
}
