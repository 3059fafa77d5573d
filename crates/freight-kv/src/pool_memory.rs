//! The memory behind the value pool.
//!
//! The pool is private to the server (clients never map it), so it need not be a
//! shareable segment: it is anonymous memory, backed by huge pages where the kernel
//! grants them. Every GET reads its value from here with the CPU or the kernel's socket
//! code, and a gigabyte-sized pool of small pages costs those copies a page-table walk
//! every 4 KiB; on the tcp path that made the send copy the largest cost of a 1 MiB GET.

use freight_core::{Error, Result};
use memmap2::{Advice, MmapMut};

/// Zeroed, page-aligned host memory, faulted in up front.
pub struct PoolMemory {
    map: MmapMut,
}

impl PoolMemory {
    pub fn allocate(len: usize) -> Result<PoolMemory> {
        let mut map =
            MmapMut::map_anon(len).map_err(|e| Error::Io(format!("cannot map {len} bytes for the pool: {e}")))?;
        // Only a hint: without transparent huge pages the pool works as well, a little slower.
        if let Err(e) = map.advise(Advice::HugePage) {
            tracing::debug!(error = %e, "the kernel declined huge pages for the pool");
        }
        // Touched now, so that the first writes into the pool do not pay for page faults.
        map.fill(0);
        Ok(PoolMemory { map })
    }

    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}
