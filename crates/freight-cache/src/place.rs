//! Where a chunk's bytes are, and which way a move between the caller's KV memory and
//! a chunk goes: the vocabulary [`crate::chunk_bytes`] and [`crate::gpu_scratch`] share.

use freight_core::MemKind;

/// Where some bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub kind: MemKind,
    pub addr: u64,
    /// The GPU, for device memory.
    pub dev: u64,
    /// A GPU kernel can address it: device memory, or host memory pinned and mapped.
    pub mapped: bool,
}

impl Place {
    pub fn host(addr: u64) -> Place {
        Place { kind: MemKind::Dram, addr, dev: 0, mapped: false }
    }

    pub fn gpu(addr: u64, dev: u64) -> Place {
        Place { kind: MemKind::Vram, addr, dev, mapped: true }
    }

    pub fn at(self, offset: u64) -> Place {
        Place { addr: self.addr + offset, ..self }
    }

    pub(crate) fn on_gpu(&self) -> bool {
        self.kind == MemKind::Vram
    }
}

/// Which way the runs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the KV memory into the chunk (storing).
    Gather,
    /// From the chunk into the KV memory (retrieving).
    Scatter,
}
