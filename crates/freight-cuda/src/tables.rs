//! Work tables in GPU memory, reused from request to request.
//!
//! A compiled request with more than a few copies hands the copy kernel its work items
//! in a table in GPU memory (see `freight_core::transport::cuda`). Requests that are made
//! once and posted once, such as a KV cache connector's loads (a new block list every
//! time), paid for a fresh allocation and its release each time: `cuMemAlloc`, and a
//! `cuMemFree` that waits for the whole device. Tables come instead from free lists
//! per GPU and size class (powers of two from [`MIN_CLASS`]), and go back to them
//! when their program is dropped.
//!
//! Invariant: a table is returned only once no launch that reads it can still run. Its
//! owner, the compiled program, lives until its last launch completed (the completion
//! watcher holds it), so dropping the program is that moment.
//!
//! At most [`KEPT_BYTES`] of idle tables are kept per GPU; past that, or for a table
//! larger than [`MAX_CLASS`], the memory is freed as before.

use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::driver::{copy_sync, Device, DeviceBuffer};
use freight_proto::error::Result;

/// Smallest table allocated (a class of its own for every smaller table).
pub const MIN_CLASS: usize = 4 << 10;
/// Largest pooled table: 4 MiB holds about 170 000 work items.
pub const MAX_CLASS: usize = 4 << 20;
/// Idle table bytes kept per GPU.
pub const KEPT_BYTES: usize = 32 << 20;

/// Idle tables of one GPU by class, and their total size.
#[derive(Default)]
struct Idle {
    by_class: HashMap<usize, Vec<DeviceBuffer>>,
    bytes: usize,
}

fn idle() -> &'static Mutex<HashMap<usize, Idle>> {
    static IDLE: OnceLock<Mutex<HashMap<usize, Idle>>> = OnceLock::new();
    IDLE.get_or_init(Default::default)
}

/// The class of a table of `len` bytes: the power of two that holds it (None: too
/// large to pool).
fn class_of(len: usize) -> Option<usize> {
    let class = len.max(MIN_CLASS).checked_next_power_of_two()?;
    (class <= MAX_CLASS).then_some(class)
}

/// A work table in GPU memory, back to its free list when dropped.
pub struct Table {
    buf: Option<DeviceBuffer>,
    class: Option<usize>,
}

impl Table {
    /// A table on `device` holding `bytes` (copied there before this returns), reused
    /// from an earlier request where one of its class is idle.
    pub fn upload(device: &'static Device, bytes: &[u8]) -> Result<Table> {
        let class = class_of(bytes.len());
        let reused = class.and_then(|c| {
            let mut idle = idle().lock();
            let gpu = idle.get_mut(&device.ordinal)?;
            let buf = gpu.by_class.get_mut(&c)?.pop()?;
            gpu.bytes -= c;
            Some(buf)
        });
        let buf = match reused {
            Some(b) => b,
            None => DeviceBuffer::alloc(device, class.unwrap_or(bytes.len()))?,
        };
        if !bytes.is_empty() {
            // Landed before any kernel may read it (see copy_sync).
            copy_sync(device, buf.addr(), bytes.as_ptr() as u64, bytes.len())?;
        }
        Ok(Table { buf: Some(buf), class })
    }

    /// The table's address in GPU memory.
    pub fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, DeviceBuffer::addr)
    }

    /// Idle tables kept for `device` (bytes), for tests and diagnostics.
    pub fn idle_bytes(device: &Device) -> usize {
        idle().lock().get(&device.ordinal).map_or(0, |g| g.bytes)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let (Some(buf), Some(class)) = (self.buf.take(), self.class) else { return };
        let mut idle = idle().lock();
        let gpu = idle.entry(buf.device().ordinal).or_default();
        if gpu.bytes + class <= KEPT_BYTES {
            gpu.bytes += class;
            gpu.by_class.entry(class).or_default().push(buf);
        } else {
            drop(idle);
            drop(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_the_smallest_up_to_the_largest_pooled() {
        assert_eq!(class_of(0), Some(MIN_CLASS));
        assert_eq!(class_of(1), Some(MIN_CLASS));
        assert_eq!(class_of(MIN_CLASS), Some(MIN_CLASS));
        assert_eq!(class_of(MIN_CLASS + 1), Some(2 * MIN_CLASS));
        assert_eq!(class_of(196_608), Some(256 << 10));
        assert_eq!(class_of(MAX_CLASS), Some(MAX_CLASS));
        assert_eq!(class_of(MAX_CLASS + 1), None);
        assert_eq!(class_of(usize::MAX), None);
    }
}
