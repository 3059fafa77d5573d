//! Where devices sit on the PCI tree, and how close two of them are: a NIC under the
//! same PCIe switch as a GPU moves the GPU's data without crossing the CPU's root
//! complex, one on another socket crosses the socket interconnect too. Every reader
//! takes the filesystem root (`/` on a real machine), so tests describe a machine in a
//! temporary directory.

use std::path::Path;

use serde::Serialize;

/// Where a device sits on the PCI tree: its address and the chain of bridges above it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PciPlace {
    /// "0000:17:00.0".
    pub address: String,
    /// The host bridge ("pci0000:16"), then each bridge down to the device itself.
    #[serde(skip)]
    pub chain: Vec<String>,
    pub numa_node: Option<u32>,
}

/// How close two PCI devices are, closest first (the terms of `nvidia-smi topo`).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Closeness {
    /// Under one PCIe switch or root port: traffic between them stays below the CPU.
    PcieSwitch,
    /// The same host bridge (root complex).
    HostBridge,
    /// Different host bridges of one NUMA node.
    NumaNode,
    /// Across NUMA nodes (the socket interconnect), or unknown.
    System,
}

impl Closeness {
    /// The name in reports, as in the JSON ("pcie-switch").
    pub fn label(self) -> &'static str {
        match self {
            Closeness::PcieSwitch => "pcie-switch",
            Closeness::HostBridge => "host-bridge",
            Closeness::NumaNode => "numa-node",
            Closeness::System => "system",
        }
    }
}

pub fn closeness(a: &PciPlace, b: &PciPlace) -> Closeness {
    let shared = a.chain.iter().zip(&b.chain).take_while(|(x, y)| x == y).count();
    if shared >= 2 {
        Closeness::PcieSwitch
    } else if shared == 1 {
        Closeness::HostBridge
    } else if a.numa_node.is_some() && a.numa_node == b.numa_node {
        Closeness::NumaNode
    } else {
        Closeness::System
    }
}

fn is_pci_address(name: &str) -> bool {
    let b = name.as_bytes();
    name.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// The PCI device at or above `device` (a sysfs device directory, possibly a virtio or
/// other child of the PCI function), from its resolved path.
pub fn place(root: &Path, device: &Path) -> Option<PciPlace> {
    let real = std::fs::canonicalize(device).ok()?;
    let parts: Vec<String> = real.iter().map(|c| c.to_string_lossy().into_owned()).collect();
    let host = parts.iter().position(|p| p.starts_with("pci") && p.contains(':'))?;
    let mut chain = vec![parts[host].clone()];
    chain.extend(parts[host + 1..].iter().take_while(|p| is_pci_address(p)).cloned());
    if chain.len() < 2 {
        return None;
    }
    let address = chain.last().cloned()?;
    let numa = std::fs::read_to_string(root.join(format!("sys/bus/pci/devices/{address}/numa_node")))
        .ok()
        .and_then(|n| n.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    Some(PciPlace { address, chain, numa_node: numa })
}

/// The PCI device at `address` ("0000:1b:00.0", as CUDA names a GPU; any case).
pub fn device(root: &Path, address: &str) -> Option<PciPlace> {
    place(root, &root.join(format!("sys/bus/pci/devices/{}", address.to_ascii_lowercase())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// Devices by their chain from the host bridge down, and their NUMA nodes: a GPU
    /// and a NIC below one switch, a NIC on another root port of that bridge (with a
    /// virtio child), and a NIC on the second socket.
    const DEVICES: [(&[&str], i32); 4] = [
        (&["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0", "0000:3c:08.0", "0000:3d:00.0"], 0),
        (&["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0", "0000:3c:10.0", "0000:3e:00.0"], 0),
        (&["pci0000:3a", "0000:3a:02.0"], -1),
        (&["pci0000:d7", "0000:d7:00.0", "0000:d8:00.0"], 1),
    ];

    fn machine() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let devices = t.path().join("sys/devices");
        let by_address = t.path().join("sys/bus/pci/devices");
        fs::create_dir_all(&by_address).unwrap();
        for (chain, node) in DEVICES {
            let dir = chain.iter().fold(devices.clone(), |d, c| d.join(c));
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("numa_node"), format!("{node}\n")).unwrap();
            std::os::unix::fs::symlink(&dir, by_address.join(chain.last().unwrap())).unwrap();
        }
        fs::create_dir_all(devices.join("pci0000:3a/0000:3a:02.0/virtio2")).unwrap();
        t
    }

    #[test]
    fn places_and_closeness_follow_the_pci_tree_then_numa() {
        let t = machine();
        let root = t.path();
        let gpu = device(root, "0000:3d:00.0").unwrap();
        assert_eq!(gpu.chain, DEVICES[0].0);
        assert_eq!(gpu.numa_node, Some(0));
        let switch_mate = device(root, "0000:3e:00.0").unwrap();
        let virtio = place(root, &root.join("sys/devices/pci0000:3a/0000:3a:02.0/virtio2")).unwrap();
        assert_eq!((virtio.address.as_str(), virtio.numa_node), ("0000:3a:02.0", None), "its PCI function");
        let other_socket = device(root, "0000:d8:00.0").unwrap();
        assert_eq!(closeness(&gpu, &switch_mate), Closeness::PcieSwitch);
        assert_eq!(closeness(&gpu, &virtio), Closeness::HostBridge);
        assert_eq!(closeness(&gpu, &other_socket), Closeness::System);
        let same_node_elsewhere = PciPlace { chain: vec!["pci0000:40".into(), "0000:41:00.0".into()], ..gpu.clone() };
        assert_eq!(closeness(&gpu, &same_node_elsewhere), Closeness::NumaNode);
        assert!(Closeness::PcieSwitch < Closeness::HostBridge && Closeness::NumaNode < Closeness::System);
        // CUDA names devices in upper case; a device that is not there has no place.
        assert_eq!(device(root, "0000:3D:00.0"), Some(gpu));
        assert!(device(root, "0000:99:00.0").is_none());
        assert!(place(root, &root.join("sys/devices/virtual/net/lo")).is_none());
    }
}
