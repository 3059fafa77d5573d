//! What freight learns of the machine it runs on, and how it waits on it:
//!
//! - [`identity`]: which kernel and pid namespace this process runs in (same-host
//!   peers share memory; others do not).
//! - [`poll`]: whether this host has cores to spare for polling, and brief polls.
//! - [`nic`]: the network interfaces, which reach a peer directly, and pinning threads
//!   near them.
//! - [`pci`]: where devices sit on the PCI tree and how close two of them are.

pub mod nic;
pub mod pci;
pub mod poll;

use freight_proto::metadata::HostIdentity;

/// This process's host identity, read from `/proc`.
pub fn identity() -> HostIdentity {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let pid_namespace =
        std::fs::metadata("/proc/self/ns/pid").map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap_or(0);
    HostIdentity {
        hostname: read("/proc/sys/kernel/hostname"),
        boot_id: read("/proc/sys/kernel/random/boot_id"),
        pid_namespace,
        pid: std::process::id(),
    }
}
