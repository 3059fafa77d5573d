//! libfabric's C interface, loaded at run time: the wheel must import where libfabric is
//! not installed, so nothing links against it.
//!
//! Only five functions are real exports (`fi_getinfo` and friends). Everything else in
//! libfabric's API (`fi_domain`, `fi_write`, `fi_cq_read`...) is an inline function in
//! its headers that calls through the operation tables each object carries; the
//! wrappers at the end of this file do the same. The structures declare the ABI of
//! libfabric 1.x (stable since 1.0, fields only ever appended) up to the last field this
//! crate touches; `fabric_abi` in the tests checks the offsets that matter against
//! known values of the headers.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

// -- constants (rdma/fabric.h, fi_domain.h, fi_endpoint.h, fi_errno.h) -------------------

pub const FI_RMA: u64 = 1 << 2;
pub const FI_READ: u64 = 1 << 8;
pub const FI_WRITE: u64 = 1 << 9;
pub const FI_RECV: u64 = 1 << 10;
pub const FI_TRANSMIT: u64 = 1 << 11;
pub const FI_REMOTE_READ: u64 = 1 << 12;
pub const FI_REMOTE_WRITE: u64 = 1 << 13;
pub const FI_DELIVERY_COMPLETE: u64 = 1 << 28;
/// The provider can reach device memory (GPU) registered with an `iface`.
pub const FI_HMEM: u64 = 1 << 47;
pub const FI_CONTEXT2: u64 = 1 << 52;
pub const FI_CONTEXT: u64 = 1 << 59;

pub const FI_EP_RDM: u32 = 3;
/// `addr_format`: a NUL-terminated string ("fi_shm://..."), of any length.
pub const FI_ADDR_STR: u32 = 9;
pub const FI_THREAD_SAFE: u32 = 1;
pub const FI_AV_TABLE: u32 = 2;
pub const FI_CQ_FORMAT_CONTEXT: u32 = 1;
pub const FI_WAIT_NONE: u32 = 0;
pub const FI_WAIT_UNSPEC: u32 = 1;
pub const FI_WAIT_YIELD: u32 = 5;
pub const FI_ENABLE: c_int = 6;

pub const FI_MR_LOCAL: c_int = 1 << 2;
pub const FI_MR_VIRT_ADDR: c_int = 1 << 4;
pub const FI_MR_ALLOCATED: c_int = 1 << 5;
pub const FI_MR_PROV_KEY: c_int = 1 << 6;
/// Device memory must be registered, and its `desc` passed, to be used at all.
pub const FI_MR_HMEM: c_int = 1 << 10;

/// `enum fi_hmem_iface`: what kind of memory a registration names.
pub const FI_HMEM_SYSTEM: u32 = 0;
pub const FI_HMEM_CUDA: u32 = 1;

pub const FI_EAGAIN: isize = 11;
pub const FI_ETIMEDOUT: isize = 110;
/// What a sleeping completion-queue read returns after `fi_cq_signal` woke it (the
/// providers built on libfabric's common queue code answer so): woken, nothing read.
pub const FI_ECANCELED: isize = 125;
pub const FI_EAVAIL: isize = 259;

/// The API version this code is written against. 1.11 has everything it uses; below
/// 1.10 the core would register any memory as host memory, whatever its `iface`, and a
/// provider would then touch GPU memory as if it were host memory.
pub const API_VERSION: u32 = (1 << 16) | 11;

// -- structures --------------------------------------------------------------------------

type Unused = *const c_void;

#[repr(C)]
pub struct Fid {
    pub fclass: usize,
    pub context: *mut c_void,
    pub ops: *const FiOps,
}

#[repr(C)]
pub struct FiOps {
    pub size: usize,
    pub close: unsafe extern "C" fn(*mut Fid) -> c_int,
    pub bind: unsafe extern "C" fn(*mut Fid, *mut Fid, u64) -> c_int,
    pub control: unsafe extern "C" fn(*mut Fid, c_int, *mut c_void) -> c_int,
}

