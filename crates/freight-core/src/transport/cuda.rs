//! The cuda transport: same-host transfers where GPU memory is on either side.
//!
//! A request is compiled once into a [`CudaProgram`]: every copy translated into this
//! process's address space (the peer's GPU allocations opened through CUDA IPC, its
//! host memory through the shm mappings, host memory pinned), cut into work items and
//! uploaded as one table. Posting it is one kernel launch (plus copy-engine calls for
//! long copies to or from host memory, where the copy engines beat SM loads over PCIe)
//! and one event; the agent's completion thread finishes the request when the event
//! fires, and only then does its notification go out. A request of a few small copies
//! (the latency-bound kind) carries its items in the launch itself, and its kernel ends
//! by writing a flag in host memory that the posting thread watches (see
//! [`freight_cuda::flags`]).
//!
//! [`CudaConfig`] holds the kernel's launch shape and item size and how completion is
//! learned; `bench/gpu_sweep.py` measures the choices.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys as cu;

use crate::tracker::{Finisher, Tracker};
use crate::transport::shm::{Mapping, ShmPeer};
use freight_cuda::completion::{CompletionMode, Completions, Work};
use freight_cuda::driver::{check, Device, Event};
use freight_cuda::flags::{self, Flag};
use freight_cuda::ipc::{ImportCache, Imported};
use freight_cuda::kernel::{self, Item, Kernel, LaunchShape, FEW_ITEMS};
use freight_cuda::pinned;
use freight_cuda::tables::Table;
use freight_proto::error::{Error, Result};
use freight_proto::op::OpKind;
use freight_proto::plan::Plan;
use freight_proto::region::{MemKind, RegionInfo};

/// Requests up to this size are waited for on the posting thread, briefly.
const SMALL_BYTES: u64 = 256 << 10;
/// How long the posting thread waits for a small request before leaving it to the
/// completion thread: a launch and a small copy take 5 to 15 us.
const SMALL_WAIT: std::time::Duration = std::time::Duration::from_micros(30);

/// Tunables of the cuda transport.
#[derive(Debug, Clone)]
pub struct CudaConfig {
    /// Copies between GPU and host memory at least this long go to the copy engines
    /// (shorter ones ride in the kernel with the rest).
    pub copy_engine_min_host: u64,
    /// The same for GPU-to-GPU copies (default 16 MiB). Measured on H200 over NVLink,
    /// the copy engines move copies of 32 MiB and more 2 to 6% faster than the kernel
    /// (one merged 4 GiB copy: 386 against 364 GB/s); shorter copies stay in the
    /// kernel, which needs one launch for any number of them.
    pub copy_engine_min_peer: u64,
    /// Longest work item of the copy kernel (a multiple of 16, at least 1 KiB); copies of
    /// a request with too few items for the GPU are cut finer (see [`kernel::cut`]).
    pub kernel_item_bytes: u64,
    /// How the copy kernel is launched.
    pub kernel_shape: LaunchShape,
    /// How the completion thread learns that a request's GPU work is done.
    pub completion: CompletionMode,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            copy_engine_min_host: 4 << 20,
            copy_engine_min_peer: 16 << 20,
            kernel_item_bytes: kernel::ITEM_BYTES,
            kernel_shape: LaunchShape::default(),
            completion: CompletionMode::default(),
        }
    }
}

/// The cuda view of one peer: its GPU allocations opened here.
#[derive(Default)]
pub struct CudaPeer {
    pub imports: ImportCache,
}

/// Where one side of a copy lives, translated into this process.
struct Side<'a> {
    region: &'a RegionInfo,
    /// Added (wrapping) to the owner's address to get ours.
    shift: u64,
}

/// How a program's work items reach the copy kernel.
enum KernelWork {
    /// In a table in GPU memory (reused across requests: [`freight_cuda::tables`]),
    /// launched with the configured shape.
    Table { kernel: Arc<Kernel>, table: Table, count: usize },
    /// A few items in the launch's parameters (requests with no copy-engine part): the
    /// kernel ends by writing to `flag`, which the posting thread watches.
    Few { kernel: Arc<Kernel>, items: Vec<Item>, flag: Flag },
}

