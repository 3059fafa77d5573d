//! One rail: a libfabric domain (one NIC, or one provider instance) with its reliable
//! datagram endpoint, address vector, completion queue and memory registrations.
//! Safe methods over the raw objects; the threading around them is in `progress`.

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, RwLock};

use super::ffi::*;
use freight_proto::error::{Error, Result};
use freight_proto::region::{MemKind, RegionInfo};

/// A list of `fi_info` from `fi_getinfo`, freed on drop.
pub struct InfoList {
    lib: &'static Lib,
    head: *mut FiInfo,
}

/// What freight asks of a provider beyond one-sided reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wants {
    /// Writes complete only once delivered (notifications and docks rely on it).
    pub delivery_complete: bool,
    /// GPU memory can be registered and reached one-sided (`FI_HMEM`).
    pub gpu_memory: bool,
}

/// What `fi_getinfo` says about one domain a provider offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainInfo {
    /// The provider as libfabric names it ("tcp;ofi_rxm", "efa", "shm").
    pub provider: String,
    pub fabric: String,
    pub domain: String,
}

fn fabric_error(lib: &Lib, call: &str, code: isize) -> Error {
    Error::TransportUnavailable(format!("fabric: {call} failed: {}", lib.error_text(code)))
}

impl InfoList {
    /// The domains of `provider` (any provider when `None`) that offer reliable
    /// datagram endpoints with one-sided reads and writes, and what else `wants` asks.
    pub fn discover(lib: &'static Lib, provider: Option<&str>, wants: Wants) -> Result<InfoList> {
        // SAFETY: fi_dupinfo(NULL) allocates an empty hints structure with its attribute
        // structures; the fields set below exist in every 1.x version; fi_freeinfo frees
        // the strdup'd provider name with the rest.
        unsafe {
            let hints = (lib.dupinfo)(null());
            if hints.is_null() {
                return Err(Error::TransportUnavailable("fabric: fi_allocinfo failed".into()));
            }
            (*hints).caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
            // We give every operation a context of 64 bytes the provider may use.
            (*hints).mode = FI_CONTEXT | FI_CONTEXT2;
            (*(*hints).ep_attr).ep_type = FI_EP_RDM;
            let domain = &mut *(*hints).domain_attr;
            domain.mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
            domain.threading = FI_THREAD_SAFE;
            if wants.gpu_memory {
                (*hints).caps |= FI_HMEM;
                // Every buffer is registered and its desc passed already (FI_MR_LOCAL).
                domain.mr_mode |= FI_MR_HMEM;
            }
            if wants.delivery_complete {
                (*(*hints).tx_attr).op_flags = FI_DELIVERY_COMPLETE;
            }
            if let Some(p) = provider {
                let name = CString::new(p).map_err(|_| Error::InvalidArgument("provider name with a NUL".into()))?;
                (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
            }
            let mut head = null_mut();
            let rc = (lib.getinfo)(API_VERSION, null(), null(), 0, hints, &mut head);
            (lib.freeinfo)(hints);
            if rc != 0 {
                let which = provider.map_or("any provider".to_string(), |p| format!("provider '{p}'"));
                return Err(Error::TransportUnavailable(format!(
                    "fabric: {which} offers no reliable datagram endpoint with RMA{}{}: {}",
                    if wants.delivery_complete { " and delivery-complete writes" } else { "" },
                    if wants.gpu_memory { " and GPU memory (FI_HMEM)" } else { "" },
                    lib.error_text(rc as isize)
                )));
            }
            Ok(InfoList { lib, head })
        }
    }

    fn iter(&self) -> impl Iterator<Item = *mut FiInfo> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur.is_null() {
                return None;
            }
            let this = cur;
            // SAFETY: a node of the list fi_getinfo returned, alive while `self` is.
            cur = unsafe { (*cur).next };
            Some(this)
        })
    }

    /// Each entry with what it says about itself.
    fn described(&self) -> impl Iterator<Item = (*mut FiInfo, DomainInfo)> + '_ {
        // SAFETY: nodes of the list and their attribute strings live while `self` does.
        self.iter().map(|i| unsafe {
            let d = DomainInfo {
                provider: text((*(*i).fabric_attr).prov_name),
                fabric: text((*(*i).fabric_attr).name),
                domain: text((*(*i).domain_attr).name),
            };
            (i, d)
        })
    }

    pub fn domains(&self) -> Vec<DomainInfo> {
        self.described().map(|(_, d)| d).collect()
    }

    /// The first entry for domain `name`.
    fn find(&self, name: &str) -> Option<(*mut FiInfo, DomainInfo)> {
        self.described().find(|(_, d)| d.domain == name)
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed once.
        unsafe { (self.lib.freeinfo)(self.head) }
    }
}