#[repr(C)]
pub struct FiInfo {
    pub next: *mut FiInfo,
    pub caps: u64,
    pub mode: u64,
    pub addr_format: u32,
    pub src_addrlen: usize,
    pub dest_addrlen: usize,
    pub src_addr: *mut c_void,
    pub dest_addr: *mut c_void,
    pub handle: *mut Fid,
    pub tx_attr: *mut FiTxAttr,
    pub rx_attr: *mut c_void,
    pub ep_attr: *mut FiEpAttr,
    pub domain_attr: *mut FiDomainAttr,
    pub fabric_attr: *mut FiFabricAttr,
    pub nic: *mut c_void,
}

/// Leading fields of `struct fi_tx_attr`.
#[repr(C)]
pub struct FiTxAttr {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
}

/// Leading fields of `struct fi_ep_attr`.
#[repr(C)]
pub struct FiEpAttr {
    pub ep_type: u32,
    pub protocol: u32,
    pub protocol_version: u32,
    pub max_msg_size: usize,
}

/// Leading fields of `struct fi_domain_attr`.
#[repr(C)]
pub struct FiDomainAttr {
    pub domain: *mut c_void,
    pub name: *mut c_char,
    pub threading: u32,
    pub control_progress: u32,
    pub data_progress: u32,
    pub resource_mgmt: u32,
    pub av_type: u32,
    pub mr_mode: c_int,
    pub mr_key_size: usize,
}

/// Leading fields of `struct fi_fabric_attr`.
#[repr(C)]
pub struct FiFabricAttr {
    pub fabric: *mut c_void,
    pub name: *mut c_char,
    pub prov_name: *mut c_char,
    pub prov_version: u32,
    pub api_version: u32,
}

#[repr(C)]
pub struct FidFabric {
    pub fid: Fid,
    pub ops: *const FiOpsFabric,
}

#[repr(C)]
pub struct FiOpsFabric {
    pub size: usize,
    pub domain: unsafe extern "C" fn(*mut FidFabric, *mut FiInfo, *mut *mut FidDomain, *mut c_void) -> c_int,
}

#[repr(C)]
pub struct FidDomain {
    pub fid: Fid,
    pub ops: *const FiOpsDomain,
    pub mr: *const FiOpsMr,
}

#[repr(C)]
pub struct FiOpsDomain {
    pub size: usize,
    pub av_open: unsafe extern "C" fn(*mut FidDomain, *mut FiAvAttr, *mut *mut FidAv, *mut c_void) -> c_int,
    pub cq_open: unsafe extern "C" fn(*mut FidDomain, *mut FiCqAttr, *mut *mut FidCq, *mut c_void) -> c_int,
    pub endpoint: unsafe extern "C" fn(*mut FidDomain, *mut FiInfo, *mut *mut FidEp, *mut c_void) -> c_int,
}

#[repr(C)]
pub struct FiOpsMr {
    pub size: usize,
    pub reg: Unused,
    pub regv: Unused,
    pub regattr: unsafe extern "C" fn(*mut Fid, *const FiMrAttr, u64, *mut *mut FidMr) -> c_int,
}

/// `struct iovec`.
#[repr(C)]
pub struct IoVec {
    pub base: *mut c_void,
    pub len: usize,
}

/// `struct fi_mr_attr` as of 1.17. Later versions append fields, which the library
/// reads only from callers that declare a later API version.
#[repr(C)]
pub struct FiMrAttr {
    pub mr_iov: *const IoVec,
    pub iov_count: usize,
    pub access: u64,
    pub offset: u64,
    pub requested_key: u64,
    pub context: *mut c_void,
    pub auth_key_size: usize,
    pub auth_key: *mut u8,
    pub iface: u32,
    /// The union of device ids (`cuda`, `ze`...): the CUDA ordinal for `FI_HMEM_CUDA`.
    pub device: u64,
}

#[repr(C)]
pub struct FidMr {
    pub fid: Fid,
    pub mem_desc: *mut c_void,
    pub key: u64,
}

#[repr(C)]
pub struct FidEp {
    pub fid: Fid,
    pub ops: Unused,
    pub cm: *const FiOpsCm,
    pub msg: Unused,
    pub rma: *const FiOpsRma,
}

#[repr(C)]
pub struct FiOpsCm {
    pub size: usize,
    pub setname: Unused,
    pub getname: unsafe extern "C" fn(*mut Fid, *mut c_void, *mut usize) -> c_int,
}

