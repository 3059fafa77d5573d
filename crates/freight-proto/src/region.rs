//! The vocabulary of registered memory, as both ends of a transfer speak it: kinds of
//! memory, what a peer is told about a region, and the index a peer's regions are
//! looked up in. The registry that hands these out lives in the engine.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{invalid, Error, Result};

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemKind {
    /// Host memory. `dev` is ignored (0).
    Dram,
    /// GPU memory. `dev` is the CUDA device ordinal.
    Vram,
    /// A file. `addr` is the file offset and `dev` the file descriptor.
    File,
}

impl MemKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MemKind::Dram => "DRAM",
            MemKind::Vram => "VRAM",
            MemKind::File => "FILE",
        }
    }

    /// A kind by name, case-insensitive, surrounding blanks ignored; "HOST"/"CPU" are
    /// DRAM and "GPU"/"CUDA" VRAM. The only list of these names (Python asks here).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "DRAM" | "HOST" | "CPU" => Ok(MemKind::Dram),
            "VRAM" | "GPU" | "CUDA" => Ok(MemKind::Vram),
            "FILE" => Ok(MemKind::File),
            _ => Err(invalid(format!("unknown memory kind {s:?} (expected DRAM, VRAM or FILE)"))),
        }
    }
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a region lives inside a shared segment, as a peer needs it to map the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedLocation {
    pub segment: u64,
    pub fd: i32,
    pub segment_len: u64,
    /// Offset of the region's first byte inside the segment.
    pub offset: u64,
}

/// What a peer needs to know about one registered region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub key: u64,
    pub kind: MemKind,
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
    /// Present when the region lies in a shared segment that same-host peers can map.
    pub shared: Option<SharedLocation>,
    /// Present for GPU memory exported to same-host peers (CUDA IPC).
    pub gpu: Option<GpuLocation>,
    /// Peers may read it but not write it (see [`Access::ReadOnly`]).
    pub read_only: bool,
}

/// Who may do what with a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Peers read and write it; it is the local side of any transfer.
    #[default]
    Shared,
    /// Peers only read it, and this agent's own READs never land in it: memory that
    /// must not change (an immutable buffer, a read-only mapping, which a write would
    /// fault on). A peer's WRITE into it is refused at the peer, and again here by the
    /// transports that serve remote accesses.
    ReadOnly,
    /// No peer may use it: the owner's local side only (the engine's `Registry::register_private`).
    Private,
}

/// What a same-host peer needs to map a registered GPU region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLocation {
    /// PCI bus id of the GPU that holds the memory ("0000:1b:00.0").
    pub bus_id: String,
    /// The allocation the region lies in: the IPC handle names it.
    pub alloc_base: u64,
    pub alloc_len: u64,
    /// `cuIpcGetMemHandle` of the allocation (64 opaque bytes), or empty where the
    /// allocation cannot be exported (see [`GpuLocation::exportable`]).
    pub handle: Vec<u8>,
}

impl GpuLocation {
    /// Whether same-host peers can map the allocation. Memory from a stream-ordered
    /// pool (`cudaMallocAsync`) or the VMM API (PyTorch's expandable segments) has no
    /// IPC handle: peers then reach it through staging (tcp), not the cuda transport.
    pub fn exportable(&self) -> bool {
        !self.handle.is_empty()
    }
}

impl RegionInfo {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// Fails where `[addr, addr+len)` of this region would be written by a transfer
    /// that must not write it.
    pub fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::InvalidArgument(format!(
                "region {} at {:#x} is registered read-only: no transfer may write into it",
                self.key, self.addr
            )));
        }
        Ok(())
    }

    /// Checks that `[addr, addr+len)` lies inside this region.
    pub fn check_contains(&self, addr: u64, len: u64) -> Result<()> {
        match addr.checked_add(len) {
            Some(end) if addr >= self.addr && end <= self.end() => Ok(()),
            _ => Err(Error::OutOfBounds { addr, len, region_addr: self.addr, region_len: self.len }),
        }
    }
}

/// Read-only index of a peer's regions, built from its metadata.
#[derive(Debug, Default, Clone)]
pub struct RemoteRegions {
    index: HashMap<(MemKind, u64), BTreeMap<u64, RegionInfo>>,
    by_key: HashMap<u64, RegionInfo>,
}

impl RemoteRegions {
    pub fn new(regions: &[RegionInfo]) -> Self {
        let mut index: HashMap<(MemKind, u64), BTreeMap<u64, RegionInfo>> = HashMap::new();
        let mut by_key = HashMap::with_capacity(regions.len());
        for r in regions {
            index.entry((r.kind, r.dev)).or_default().insert(r.addr, r.clone());
            by_key.insert(r.key, r.clone());
        }
        RemoteRegions { index, by_key }
    }

    pub fn find(&self, kind: MemKind, addr: u64, len: u64, dev: u64) -> Result<&RegionInfo> {
        let dev = if kind == MemKind::Dram { 0 } else { dev };
        let region = self
            .index
            .get(&(kind, dev))
            .and_then(|tree| tree.range(..=addr).next_back())
            .map(|(_, r)| r)
            .filter(|r| addr < r.end())
            .ok_or_else(|| Error::NotRegistered { kind: kind.to_string(), addr, len, dev })?;
        region.check_contains(addr, len)?;
        Ok(region)
    }

    pub fn get(&self, key: u64) -> Option<&RegionInfo> {
        self.by_key.get(&key)
    }

    pub fn contains(&self, key: u64) -> bool {
        self.by_key.contains_key(&key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &RegionInfo> {
        self.by_key.values()
    }

    /// Forgets a region the owner revoked.
    pub fn remove(&mut self, key: u64) {
        if let Some(r) = self.by_key.remove(&key) {
            if let Some(tree) = self.index.get_mut(&(r.kind, r.dev)) {
                tree.remove(&r.addr);
            }
        }
    }
}
