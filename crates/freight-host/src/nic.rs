//! The host's network interfaces, which of them reach a peer directly, where they sit
//! (NUMA node, place on the PCI tree), and pinning threads to the cores of a node. The
//! choices are pure functions over what [`local_nics`] read, so that they are tested
//! without a second NIC.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;

use crate::pci::{self, Closeness, PciPlace};

/// One IPv4 address of an interface that is up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    pub addr: Ipv4Addr,
    /// Prefix length of its subnet.
    pub prefix: u32,
    /// The NUMA node of its device (`None` for virtual interfaces and one-node hosts).
    pub numa_node: Option<u32>,
    /// Its PCI function (`None` for virtual interfaces: loopback, veth, bridges).
    pub pci: Option<PciPlace>,
}

impl Nic {
    /// How close it is to the device at `near` (a GPU): by the PCI tree where both
    /// places are known, else by NUMA node.
    pub fn closeness_to(&self, near: &PciPlace) -> Closeness {
        match &self.pci {
            Some(p) => pci::closeness(p, near),
            None if self.numa_node.is_some() && self.numa_node == near.numa_node => Closeness::NumaNode,
            None => Closeness::System,
        }
    }

    fn reaches(&self, peer: Ipv4Addr) -> bool {
        let mask = if self.prefix == 0 { 0 } else { u32::MAX << (32 - self.prefix.min(32)) };
        u32::from(self.addr) & mask == u32::from(peer) & mask
    }
}

/// How the threads of a tcp stream are placed on cores.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Pinning {
    /// Wherever the scheduler puts them.
    Off,
    /// On the cores of the NUMA node of the stream's NIC, where it has one (the default:
    /// data then crosses no socket interconnect between NIC, thread and the kernel's
    /// buffers).
    #[default]
    Numa,
    /// Stream `i`'s threads on these cores, in turn.
    Cores(Vec<usize>),
}

impl Pinning {
    /// `off`, `numa`, or a core list such as `0-3,8`.
    pub fn parse(s: &str) -> Result<Pinning, String> {
        match s.trim() {
            "off" | "none" => Ok(Pinning::Off),
            "numa" => Ok(Pinning::Numa),
            list => parse_cpu_list(list)
                .filter(|c| !c.is_empty())
                .map(Pinning::Cores)
                .ok_or_else(|| format!("'{s}': expected off, numa, or a core list such as 0-3,8")),
        }
    }

    /// The spelling [`Pinning::parse`] reads back: `off`, `numa` or the core list.
    pub fn spec(&self) -> String {
        match self {
            Pinning::Off => "off".into(),
            Pinning::Numa => "numa".into(),
            Pinning::Cores(list) => list.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
        }
    }

    /// The cores for thread `slot` of a stream whose NIC is on `numa_node` (`None`:
    /// leave the thread alone).
    pub fn cores_for(&self, slot: usize, numa_node: Option<u32>) -> Option<Vec<usize>> {
        match self {
            Pinning::Off => None,
            Pinning::Numa => numa_node.and_then(node_cpus),
            Pinning::Cores(list) => Some(vec![list[slot % list.len()]]),
        }
    }
}

/// Parses a kernel CPU list ("0-3,8,10-11").
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b || b - a > 4096 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.trim().parse().ok()?),
        }
    }
    Some(out)
}

/// The cores of NUMA node `node`, from sysfs.
pub fn node_cpus(node: u32) -> Option<Vec<usize>> {
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    parse_cpu_list(&list).filter(|c| !c.is_empty())
}

