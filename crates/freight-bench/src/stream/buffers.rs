//! The benchmark's memory: host memory in a shared segment or GPU memory, registered
//! with the agent, filled and checked with the pattern of [`crate::pattern`].

use std::sync::Arc;

use freight_core::{Agent, Desc, MemKind, SharedSegment};
use freight_cuda::driver::{copy_sync, DeviceBuffer};
use freight_cuda::Device as Gpu;

use crate::options::{CliError, CliResult};
use crate::pattern;

/// Where a process keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    /// `cpu`, `cuda`, `cuda:N` or `auto` (the GPU `auto_gpu` when there is one, else the host).
    pub fn parse(s: &str, auto_gpu: usize) -> CliResult<Device> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" | "host" => Ok(Device::Cpu),
            "auto" => Ok(match freight_cuda::driver::device_count() {
                Ok(n) if n > 0 => Device::Cuda(auto_gpu % n),
                _ => Device::Cpu,
            }),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| CliError::usage(format!("--device '{s}': expected cpu, cuda, cuda:N or auto"))),
        }
    }

    pub fn name(self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

/// A registered allocation.
pub struct Memory {
    pub kind: MemKind,
    pub dev: u64,
    pub addr: u64,
    pub len: u64,
    _host: Option<Arc<SharedSegment>>,
    _gpu: Option<DeviceBuffer>,
}

impl Memory {
    /// `remedy` names the options that shrink `len`, for a host that cannot hold it.
    pub fn alloc(agent: &Agent, device: Device, len: u64, remedy: &str) -> CliResult<Memory> {
        let n = usize::try_from(len).map_err(|_| CliError::usage("size too large for this machine"))?;
        let memory = match device {
            Device::Cpu => {
                crate::host_memory::ensure_room(len, "this process's share of the benchmark", remedy)?;
                let seg = agent.alloc(n).map_err(|e| CliError::runtime(format!("cannot allocate {len} bytes: {e}")))?;
                Memory { kind: MemKind::Dram, dev: 0, addr: seg.addr(), len, _host: Some(seg), _gpu: None }
            }
            Device::Cuda(ordinal) => {
                let gpu = Gpu::get(ordinal).map_err(|e| CliError::runtime(format!("GPU {ordinal}: {e}")))?;
                let buf = DeviceBuffer::alloc(gpu, n)
                    .map_err(|e| CliError::runtime(format!("cannot allocate {len} bytes on GPU {ordinal}: {e}")))?;
                Memory { kind: MemKind::Vram, dev: ordinal as u64, addr: buf.addr(), len, _host: None, _gpu: Some(buf) }
            }
        };
        agent.register(memory.kind, memory.addr, len, memory.dev)?;
        Ok(memory)
    }

    pub fn desc(&self, offset: u64, len: u64) -> Desc {
        debug_assert!(offset + len <= self.len);
        Desc { addr: self.addr + offset, len, dev: self.dev }
    }

    /// Writes the pattern of `seed` over `[offset, offset + len)`.
    pub fn fill(&self, offset: u64, len: u64, seed: u64) -> CliResult<()> {
        let addr = self.addr + offset;
        match self.kind {
            MemKind::Vram => {
                let mut staging = vec![0u8; len as usize];
                pattern::fill(&mut staging, seed);
                let gpu = Gpu::get(self.dev as usize)?;
                copy_sync(gpu, addr, staging.as_ptr() as u64, staging.len())?;
            }
            _ => {
                // SAFETY: inside our own allocation, which no transfer touches while the
                // benchmark fills it (fills happen before any send).
                let bytes = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
                pattern::fill(bytes, seed);
            }
        }
        Ok(())
    }
}

/// Checks `len` bytes at `addr` (of `kind`, on `dev`) against the pattern of `seed`.
pub fn check(kind: MemKind, addr: u64, dev: u64, len: u64, seed: u64) -> CliResult<()> {
    let outcome = match kind {
        MemKind::Vram => {
            let mut staging = vec![0u8; len as usize];
            let gpu = Gpu::get(dev as usize)?;
            copy_sync(gpu, staging.as_mut_ptr() as u64, addr, staging.len())?;
            pattern::check(&staging, seed)
        }
        _ => {
            // SAFETY: a received message or object, live while the caller holds it.
            let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
            pattern::check(bytes, seed)
        }
    };
    outcome.map_err(CliError::runtime)
}