type RmaFn = unsafe extern "C" fn(*mut FidEp, *mut c_void, usize, *mut c_void, u64, u64, u64, *mut c_void) -> isize;

#[repr(C)]
pub struct FiOpsRma {
    pub size: usize,
    pub read: RmaFn,
    pub readv: Unused,
    pub readmsg: Unused,
    /// `const void *buf` in C; the same ABI.
    pub write: RmaFn,
}

#[repr(C)]
pub struct FidCq {
    pub fid: Fid,
    pub ops: *const FiOpsCq,
}

#[repr(C)]
pub struct FiOpsCq {
    pub size: usize,
    pub read: unsafe extern "C" fn(*mut FidCq, *mut c_void, usize) -> isize,
    pub readfrom: Unused,
    pub readerr: unsafe extern "C" fn(*mut FidCq, *mut FiCqErrEntry, u64) -> isize,
    pub sread: unsafe extern "C" fn(*mut FidCq, *mut c_void, usize, *const c_void, c_int) -> isize,
    pub sreadfrom: Unused,
    pub signal: unsafe extern "C" fn(*mut FidCq) -> c_int,
    pub strerror: unsafe extern "C" fn(*mut FidCq, c_int, *const c_void, *mut c_char, usize) -> *const c_char,
}

#[repr(C)]
pub struct FidAv {
    pub fid: Fid,
    pub ops: *const FiOpsAv,
}

#[repr(C)]
pub struct FiOpsAv {
    pub size: usize,
    pub insert: unsafe extern "C" fn(*mut FidAv, *const c_void, usize, *mut u64, u64, *mut c_void) -> c_int,
}

#[repr(C)]
#[derive(Default)]
pub struct FiAvAttr {
    pub av_type: u32,
    pub rx_ctx_bits: c_int,
    pub count: usize,
    pub ep_per_node: usize,
    pub name: usize,
    pub map_addr: usize,
    pub flags: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct FiCqAttr {
    pub size: usize,
    pub flags: u64,
    pub format: u32,
    pub wait_obj: u32,
    pub signaling_vector: c_int,
    pub wait_cond: u32,
    pub wait_set: usize,
}

/// `struct fi_cq_entry` (`FI_CQ_FORMAT_CONTEXT`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FiCqEntry {
    pub op_context: *mut c_void,
}

#[repr(C)]
pub struct FiCqErrEntry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
    pub tag: u64,
    pub olen: usize,
    pub err: c_int,
    pub prov_errno: c_int,
    pub err_data: *mut c_void,
    pub err_data_size: usize,
}

impl Default for FiCqErrEntry {
    fn default() -> Self {
        // SAFETY: a plain C structure of integers and pointers; all zeroes is valid.
        unsafe { std::mem::zeroed() }
    }
}

// -- the library -------------------------------------------------------------------------

type GetInfo = unsafe extern "C" fn(u32, *const c_char, *const c_char, u64, *const FiInfo, *mut *mut FiInfo) -> c_int;

/// The exported functions, resolved once per process.
pub struct Lib {
    pub getinfo: GetInfo,
    pub freeinfo: unsafe extern "C" fn(*mut FiInfo),
    pub dupinfo: unsafe extern "C" fn(*const FiInfo) -> *mut FiInfo,
    pub fabric: unsafe extern "C" fn(*mut FiFabricAttr, *mut *mut FidFabric, *mut c_void) -> c_int,
    pub strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    pub version: unsafe extern "C" fn() -> u32,
    /// The name it was loaded by ("libfabric.so.1").
    pub name: String,
    _lib: libloading::Library,
}

/// Library names tried in turn (`FREIGHT_LIBFABRIC` names another one first).
const NAMES: [&str; 2] = ["libfabric.so.1", "libfabric.so"];