/// Where registered memory lives, as the provider is told (`fi_mr_attr.iface`).
#[derive(Debug, Clone, Copy)]
enum Memory {
    Host,
    /// GPU memory of the CUDA device with this ordinal.
    Gpu(u64),
}

/// Longest string address taken from a peer (the shm provider's are tens of bytes).
const MAX_STR_ADDRESS: usize = 1024;

/// See [`Rail::check_peer_address`]: `ours` is the length of this rail's own address.
fn address_fits(format: u32, ours: usize, theirs: &[u8]) -> std::result::Result<(), String> {
    if format != FI_ADDR_STR {
        return if theirs.len() == ours {
            Ok(())
        } else {
            Err(format!("an address of {} bytes where the provider uses {ours}", theirs.len()))
        };
    }
    // A string address names the peer's process (the shm provider's hold its pid), so
    // lengths differ; the provider reads up to the first NUL.
    match theirs.iter().position(|&b| b == 0) {
        Some(end) if end + 1 == theirs.len() && end > 0 && theirs.len() <= MAX_STR_ADDRESS => Ok(()),
        _ => Err(format!(
            "a string address of {} bytes that is not one NUL-terminated string of at most {MAX_STR_ADDRESS}",
            theirs.len()
        )),
    }
}

/// A registration of local memory with one domain.
pub struct Mr {
    fid: *mut FidMr,
    /// What local operations pass as `desc` (needed where the provider has `FI_MR_LOCAL`).
    pub desc: *mut c_void,
    /// What peers pass to reach it.
    pub key: u64,
}

// SAFETY: a registration is an immutable handle; libfabric objects of a thread-safe
// domain may be used and closed from any thread.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: closed once; the domain outlives it (the rail closes its cache first).
        unsafe { ((*(*self.fid).fid.ops).close)(&mut (*self.fid).fid) };
    }
}

/// One domain's objects. Every method takes `&self`: the domain is opened thread-safe,
/// and in practice one progress thread posts and reaps while others register memory.
/// Memory that both sides may read and write: the source and destination of local
/// operations, and the target of peers' reads and writes.
const FULL_ACCESS: u64 = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
/// Memory peers may only read; locally it is only ever a source (of a write).
const READ_ONLY_ACCESS: u64 = FI_WRITE | FI_REMOTE_READ;
/// Memory no peer may reach (a private region): the local side of this agent's own
/// operations only. Refusing its key in the exchange is not enough: with keys the
/// provider hands out in sequence, a peer could guess it.
const LOCAL_ACCESS: u64 = FI_READ | FI_WRITE;

pub struct Rail {
    lib: &'static Lib,
    fabric: *mut FidFabric,
    domain: *mut FidDomain,
    av: *mut FidAv,
    cq: *mut FidCq,
    ep: *mut FidEp,
    /// This endpoint's address, for peers.
    pub address: Vec<u8>,
    /// How the provider writes addresses (`FI_ADDR_STR`, `FI_SOCKADDR_IN`...).
    pub addr_format: u32,
    pub info: DomainInfo,
    /// Remote addresses are virtual addresses (else offsets into the registration).
    pub virt_addr: bool,
    /// Largest single operation.
    pub max_msg: u64,
    /// The completion queue has a wait object: an idle thread may sleep on it.
    pub waitable: bool,
    /// The provider offered `FI_HMEM`, and no GPU registration has failed yet: GPU
    /// memory is registered as it is rather than staged.
    gpu_direct: AtomicBool,
    /// Why GPU memory is staged, once [`Rail::stage_gpu_memory`] said so.
    gpu_refusal: Mutex<Option<String>>,
    /// Registration cache: region key -> registration.
    mrs: RwLock<HashMap<u64, std::sync::Arc<Mr>>>,
}

