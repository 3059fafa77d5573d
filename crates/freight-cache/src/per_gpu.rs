//! Device memory and streams kept per GPU between calls: making them per chunk would
//! cost more than the chunk's copy.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;

use freight_core::cuda::driver::DeviceBuffer;
use freight_core::cuda::Device;
use freight_core::{Error, Result};

/// One `T` per GPU, made on first use. Users of one GPU's value take turns.
pub(crate) struct PerGpu<T>(OnceLock<Mutex<HashMap<usize, T>>>);

impl<T> PerGpu<T> {
    pub(crate) const fn new() -> PerGpu<T> {
        PerGpu(OnceLock::new())
    }

    /// Runs `f` with `device`'s value, made by `make` if there is none yet.
    pub(crate) fn with<R>(
        &self,
        device: &'static Device,
        make: impl FnOnce() -> Result<T>,
        f: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        let mut all = self.0.get_or_init(Default::default).lock();
        let value = match all.entry(device.ordinal) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(make()?),
        };
        f(value)
    }

    /// Runs `f` with every GPU's value; returns the first error, after running all.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&mut T) -> Result<()>) -> Result<()> {
        let Some(all) = self.0.get() else { return Ok(()) };
        let mut first = Ok(());
        for value in all.lock().values_mut() {
            let r = f(value);
            if first.is_ok() {
                first = r;
            }
        }
        first
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
