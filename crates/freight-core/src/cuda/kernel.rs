//! The batched copy kernel: one launch moves every copy of a request, whatever their
//! number and sizes. CUDA C++ compiled by NVRTC at run time, once per GPU architecture.
//!
//! A request becomes a table of work items (source, destination, length), long copies
//! cut into items of at most [`ITEM_BYTES`]. Each warp takes items in turn and copies
//! with 16-byte loads and stores, eight in flight per lane, when source and destination
//! share their alignment (byte copies otherwise). The kernel runs on the initiator's GPU
//! and reaches the peer's memory through an IPC mapping: it pushes for a WRITE and pulls
//! for a READ.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nvrtc;
use parking_lot::Mutex;

use super::driver::{check, Device};
use crate::error::{Error, Result};

/// Largest piece of a copy that one warp moves: small enough that a few large copies
/// still spread over every SM, large enough that the item table stays small.
pub const ITEM_BYTES: u64 = 64 << 10;

/// One work item as the kernel reads it.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

pub const KERNEL_NAME: &str = "freight_batched_copy";

pub const SOURCE: &str = r#"
struct Item { unsigned long long src, dst, len; };

__device__ __forceinline__ void copy_bytes(const unsigned char* s, unsigned char* d,
                                           unsigned long long n, unsigned lane) {
    for (unsigned long long i = lane; i < n; i += 32) d[i] = s[i];
}

__device__ __forceinline__ void copy_item(const Item it, unsigned lane) {
    const unsigned char* s = (const unsigned char*)it.src;
    unsigned char* d = (unsigned char*)it.dst;
    unsigned long long n = it.len;
    if (((it.src ^ it.dst) & 15) != 0) {  // alignments differ: no vector access is safe
        copy_bytes(s, d, n, lane);
        return;
    }
    unsigned long long head = (16 - (it.src & 15)) & 15;
    if (head > n) head = n;
    copy_bytes(s, d, head, lane);
    const uint4* vs = (const uint4*)(s + head);
    uint4* vd = (uint4*)(d + head);
    const unsigned long long vectors = (n - head) >> 4;
    unsigned long long i = lane;
    // Eight 16-byte loads in flight per lane before any store: a 4 KiB item is one
    // round trip over the link, not two.
    for (; i + 224 < vectors; i += 256) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = vs[i + 32 * k];
#pragma unroll
        for (int k = 0; k < 8; ++k) vd[i + 32 * k] = v[k];
    }
    for (; i < vectors; i += 32) vd[i] = vs[i];
    const unsigned long long done = head + (vectors << 4);
    copy_bytes(s + done, d + done, n - done, lane);
}

extern "C" __global__ void __launch_bounds__(256) freight_batched_copy(const Item* items, unsigned long long count) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    for (unsigned long long w = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < count; w += warps) {
        copy_item(items[w], lane);
    }
}
"#;

/// Threads per block: eight warps.
pub const BLOCK_THREADS: u32 = 256;

/// Blocks per SM: as many as an SM holds (64 warps). Measured on H200 over NVLink, half
/// as many moved 4 KiB and 16 KiB items 5 to 15% slower; large items do not care.
pub const BLOCKS_PER_SM: usize = 8;

/// Blocks to launch for `items` work items on a GPU with `multiprocessors` SMs: one
/// warp per item, at most [`BLOCKS_PER_SM`] per SM (the grid loop does the rest).
pub fn grid_size(items: usize, multiprocessors: u32) -> u32 {
    let warps_per_block = (BLOCK_THREADS / 32) as usize;
    let wanted = items.div_ceil(warps_per_block).max(1);
    let most = multiprocessors.max(1) as usize * BLOCKS_PER_SM;
    wanted.min(most) as u32
}

/// Cuts copies (src, dst, len) into work items of at most [`ITEM_BYTES`].
pub fn items_of(copies: impl IntoIterator<Item = (u64, u64, u64)>) -> Vec<Item> {
    let mut items = Vec::new();
    for (src, dst, len) in copies {
        let mut off = 0;
        while off < len {
            let n = (len - off).min(ITEM_BYTES);
            items.push(Item { src: src + off, dst: dst + off, len: n });
            off += n;
        }
    }
    items
}

/// NVRTC, loaded on first use. Wheels of NVRTC (PyPI's nvidia-cuda-nvrtc) live outside
/// the loader's search path, so `FREIGHT_NVRTC` (a library file) and the folders in
/// `FREIGHT_CUDA_LIB_DIRS` are tried first: loading a library by path makes it
/// resolvable by its soname afterwards.
fn nvrtc_init() -> Result<()> {
    static STATE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            for path in nvrtc_candidates() {
                // SAFETY: loading a shared library; it stays loaded for the process.
                if let Ok(lib) = unsafe { libloading::Library::new(&path) } {
                    tracing::debug!(path = %path.display(), "loaded NVRTC");
                    std::mem::forget(lib);
                    break;
                }
            }
            // SAFETY: probing for the library has no side effects beyond dlopen.
            if unsafe { nvrtc::is_culib_present() } {
                Ok(())
            } else {
                Err("NVRTC (libnvrtc.so) is not installed; set FREIGHT_NVRTC to its path".into())
            }
        })
        .clone()
        .map_err(|why| Error::TransportUnavailable(format!("cannot compile GPU kernels: {why}")))
}

fn nvrtc_candidates() -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("FREIGHT_NVRTC") {
        out.push(p.into());
    }
    let mut dirs: Vec<std::path::PathBuf> =
        std::env::var_os("FREIGHT_CUDA_LIB_DIRS").map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            dirs.push(std::path::PathBuf::from(home).join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut libs: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc.so")))
            .collect();
        libs.sort();
        out.extend(libs);
    }
    out
}