/// Restricts the calling thread to `cores`.
pub fn pin_current_thread(cores: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET writes inside it for indexes below
    // its capacity (checked); sched_setaffinity(0) applies to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores.iter().filter(|&&c| c < 8 * std::mem::size_of::<libc::cpu_set_t>()) {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Pins the calling thread as `pinning` says for a stream on the NIC of `local` (a
/// socket's local address), or, where that NIC has no NUMA node, on `fallback` (the
/// node of the GPU the stream's data comes from); logs what it did, and failures, which
/// are never fatal.
pub fn pin_stream_thread(pinning: &Pinning, slot: usize, local: Option<SocketAddr>, fallback: Option<u32>) {
    if *pinning == Pinning::Off {
        return;
    }
    let numa_node = local.and_then(|a| nic_of(&local_nics(), a.ip())).and_then(|n| n.numa_node).or(fallback);
    let Some(cores) = pinning.cores_for(slot, numa_node) else { return };
    match pin_current_thread(&cores) {
        Ok(()) => tracing::debug!(?cores, ?numa_node, slot, "stream thread pinned"),
        Err(e) => tracing::warn!(?cores, error = %e, "cannot pin a stream thread"),
    }
}

/// The interface that holds `ip`.
pub fn nic_of(nics: &[Nic], ip: IpAddr) -> Option<Nic> {
    nics.iter().find(|n| IpAddr::V4(n.addr) == ip).cloned()
}

/// The local addresses to bind a peer's data streams to when none are configured: one
/// per interface whose subnet holds one of the peer's addresses (so each NIC that
/// reaches the peer directly carries streams), the NICs closest to `near` (the GPU whose
/// memory the streams carry) first: under its PCIe switch, then its host bridge, then
/// its NUMA node; loopback alone for a peer on this host that listens there. Empty when
/// none does (the peer is behind a router): the kernel's routing then decides.
pub fn towards(nics: &[Nic], peer_addrs: &[String], same_host: bool, near: Option<&PciPlace>) -> Vec<IpAddr> {
    let peers: Vec<Ipv4Addr> = peer_addrs
        .iter()
        .filter_map(|a| a.parse::<SocketAddr>().ok())
        .filter_map(|a| match a.ip() {
            IpAddr::V4(ip) => Some(ip),
            IpAddr::V6(_) => None,
        })
        .collect();
    let ours = |ip: &Ipv4Addr| nics.iter().any(|n| n.addr == *ip);
    // The peer shares our network namespace when it advertises our own addresses (it
    // listens on all of them) or only loopback ones; on the same host, a namespace of
    // its own gives it addresses of its own.
    let beside_us =
        same_host && (peers.iter().any(|p| !p.is_loopback() && ours(p)) || peers.iter().all(|p| p.is_loopback()));
    if beside_us {
        let lo = nics.iter().find(|n| n.addr.is_loopback() && peers.iter().any(|p| p.is_loopback() && n.reaches(*p)));
        return lo.map(|n| IpAddr::V4(n.addr)).into_iter().collect();
    }
    // Neither loopback nor an address we hold ourselves (a docker bridge, the same
    // private subnet on every host) is the peer's, however it advertises them.
    let peers: Vec<Ipv4Addr> = peers.into_iter().filter(|p| !p.is_loopback() && !ours(p)).collect();
    let mut chosen: Vec<&Nic> =
        nics.iter().filter(|n| !n.addr.is_loopback() && peers.iter().any(|&p| n.reaches(p))).collect();
    chosen.sort_by_key(|n| (near.map(|g| n.closeness_to(g)), n.name.clone()));
    chosen.dedup_by(|a, b| a.name == b.name);
    chosen.into_iter().map(|n| IpAddr::V4(n.addr)).collect()
}

/// The host's interfaces that are up, with their IPv4 addresses.
pub fn local_nics() -> Vec<Nic> {
    let mut nics = Vec::new();
    // SAFETY: getifaddrs hands us a list we free with freeifaddrs; we only read it.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return nics;
        }
        let mut cur = head;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            if !up || ifa.ifa_addr.is_null() || (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET {
                continue;
            }
            let v4 = |p: *const libc::sockaddr| {
                Ipv4Addr::from(u32::from_be((*(p as *const libc::sockaddr_in)).sin_addr.s_addr))
            };
            let prefix = if ifa.ifa_netmask.is_null() { 32 } else { u32::from(v4(ifa.ifa_netmask)).count_ones() };
            let name = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
            let pci = pci::place(Path::new("/"), Path::new(&format!("/sys/class/net/{name}/device")));
            let numa_node = pci.as_ref().and_then(|p| p.numa_node);
            nics.push(Nic { name, addr: v4(ifa.ifa_addr), prefix, numa_node, pci });
        }
        libc::freeifaddrs(head);
    }
    nics
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device on the PCI tree: `chain` is its host bridge, then its bridges, then it.
    fn place(chain: &[&str], numa_node: Option<u32>) -> PciPlace {
        let chain: Vec<String> = chain.iter().map(|s| s.to_string()).collect();
        PciPlace { address: chain.last().unwrap().clone(), chain, numa_node }
    }

    fn nic(name: &str, addr: &str, prefix: u32, numa_node: Option<u32>) -> Nic {
        Nic { name: name.into(), addr: addr.parse().unwrap(), prefix, numa_node, pci: None }
    }

    /// Two sockets: rdma0 and rdma2 on node 0 (rdma2 under the switch of GPU `gpu()`),
    /// rdma1 on node 1.
    fn host() -> Vec<Nic> {
        let on = |n: Nic, chain: &[&str]| Nic { pci: Some(place(chain, n.numa_node)), ..n };
        vec![
            nic("lo", "127.0.0.1", 8, None),
            nic("eth0", "192.0.2.10", 24, None),
            on(nic("rdma1", "10.77.1.1", 24, Some(1)), &["pci0000:80", "0000:80:01.0", "0000:81:00.0"]),
            on(nic("rdma0", "10.77.0.1", 24, Some(0)), &["pci0000:00", "0000:00:02.0", "0000:03:00.0"]),
            on(nic("rdma2", "10.77.2.1", 24, Some(0)), &["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"]),
        ]
    }

    fn gpu() -> PciPlace {
        place(&["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0"], Some(0))
    }

    #[test]
    fn every_nic_on_a_peer_subnet_carries_streams() {
        let peer: Vec<String> = ["10.77.0.2:7000", "10.77.1.2:7000", "10.77.2.2:7000"].map(String::from).to_vec();
        let ips = |v: Vec<IpAddr>| v.into_iter().map(|i| i.to_string()).collect::<Vec<_>>();
        assert_eq!(ips(towards(&host(), &peer, false, None)), ["10.77.0.1", "10.77.1.1", "10.77.2.1"]);
        // Another host's loopback address is not ours to dial.
        let mut with_lo = peer.clone();
        with_lo.push("127.0.0.1:7000".into());
        assert_eq!(ips(towards(&host(), &with_lo, false, None)), ["10.77.0.1", "10.77.1.1", "10.77.2.1"]);
        // The NICs closest to the GPU first: under its switch, then its host bridge,
        // then the other socket.
        assert_eq!(ips(towards(&host(), &peer, false, Some(&gpu()))), ["10.77.2.1", "10.77.0.1", "10.77.1.1"]);
        // A GPU on the other socket prefers that socket's NIC.
        let far_gpu = place(&["pci0000:80", "0000:80:02.0", "0000:85:00.0"], Some(1));
        assert_eq!(ips(towards(&host(), &peer, false, Some(&far_gpu))), ["10.77.1.1", "10.77.0.1", "10.77.2.1"]);
        // Only the NICs whose subnet holds one of the peer's addresses.
        let one = vec!["10.77.1.9:7000".to_string(), "not an address".into()];
        assert_eq!(ips(towards(&host(), &one, false, None)), ["10.77.1.1"]);
        // A peer behind a router: the kernel decides.
        assert!(towards(&host(), &["203.0.113.5:7000".to_string()], false, None).is_empty());
        // Addresses we hold ourselves are not the peer's.
        let bridged = vec!["192.0.2.10:7000".to_string(), "10.77.2.7:7000".into()];
        assert_eq!(ips(towards(&host(), &bridged, false, None)), ["10.77.2.1"]);
        // A peer in our network namespace: loopback, where it listens there.
        assert_eq!(ips(towards(&host(), &["127.0.0.1:7000".to_string()], true, None)), ["127.0.0.1"]);
        let everywhere = vec!["192.0.2.10:7000".to_string(), "127.0.0.1:7000".into()];
        assert_eq!(ips(towards(&host(), &everywhere, true, None)), ["127.0.0.1"]);
        assert!(towards(&host(), &everywhere[..1], true, None).is_empty(), "not on loopback: the kernel decides");
        // On this host but in a namespace of its own: its NICs, not loopback.
        assert_eq!(ips(towards(&host(), &with_lo, true, None)), ["10.77.0.1", "10.77.1.1", "10.77.2.1"]);
    }

    #[test]
    fn a_nic_without_a_pci_function_is_as_close_as_its_numa_node() {
        let gpu = gpu();
        let hosts = host();
        let by_name = |n: &str| hosts.iter().find(|x| x.name == n).unwrap().clone();
        assert_eq!(by_name("rdma2").closeness_to(&gpu), Closeness::PcieSwitch);
        assert_eq!(by_name("rdma0").closeness_to(&gpu), Closeness::HostBridge);
        assert_eq!(by_name("rdma1").closeness_to(&gpu), Closeness::System);
        assert_eq!(nic("veth0", "10.9.0.1", 24, Some(0)).closeness_to(&gpu), Closeness::NumaNode);
        assert_eq!(nic("veth1", "10.9.1.1", 24, None).closeness_to(&gpu), Closeness::System);
    }

    #[test]
    fn pinning_follows_the_configuration() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(Pinning::parse("numa"), Ok(Pinning::Numa));
        assert_eq!(Pinning::parse("off"), Ok(Pinning::Off));
        assert_eq!(Pinning::parse("2,4-5"), Ok(Pinning::Cores(vec![2, 4, 5])));
        assert!(Pinning::parse("fast").unwrap_err().contains("core list"));
        let cores = Pinning::Cores(vec![2, 4, 5]);
        assert_eq!((cores.cores_for(0, None), cores.cores_for(4, Some(1))), (Some(vec![2]), Some(vec![4])));
        assert_eq!(Pinning::Off.cores_for(0, Some(0)), None);
        assert_eq!(Pinning::Numa.cores_for(0, None), None, "a NIC without a node leaves threads alone");
    }

    #[test]
    fn a_thread_can_be_pinned_to_a_core_it_may_use() {
        let first = (0..1024).find(|&c| {
            // SAFETY: reading our own affinity mask.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0
                    && libc::CPU_ISSET(c, &set)
            }
        });
        let core = first.expect("some core is allowed");
        std::thread::spawn(move || pin_current_thread(&[core]).unwrap()).join().unwrap();
    }
}
