//! The CUDA driver, loaded on first use: typed errors, devices with their primary
//! contexts and streams, events and device buffers.
//!
//! Every GPU freight touches is used through its primary context (the one PyTorch and
//! CuPy use too), so pointers that the application allocated are valid here as they are.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys::{self as cu, CUresult};

use freight_proto::error::{Error, Result};

/// Whether CUDA is usable here: the driver library loads, initialises, and sees a GPU.
pub fn available() -> bool {
    init().is_ok()
}

/// Why CUDA is not usable here, or `None` when it is.
pub fn unavailable_reason() -> Option<String> {
    init().err().map(|e| e.to_string())
}

/// Loads and initialises the driver once; later calls return the first outcome.
pub fn init() -> Result<()> {
    static STATE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: probing for the library has no side effects beyond dlopen.
            if !unsafe { cu::is_culib_present() } {
                return Err("the CUDA driver library (libcuda.so) is not installed".into());
            }
            // SAFETY: cuInit may be called any number of times from any thread.
            check(unsafe { cu::cuInit(0) }, "cuInit").map_err(|e| e.to_string())?;
            let mut n = 0;
            // SAFETY: out-pointer to a local.
            check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount").map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("the CUDA driver sees no GPU".into());
            }
            Ok(())
        })
        .clone()
        .map_err(|why| Error::TransportUnavailable(format!("CUDA is not available: {why}")))
}

/// Maps a driver result to a typed error naming the call.
pub fn check(result: CUresult, call: &'static str) -> Result<()> {
    if result == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null).
    unsafe { cu::cuGetErrorName(result, &mut name) };
    let code = if name.is_null() {
        format!("{result:?}")
    } else {
        // SAFETY: a NUL-terminated static string owned by the driver.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    Err(Error::Cuda { call: call.to_string(), code })
}

/// The CUDA version the driver supports, as (major, minor): (12, 8) for CUDA 12.8.
pub fn driver_version() -> Result<(i32, i32)> {
    init()?;
    let mut v = 0;
    // SAFETY: out-pointer to a local.
    check(unsafe { cu::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
    Ok((v / 1000, v % 1000 / 10))
}

/// Number of GPUs this process sees.
pub fn device_count() -> Result<usize> {
    init()?;
    let mut n = 0;
    // SAFETY: out-pointer to a local.
    check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n as usize)
}

/// One GPU: its primary context, a stream for freight's work, and what the kernel
/// compiler and the path report need to know about it.
pub struct Device {
    pub ordinal: usize,
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
    stream: Stream,
    /// For [`copy_sync`]: waiting on it waits for that copy alone, not for transfers in
    /// flight on `stream`. Made on first use.
    sync_stream: OnceLock<std::result::Result<Stream, Error>>,
    /// GPUs whose memory this one's kernels may reach (see [`Device::enable_access`]).
    peers_enabled: parking_lot::Mutex<Vec<usize>>,
    /// PCI bus id ("0000:1b:00.0"): the same GPU under any CUDA_VISIBLE_DEVICES.
    pub bus_id: String,
    /// The product name ("NVIDIA H100 80GB HBM3").
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: u32,
}

// SAFETY: contexts and streams are thread-safe driver handles.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ordinal).field("bus_id", &self.bus_id).finish()
    }
}