fn nvrtc_check(r: nvrtc::nvrtcResult, call: &'static str) -> Result<()> {
    if r == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { call: call.into(), code: format!("{r:?}") })
    }
}

/// Compiles the kernel for one architecture ("sm_90") into a cubin. Needs NVRTC only,
/// no GPU: this is also the compile check that runs where there is none.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    nvrtc_init()?;
    let src = CString::new(SOURCE).expect("no NUL in the source");
    let name = CString::new("freight_copy.cu").expect("no NUL");
    let options: Vec<CString> = [format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()]
        .into_iter()
        .map(|o| CString::new(o).expect("no NUL"))
        .collect();
    let option_ptrs: Vec<*const std::ffi::c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog = std::ptr::null_mut();
    // SAFETY: NUL-terminated inputs that outlive the calls; the program is destroyed
    // before returning.
    unsafe {
        nvrtc_check(
            nvrtc::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()),
            "nvrtcCreateProgram",
        )?;
        let compiled = nvrtc::nvrtcCompileProgram(prog, option_ptrs.len() as i32, option_ptrs.as_ptr());
        let result = if compiled == nvrtc::nvrtcResult::NVRTC_SUCCESS {
            let mut size = 0;
            nvrtc_check(nvrtc::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize").and_then(|_| {
                let mut cubin = vec![0u8; size];
                nvrtc_check(nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()), "nvrtcGetCUBIN").map(|_| cubin)
            })
        } else {
            let mut size = 0;
            nvrtc::nvrtcGetProgramLogSize(prog, &mut size);
            let mut log = vec![0u8; size.max(1)];
            nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast());
            let log = CStr::from_bytes_until_nul(&log).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            Err(Error::Cuda { call: "nvrtcCompileProgram".into(), code: format!("{compiled:?} for {arch}: {log}") })
        };
        nvrtc::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// The kernel loaded on one GPU.
pub struct Kernel {
    function: cu::CUfunction,
    device: &'static Device,
}

// SAFETY: a function handle is valid in its context from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// The kernel on `device`: compiled once per architecture, loaded once per GPU.
    pub fn on(device: &'static Device) -> Result<Arc<Kernel>> {
        static CUBINS: OnceLock<Mutex<HashMap<String, Arc<Vec<u8>>>>> = OnceLock::new();
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Kernel>>>> = OnceLock::new();
        let loaded = LOADED.get_or_init(Default::default);
        if let Some(k) = loaded.lock().get(&device.ordinal) {
            return Ok(k.clone());
        }
        let (major, minor) = device.compute_capability;
        let arch = format!("sm_{major}{minor}");
        let cubin = {
            let mut cubins = CUBINS.get_or_init(Default::default).lock();
            match cubins.get(&arch) {
                Some(c) => c.clone(),
                None => {
                    let t = std::time::Instant::now();
                    let c = Arc::new(compile(&arch)?);
                    tracing::info!(%arch, bytes = c.len(), ms = t.elapsed().as_millis() as u64, "compiled the copy kernel");
                    cubins.insert(arch.clone(), c.clone());
                    c
                }
            }
        };
        device.bind()?;
        let mut module = std::ptr::null_mut();
        let mut function = std::ptr::null_mut();
        let fname = CString::new(KERNEL_NAME).expect("no NUL");
        // SAFETY: a cubin NVRTC produced for this architecture; the module is kept for
        // the life of the process.
        unsafe {
            check(cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const c_void), "cuModuleLoadData")?;
            check(cu::cuModuleGetFunction(&mut function, module, fname.as_ptr()), "cuModuleGetFunction")?;
        }
        let k = Arc::new(Kernel { function, device });
        loaded.lock().insert(device.ordinal, k.clone());
        Ok(k)
    }

    /// Launches the kernel over `count` items at device address `table`, on the
    /// device's stream.
    pub fn launch(&self, table: u64, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let grid = grid_size(count, self.device.multiprocessors);
        let (mut table, mut count) = (table, count as u64);
        let mut params: [*mut c_void; 2] = [(&mut table as *mut u64).cast(), (&mut count as *mut u64).cast()];
        self.device.bind()?;
        // SAFETY: the parameters match the kernel's signature; the table holds `count`
        // items whose ranges the plan bounds-checked.
        check(
            unsafe {
                cu::cuLaunchKernel(
                    self.function,
                    grid,
                    1,
                    1,
                    BLOCK_THREADS,
                    1,
                    1,
                    0,
                    self.device.stream(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_copies_are_cut_into_items() {
        let items = items_of([(0, 1 << 30, ITEM_BYTES * 2 + 5), (100, 200, 3)]);
        assert_eq!(items.len(), 4);
        assert_eq!(items[0], Item { src: 0, dst: 1 << 30, len: ITEM_BYTES });
        assert_eq!(items[2], Item { src: 2 * ITEM_BYTES, dst: (1 << 30) + 2 * ITEM_BYTES, len: 5 });
        assert_eq!(items[3], Item { src: 100, dst: 200, len: 3 });
        assert_eq!(std::mem::size_of::<Item>(), 24);
    }

    #[test]
    fn the_grid_fills_the_gpu_and_no_more() {
        assert_eq!(grid_size(1, 132), 1);
        assert_eq!(grid_size(9, 132), 2);
        assert_eq!(grid_size(1 << 20, 132), 132 * BLOCKS_PER_SM as u32);
    }

    /// Compiles the kernel where NVRTC is installed (CI installs it from PyPI); says
    /// why it skips where it is not.
    #[test]
    fn the_kernel_compiles_for_hopper_and_ampere() {
        if let Err(e) = nvrtc_init() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        for arch in ["sm_90", "sm_80"] {
            let cubin = compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: not a cubin");
        }
    }
}