/// A request compiled for the GPU, reused by every post.
pub struct CudaProgram {
    device: &'static Device,
    kernel: Option<KernelWork>,
    shape: LaunchShape,
    /// (destination, source, length) for the copy engines.
    engine_copies: Vec<(u64, u64, u64)>,
    /// Bytes moved per post.
    bytes: u64,
    /// Small enough that the posting thread waits for it itself (see `execute`).
    small: bool,
    event: Arc<Event>,
    _imports: Vec<Arc<Imported>>,
    _maps: Vec<Arc<Mapping>>,
}

/// Everything `compile` needs to know about the peer.
pub struct PeerView<'a> {
    pub cuda: &'a CudaPeer,
    pub shm: &'a ShmPeer,
    /// The peer is this very process (its GPU pointers are valid here as they are).
    pub same_process: bool,
}

/// The GPU that runs a request: the one holding the local memory, else the one holding
/// the peer's memory if this process sees it, else the first.
pub fn launch_device(local: &RegionInfo, remote: &RegionInfo) -> Result<&'static Device> {
    if local.kind == MemKind::Vram {
        return Device::get(local.dev as usize);
    }
    if let Some(g) = &remote.gpu {
        if let Some(d) = Device::by_bus_id(&g.bus_id)? {
            return Ok(d);
        }
    }
    Device::get(0)
}

impl CudaProgram {
    pub fn compile(
        plan: &Plan,
        op: OpKind,
        local_region: impl Fn(u64) -> Option<RegionInfo>,
        remote_region: impl Fn(u64) -> Option<RegionInfo>,
        peer: &PeerView<'_>,
        cfg: &CudaConfig,
        agent_id: u64,
    ) -> Result<CudaProgram> {
        let first =
            plan.copies().next().ok_or_else(|| Error::InvalidArgument("a request with nothing to copy".into()))?;
        let lr = local_region(first.local_region).ok_or(Error::UnknownRegion(first.local_region))?;
        let rr = remote_region(first.remote_region).ok_or(Error::UnknownRegion(first.remote_region))?;
        let device = launch_device(&lr, &rr)?;
        let started = Instant::now();
        let mut imports: Vec<Arc<Imported>> = Vec::new();
        let mut maps: Vec<Arc<Mapping>> = Vec::new();
        let mut local_cache: Option<(RegionInfo, u64)> = None;
        let mut remote_cache: Option<(RegionInfo, u64)> = None;
        let (mut kernel_copies, mut engine_copies) = (Vec::new(), Vec::new());
        let mut bytes = 0;
        for o in plan.copies() {
            let local = match &local_cache {
                Some((r, s)) if r.key == o.local_region => Side { region: r, shift: *s },
                _ => {
                    let r = local_region(o.local_region).ok_or(Error::UnknownRegion(o.local_region))?;
                    let shift = local_shift(device, &r, agent_id)?;
                    local_cache = Some((r, shift));
                    let (r, s) = local_cache.as_ref().expect("just set");
                    Side { region: r, shift: *s }
                }
            };
            let remote = match &remote_cache {
                Some((r, s)) if r.key == o.remote_region => Side { region: r, shift: *s },
                _ => {
                    let r = remote_region(o.remote_region).ok_or(Error::UnknownRegion(o.remote_region))?;
                    let shift = remote_shift(device, &r, peer, &mut imports, &mut maps)?;
                    remote_cache = Some((r, shift));
                    let (r, s) = remote_cache.as_ref().expect("just set");
                    Side { region: r, shift: *s }
                }
            };
            bytes += o.len;
            let l = o.local_addr.wrapping_add(local.shift);
            let r = o.remote_addr.wrapping_add(remote.shift);
            let (src, dst) = match op {
                OpKind::Write => (l, r),
                OpKind::Read => (r, l),
            };
            let host_involved = local.region.kind == MemKind::Dram || remote.region.kind == MemKind::Dram;
            let engine_min = if host_involved { cfg.copy_engine_min_host } else { cfg.copy_engine_min_peer };
            if o.len >= engine_min {
                engine_copies.push((dst, src, o.len));
            } else {
                kernel_copies.push((src, dst, o.len));
            }
        }
        let translated = started.elapsed();
        let kernel = if kernel_copies.is_empty() {
            None
        } else {
            let kernel = Kernel::on(device)?;
            let workers = kernel.concurrency(&cfg.kernel_shape);
            let items = kernel::cut(&kernel_copies, cfg.kernel_item_bytes, workers);
            if items.len() <= FEW_ITEMS && engine_copies.is_empty() {
                Some(KernelWork::Few { kernel, items, flag: Flag::new(device)? })
            } else {
                // SAFETY: Item is repr(C) plain data; viewing it as bytes for the upload.
                let table_bytes = unsafe {
                    std::slice::from_raw_parts(items.as_ptr() as *const u8, std::mem::size_of_val(items.as_slice()))
                };
                let table = Table::upload(device, table_bytes)?;
                Some(KernelWork::Table { kernel, table, count: items.len() })
            }
        };
        debug_assert_eq!(std::mem::size_of::<Item>(), 24);
        let event = Arc::new(Event::new(device)?);
        tracing::debug!(
            kernel_copies = kernel_copies.len(),
            items = kernel_items(&kernel),
            engine_copies = engine_copies.len(),
            translate_us = translated.as_micros() as u64,
            total_us = started.elapsed().as_micros() as u64,
            "compiled a request for the GPU"
        );
        Ok(CudaProgram {
            device,
            kernel,
            shape: cfg.kernel_shape,
            engine_copies,
            bytes,
            small: bytes <= SMALL_BYTES,
            event,
            _imports: imports,
            _maps: maps,
        })
    }