// SAFETY: see the struct documentation (FI_THREAD_SAFE domain).
unsafe impl Send for Rail {}
unsafe impl Sync for Rail {}

impl Rail {
    /// Opens domain `name` of the list.
    pub fn open(list: &InfoList, name: &str) -> Result<Rail> {
        let lib = list.lib;
        let (info, described) = list.find(name).ok_or_else(|| {
            let known: Vec<String> = list.domains().into_iter().map(|d| d.domain).collect();
            Error::InvalidArgument(format!(
                "fabric domain '{name}' not found (the provider offers: {})",
                known.join(", ")
            ))
        })?;
        let mut rail = Rail {
            lib,
            fabric: null_mut(),
            domain: null_mut(),
            av: null_mut(),
            cq: null_mut(),
            ep: null_mut(),
            address: Vec::new(),
            addr_format: 0,
            info: described,
            virt_addr: false,
            max_msg: 0,
            waitable: false,
            gpu_direct: AtomicBool::new(false),
            gpu_refusal: Mutex::new(None),
            mrs: RwLock::new(HashMap::new()),
        };
        // SAFETY: the calls follow libfabric's documented order; each object is stored
        // in `rail` as soon as it exists, so that Drop closes whatever was opened.
        unsafe {
            let check =
                |call: &str, rc: c_int| if rc == 0 { Ok(()) } else { Err(fabric_error(lib, call, rc as isize)) };
            check("fi_fabric", (lib.fabric)((*info).fabric_attr, &mut rail.fabric, null_mut()))?;
            check("fi_domain", ((*(*rail.fabric).ops).domain)(rail.fabric, info, &mut rail.domain, null_mut()))?;
            let mut av_attr = FiAvAttr { av_type: FI_AV_TABLE, ..Default::default() };
            check("fi_av_open", ((*(*rail.domain).ops).av_open)(rail.domain, &mut av_attr, &mut rail.av, null_mut()))?;
            let mut cq_attr =
                FiCqAttr { size: 4096, format: FI_CQ_FORMAT_CONTEXT, wait_obj: FI_WAIT_UNSPEC, ..Default::default() };
            let cq_open = (*(*rail.domain).ops).cq_open;
            // A wait object that sleeps in the kernel is worth having; one that spins
            // (`FI_WAIT_YIELD`, what the shm provider picks) is not, and its blocking
            // read ignores the timeout in libfabric 1.17: poll such queues instead.
            if cq_open(rail.domain, &mut cq_attr, &mut rail.cq, null_mut()) == 0 && cq_attr.wait_obj != FI_WAIT_YIELD {
                rail.waitable = true;
            } else {
                if !rail.cq.is_null() {
                    ((*(*rail.cq).fid.ops).close)(&mut (*rail.cq).fid);
                    rail.cq = null_mut();
                }
                cq_attr.wait_obj = FI_WAIT_NONE;
                check("fi_cq_open", cq_open(rail.domain, &mut cq_attr, &mut rail.cq, null_mut()))?;
            }
            check("fi_endpoint", ((*(*rail.domain).ops).endpoint)(rail.domain, info, &mut rail.ep, null_mut()))?;
            let ep_fid = &mut (*rail.ep).fid;
            check("fi_ep_bind(av)", ((*ep_fid.ops).bind)(ep_fid, &mut (*rail.av).fid, 0))?;
            check("fi_ep_bind(cq)", ((*ep_fid.ops).bind)(ep_fid, &mut (*rail.cq).fid, FI_TRANSMIT | FI_RECV))?;
            check("fi_enable", ((*ep_fid.ops).control)(ep_fid, FI_ENABLE, null_mut()))?;
            let mut buf = vec![0u8; 256];
            let mut len = buf.len();
            check("fi_getname", ((*(*rail.ep).cm).getname)(ep_fid, buf.as_mut_ptr().cast(), &mut len))?;
            buf.truncate(len);
            rail.address = buf;
            rail.addr_format = (*info).addr_format;
            rail.virt_addr = (*(*info).domain_attr).mr_mode & FI_MR_VIRT_ADDR != 0;
            rail.max_msg = (*(*info).ep_attr).max_msg_size as u64;
            rail.gpu_direct = AtomicBool::new((*info).caps & FI_HMEM != 0);
        }
        Ok(rail)
    }

