//! Device memory and streams kept per GPU between calls: making them per chunk would
//! cost more than the chunk's copy.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use freight_core::{Error, Result};
use freight_cuda::bounce::PinnedBuffer;
use freight_cuda::driver::{DeviceBuffer, Event, Stream};
use freight_cuda::kernel::Item;
use freight_cuda::Device;

/// One `T` per GPU, made on first use. Users of one GPU's value take turns; users of
/// different GPUs do not wait for each other (the map's own lock is held only to find
/// or add a GPU's entry, never while a value is in use).
pub(crate) struct PerGpu<T>(OnceLock<Mutex<HashMap<usize, Entry<T>>>>);

/// A GPU's value, `None` until made.
type Entry<T> = Arc<Mutex<Option<T>>>;

impl<T> PerGpu<T> {
    pub(crate) const fn new() -> PerGpu<T> {
        PerGpu(OnceLock::new())
    }

    fn entry(&self, gpu: usize) -> Entry<T> {
        self.0.get_or_init(Default::default).lock().entry(gpu).or_default().clone()
    }

    /// Runs `f` with GPU `gpu`'s value, made by `make` if there is none yet (or the last
    /// `make` failed).
    pub(crate) fn with<R>(
        &self,
        gpu: usize,
        make: impl FnOnce() -> Result<T>,
        f: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        let entry = self.entry(gpu);
        let mut value = entry.lock();
        if value.is_none() {
            *value = Some(make()?);
        }
        f(value.as_mut().expect("made above"))
    }

    /// Runs `f` with GPU `gpu`'s value, if it has one.
    pub(crate) fn with_existing(&self, gpu: usize, f: impl FnOnce(&mut T) -> Result<()>) -> Result<()> {
        let Some(entry) = self.0.get().and_then(|all| all.lock().get(&gpu).cloned()) else { return Ok(()) };
        let mut value = entry.lock();
        value.as_mut().map_or(Ok(()), f)
    }
}

/// A device buffer that is replaced by a larger one when it is too small.
#[derive(Default)]
pub(crate) struct Grown(Option<DeviceBuffer>);

impl Grown {
    /// Bytes of the buffer there is now (0 before the first reserve).
    pub(crate) fn len(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.len() as u64)
    }

    /// The buffer, at least `len` bytes long.
    pub(crate) fn reserve(&mut self, device: &'static Device, len: u64) -> Result<&DeviceBuffer> {
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument(format!("{len} bytes is too large")))?;
        if !matches!(&self.0, Some(b) if b.len() >= n) {
            // Powers of two, so that growing chunk by chunk reallocates a few times only.
            self.0 = None;
            self.0 = Some(DeviceBuffer::alloc(device, n.next_power_of_two())?);
        }
        Ok(self.0.as_ref().expect("just made"))
    }
}

/// The batched copy kernel's work items on their way to a GPU. They are written into
/// pinned host memory, so that their upload is queued on the kernel's stream: from
/// pageable memory the driver would stage it while the host waits, which costs a chunk
/// of thousands of items about as much as its copy.
pub(crate) struct ItemTable {
    table: Grown,
    host: Option<PinnedBuffer>,
    /// Recorded after the last upload: the host may overwrite `host` then.
    sent: Event,
}

impl ItemTable {
    pub(crate) fn new(device: &'static Device) -> Result<ItemTable> {
        Ok(ItemTable { table: Grown::default(), host: None, sent: Event::new(device)? })
    }

    /// Bytes of the device table there is now.
    pub(crate) fn len(&self) -> u64 {
        self.table.len()
    }

    /// Queues the upload of `items` on `stream` and returns the device table's address.
    /// Kernels queued earlier on `stream` may still read the table; anything else that
    /// reads it must be done with it (a larger table replaces it).
    pub(crate) fn upload(&mut self, device: &'static Device, stream: &Stream, items: &[Item]) -> Result<u64> {
        let bytes = std::mem::size_of_val(items);
        // The previous upload from the pinned buffer must have left it.
        self.sent.synchronize()?;
        let table = self.table.reserve(device, bytes as u64)?.addr();
        if !matches!(&self.host, Some(h) if h.len() >= bytes) {
            self.host = None;
            self.host = Some(PinnedBuffer::new(device, bytes.next_power_of_two())?);
        }
        let host = self.host.as_ref().expect("just made").as_ptr();
        let _ctx = device.bind()?;
        // SAFETY: `Item` is three u64s, `repr(C)`; the pinned buffer holds `bytes`, and
        // its previous upload is done (waited for above). The device table's earlier
        // readers are queued ahead on the same stream, or done (see above).
        unsafe {
            std::ptr::copy_nonoverlapping(items.as_ptr().cast::<u8>(), host, bytes);
            stream.copy(table, host as u64, bytes)?;
        }
        stream.record(&self.sent)?;
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_gpu_in_use_does_not_hold_up_another() {
        static VALUES: PerGpu<u32> = PerGpu::new();
        let (entered, in_use) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            VALUES.with(
                0,
                || Ok(0),
                |v| {
                    entered.send(()).unwrap();
                    released.recv().unwrap();
                    *v += 1;
                    Ok(())
                },
            )
        });
        in_use.recv().unwrap();
        let (done, finished) = mpsc::channel();
        let other = std::thread::spawn(move || {
            let r = VALUES.with(1, || Ok(10), |v| Ok(*v));
            done.send(r.unwrap()).unwrap();
        });
        let seen = finished.recv_timeout(Duration::from_secs(10));
        release.send(()).unwrap();
        holder.join().unwrap().unwrap();
        other.join().unwrap();
        assert_eq!(seen, Ok(10), "GPU 1's value waited for GPU 0's user");
        // A failed make leaves no value; the next use makes one.
        assert!(VALUES.with(2, || Err(Error::InvalidState("no".into())), |_| Ok(())).is_err());
        assert_eq!(VALUES.with(2, || Ok(7), |v| Ok(*v)).unwrap(), 7);
        let mut seen = 0;
        VALUES
            .with_existing(0, |v| {
                seen = *v;
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, 1);
        VALUES.with_existing(5, |_| panic!("GPU 5 has no value")).unwrap();
    }
}