    /// Work items the kernel runs per post (0: copy engines only).
    pub fn kernel_items(&self) -> usize {
        kernel_items(&self.kernel)
    }

    /// Launches the copies and arranges for `tracker` to finish when they are done.
    pub fn execute(
        self: &Arc<Self>,
        tracker: &Arc<Tracker>,
        finisher: Finisher,
        completions: &Completions,
    ) -> Result<()> {
        tracker.begin(1, finisher)?;
        let launched = Instant::now();
        match self.launch() {
            // A small copy is done within microseconds of its launch: handing it to the
            // completion thread would add that thread's wake-up to its latency.
            Ok(flag_value) if self.small && self.finished_soon(flag_value) => tracker.finish_part(Ok(())),
            Ok(_) => {
                let (t, keep) = (tracker.clone(), self.clone());
                completions.watch(
                    self.device,
                    self.event.clone(),
                    Work { bytes: self.bytes, launched },
                    Box::new(move |outcome| {
                        drop(keep);
                        t.finish_part(outcome);
                    }),
                );
            }
            Err(e) => tracker.finish_part(Err(e)),
        }
        Ok(())
    }

    /// Watches for the end for a few microseconds (where the host has cores to spare):
    /// the kernel's flag where it has one, else the event.
    fn finished_soon(&self, flag_value: Option<u64>) -> bool {
        match (&self.kernel, flag_value) {
            (Some(KernelWork::Few { flag, .. }), Some(value)) => {
                freight_host::poll::briefly(SMALL_WAIT, || flag.holds(value).then_some(())).is_some()
            }
            _ => freight_host::poll::briefly(SMALL_WAIT, || self.event.query().ok().filter(|&done| done)).is_some(),
        }
    }

    /// Queues the copies and the event; returns the value the kernel writes to its flag
    /// when it has one.
    fn launch(&self) -> Result<Option<u64>> {
        let _ctx = self.device.bind()?;
        let stream = self.device.stream();
        let mut flag_value = None;
        match &self.kernel {
            // SAFETY (both): the device's own stream, which lives as long as the process;
            // the flag is mapped host memory from the pool.
            Some(KernelWork::Table { kernel, table, count }) => unsafe {
                kernel.launch_on(stream, table.addr(), *count, &self.shape)?
            },
            Some(KernelWork::Few { kernel, items, flag }) => {
                let value = flags::next_value();
                unsafe { kernel.launch_few(stream, items, flag.device_addr(), value)? };
                flag_value = Some(value);
            }
            None => {}
        }
        let rest = || -> Result<()> {
            for &(dst, src, len) in &self.engine_copies {
                // SAFETY: both ranges were bounds-checked against registered regions and
                // are mapped (and pinned, for host memory) for this program's lifetime.
                check(unsafe { cu::cuMemcpyAsync(dst, src, len as usize, stream) }, "cuMemcpyAsync")?;
            }
            // Recorded for a flagged kernel too: the completion thread waits on the
            // event when the posting thread stops watching the flag.
            self.event.record(self.device)
        };
        if let Err(e) = rest() {
            // What was queued still reads and writes the request's memory: it must end
            // before the request fails, which lets the memory be deregistered or reused.
            // SAFETY: the device's own stream.
            let _ = unsafe { cu::cuStreamSynchronize(stream) };
            return Err(e);
        }
        Ok(flag_value)
    }
}

