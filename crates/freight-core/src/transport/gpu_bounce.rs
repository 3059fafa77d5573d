//! GPU memory over tcp. Sockets read and write host memory only, so the GPU pieces of a
//! message pass through a pinned bounce buffer: gathered into it by the copy engines
//! before the message is sent, scattered out of it after its payload was received. Host
//! pieces of the same message are copied alongside, so the payload stays one contiguous
//! run in the buffer, laid out exactly as on the wire.
//!
//! Senders keep two buffers ([`Alternating`]) and gather the next message while the
//! current one is on the wire: the initiator for WRITEs, the target for READ answers.
//! The initiator receives READ answers into two buffers too ([`Landing`]): one answer's
//! copies into the GPU run while the next answer is read.

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::net::TcpStream;
use std::sync::Arc;

use crate::frame_io;
use freight_cuda::bounce::{Bounce, Direction};
use freight_cuda::driver::Device;
use freight_proto::error::{Error, Result};
use freight_proto::region::{MemKind, RegionInfo};

/// One piece of a message: where its bytes are here, and the GPU holding them (`None`
/// for host memory).
#[derive(Clone, Copy)]
pub struct Piece {
    pub addr: u64,
    pub len: u64,
    pub gpu: Option<&'static Device>,
}

/// The GPUs behind a request's local GPU regions, by region key.
#[derive(Default)]
pub struct GpuRegions(HashMap<u64, &'static Device>);

impl GpuRegions {
    /// `None` when none of `regions` is GPU memory: the tcp path then never stages.
    pub fn of<'a>(regions: impl IntoIterator<Item = &'a RegionInfo>) -> Result<Option<Arc<GpuRegions>>> {
        let mut map = HashMap::new();
        for r in regions.into_iter().filter(|r| r.kind == MemKind::Vram) {
            map.insert(r.key, gpu_of(r)?);
        }
        Ok((!map.is_empty()).then(|| Arc::new(GpuRegions(map))))
    }

    pub fn device(&self, region: u64) -> Option<&'static Device> {
        self.0.get(&region).copied()
    }

    /// One of the GPUs (the one of the lowest region key, for a stable answer).
    pub fn first(&self) -> Option<&'static Device> {
        self.0.iter().min_by_key(|(k, _)| **k).map(|(_, d)| *d)
    }
}

/// The GPU of a GPU region, or why its bytes cannot be staged here.
pub fn gpu_of(r: &RegionInfo) -> Result<&'static Device> {
    freight_cuda::driver::init().and_then(|_| Device::get(r.dev as usize)).map_err(|e| {
        Error::TransportUnavailable(format!(
            "cannot stage GPU region {} (GPU {}) through host memory: {e}",
            r.key, r.dev
        ))
    })
}

fn total(pieces: &[Piece]) -> usize {
    pieces.iter().map(|p| p.len as usize).sum()
}

/// The buffer in `slot`, made (or grown) to hold `len` bytes.
pub fn bounce_for<'a>(slot: &'a mut Option<Bounce>, pieces: &[Piece]) -> Result<&'a mut Bounce> {
    let device = pieces.iter().find_map(|p| p.gpu).expect("staging is only asked for GPU pieces");
    let len = total(pieces);
    match slot {
        Some(b) => b.reserve(device, len)?,
        None => *slot = Some(Bounce::new(device, len.next_power_of_two())?),
    }
    Ok(slot.as_mut().expect("just filled"))
}

/// Lays the pieces back to back into the buffer: GPU pieces by queued copies (wait on
/// the buffer before sending), host pieces at once. Returns the payload's length.
pub fn gather(bounce: &mut Bounce, pieces: &[Piece]) -> Result<usize> {
    let mut off = 0usize;
    for p in pieces {
        let len = p.len as usize;
        match p.gpu {
            Some(dev) => bounce.copy(dev, Direction::ToBuffer, p.addr, off, len)?,
            // SAFETY: host pieces lie in registered memory the caller holds guards on.
            None => bounce.bytes_mut(off + len)[off..]
                .copy_from_slice(unsafe { std::slice::from_raw_parts(p.addr as *const u8, len) }),
        }
        off += len;
    }
    Ok(off)
}