    fn error(&self, call: &str, code: isize) -> Error {
        fabric_error(self.lib, call, code)
    }

    /// libfabric's text for an error code.
    pub fn error_text(&self, code: isize) -> String {
        self.lib.error_text(code)
    }

    /// Whether GPU memory is registered with this rail rather than staged.
    pub fn gpu_direct(&self) -> bool {
        self.gpu_direct.load(Ordering::Relaxed)
    }

    /// From now on GPU memory is staged, for `why` (the first reason given is kept).
    /// Whether this turned the rail: it registered GPU memory until now.
    pub fn stage_gpu_memory(&self, why: String) -> bool {
        self.gpu_refusal.lock().get_or_insert(why);
        self.gpu_direct.swap(false, Ordering::Relaxed)
    }

    /// Why this rail stages GPU memory, where it does.
    pub fn gpu_staged_why(&self) -> Option<String> {
        if self.gpu_direct() {
            return None;
        }
        Some(self.gpu_refusal.lock().clone().unwrap_or_else(|| "the provider offers no FI_HMEM".into()))
    }

    /// The registration of GPU memory `region` (see [`Rail::registration`]), or `None`
    /// where it must be staged: the provider offers no `FI_HMEM`, or registering GPU
    /// memory failed once (a libfabric built without CUDA still offers `FI_HMEM` for
    /// other devices, and answers so). After one failure the rail stages all GPU
    /// memory: a provider that cannot register one allocation cannot register the next.
    pub fn gpu_registration(&self, region: &RegionInfo, private: bool) -> Option<std::sync::Arc<Mr>> {
        if !self.gpu_direct() {
            return None;
        }
        match self.registration(region, private) {
            Ok(mr) => Some(mr),
            Err(e) => {
                if self.stage_gpu_memory(format!("the provider refused GPU memory: {e}")) {
                    tracing::warn!(domain = %self.info.domain, provider = %self.info.provider, error = %e,
                        "the provider offers FI_HMEM but cannot register GPU memory: staging it instead");
                }
                None
            }
        }
    }

    /// The registration of `region`, made on first use. A read-only region's lets no
    /// peer write it, a private region's lets no peer reach it at all (the provider
    /// refuses the access). GPU memory only where the provider offered `FI_HMEM`.
    pub fn registration(&self, region: &RegionInfo, private: bool) -> Result<std::sync::Arc<Mr>> {
        let (key, addr, len) = (region.key, region.addr, region.len);
        let memory = match region.kind {
            MemKind::Vram if !self.gpu_direct() => {
                return Err(Error::TransportUnavailable(format!(
                    "fabric: provider {} cannot register GPU memory (region {key})",
                    self.info.provider
                )))
            }
            MemKind::Vram => Memory::Gpu(region.dev),
            _ => Memory::Host,
        };
        if let Some(mr) = self.mrs.read().get(&key) {
            return Ok(mr.clone());
        }
        let mut mrs = self.mrs.write();
        if let Some(mr) = mrs.get(&key) {
            return Ok(mr.clone());
        }
        // SAFETY: the region is registered memory that stays mapped until `forget`
        // (called before the registry lets it go).
        let access = match (private, region.read_only) {
            (true, _) => LOCAL_ACCESS,
            (false, true) => READ_ONLY_ACCESS,
            (false, false) => FULL_ACCESS,
        };
        let mr = std::sync::Arc::new(unsafe { self.register_with(addr, len, key, access, memory) }?);
        mrs.insert(key, mr.clone());
        Ok(mr)
    }