fn kernel_items(kernel: &Option<KernelWork>) -> usize {
    match kernel {
        None => 0,
        Some(KernelWork::Table { count, .. }) => *count,
        Some(KernelWork::Few { items, .. }) => items.len(),
    }
}

/// Local memory: GPU memory must be on the launching GPU's side of a peer link; host
/// memory is pinned (once) so the GPU reaches it directly.
fn local_shift(device: &'static Device, r: &RegionInfo, agent_id: u64) -> Result<u64> {
    match r.kind {
        MemKind::Vram => {
            device.enable_access(Device::get(r.dev as usize)?)?;
            Ok(0)
        }
        MemKind::Dram => {
            pinned::pin(device, r.addr, r.len, pinned::Owner::Region { agent: agent_id, key: r.key })?;
            Ok(0)
        }
        MemKind::File => Err(Error::TransportUnavailable("cuda cannot serve FILE memory".into())),
    }
}

/// The peer's memory as this process reaches it: its GPU allocations through IPC, its
/// host memory through the shm mapping (pinned).
fn remote_shift(
    device: &'static Device,
    r: &RegionInfo,
    peer: &PeerView<'_>,
    imports: &mut Vec<Arc<Imported>>,
    maps: &mut Vec<Arc<Mapping>>,
) -> Result<u64> {
    match r.kind {
        MemKind::Vram if peer.same_process => {
            device.enable_access(Device::get(r.dev as usize)?)?;
            Ok(0)
        }
        MemKind::Vram => {
            let loc = r.gpu.as_ref().ok_or_else(|| {
                Error::TransportUnavailable(format!(
                    "the peer's GPU region {} carries no CUDA IPC handle (it registered it without CUDA)",
                    r.key
                ))
            })?;
            if !loc.exportable() {
                return Err(not_exportable(r.key));
            }
            let m = peer.cuda.imports.open(device, loc)?;
            let shift = m.base.wrapping_sub(loc.alloc_base);
            if !imports.iter().any(|x| Arc::ptr_eq(x, &m)) {
                imports.push(m);
            }
            Ok(shift)
        }
        MemKind::Dram => {
            let (m, base) = peer.shm.remote_base(r)?;
            pinned::pin(device, m.addr(), m.len() as u64, pinned::Owner::Memory(m.addr()))?;
            if !maps.iter().any(|x| Arc::ptr_eq(x, &m)) {
                maps.push(m);
            }
            Ok(base as u64)
        }
        MemKind::File => Err(Error::TransportUnavailable("cuda cannot serve FILE memory".into())),
    }
}

/// Checks that `[addr, addr+len)` is memory of GPU `dev` and exports it for same-host
/// peers. `None` where CUDA is absent: the region is then registered as given and the
/// transports refuse it with the reason.
pub fn export_region(addr: u64, len: u64, dev: u64) -> Result<Option<freight_proto::region::GpuLocation>> {
    match check_region(addr, len, dev)? {
        Some(device) => freight_cuda::ipc::export(device, addr, len).map(Some),
        None => Ok(None),
    }
}