impl Lib {
    /// libfabric, or why it cannot be used (the same answer for the whole process).
    pub fn get() -> Result<&'static Lib, String> {
        static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
        LIB.get_or_init(Lib::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Lib, String> {
        let mut names: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
        if let Ok(custom) = std::env::var("FREIGHT_LIBFABRIC") {
            names.insert(0, custom);
        }
        let mut errors = Vec::new();
        for name in &names {
            // SAFETY: loading libfabric runs its constructors, which only set up globals.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Lib::resolve(lib, name).map_err(|e| format!("{name}: {e}")),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(format!("libfabric is not installed (Debian: apt-get install libfabric1; {})", errors.join("; ")))
    }

    fn resolve(lib: libloading::Library, name: &str) -> Result<Lib, libloading::Error> {
        // SAFETY: the symbols have these C signatures in every libfabric 1.x.
        unsafe {
            Ok(Lib {
                getinfo: *lib.get(b"fi_getinfo\0")?,
                freeinfo: *lib.get(b"fi_freeinfo\0")?,
                dupinfo: *lib.get(b"fi_dupinfo\0")?,
                fabric: *lib.get(b"fi_fabric\0")?,
                strerror: *lib.get(b"fi_strerror\0")?,
                version: *lib.get(b"fi_version\0")?,
                name: name.to_string(),
                _lib: lib,
            })
        }
    }

    /// libfabric's text for a (positive or negative) error code.
    pub fn error_text(&self, code: isize) -> String {
        let code = code.unsigned_abs() as c_int;
        // SAFETY: fi_strerror returns a static string for any code.
        let text = unsafe { CStr::from_ptr((self.strerror)(code)) };
        format!("{} ({code})", text.to_string_lossy())
    }

    /// "major.minor" of the loaded library.
    pub fn version_text(&self) -> String {
        // SAFETY: no arguments, returns a number.
        let v = unsafe { (self.version)() };
        format!("{}.{}", v >> 16, v & 0xffff)
    }
}

/// Reads a C string owned by libfabric (empty for null).
///
/// # Safety
/// `p` is null or a valid NUL-terminated string.
pub unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod fabric_abi {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets and sizes as the libfabric 1.17 headers give them on x86-64 and aarch64.
    #[test]
    fn layouts_match_the_c_headers() {
        assert_eq!(size_of::<Fid>(), 24);
        assert_eq!(offset_of!(FiInfo, tx_attr), 72);
        assert_eq!(offset_of!(FiInfo, ep_attr), 88);
        assert_eq!(offset_of!(FiInfo, domain_attr), 96);
        assert_eq!(offset_of!(FiInfo, fabric_attr), 104);
        assert_eq!(size_of::<FiInfo>(), 120);
        assert_eq!(offset_of!(FiTxAttr, op_flags), 16);
        assert_eq!(offset_of!(FiEpAttr, max_msg_size), 16);
        assert_eq!(offset_of!(FiDomainAttr, threading), 16);
        assert_eq!(offset_of!(FiDomainAttr, av_type), 32);
        assert_eq!(offset_of!(FiDomainAttr, mr_mode), 36);
        assert_eq!(offset_of!(FiFabricAttr, prov_name), 16);
        assert_eq!(offset_of!(FidDomain, mr), 32);
        assert_eq!(offset_of!(FiOpsMr, regattr), 24);
        assert_eq!(offset_of!(FiMrAttr, requested_key), 32);
        assert_eq!(offset_of!(FiMrAttr, iface), 64);
        assert_eq!(offset_of!(FiMrAttr, device), 72);
        assert_eq!(size_of::<FiMrAttr>(), 80);
        assert_eq!(offset_of!(FidMr, key), 32);
        assert_eq!(offset_of!(FidEp, cm), 32);
        assert_eq!(offset_of!(FidEp, rma), 48);
        assert_eq!(offset_of!(FiOpsCm, getname), 16);
        assert_eq!(offset_of!(FiOpsRma, write), 32);
        assert_eq!(offset_of!(FiOpsCq, readerr), 24);
        assert_eq!(offset_of!(FiOpsCq, sread), 32);
        assert_eq!(offset_of!(FiOpsCq, signal), 48);
        assert_eq!(size_of::<FiAvAttr>(), 48);
        assert_eq!(size_of::<FiCqAttr>(), 40);
        assert_eq!(offset_of!(FiCqAttr, wait_obj), 20);
        assert_eq!(size_of::<FiCqErrEntry>(), 80);
        assert_eq!(offset_of!(FiCqErrEntry, prov_errno), 60);
    }
}
