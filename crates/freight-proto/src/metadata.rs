//! An agent's metadata: what a peer needs to reach it and access its memory.
//!
//! Format: the magic `FRMD`, a little-endian u16 format version, then the postcard
//! encoding of [`AgentMetadata`]. Decoding never trusts its input: sizes are bounded,
//! every field is validated, and newer versions are refused with a clear message.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::region::{MemKind, RegionInfo};

pub const MAGIC: [u8; 4] = *b"FRMD";
pub const VERSION: u16 = 3;
/// Larger blobs are refused before decoding (10^6 regions fit comfortably).
pub const MAX_METADATA_BYTES: usize = 128 << 20;
const MAX_NAME: usize = 256;

/// Identifies the machine and process namespace an agent runs in, so that a peer can
/// tell whether shared memory can reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    pub hostname: String,
    /// The kernel's boot id: equal boot ids mean the same running kernel.
    pub boot_id: String,
    /// Inode of the pid namespace: equal means `/proc/<pid>` names the same process.
    pub pid_namespace: u64,
    pub pid: u32,
}

impl HostIdentity {
    /// Whether shared memory and `/proc/<pid>` reach from one to the other: the same
    /// running kernel and the same pid namespace. (The engine reads the current
    /// process's identity: `freight_core::host::identity`.)
    pub fn same_host(&self, other: &HostIdentity) -> bool {
        !self.boot_id.is_empty() && self.boot_id == other.boot_id && self.pid_namespace == other.pid_namespace
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    pub name: String,
    /// Random per agent instance: a restarted peer has a new id.
    pub agent_id: u64,
    /// Presented by peers on every connection to this agent.
    pub secret: [u8; 16],
    pub host: HostIdentity,
    /// Listener addresses (`ip:port`) in order of preference.
    pub addresses: Vec<String>,
    /// Transports this agent serves.
    pub transports: Vec<String>,
    pub regions: Vec<RegionInfo>,
}

impl AgentMetadata {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.regions.len() * 24);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        postcard::to_extend(self, out).expect("metadata always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Result<AgentMetadata> {
        let bad = |m: String| Error::Metadata(m);
        if bytes.len() > MAX_METADATA_BYTES {
            return Err(bad(format!("{} bytes is more than the {} allowed", bytes.len(), MAX_METADATA_BYTES)));
        }
        if bytes.len() < 6 || bytes[..4] != MAGIC {
            return Err(bad("not freight metadata (bad magic)".into()));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(bad(format!(
                "format version {version} is not understood (this freight reads version {VERSION})"
            )));
        }
        let (md, rest): (AgentMetadata, &[u8]) =
            postcard::take_from_bytes(&bytes[6..]).map_err(|e| bad(format!("does not decode: {e}")))?;
        if !rest.is_empty() {
            return Err(bad(format!("{} trailing bytes", rest.len())));
        }
        md.validate()?;
        Ok(md)
    }