/// Checks that `[addr, addr+len)` is memory of GPU `dev`, without exporting anything
/// (for private regions, which no peer may map). `None` where CUDA is absent.
pub fn check_region(addr: u64, len: u64, dev: u64) -> Result<Option<&'static Device>> {
    use freight_cuda::driver::{pointer_kind, PointerKind};
    if freight_cuda::driver::init().is_err() {
        return Ok(None);
    }
    let device = Device::get(dev as usize)?;
    match pointer_kind(addr)? {
        PointerKind::Device(owner) if owner == device.ordinal => {}
        PointerKind::Device(owner) => {
            return Err(Error::InvalidArgument(format!(
                "address {addr:#x} is memory of GPU {owner}, not of GPU {dev} as registered"
            )))
        }
        PointerKind::Host => {
            return Err(Error::InvalidArgument(format!(
                "address {addr:#x} is not GPU memory (register host memory as DRAM)"
            )))
        }
    }
    // Kernels trust registered bounds: a region past its allocation's end would have
    // them fault, and a fault poisons the context for every user of the GPU. (Only
    // `cudaMalloc`'s allocations can be checked: a pool's or the VMM API's are seen
    // chunk by chunk.)
    let _ctx = device.bind()?;
    if !freight_cuda::driver::legacy_ipc_capable(addr)? {
        return Ok(Some(device));
    }
    let (base, alloc_len) = freight_cuda::driver::allocation_range(addr)?;
    if addr.checked_add(len).is_none_or(|end| end > base + alloc_len) {
        return Err(Error::InvalidArgument(format!(
            "GPU memory [{addr:#x}, +{len}) runs past its allocation [{base:#x}, +{alloc_len})"
        )));
    }
    Ok(Some(device))
}

fn not_exportable(key: u64) -> Error {
    Error::TransportUnavailable(format!(
        "the peer's GPU region {key} lies in memory CUDA IPC cannot share (a stream-ordered pool or \
         VMM allocation, such as PyTorch's expandable segments)"
    ))
}

/// How the cuda transport would serve a path between `local` and `remote` regions (one
/// of them GPU memory), or why it cannot: the facts the path report gives.
pub fn path_facts(
    local: Option<&RegionInfo>,
    remote: Option<&RegionInfo>,
    same_host: bool,
) -> std::result::Result<String, String> {
    freight_cuda::driver::init().map_err(|e| e.to_string())?;
    if !same_host {
        return Err("the peer is on another host".into());
    }
    let (Some(local), Some(remote)) = (local, remote) else {
        return Err("no memory registered on one side".into());
    };
    let device = launch_device(local, remote).map_err(|e| e.to_string())?;
    let here = format!("GPU {} ({})", device.ordinal, device.bus_id);
    if remote.kind != MemKind::Vram {
        return Ok(format!("same host, {here} copies to and from the peer's host memory, mapped and pinned (PCIe)"));
    }
    let Some(loc) = &remote.gpu else {
        return Err(format!("the peer's GPU region {} carries no CUDA IPC handle", remote.key));
    };
    if !loc.exportable() {
        return Err(not_exportable(remote.key).to_string());
    }
    let owner = Device::by_bus_id(&loc.bus_id).map_err(|e| e.to_string())?;
    let how = match owner {
        Some(o) if o.ordinal == device.ordinal => "on the same GPU".to_string(),
        Some(o) => match device.can_access(o) {
            Ok(true) => format!("directly over {}", link_name(device, o)),
            Ok(false) => {
                return Err(format!("{here} cannot access the peer's GPU {} directly (no peer access)", loc.bus_id))
            }
            Err(e) => return Err(e.to_string()),
        },
        None => "through CUDA IPC (that GPU is hidden from this process; peer access is checked when mapping)".into(),
    };
    let side = if local.kind == MemKind::Vram { "" } else { " from pinned host memory" };
    Ok(format!(
        "same host, {here} reaches the peer's GPU {} {how}{side}: one batched copy kernel per request",
        loc.bus_id
    ))
}

/// "NVLink" where two GPUs support native atomics on each other's memory (the mark of
/// an NVLink connection on the GPUs freight targets), else "PCIe".
fn link_name(a: &Device, b: &Device) -> &'static str {
    let mut atomics = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe {
        cu::cuDeviceGetP2PAttribute(
            &mut atomics,
            cu::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
            a.raw(),
            b.raw(),
        )
    };
    if r == cu::CUresult::CUDA_SUCCESS && atomics != 0 {
        "NVLink"
    } else {
        "PCIe"
    }
}
