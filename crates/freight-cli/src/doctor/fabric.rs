//! libfabric, where this machine has it: loaded at run time (nothing at build time), with
//! its version and the providers `fi_getinfo` offers here.

use std::ffi::{c_char, c_int, c_void, CStr};

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Fabric {
    /// The library that loaded ("libfabric.so.1"), or `None`.
    pub library: Option<String>,
    /// "1.17".
    pub version: Option<String>,
    /// Providers `fi_getinfo` lists (each once, e.g. "tcp;ofi_rxm", "shm").
    pub providers: Vec<String>,
    /// Why there is nothing to report, where there is not.
    pub note: Option<String>,
}

// The prefix of libfabric's `struct fi_info` and `struct fi_fabric_attr` (stable across
// the 1.x ABI) that finding the providers needs.
#[repr(C)]
struct FiFabricAttr {
    fabric: *mut c_void,
    name: *const c_char,
    prov_name: *const c_char,
    prov_version: u32,
    api_version: u32,
}

#[repr(C)]
struct FiInfo {
    next: *const FiInfo,
    caps: u64,
    mode: u64,
    addr_format: u32,
    src_addrlen: usize,
    dest_addrlen: usize,
    src_addr: *mut c_void,
    dest_addr: *mut c_void,
    handle: *mut c_void,
    tx_attr: *mut c_void,
    rx_attr: *mut c_void,
    ep_attr: *mut c_void,
    domain_attr: *mut c_void,
    fabric_attr: *const FiFabricAttr,
    nic: *mut c_void,
}

type FiVersion = unsafe extern "C" fn() -> u32;
type FiGetinfo =
    unsafe extern "C" fn(u32, *const c_char, *const c_char, u64, *const FiInfo, *mut *const FiInfo) -> c_int;
type FiFreeinfo = unsafe extern "C" fn(*const FiInfo);

const LIBRARIES: [&CStr; 2] = [c"libfabric.so.1", c"libfabric.so"];

pub fn probe() -> Fabric {
    let Some((library, handle)) = LIBRARIES.iter().find_map(|name| {
        // SAFETY: dlopen of a library name; a failure returns null.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        (!h.is_null()).then(|| (name.to_string_lossy().into_owned(), h))
    }) else {
        return Fabric {
            library: None,
            version: None,
            providers: Vec::new(),
            note: Some("libfabric is not installed (Debian: apt-get install libfabric1)".into()),
        };
    };
    let symbol = |name: &CStr| {
        // SAFETY: looking a symbol up in a library we loaded.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let (Some(version), Some(getinfo), Some(freeinfo)) =
        (symbol(c"fi_version"), symbol(c"fi_getinfo"), symbol(c"fi_freeinfo"))
    else {
        return Fabric {
            library: Some(library),
            version: None,
            providers: Vec::new(),
            note: Some("the library lacks fi_version, fi_getinfo or fi_freeinfo".into()),
        };
    };
    // SAFETY: the symbols have libfabric's documented signatures.
    let (version, getinfo, freeinfo) = unsafe {
        (
            std::mem::transmute::<*mut c_void, FiVersion>(version),
            std::mem::transmute::<*mut c_void, FiGetinfo>(getinfo),
            std::mem::transmute::<*mut c_void, FiFreeinfo>(freeinfo),
        )
    };
    // SAFETY: plain calls into libfabric; the list is read, then freed once.
    let (api, providers, note) = unsafe {
        let api = version();
        let mut list: *const FiInfo = std::ptr::null();
        let rc = getinfo(api, std::ptr::null(), std::ptr::null(), 0, std::ptr::null(), &mut list);
        let mut providers = Vec::new();
        let mut cur = list;
        while !cur.is_null() {
            let attr = (*cur).fabric_attr;
            if !attr.is_null() && !(*attr).prov_name.is_null() {
                let name = CStr::from_ptr((*attr).prov_name).to_string_lossy().into_owned();
                if !providers.contains(&name) {
                    providers.push(name);
                }
            }
            cur = (*cur).next;
        }
        if !list.is_null() {
            freeinfo(list);
        }
        let note = (rc != 0).then(|| format!("fi_getinfo returned {rc}: no provider can run here"));
        (api, providers, note)
    };
    Fabric { library: Some(library), version: Some(format!("{}.{}", api >> 16, api & 0xffff)), providers, note }
}