/// Copies a received payload (the first bytes of the buffer) out to the pieces and
/// waits until the GPU copies are done, so the data is in place when this returns.
pub fn scatter(bounce: &mut Bounce, pieces: &[Piece]) -> Result<()> {
    scatter_queued(bounce, pieces)?;
    bounce.wait()
}

/// [`scatter`], leaving the GPU copies running: the data is in place, and the buffer
/// free, once [`Bounce::wait`] returns.
fn scatter_queued(bounce: &mut Bounce, pieces: &[Piece]) -> Result<()> {
    let mut off = 0usize;
    for p in pieces {
        let len = p.len as usize;
        match p.gpu {
            Some(dev) => bounce.copy(dev, Direction::ToGpu, p.addr, off, len)?,
            // SAFETY: as in `gather`, for writing.
            None => unsafe { std::slice::from_raw_parts_mut(p.addr as *mut u8, len) }
                .copy_from_slice(&bounce.bytes(off + len)[off..]),
        }
        off += len;
    }
    Ok(())
}

/// Receives a payload of `len` bytes that holds GPU pieces into the bounce buffer in
/// `slot` and scatters it. The outer error means the stream failed; the inner one that
/// the bytes were read but could not be put in place.
pub fn receive(sock: &mut TcpStream, slot: &mut Option<Bounce>, pieces: &[Piece], len: u64) -> Result<Result<()>> {
    let queued = receive_queued(sock, slot, pieces, len)?;
    // Waited for also when a copy failed part way: those queued before it still write
    // into the destination and read the buffer, which the next payload reuses, and the
    // failure lets the owner deregister the destination.
    let waited = slot.as_mut().map_or(Ok(()), Bounce::wait);
    Ok(queued.and(waited))
}

/// [`receive`], leaving the GPU copies running (see [`scatter_queued`]).
fn receive_queued(sock: &mut TcpStream, slot: &mut Option<Bounce>, pieces: &[Piece], len: u64) -> Result<Result<()>> {
    let bounce = match bounce_for(slot, pieces) {
        Ok(b) => b,
        Err(e) => {
            frame_io::discard(sock, len)?;
            return Ok(Err(e));
        }
    };
    frame_io::read_exact_vectored(sock, &mut [IoSliceMut::new(bounce.bytes_mut(len as usize))])?;
    Ok(scatter_queued(bounce, pieces))
}

/// Two bounce buffers that a receiving thread reads payloads into in turn: while one
/// payload's GPU copies run, the next payload is read into the other buffer. The thread
/// holds back the first payload's completion (`T`) until its copies are done.
pub struct Landing<T> {
    slots: [Option<Bounce>; 2],
    /// The buffer the next payload goes into.
    next: usize,
    /// What waits for the copies out of the other buffer.
    held: Option<T>,
}

impl<T> Default for Landing<T> {
    fn default() -> Self {
        Landing { slots: [None, None], next: 0, held: None }
    }
}

impl<T> Landing<T> {
    /// Reads a payload into the free buffer and starts its GPU copies (see [`receive`]).
    /// Then [`Landing::hold`] its completion, or, where the copies could not start,
    /// report it at once.
    pub fn receive(&mut self, sock: &mut TcpStream, pieces: &[Piece], len: u64) -> Result<Result<()>> {
        let slot = &mut self.slots[self.next];
        let received = receive_queued(sock, slot, pieces, len);
        if let (Ok(Err(_)), Some(bounce)) = (&received, slot.as_mut()) {
            // Some copies may have started before one failed: the buffer is reused next.
            let _ = bounce.wait();
        }
        received
    }

    /// Holds `what` until the copies of the payload just received are done; the
    /// payload before it is settled first (its copies ran while this one was read).
    pub fn hold(&mut self, what: T, settled: impl FnOnce(T, Result<()>)) {
        self.settle(settled);
        self.held = Some(what);
        self.next ^= 1;
    }