impl Device {
    /// The GPU with this ordinal (as this process numbers them), opened once.
    pub fn get(ordinal: usize) -> Result<&'static Device> {
        static DEVICES: OnceLock<Vec<OnceLock<std::result::Result<Device, Error>>>> = OnceLock::new();
        let n = device_count()?;
        let table = DEVICES.get_or_init(|| (0..n).map(|_| OnceLock::new()).collect());
        let slot = table.get(ordinal).ok_or_else(|| {
            Error::InvalidArgument(format!("there is no GPU {ordinal}: this process sees {n} GPU(s)"))
        })?;
        slot.get_or_init(|| Device::open(ordinal)).as_ref().map_err(Clone::clone)
    }

    fn open(ordinal: usize) -> Result<Device> {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; the primary context is retained for the life
        // of the process (devices are never closed).
        unsafe {
            check(cu::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
            check(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
        }
        // Current only while the stream is made, as for every other call (see `bind`).
        let stream = {
            let _ctx = Bound::enter(ctx)?;
            Stream::create()?
        };
        let attr = |a: cu::CUdevice_attribute| -> Result<i32> {
            let mut v = 0;
            // SAFETY: out-pointer to a local.
            check(unsafe { cu::cuDeviceGetAttribute(&mut v, a, dev) }, "cuDeviceGetAttribute")?;
            Ok(v)
        };
        use cu::CUdevice_attribute as A;
        let compute_capability = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let multiprocessors = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is large enough for "dddd:bb:dd.f" and NUL.
        check(unsafe { cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) }, "cuDeviceGetPCIBusId")?;
        // SAFETY: NUL-terminated by the driver.
        let bus_id = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().to_ascii_lowercase();
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL included.
        check(unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev) }, "cuDeviceGetName")?;
        // SAFETY: NUL-terminated by the driver.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        tracing::debug!(ordinal, %bus_id, ?compute_capability, multiprocessors, "opened GPU");
        Ok(Device {
            ordinal,
            dev,
            ctx,
            stream,
            sync_stream: OnceLock::new(),
            peers_enabled: parking_lot::Mutex::new(Vec::new()),
            bus_id,
            name,
            compute_capability,
            multiprocessors,
        })
    }

    /// Makes this GPU's context current on the calling thread until the guard goes,
    /// then the thread's previous one again (cheap when it already is current). The
    /// CUDA runtime, and with it PyTorch, takes a thread's current device from this
    /// context: a call into freight must not leave the application on another GPU.
    pub fn bind(&self) -> Result<Bound> {
        Bound::enter(self.ctx)
    }

    /// The stream of the cuda transport's requests.
    pub fn stream(&self) -> cu::CUstream {
        self.stream.raw()
    }

    fn sync_stream(&self) -> Result<&Stream> {
        self.sync_stream.get_or_init(|| self.bind().and_then(|_ctx| Stream::create())).as_ref().map_err(Clone::clone)
    }

    pub fn raw(&self) -> cu::CUdevice {
        self.dev
    }

    /// Whether this GPU can address `other`'s memory directly (NVLink or PCIe P2P).
    pub fn can_access(&self, other: &Device) -> Result<bool> {
        if self.dev == other.dev {
            return Ok(true);
        }
        let mut ok = 0;
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuDeviceCanAccessPeer(&mut ok, self.dev, other.dev) }, "cuDeviceCanAccessPeer")?;
        Ok(ok != 0)
    }

    /// Lets kernels on this GPU dereference `other`'s memory of this process. Peer
    /// access that is possible is not yet enabled: a kernel that touches the other GPU
    /// before this faults, and the fault poisons the context PyTorch shares. (Memory of
    /// other processes needs none of this: IPC mappings enable it themselves.)
    pub fn enable_access(&self, other: &Device) -> Result<()> {
        if self.dev == other.dev || self.peers_enabled.lock().contains(&other.ordinal) {
            return Ok(());
        }
        if !self.can_access(other)? {
            return Err(Error::TransportUnavailable(format!(
                "GPU {} cannot access GPU {} directly (no peer access)",
                self.ordinal, other.ordinal
            )));
        }
        let _ctx = self.bind()?;
        // SAFETY: both contexts are valid, retained primary contexts.
        let r = unsafe { cu::cuCtxEnablePeerAccess(other.ctx, 0) };
        // The application (PyTorch) may have enabled it already.
        if r != CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            check(r, "cuCtxEnablePeerAccess")?;
        }
        self.peers_enabled.lock().push(other.ordinal);
        Ok(())
    }

    /// The GPU with this PCI bus id, if this process sees it.
    pub fn by_bus_id(bus_id: &str) -> Result<Option<&'static Device>> {
        for i in 0..device_count()? {
            let d = Device::get(i)?;
            if d.bus_id.eq_ignore_ascii_case(bus_id) {
                return Ok(Some(d));
            }
        }
        Ok(None)
    }
}

/// A GPU made current by [`Device::bind`]; the thread's previous context comes back
/// when it drops. Tied to its thread (a raw context pointer is neither Send nor Sync).
#[must_use = "the GPU is current only while the guard lives"]
pub struct Bound {
    previous: Option<cu::CUcontext>,
}

impl Bound {
    fn enter(ctx: cu::CUcontext) -> Result<Bound> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuCtxGetCurrent(&mut previous) }, "cuCtxGetCurrent")?;
        if previous == ctx {
            return Ok(Bound { previous: None });
        }
        // SAFETY: a valid, retained context.
        check(unsafe { cu::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        Ok(Bound { previous: Some(previous) })
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: the context that was current before (or none): still valid, since
            // primary contexts stay retained for the life of the process.
            unsafe { cu::cuCtxSetCurrent(previous) };
        }
    }
}

/// What the driver knows about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerKind {
    /// Device memory of the GPU with this ordinal.
    Device(usize),
    /// Host memory, or memory CUDA does not know.
    Host,
}

/// A 32-bit attribute of `addr`, with the driver's answer.
fn pointer_attribute(addr: u64, attribute: cu::CUpointer_attribute) -> (CUresult, i32) {
    let mut value: i32 = 0;
    // SAFETY: every attribute asked for here is a 32-bit value, written into a local.
    let r = unsafe { cu::cuPointerGetAttribute((&mut value as *mut i32).cast(), attribute, addr) };
    (r, value)
}