    /// Checks everything a hostile blob could get wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Metadata(m));
        if self.name.is_empty() || self.name.len() > MAX_NAME || self.name.chars().any(|c| c.is_control()) {
            return bad(format!("agent name must be 1..{MAX_NAME} printable characters"));
        }
        for a in &self.addresses {
            if a.parse::<SocketAddr>().is_err() {
                return bad(format!("address '{a}' is not ip:port"));
            }
        }
        let mut keys = std::collections::HashSet::with_capacity(self.regions.len());
        for r in &self.regions {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return bad(format!("region {} has an invalid range [{:#x}, +{})", r.key, r.addr, r.len));
            }
            if !keys.insert(r.key) {
                return bad(format!("region key {} appears twice", r.key));
            }
            if let Some(s) = &r.shared {
                if s.offset.checked_add(r.len).is_none_or(|end| end > s.segment_len) || s.fd < 0 {
                    return bad(format!("region {} has an invalid shared location", r.key));
                }
            }
            if let Some(g) = &r.gpu {
                let inside = r.addr >= g.alloc_base
                    && g.alloc_base.checked_add(g.alloc_len).is_some_and(|end| r.addr + r.len <= end);
                if !matches!(g.handle.len(), 0 | 64) || g.bus_id.len() > 32 || !inside || r.kind != MemKind::Vram {
                    return bad(format!("region {} has an invalid GPU location", r.key));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{GpuLocation, MemKind, SharedLocation};
    use proptest::prelude::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill-0".into(),
            agent_id: 42,
            secret: [7; 16],
            host: HostIdentity {
                hostname: "node-7".into(),
                boot_id: "0f3c".into(),
                pid_namespace: 4026531836,
                pid: 4242,
            },
            addresses: vec!["127.0.0.1:5000".into()],
            transports: vec!["shm".into(), "tcp".into()],
            regions: vec![
                RegionInfo {
                    key: 1,
                    kind: MemKind::Dram,
                    addr: 0x1000,
                    len: 4096,
                    dev: 0,
                    shared: None,
                    gpu: None,
                    read_only: false,
                },
                RegionInfo {
                    key: 2,
                    kind: MemKind::Dram,
                    addr: 0x9000,
                    len: 4096,
                    dev: 0,
                    shared: Some(SharedLocation { segment: 3, fd: 9, segment_len: 8192, offset: 4096 }),
                    gpu: None,
                    read_only: false,
                },
                RegionInfo {
                    key: 3,
                    kind: MemKind::Vram,
                    addr: 0x7f00_0000_0000,
                    len: 1 << 20,
                    dev: 1,
                    shared: None,
                    gpu: Some(GpuLocation {
                        bus_id: "0000:1b:00.0".into(),
                        alloc_base: 0x7f00_0000_0000,
                        alloc_len: 2 << 20,
                        handle: vec![5; 64],
                    }),
                    read_only: false,
                },
            ],
        }
    }

    #[test]
    fn roundtrip() {
        let md = sample();
        assert_eq!(AgentMetadata::decode(&md.encode()).unwrap(), md);
    }

    #[test]
    fn rejects_bad_magic_version_and_trailing_bytes() {
        let bytes = sample().encode();
        assert!(AgentMetadata::decode(b"nope").is_err());
        let mut newer = bytes.clone();
        newer[4] = 9;
        let err = AgentMetadata::decode(&newer).unwrap_err().to_string();
        assert!(err.contains("version 9"), "{err}");
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(AgentMetadata::decode(&longer).is_err());
        assert!(AgentMetadata::decode(&bytes[..bytes.len() - 3]).is_err());
    }

    #[test]
    fn rejects_inconsistent_content() {
        let mut md = sample();
        md.regions[1].key = 1;
        assert!(AgentMetadata::decode(&md.encode()).is_err());
        let mut md = sample();
        md.regions[0].addr = u64::MAX;
        assert!(AgentMetadata::decode(&md.encode()).is_err());
        let mut md = sample();
        md.addresses = vec!["not an address".into()];
        assert!(AgentMetadata::decode(&md.encode()).is_err());
        let mut md = sample();
        md.name = String::new();
        assert!(AgentMetadata::decode(&md.encode()).is_err());
        let mut md = sample();
        md.regions[1].shared.as_mut().unwrap().offset = 8000;
        assert!(AgentMetadata::decode(&md.encode()).is_err());
        let mut md = sample();
        md.regions[2].gpu.as_mut().unwrap().handle = vec![5; 10];
        assert!(AgentMetadata::decode(&md.encode()).is_err());
    }

    #[test]
    fn gpu_memory_without_an_ipc_handle_is_described_as_not_exportable() {
        let mut md = sample();
        md.regions[2].gpu.as_mut().unwrap().handle.clear();
        let back = AgentMetadata::decode(&md.encode()).unwrap();
        assert!(!back.regions[2].gpu.as_ref().unwrap().exportable());
        assert!(sample().regions[2].gpu.as_ref().unwrap().exportable());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = AgentMetadata::decode(&bytes);
        }

        #[test]
        fn mutated_metadata_never_panics(pos in 0usize..200, val in any::<u8>()) {
            let mut bytes = sample().encode();
            let p = pos % bytes.len();
            bytes[p] = val;
            let _ = AgentMetadata::decode(&bytes);
        }
    }
}
