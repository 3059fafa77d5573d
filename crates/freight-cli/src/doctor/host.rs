//! The host as sysfs and procfs describe it: CPUs, NUMA nodes, network interfaces and
//! where they sit on the PCI tree. Every reader takes the filesystem root, so the tests
//! describe a machine in a temporary directory.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use freight_host::pci;
pub use freight_host::pci::{closeness, Closeness, PciPlace};
use serde::Serialize;

/// A filesystem root that holds `sys/` and `proc/` (`/` on a real machine).
pub struct Root(pub PathBuf);

impl Root {
    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel.trim_start_matches('/'))
    }

    /// A small file's content, trimmed; `None` when it is missing or unreadable (sysfs
    /// refuses some reads, e.g. the speed of a link that is down).
    pub fn read(&self, rel: &str) -> Option<String> {
        read_trimmed(&self.path(rel))
    }

    fn entries(&self, rel: &str) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.path(rel))
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort_by_key(|n| natural(n));
        names
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Sorts "cpu10" after "cpu9".
fn natural(name: &str) -> (String, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (head, tail) = name.split_at(name.len() - digits);
    (head.to_string(), tail.parse().unwrap_or(0))
}

/// Parses a kernel CPU list ("0-3,8,10-11").
pub fn parse_cpulist(list: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    cpus.extend(a..=b);
                }
            }
            None => cpus.extend(part.parse::<u32>().ok()),
        }
    }
    cpus
}

#[derive(Debug, Serialize, PartialEq)]
pub struct Cpus {
    /// Online CPUs, as the kernel lists them ("0-15").
    pub online: String,
    pub count: usize,
    pub model: Option<String>,
    /// Frequency governors and how many CPUs use each (empty where cpufreq is absent,
    /// as in most virtual machines).
    pub governors: BTreeMap<String, usize>,
}

pub fn cpus(root: &Root) -> Cpus {
    let online = root.read("sys/devices/system/cpu/online").unwrap_or_default();
    let ids = parse_cpulist(&online);
    let mut governors = BTreeMap::new();
    for id in &ids {
        if let Some(g) = root.read(&format!("sys/devices/system/cpu/cpu{id}/cpufreq/scaling_governor")) {
            *governors.entry(g).or_insert(0) += 1;
        }
    }
    let model = root.read("proc/cpuinfo").and_then(|info| {
        info.lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    });
    Cpus { online, count: ids.len(), model, governors }
}

#[derive(Debug, Serialize, PartialEq)]
pub struct NumaNode {
    pub node: u32,
    pub cpus: String,
}

pub fn numa_nodes(root: &Root) -> Vec<NumaNode> {
    root.entries("sys/devices/system/node")
        .into_iter()
        .filter_map(|name| {
            let node = name.strip_prefix("node")?.parse().ok()?;
            let cpus = root.read(&format!("sys/devices/system/node/{name}/cpulist")).unwrap_or_default();
            Some(NumaNode { node, cpus })
        })
        .collect()
}

/// The PCI device at or above `device` (a sysfs device directory).
pub fn pci_place(root: &Root, device: &Path) -> Option<PciPlace> {
    pci::place(&root.0, device)
}

/// The PCI device at `address`.
pub fn pci_device(root: &Root, address: &str) -> Option<PciPlace> {
    pci::device(&root.0, address)
}