    /// Registers `[addr, addr+len)` with the domain, uncached, asking for `key` where
    /// the provider lets the application choose keys.
    ///
    /// # Safety
    /// The memory stays mapped until the registration is dropped.
    pub unsafe fn register(&self, addr: u64, len: u64, key: u64) -> Result<Mr> {
        self.register_with(addr, len, key, FULL_ACCESS, Memory::Host)
    }

    /// [`Rail::register`] for memory that is only ever the local side of this agent's
    /// own operations (staging buffers): no peer may reach it, whatever key it guesses.
    ///
    /// # Safety
    /// As [`Rail::register`].
    pub unsafe fn register_local(&self, addr: u64, len: u64, key: u64) -> Result<Mr> {
        self.register_with(addr, len, key, LOCAL_ACCESS, Memory::Host)
    }

    /// [`Rail::register`] with the given access rights.
    ///
    /// # Safety
    /// As [`Rail::register`].
    unsafe fn register_with(&self, addr: u64, len: u64, key: u64, access: u64, memory: Memory) -> Result<Mr> {
        let iov = IoVec { base: addr as *mut c_void, len: len as usize };
        let (iface, device) = match memory {
            Memory::Host => (FI_HMEM_SYSTEM, 0),
            // The union's `int cuda`: the low half of the u64 on little-endian machines.
            Memory::Gpu(ordinal) => (FI_HMEM_CUDA, ordinal),
        };
        let attr = FiMrAttr {
            mr_iov: &iov,
            iov_count: 1,
            access,
            offset: 0,
            requested_key: key,
            context: null_mut(),
            auth_key_size: 0,
            auth_key: null_mut(),
            iface,
            device,
        };
        let mut fid: *mut FidMr = null_mut();
        let regattr = (*(*self.domain).mr).regattr;
        let rc = regattr(&mut (*self.domain).fid, &attr, 0, &mut fid);
        if rc != 0 {
            return Err(self.error("fi_mr_regattr", rc as isize));
        }
        Ok(Mr { fid, desc: (*fid).mem_desc, key: (*fid).key })
    }

    /// Drops the registration of region `key` (peers' accesses fail from now on).
    pub fn forget(&self, key: u64) -> bool {
        self.mrs.write().remove(&key).is_some()
    }

    /// Whether `theirs`, a peer's endpoint address, is one this rail's provider may be
    /// handed: it reads an address of its own fixed length, or a string up to its NUL.
    pub fn check_peer_address(&self, theirs: &[u8]) -> std::result::Result<(), String> {
        address_fits(self.addr_format, self.address.len(), theirs)
    }

    /// Adds a peer's endpoint address; returns its handle for operations.
    pub fn insert(&self, address: &[u8]) -> Result<u64> {
        let mut handle = 0u64;
        // SAFETY: `address` is a provider address of the length the provider expects
        // (it came from the peer's fi_getname for the same provider).
        let n = unsafe { ((*(*self.av).ops).insert)(self.av, address.as_ptr().cast(), 1, &mut handle, 0, null_mut()) };
        if n != 1 {
            return Err(self.error("fi_av_insert", if n < 0 { n as isize } else { 22 }));
        }
        Ok(handle)
    }