    /// Waits for the copies of the held payload, if any, and hands it to `settled`
    /// with the outcome.
    pub fn settle(&mut self, settled: impl FnOnce(T, Result<()>)) {
        if let Some(what) = self.held.take() {
            let done = self.slots[self.next ^ 1].as_mut().map_or(Ok(()), Bounce::wait);
            settled(what, done);
        }
    }
}

/// Two bounce buffers used in turn by a sending thread: the next message is gathered
/// into one while the other is on the wire. A slot is handed out again two gathers
/// later, so its message must have been sent by then.
#[derive(Default)]
pub struct Alternating {
    slots: [Option<Bounce>; 2],
    next: usize,
}

impl Alternating {
    /// Queues the copies that lay `pieces` into the next slot; returns the slot.
    pub fn gather(&mut self, pieces: &[Piece]) -> Result<usize> {
        let slot = self.next;
        self.next ^= 1;
        let bounce = bounce_for(&mut self.slots[slot], pieces)?;
        if let Err(e) = gather(bounce, pieces) {
            // Copies queued before the failure still fill the slot, which is gathered
            // into again two requests on, and read the request's memory.
            let _ = bounce.wait();
            return Err(e);
        }
        Ok(slot)
    }

    /// The first `len` bytes of `slot` (a slot `gather` returned), once its copies are done.
    pub fn ready(&mut self, slot: usize, len: usize) -> Result<&[u8]> {
        let bounce = self.slots[slot].as_mut().expect("a gathered slot");
        bounce.wait()?;
        Ok(bounce.bytes(len))
    }
}

/// Whether tcp can stage the GPU memory at the ends of a path, or why not: local GPU
/// memory needs CUDA here; the peer's needs CUDA there, which its regions show (GPU
/// memory registered with CUDA carries an export).
pub fn path_facts(local: Option<&RegionInfo>, remote: Option<&RegionInfo>) -> std::result::Result<(), String> {
    if let Some(l) = local.filter(|r| r.kind == MemKind::Vram) {
        gpu_of(l).map_err(|e| e.to_string())?;
    }
    match remote.filter(|r| r.kind == MemKind::Vram) {
        Some(r) if r.gpu.is_none() => {
            Err(format!("the peer registered GPU region {} without CUDA, so it cannot stage it", r.key))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use freight_proto::region::GpuLocation;

    fn region(key: u64, kind: MemKind, gpu: bool) -> RegionInfo {
        let gpu = gpu.then(|| GpuLocation {
            bus_id: "0000:1b:00.0".into(),
            alloc_base: 0x7000_0000,
            alloc_len: 1 << 20,
            handle: vec![0; 64],
        });
        RegionInfo { key, kind, addr: 0x7000_0000, len: 1 << 20, dev: 0, shared: None, gpu, read_only: false }
    }

    #[test]
    fn host_memory_is_never_staged() {
        let regions = [region(1, MemKind::Dram, false), region(2, MemKind::Dram, false)];
        assert!(GpuRegions::of(&regions).unwrap().is_none());
        assert_eq!(path_facts(Some(&regions[0]), Some(&regions[1])), Ok(()));
    }

    #[test]
    fn the_peers_gpu_memory_needs_cuda_there() {
        let host = region(1, MemKind::Dram, false);
        let e = path_facts(Some(&host), Some(&region(7, MemKind::Vram, false))).unwrap_err();
        assert!(e.contains("region 7") && e.contains("without CUDA"), "{e}");
        assert_eq!(path_facts(Some(&host), Some(&region(7, MemKind::Vram, true))), Ok(()));
    }

    #[test]
    fn local_gpu_memory_needs_cuda_here() {
        if freight_cuda::driver::init().is_ok() {
            eprintln!("SKIPPED: CUDA is present; this checks the behaviour without it");
            return;
        }
        let gpu = region(3, MemKind::Vram, false);
        let e = path_facts(Some(&gpu), None).unwrap_err();
        assert!(e.contains("cannot stage GPU region 3"), "{e}");
        assert!(matches!(GpuRegions::of([&gpu]), Err(Error::TransportUnavailable(_))));
    }
}