#[derive(Debug, Serialize, PartialEq)]
pub struct Irq {
    pub irq: u32,
    /// CPUs it may interrupt ("0-3").
    pub cpus: Option<String>,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct Nic {
    pub name: String,
    pub state: Option<String>,
    pub mtu: Option<u32>,
    /// Link speed in Mb/s; `None` where the driver does not say (virtual links).
    pub speed_mbps: Option<u64>,
    pub driver: Option<String>,
    /// Its PCI function; `None` for virtual interfaces (loopback, veth, bridges).
    pub pci: Option<PciPlace>,
    pub irqs: Vec<Irq>,
}

pub fn nics(root: &Root) -> Vec<Nic> {
    root.entries("sys/class/net")
        .into_iter()
        .map(|name| {
            let dir = format!("sys/class/net/{name}");
            let device = root.path(&format!("{dir}/device"));
            let pci = pci_place(root, &device);
            let driver = fs::read_link(device.join("driver"))
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
            let irqs = pci.as_ref().map(|p| irqs_of(root, &p.address)).unwrap_or_default();
            Nic {
                state: root.read(&format!("{dir}/operstate")),
                mtu: root.read(&format!("{dir}/mtu")).and_then(|v| v.parse().ok()),
                speed_mbps: root.read(&format!("{dir}/speed")).and_then(|v| v.parse::<i64>().ok()).and_then(|v| {
                    // -1 (and some drivers' 65535) mean "unknown".
                    (v > 0 && v != 65535).then_some(v as u64)
                }),
                driver,
                pci,
                irqs,
                name,
            }
        })
        .collect()
}

fn irqs_of(root: &Root, pci: &str) -> Vec<Irq> {
    root.entries(&format!("sys/bus/pci/devices/{pci}/msi_irqs"))
        .into_iter()
        .filter_map(|n| n.parse::<u32>().ok())
        .map(|irq| Irq { irq, cpus: root.read(&format!("proc/irq/{irq}/smp_affinity_list")) })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn write(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    fn link(root: &Path, rel: &str, target: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        symlink(root.join(target), p).unwrap();
    }

    /// Two sockets; a NIC and a GPU under one switch on node 0, a NIC on node 1, a
    /// virtio NIC, loopback.
    fn machine() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        write(r, "sys/devices/system/cpu/online", "0-3\n");
        for (cpu, gov) in [(0, "performance"), (1, "performance"), (2, "powersave"), (3, "performance")] {
            write(r, &format!("sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor"), gov);
        }
        write(r, "proc/cpuinfo", "processor\t: 0\nmodel name\t: Test CPU @ 3GHz\n");
        write(r, "sys/devices/system/node/node0/cpulist", "0-1");
        write(r, "sys/devices/system/node/node1/cpulist", "2-3");
        let sw = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0";
        for (dev, node) in [
            (format!("{sw}/0000:02:00.0"), "0"),
            (format!("{sw}/0000:02:01.0"), "0"),
            ("sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0".to_string(), "1"),
            ("sys/devices/pci0000:00/0000:00:03.0".to_string(), "-1"),
        ] {
            fs::create_dir_all(r.join(&dev)).unwrap();
            let addr = dev.rsplit('/').next().unwrap().to_string();
            link(r, &format!("sys/bus/pci/devices/{addr}"), &dev);
            write(r, &format!("{dev}/numa_node"), node);
        }
        fs::create_dir_all(r.join(format!("{sw}/0000:02:00.0/msi_irqs/24"))).unwrap();
        fs::create_dir_all(r.join(format!("{sw}/0000:02:00.0/msi_irqs/25"))).unwrap();
        write(r, "proc/irq/24/smp_affinity_list", "0-1");
        write(r, "proc/irq/25/smp_affinity_list", "1");
        fs::create_dir_all(r.join("sys/devices/pci0000:00/0000:00:03.0/virtio2")).unwrap();
        fs::create_dir_all(r.join("drivers/mlx5_core")).unwrap();
        link(r, &format!("{sw}/0000:02:00.0/driver"), "drivers/mlx5_core");
        for (nic, dev, speed) in [
            ("eth0", Some(format!("{sw}/0000:02:00.0")), "100000"),
            ("eth1", Some("sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0".to_string()), "-1"),
            ("ens3", Some("sys/devices/pci0000:00/0000:00:03.0/virtio2".to_string()), "-1"),
            ("lo", None, "x"),
        ] {
            write(r, &format!("sys/class/net/{nic}/operstate"), "up");
            write(r, &format!("sys/class/net/{nic}/mtu"), "9000");
            if speed != "x" {
                write(r, &format!("sys/class/net/{nic}/speed"), speed);
            }
            if let Some(dev) = dev {
                link(r, &format!("sys/class/net/{nic}/device"), &dev);
            }
        }
        t
    }

    #[test]
    fn cpulists_parse_ranges_and_singles() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<u32>::new());
        assert_eq!(parse_cpulist("5"), vec![5]);
    }

    #[test]
    fn cpus_and_numa_nodes_come_from_sysfs() {
        let t = machine();
        let root = Root(t.path().to_path_buf());
        let c = cpus(&root);
        assert_eq!((c.online.as_str(), c.count, c.model.as_deref()), ("0-3", 4, Some("Test CPU @ 3GHz")));
        assert_eq!(c.governors.get("performance"), Some(&3));
        assert_eq!(c.governors.get("powersave"), Some(&1));
        let nodes = numa_nodes(&root);
        assert_eq!(nodes, vec![NumaNode { node: 0, cpus: "0-1".into() }, NumaNode { node: 1, cpus: "2-3".into() }]);
    }

    #[test]
    fn nics_report_link_pci_place_numa_node_and_irqs() {
        let t = machine();
        let root = Root(t.path().to_path_buf());
        let nics = nics(&root);
        let names: Vec<&str> = nics.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, vec!["ens3", "eth0", "eth1", "lo"]);
        let eth0 = &nics[1];
        assert_eq!((eth0.mtu, eth0.speed_mbps, eth0.driver.as_deref()), (Some(9000), Some(100_000), Some("mlx5_core")));
        let pci = eth0.pci.as_ref().unwrap();
        assert_eq!((pci.address.as_str(), pci.numa_node), ("0000:02:00.0", Some(0)));
        assert_eq!(eth0.irqs, vec![Irq { irq: 24, cpus: Some("0-1".into()) }, Irq { irq: 25, cpus: Some("1".into()) }]);
        // A virtio NIC is the child of its PCI function; NUMA -1 means unknown.
        let ens3 = nics[0].pci.as_ref().unwrap();
        assert_eq!((ens3.address.as_str(), ens3.numa_node), ("0000:00:03.0", None));
        assert_eq!(nics[2].speed_mbps, None);
        assert!(nics[3].pci.is_none() && nics[3].irqs.is_empty());
    }
}
