//! GPU memory over a fabric rail, where the provider cannot register it (no `FI_HMEM`,
//! or a libfabric built without CUDA: see `Rail::gpu_registration`): the rail's thread copies each operation's GPU bytes into a pinned
//! buffer registered with the rail before a write, and out of it after a read. A rail
//! keeps a few such buffers, so that copying the next operation overlaps the network
//! moving the previous ones.

use std::ffi::c_void;
use std::sync::Arc;

use super::rail::{Mr, Rail};
use crate::transport::gpu_bounce::{self, Piece};
use freight_cuda::bounce::Bounce;
use freight_cuda::driver::Device;
use freight_proto::error::Result;

/// Buffers per rail: enough operations in flight to keep a link busy while the next
/// one is copied.
const SLOTS: usize = 4;
/// Keys asked for the buffers' registrations where the application chooses keys: far
/// from region keys, which count up from 1.
const KEY_BASE: u64 = 1 << 62;

/// A buffer and its registration (dropped first: fields drop in order).
struct Slot {
    mr: Mr,
    bounce: Bounce,
}

pub struct Staging {
    rail: Arc<Rail>,
    /// Bytes per buffer: the largest operation the rail is given.
    capacity: u64,
    slots: Vec<Slot>,
    free: Vec<usize>,
}

impl Staging {
    pub fn new(rail: Arc<Rail>, capacity: u64) -> Staging {
        Staging { rail, capacity, slots: Vec::new(), free: Vec::new() }
    }

    /// A free buffer (made on first need, up to [`SLOTS`]); `None` while all are out.
    pub fn take(&mut self, device: &'static Device) -> Result<Option<usize>> {
        if let Some(i) = self.free.pop() {
            return Ok(Some(i));
        }
        if self.slots.len() == SLOTS {
            return Ok(None);
        }
        let mut bounce = Bounce::new(device, self.capacity as usize)?;
        let addr = bounce.bytes_mut(self.capacity as usize).as_mut_ptr() as u64;
        // SAFETY: the pinned buffer lives in the slot beside its registration, which
        // is dropped first (field order).
        let mr = unsafe { self.rail.register_local(addr, self.capacity, KEY_BASE + self.slots.len() as u64) }?;
        self.slots.push(Slot { mr, bounce });
        Ok(Some(self.slots.len() - 1))
    }

    pub fn give_back(&mut self, slot: usize) {
        self.free.push(slot);
    }

    /// Where operations read or write the buffer, and its registration's descriptor.
    pub fn target(&mut self, slot: usize) -> (u64, *mut c_void) {
        let s = &mut self.slots[slot];
        (s.bounce.bytes_mut(self.capacity as usize).as_mut_ptr() as u64, s.mr.desc)
    }

    /// Copies `len` bytes of GPU memory at `gpu_addr` into the buffer, and waits.
    pub fn gather(&mut self, slot: usize, device: &'static Device, gpu_addr: u64, len: u64) -> Result<()> {
        let bounce = &mut self.slots[slot].bounce;
        gpu_bounce::gather(bounce, &[Piece { addr: gpu_addr, len, gpu: Some(device) }])?;
        bounce.wait()
    }

    /// Copies the buffer's first `len` bytes to GPU memory at `gpu_addr`, and waits.
    pub fn scatter(&mut self, slot: usize, device: &'static Device, gpu_addr: u64, len: u64) -> Result<()> {
        gpu_bounce::scatter(&mut self.slots[slot].bounce, &[Piece { addr: gpu_addr, len, gpu: Some(device) }])
    }
}
