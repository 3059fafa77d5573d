//! NVRTC (CUDA C++ compiled at run time) and the modules its cubins load into: shared by
//! every kernel freight launches, so each is compiled once per GPU architecture and
//! loaded once per GPU.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nvrtc;
use parking_lot::Mutex;

use super::driver::{check, Device};
use freight_proto::error::{Error, Result};

/// NVRTC, loaded on first use. Wheels of NVRTC (PyPI's nvidia-cuda-nvrtc) live outside
/// the loader's search path, so `FREIGHT_NVRTC` (a library file) and the folders in
/// `FREIGHT_CUDA_LIB_DIRS` are tried first: loading a library by path makes it
/// resolvable by its soname afterwards.
pub fn init() -> Result<()> {
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

/// Compiles CUDA C++ `source` (named `file_name` in diagnostics) for `arch` ("sm_90")
/// with the default options plus `extra`; returns the cubin and the compiler's log.
/// Needs NVRTC only, no GPU.
pub fn compile(file_name: &str, source: &str, arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String)> {
    init()?;
    let src = CString::new(source).map_err(|_| Error::InvalidArgument("kernel source holds a NUL".into()))?;
    let name = CString::new(file_name).map_err(|_| Error::InvalidArgument("kernel file name holds a NUL".into()))?;
    let options: Vec<CString> = [format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()]
        .into_iter()
        .chain(extra.iter().map(|o| o.to_string()))
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
        let mut size = 0;
        nvrtc::nvrtcGetProgramLogSize(prog, &mut size);
        let mut log = vec![0u8; size.max(1)];
        nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast());
        let log = CStr::from_bytes_until_nul(&log).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        let result = if compiled == nvrtc::nvrtcResult::NVRTC_SUCCESS {
            let mut size = 0;
            nvrtc_check(nvrtc::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize").and_then(|_| {
                let mut cubin = vec![0u8; size];
                nvrtc_check(nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()), "nvrtcGetCUBIN").map(|_| cubin)
            })
        } else {
            Err(Error::Cuda { call: "nvrtcCompileProgram".into(), code: format!("{compiled:?} for {arch}: {log}") })
        };
        nvrtc::nvrtcDestroyProgram(&mut prog);
        result.map(|cubin| (cubin, log))
    }
}

/// A kernel source file's cubin for one architecture, and its module on one GPU.
type ByArch = (&'static str, String);
type ByGpu = (&'static str, usize);
/// A build's outcome: the cubin, or why it failed.
type Built = Result<Arc<Vec<u8>>>;

/// A cubin loaded on one GPU; lives as long as the process (kernels are loaded once).
pub struct Module {
    raw: cu::CUmodule,
    device: &'static Device,
}

// SAFETY: a module handle is valid in its context from any thread.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// The module built from `source` on `device`: compiled by NVRTC once per `(name,
    /// architecture)` and loaded once per `(name, GPU)` for the life of the process.
    pub fn cached(device: &'static Device, file_name: &'static str, source: &'static str) -> Result<Arc<Module>> {
        // A failed build is kept too: it fails the same way every time, and building
        // again would cost every request seconds under the lock.
        static CUBINS: OnceLock<Mutex<HashMap<ByArch, Built>>> = OnceLock::new();
        static LOADED: OnceLock<Mutex<HashMap<ByGpu, Arc<Module>>>> = OnceLock::new();
        // Held while loading, so that racing callers load the module once.
        let mut loaded = LOADED.get_or_init(Default::default).lock();
        if let Some(m) = loaded.get(&(file_name, device.ordinal)) {
            return Ok(m.clone());
        }
        let (major, minor) = device.compute_capability;
        let arch = format!("sm_{major}{minor}");
        let cubin = CUBINS
            .get_or_init(Default::default)
            .lock()
            .entry((file_name, arch.clone()))
            .or_insert_with(|| {
                let t = std::time::Instant::now();
                let built = compile(file_name, source, &arch, &[]).map(|(cubin, _)| Arc::new(cubin));
                match &built {
                    Ok(c) => {
                        tracing::info!(file = file_name, %arch, bytes = c.len(), ms = t.elapsed().as_millis() as u64, "compiled kernels")
                    }
                    Err(e) => tracing::error!(file = file_name, %arch, error = %e, "the kernels do not compile"),
                }
                built
            })
            .clone()?;
        let module = Arc::new(Module::load(device, &cubin)?);
        loaded.insert((file_name, device.ordinal), module.clone());
        Ok(module)
    }

    /// Loads `cubin` (built for this GPU's architecture) on `device`.
    pub fn load(device: &'static Device, cubin: &[u8]) -> Result<Module> {
        let _ctx = device.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the driver copies the image.
        check(unsafe { cu::cuModuleLoadData(&mut raw, cubin.as_ptr() as *const c_void) }, "cuModuleLoadData")?;
        Ok(Module { raw, device })
    }

    /// The kernel called `name` (an `extern "C"` name).
    pub fn function(&self, name: &str) -> Result<Function> {
        let c_name = CString::new(name).map_err(|_| Error::InvalidArgument("kernel name holds a NUL".into()))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the name is NUL-terminated; the module lives
        // for the process.
        check(unsafe { cu::cuModuleGetFunction(&mut raw, self.raw, c_name.as_ptr()) }, "cuModuleGetFunction")?;
        Ok(Function { raw, device: self.device })
    }
}

/// One kernel of a loaded [`Module`].
#[derive(Clone, Copy)]
pub struct Function {
    pub raw: cu::CUfunction,
    pub device: &'static Device,
}

// SAFETY: a function handle is valid in its context from any thread.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

impl Function {
    /// Blocks of `threads` threads that one SM holds at once.
    pub fn resident_per_sm(&self, threads: u32, dynamic_shared: usize) -> Result<u32> {
        let mut n = 0;
        // SAFETY: out-pointer to a local; a loaded function.
        check(
            unsafe {
                cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.raw, threads as i32, dynamic_shared)
            },
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )?;
        Ok(n.max(0) as u32)
    }

    /// An attribute of the compiled kernel (registers, spilled bytes...).
    pub fn attribute(&self, attribute: cu::CUfunction_attribute) -> i32 {
        let mut v = 0;
        // SAFETY: out-pointer to a local; a loaded function.
        unsafe { cu::cuFuncGetAttribute(&mut v, attribute, self.raw) };
        v
    }

    /// Launches `grid` blocks of `threads` on `stream`.
    ///
    /// # Safety
    ///
    /// `params` must point at values that match the kernel's parameters one for one, and
    /// `stream` must be a live stream of this function's GPU (or null).
    pub unsafe fn launch(
        &self,
        stream: cu::CUstream,
        grid: u32,
        threads: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let _ctx = self.device.bind()?;
        // SAFETY: as the caller promises.
        check(
            unsafe {
                cu::cuLaunchKernel(
                    self.raw,
                    grid,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}