    /// Posts a one-sided write (`read`: false) or read. Returns libfabric's code:
    /// 0, `-FI_EAGAIN` (queue full: reap completions and retry) or an error.
    ///
    /// # Safety
    /// `local` is registered memory of `len` bytes that stays valid, and `context`
    /// 64 bytes the provider may use, until the operation's completion is reaped.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post(
        &self,
        read: bool,
        local: u64,
        len: u64,
        desc: *mut c_void,
        dest: u64,
        remote: u64,
        key: u64,
        context: *mut c_void,
    ) -> isize {
        let rma = &*(*self.ep).rma;
        let f = if read { rma.read } else { rma.write };
        f(self.ep, local as *mut c_void, len as usize, desc, dest, remote, key, context)
    }

    /// Reaps up to `out.len()` completions: their count, `-FI_EAGAIN` for none, or
    /// `-FI_EAVAIL` when an error completion waits for [`Rail::read_error`].
    pub fn reap(&self, out: &mut [FiCqEntry]) -> isize {
        // SAFETY: `out` holds room for as many context entries as we ask for.
        unsafe { ((*(*self.cq).ops).read)(self.cq, out.as_mut_ptr().cast(), out.len()) }
    }

    /// Like [`Rail::reap`], but sleeps up to `timeout_ms` while nothing completes (and
    /// lets the provider make progress for peers' one-sided operations meanwhile).
    pub fn reap_waiting(&self, out: &mut [FiCqEntry], timeout_ms: i32) -> isize {
        // SAFETY: as in `reap`; no wait condition.
        unsafe { ((*(*self.cq).ops).sread)(self.cq, out.as_mut_ptr().cast(), out.len(), null(), timeout_ms) }
    }

    /// Wakes a thread sleeping in [`Rail::reap_waiting`] (none can, without a wait
    /// object).
    pub fn wake(&self) {
        if self.waitable {
            // SAFETY: signalling a queue that has a wait object is allowed from any thread.
            unsafe { ((*(*self.cq).ops).signal)(self.cq) };
        }
    }

    /// The pending error completion: its operation context and what went wrong.
    pub fn read_error(&self) -> Option<(*mut c_void, i32, String)> {
        let mut e = FiCqErrEntry::default();
        // SAFETY: one error entry, read into our structure; the provider's message is
        // copied out before anything else touches the queue.
        unsafe {
            let n = ((*(*self.cq).ops).readerr)(self.cq, &mut e, 0);
            if n != 1 {
                return None;
            }
            let mut buf = [0 as std::ffi::c_char; 256];
            let detail = ((*(*self.cq).ops).strerror)(self.cq, e.prov_errno, e.err_data, buf.as_mut_ptr(), buf.len());
            let mut reason = self.lib.error_text(e.err as isize);
            let detail = text(detail);
            if !detail.is_empty() {
                reason = format!("{reason}: {detail}");
            }
            Some((e.op_context, e.err, reason))
        }
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        self.mrs.get_mut().clear();
        // SAFETY: each object is closed once, dependents first.
        unsafe {
            for fid in [
                self.ep.cast::<Fid>(),
                self.av.cast::<Fid>(),
                self.cq.cast::<Fid>(),
                self.domain.cast::<Fid>(),
                self.fabric.cast::<Fid>(),
            ] {
                if !fid.is_null() {
                    ((*(*fid).ops).close)(fid);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed-length address must be as long as ours; a string address may be of any
    /// length but must be one NUL-terminated string (the provider reads up to the NUL).
    #[test]
    fn peer_addresses_are_checked_against_the_provider_s_format() {
        const FI_SOCKADDR_IN: u32 = 2;
        assert!(address_fits(FI_SOCKADDR_IN, 16, &[1; 16]).is_ok());
        let e = address_fits(FI_SOCKADDR_IN, 16, &[1; 17]).unwrap_err();
        assert!(e.contains("17 bytes where the provider uses 16"), "{e}");
        assert!(address_fits(FI_ADDR_STR, 17, b"fi_shm://1234567\0").is_ok());
        assert!(address_fits(FI_ADDR_STR, 17, b"fi_shm://123456\0").is_ok());
        for bad in [&b"fi_shm://123"[..], b"fi_\0shm\0", b"\0", b""] {
            let e = address_fits(FI_ADDR_STR, 17, bad).unwrap_err();
            assert!(e.contains("not one NUL-terminated string"), "{bad:?}: {e}");
        }
        assert!(address_fits(FI_ADDR_STR, 17, &[[b'a'; MAX_STR_ADDRESS].as_slice(), b"\0"].concat()).is_err());
    }
}