/// Classifies `addr` (device memory of which GPU, or not device memory at all).
pub fn pointer_kind(addr: u64) -> Result<PointerKind> {
    init()?;
    let (r, mem_type) = pointer_attribute(addr, cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
    // The driver answers INVALID_VALUE for memory it does not know (plain host memory);
    // any other failure is the driver's, not a verdict on the address.
    if r == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(PointerKind::Host);
    }
    check(r, "cuPointerGetAttribute")?;
    if mem_type as u32 != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(PointerKind::Host);
    }
    let (r, ordinal) = pointer_attribute(addr, cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
    check(r, "cuPointerGetAttribute")?;
    Ok(PointerKind::Device(ordinal as usize))
}

/// Whether `addr` is host memory the GPU can reach: allocated by CUDA or registered with
/// it (pinned). The driver knows no other host memory.
pub fn host_memory_registered(addr: u64) -> Result<bool> {
    init()?;
    let (r, mem_type) = pointer_attribute(addr, cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
    if r == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(false);
    }
    check(r, "cuPointerGetAttribute")?;
    Ok(mem_type as u32 == cu::CUmemorytype::CU_MEMORYTYPE_HOST as u32)
}

/// Whether `addr` lies in memory CUDA IPC handles can name: `cudaMalloc`'s, not a
/// stream-ordered pool's or the VMM API's (whose "allocations", as
/// [`allocation_range`] sees them, are single mapped chunks, not what the caller
/// allocated).
pub fn legacy_ipc_capable(addr: u64) -> Result<bool> {
    let (r, capable) =
        pointer_attribute(addr, cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE);
    check(r, "cuPointerGetAttribute")?;
    Ok(capable != 0)
}

/// The allocation `addr` belongs to: (base, size). IPC handles name allocations.
pub fn allocation_range(addr: u64) -> Result<(u64, u64)> {
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: out-pointers to locals.
    check(unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }, "cuMemGetAddressRange")?;
    Ok((base, size as u64))
}

/// Copies `len` bytes from `src` to `dst`, either of which may be device or host memory
/// (unified addressing tells which), and returns when the copy is complete. For copies
/// off the hot path: reassembling objects, filling and checking benchmark buffers,
/// uploading kernel tables.
///
/// Complete means landed: the driver's synchronous copy returns from pageable host
/// memory as soon as the bytes are staged, before they reach the GPU, and work on
/// freight's non-blocking streams is not ordered after it. Copying on a stream and
/// waiting for that stream closes the gap.
pub fn copy_sync(device: &Device, dst: u64, src: u64, len: usize) -> Result<()> {
    let _ctx = device.bind()?;
    let stream = device.sync_stream()?;
    // SAFETY: the caller vouches for both ranges; the driver checks the pointers.
    unsafe { stream.copy(dst, src, len)? };
    stream.synchronize()
}

/// Copies queued on the same streams as [`copy_sync`]'s and waited for together: a
/// receiver copying a batch of objects out of its buffers waits once, not once per
/// object. Dropped before [`CopyBatch::finish`], it still waits, so no copy it queued
/// outlives the caller's hold on the memory.
#[derive(Default)]
pub struct CopyBatch {
    /// GPUs with copies queued and not yet waited for.
    queued_on: Vec<&'static Device>,
}

impl CopyBatch {
    /// Queues a copy of `len` bytes from `src` to `dst` on `device`'s copy stream.
    ///
    /// # Safety
    ///
    /// Both ranges must stay valid until the batch is finished or dropped.
    pub unsafe fn copy(&mut self, device: &'static Device, dst: u64, src: u64, len: usize) -> Result<()> {
        let _ctx = device.bind()?;
        // SAFETY: as the caller vouches; the driver checks the pointers.
        unsafe { device.sync_stream()?.copy(dst, src, len)? };
        if !self.queued_on.iter().any(|d| d.ordinal == device.ordinal) {
            self.queued_on.push(device);
        }
        Ok(())
    }

    /// Waits until every queued copy is complete; the first failure is returned after
    /// every GPU was waited for.
    pub fn finish(mut self) -> Result<()> {
        self.wait()
    }

    fn wait(&mut self) -> Result<()> {
        let mut outcome = Ok(());
        for device in self.queued_on.drain(..) {
            let waited = device.bind().and_then(|_ctx| device.sync_stream()?.synchronize());
            outcome = outcome.and(waited);
        }
        outcome
    }
}

impl Drop for CopyBatch {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::warn!(error = %e, "waiting for copies of a dropped batch failed");
        }
    }
}

/// A stream of freight's own on the GPU current when it was made. Non-blocking: its work
/// never queues behind the legacy default stream, where PyTorch runs its kernels (the
/// caller orders its own work before handing memory to freight).
pub struct Stream(cu::CUstream);

