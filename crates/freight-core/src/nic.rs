//! The host's network interfaces, which of them reach a peer directly, their NUMA nodes,
//! and pinning threads to the cores of a node. The choices are pure functions over what
//! [`local_nics`] read, so that they are tested without a second NIC.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// One IPv4 address of an interface that is up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    pub addr: Ipv4Addr,
    /// Prefix length of its subnet.
    pub prefix: u32,
    /// The NUMA node of its device (`None` for virtual interfaces and one-node hosts).
    pub numa_node: Option<u32>,
}

impl Nic {
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

/// The NUMA node of a PCI device ("0000:1b:00.0", as CUDA names a GPU), from sysfs.
pub fn pci_numa_node(bus_id: &str) -> Option<u32> {
    let path = format!("/sys/bus/pci/devices/{}/numa_node", bus_id.to_ascii_lowercase());
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<i64>().ok()).and_then(|n| u32::try_from(n).ok())
}

/// The interface that holds `ip`.
pub fn nic_of(nics: &[Nic], ip: IpAddr) -> Option<Nic> {
    nics.iter().find(|n| IpAddr::V4(n.addr) == ip).cloned()
}

/// The local addresses to bind a peer's data streams to when none are configured: one
/// per interface whose subnet holds one of the peer's addresses (so each NIC that
/// reaches the peer directly carries streams), NICs on `prefer_node` first; loopback
/// alone for a peer on this host that listens there. Empty when none does (the peer is
/// behind a router): the kernel's routing then decides.
pub fn towards(nics: &[Nic], peer_addrs: &[String], same_host: bool, prefer_node: Option<u32>) -> Vec<IpAddr> {
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
    chosen.sort_by_key(|n| (prefer_node.is_some() && n.numa_node != prefer_node, n.name.clone()));
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
            let numa_node = std::fs::read_to_string(format!("/sys/class/net/{name}/device/numa_node"))
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .and_then(|n| u32::try_from(n).ok());
            nics.push(Nic { name, addr: v4(ifa.ifa_addr), prefix, numa_node });
        }
        libc::freeifaddrs(head);
    }
    nics
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str, addr: &str, prefix: u32, numa_node: Option<u32>) -> Nic {
        Nic { name: name.into(), addr: addr.parse().unwrap(), prefix, numa_node }
    }

    fn host() -> Vec<Nic> {
        vec![
            nic("lo", "127.0.0.1", 8, None),
            nic("eth0", "192.0.2.10", 24, None),
            nic("rdma1", "10.77.1.1", 24, Some(1)),
            nic("rdma0", "10.77.0.1", 24, Some(0)),
            nic("rdma2", "10.77.2.1", 24, Some(0)),
        ]
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
        // NUMA-close NICs first.
        assert_eq!(ips(towards(&host(), &peer, false, Some(1))), ["10.77.1.1", "10.77.0.1", "10.77.2.1"]);
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