// SAFETY: streams are thread-safe driver handles.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream on `device`.
    pub fn new(device: &Device) -> Result<Stream> {
        let _ctx = device.bind()?;
        Stream::create()
    }

    fn create() -> Result<Stream> {
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(
            unsafe { cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        Ok(Stream(s))
    }

    pub fn raw(&self) -> cu::CUstream {
        self.0
    }

    /// Queues a copy of `len` bytes from `src` to `dst` (device or host memory).
    ///
    /// # Safety
    ///
    /// Both ranges must stay valid until the copy is done; host memory that is not
    /// pinned makes the call wait until the driver has staged it.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: as the caller vouches.
        check(unsafe { cu::cuMemcpyAsync(dst, src, len, self.0) }, "cuMemcpyAsync")
    }

    /// Marks the end of the work queued so far.
    pub fn record(&self, event: &Event) -> Result<()> {
        event.record_on(self.0)
    }

    /// Makes later work wait for `event` (as last recorded when this is called).
    pub fn wait_for(&self, event: &Event) -> Result<()> {
        // SAFETY: a live stream and event of one context.
        check(unsafe { cu::cuStreamWaitEvent(self.0, event.0, 0) }, "cuStreamWaitEvent")
    }

    /// Waits for the work queued so far.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        check(unsafe { cu::cuStreamSynchronize(self.0) }, "cuStreamSynchronize")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: ours; the driver lets queued work finish before the stream goes.
        unsafe { cu::cuStreamDestroy_v2(self.0) };
    }
}

/// A completion marker on a stream. Waiting on it sleeps in the driver (blocking sync)
/// instead of spinning a core.
pub struct Event(cu::CUevent);

// SAFETY: events are thread-safe driver handles.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(device: &Device) -> Result<Event> {
        let _ctx = device.bind()?;
        let mut e = std::ptr::null_mut();
        let flags =
            cu::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32 | cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Event(e))
    }

    /// Marks the end of the work queued so far on `device`'s stream.
    pub fn record(&self, device: &Device) -> Result<()> {
        self.record_on(device.stream())
    }

    /// Marks the end of the work queued so far on `stream`.
    pub(crate) fn record_on(&self, stream: cu::CUstream) -> Result<()> {
        // SAFETY: valid event; the caller passes a live stream of the event's context.
        check(unsafe { cu::cuEventRecord(self.0, stream) }, "cuEventRecord")
    }

    /// `Ok(true)` when the work before the record has finished.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: valid event.
        match unsafe { cu::cuEventQuery(self.0) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|_| false),
        }
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: valid event.
        check(unsafe { cu::cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the event; the driver defers destruction until it completes.
        unsafe { cu::cuEventDestroy_v2(self.0) };
    }
}

/// Device memory owned by freight (descriptor tables of the copy kernel).
pub struct DeviceBuffer {
    ptr: cu::CUdeviceptr,
    len: usize,
    device: &'static Device,
}

// SAFETY: a device address; the driver synchronises access.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 16) on `device`, uninitialised.
    pub fn alloc(device: &'static Device, len: usize) -> Result<DeviceBuffer> {
        let _ctx = device.bind()?;
        let len = len.max(16);
        let mut ptr = 0;
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
        Ok(DeviceBuffer { ptr, len, device })
    }

    /// Allocates `len` bytes (at least 16) on `device`, all zero once this returns.
    ///
    /// The driver's plain memset of device memory returns before it runs, queued
    /// behind whatever the legacy default stream holds (a framework's kernels): a peer
    /// told of the buffer could write into it first and see its words wiped. Zeroing on
    /// a stream of freight's own and waiting for it closes that gap.
    pub fn zeroed(device: &'static Device, len: usize) -> Result<DeviceBuffer> {
        let buf = DeviceBuffer::alloc(device, len)?;
        let _ctx = device.bind()?;
        let stream = device.sync_stream()?;
        // SAFETY: our own allocation, `buf.len` bytes long.
        check(unsafe { cu::cuMemsetD8Async(buf.ptr, 0, buf.len, stream.raw()) }, "cuMemsetD8Async")?;
        stream.synchronize()?;
        Ok(buf)
    }

    /// Allocates `bytes.len()` bytes on `device` and copies `bytes` there.
    pub fn upload(device: &'static Device, bytes: &[u8]) -> Result<DeviceBuffer> {
        let buf = DeviceBuffer::alloc(device, bytes.len())?;
        if !bytes.is_empty() {
            // Landed before any kernel may read it (see copy_sync).
            copy_sync(device, buf.ptr, bytes.as_ptr() as u64, bytes.len())?;
        }
        Ok(buf)
    }

    pub fn device(&self) -> &'static Device {
        self.device
    }

    pub fn addr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.device.bind() {
            // SAFETY: we own the allocation; no launch that uses it is pending (its
            // request holds this buffer until the launch completed).
            unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}
