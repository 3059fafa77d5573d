//! The exchange that sets up fabric transfers between two agents, over a connection to
//! the target's listener (`Role::Fabric`):
//!
//! 1. `FabricHello { provider }` -> `FabricWelcome { provider, rails, virt_addr }`: the
//!    target's endpoint addresses, one per rail, or `Refused` with the reason (no fabric
//!    open, another provider). The initiator pairs its rail `i` with the target's rail
//!    `i mod n`, and adds those addresses to its rails' address vectors.
//! 2. `FabricKeys { regions }` -> `FabricKeysReply { keys }`: the keys of regions the
//!    initiator is about to use, registered by the target on first request, or none for
//!    GPU memory the target's provider cannot register (no `FI_HMEM`). Private and
//!    unknown regions are refused alike.
//!
//! A second connection, the relay, is opened when a request first names memory the
//! provider cannot reach one-sided (a region that came without keys): `FabricDocks`
//! borrows the target's landing buffers, then `FabricLand`/`FabricLift` ->
//! `FabricDocked` move chunks between them and the target's memory ([`super::relay`],
//! [`super::dock`]).
//!
//! The connection stays open for later key requests, and a thread watches it: the
//! target's agent closes it when it closes, and the kernel when the process dies. Then
//! the operations to that peer fail at once (providers may take minutes to give up on a
//! peer, or never do), and so does every later request to it.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};

use super::dock::Docks;
use super::relay::Relay;
use super::Fabric;
use crate::frame_io;
use crate::memory::Registry;
use freight_proto::error::{Error, Result};
use freight_proto::frame::Frame;
use freight_proto::region::MemKind;

/// Opens another connection of the exchange to the same peer.
pub type Dial = Box<dyn Fn() -> Result<TcpStream> + Send + Sync>;

/// The initiator's side of the exchange with one peer.
pub struct FabricLink {
    peer: Arc<str>,
    stream: Mutex<TcpStream>,
    /// Per local rail: the paired remote rail and its address-vector handle.
    routes: Vec<(u64, usize)>,
    /// How many rails the peer has: each of its regions has a key per rail.
    peer_rails: usize,
    virt_addr: bool,
    /// Region -> its key on each of the peer's rails, or `None`: reached through the
    /// peer's docks.
    keys: RwLock<HashMap<u64, Option<Vec<u64>>>>,
    /// Why the peer is gone, once the watcher saw the exchange close.
    dead: Arc<Mutex<Option<String>>>,
    /// Set when this side closes the exchange (the watcher then leaves quietly).
    closing: Arc<AtomicBool>,
    dial: Dial,
    /// The relay through the peer's docks, once a request needed it.
    /// Shared with the watcher, which closes it when the peer goes away.
    relay: Arc<Mutex<Option<Arc<Relay>>>>,
}

impl FabricLink {
    /// Runs step 1 on a connection the peer welcomed; `dial` opens the relay later.
    pub fn connect(mut stream: TcpStream, fabric: &Arc<Fabric>, peer: &str, dial: Dial) -> Result<FabricLink> {
        frame_io::write_frame(&mut stream, &Frame::FabricHello { provider: fabric.provider.clone() }, &[])?;
        let (rails, virt_addr): (Vec<Vec<u8>>, bool) = match frame_io::read_frame(&mut stream)? {
            Some(Frame::FabricWelcome { provider, rails, virt_addr }) => {
                if provider != fabric.provider || rails.is_empty() {
                    return Err(Error::Protocol(format!(
                        "fabric: peer '{peer}' answered with provider '{provider}' and {} rails",
                        rails.len()
                    )));
                }
                // The provider reads what we pass it as an address of its own format.
                let rail = &fabric.workers[0].rail;
                if let Some(why) = rails.iter().find_map(|a| rail.check_peer_address(a).err()) {
                    return Err(Error::Protocol(format!("fabric: peer '{peer}' sent {why} ({provider})")));
                }
                (rails, virt_addr)
            }
            Some(Frame::Refused { reason }) => {
                return Err(Error::TransportUnavailable(format!("fabric: peer '{peer}' refused: {reason}")))
            }
            other => return Err(Error::Protocol(format!("fabric: expected a welcome, got {other:?}"))),
        };
        let routes = (0..fabric.rails())
            .map(|i| {
                let remote = i % rails.len();
                fabric.workers[i].rail.insert(&rails[remote]).map(|handle| (handle, remote))
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(%peer, local_rails = fabric.rails(), peer_rails = rails.len(), virt_addr, "fabric link up");
        let link = FabricLink {
            peer: peer.into(),
            stream: Mutex::new(stream),
            routes,
            peer_rails: rails.len(),
            virt_addr,
            keys: RwLock::default(),
            dead: Arc::default(),
            closing: Arc::default(),
            dial,
            relay: Arc::default(),
        };
        link.watch(Arc::downgrade(fabric))?;
        Ok(link)
    }

    /// Starts the thread that notices the peer going away (see the module docs).
    fn watch(&self, fabric: Weak<Fabric>) -> Result<()> {
        let stream = self.stream.lock().try_clone()?;
        let (dead, closing, routes, peer, relay) =
            (self.dead.clone(), self.closing.clone(), self.routes.clone(), self.peer.clone(), self.relay.clone());
        std::thread::Builder::new().name("freight-fabric-watch".into()).spawn(move || {
            wait_for_hangup(&stream);
            if closing.load(Ordering::Acquire) {
                return;
            }
            let reason = "the peer closed its fabric exchange (its agent closed or its process died)".to_string();
            tracing::info!(%peer, %reason, "fabric peer gone");
            *dead.lock() = Some(reason.clone());
            // The relay first: once the rails abandon its chunks' operations, their
            // docks must not be lent again (the provider may still use them). It is
            // kept until the rails have reported those chunks, so that its driver
            // finishes them with the rails' word rather than stopping on them.
            let closed = relay.lock().take();
            if let Some(r) = &closed {
                r.close(&reason);
            }
            if let Some(f) = fabric.upgrade() {
                f.abandon(&routes, &reason);
            }
            drop(closed);
        })?;
        Ok(())
    }

    /// Why the peer is gone, if it is.
    pub fn dead_reason(&self) -> Option<String> {
        self.dead.lock().clone()
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Local rail `i`'s way to the peer: the address-vector handle and the peer's rail.
    pub fn route(&self, i: usize) -> (u64, usize) {
        self.routes[i]
    }

    /// [`FabricLink::route`] of every local rail, in order.
    pub fn routes(&self) -> &[(u64, usize)] {
        &self.routes
    }

    pub fn virt_addr(&self) -> bool {
        self.virt_addr
    }

    /// The keys of `regions` (`None` for those the peer stages), asking the peer for
    /// those not yet known (one round trip).
    pub fn keys(&self, regions: &[u64]) -> Result<HashMap<u64, Option<Vec<u64>>>> {
        let missing: Vec<u64> = {
            let known = self.keys.read();
            regions.iter().copied().filter(|r| !known.contains_key(r)).collect()
        };
        if !missing.is_empty() {
            if let Some(reason) = self.dead_reason() {
                return Err(Error::PeerDisconnected { peer: self.peer.to_string(), reason });
            }
            let mut stream = self.stream.lock();
            let asked = frame_io::write_frame(&mut *stream, &Frame::FabricKeys { regions: missing.clone() }, &[])
                .and_then(|()| frame_io::read_frame(&mut *stream));
            let peer_rails = self.peer_rails;
            match asked {
                Ok(Some(Frame::FabricKeysReply { keys, error: None }))
                    if keys.len() == missing.len() && keys.iter().flatten().all(|k| k.len() == peer_rails) =>
                {
                    self.keys.write().extend(missing.into_iter().zip(keys));
                }
                Ok(Some(Frame::FabricKeysReply { error: Some(reason), .. })) => {
                    return Err(Error::RemoteRejected { peer: self.peer.to_string(), reason });
                }
                // A question without its answer (a timeout, say) leaves the exchange out
                // of step: a later answer would be taken for the next question's. The
                // link is dead from here.
                other => {
                    let e = match other {
                        Err(e) => e,
                        Ok(frame) => Error::Protocol(format!(
                            "fabric: expected the keys of {} regions on {peer_rails} rails, got {frame:?}",
                            missing.len()
                        )),
                    };
                    self.dead.lock().get_or_insert_with(|| format!("the key exchange failed: {e}"));
                    return Err(e);
                }
            }
        }
        let known = self.keys.read();
        Ok(regions.iter().filter_map(|r| known.get(r).map(|k| (*r, k.clone()))).collect())
    }

    /// The relay through the peer's docks, opened on first use and again after one
    /// closed. Staged WRITEs are landed once the provider says they were delivered, so
    /// a provider that cannot say so cannot be used for them.
    pub fn relay(&self, fabric: &Arc<Fabric>) -> Result<Arc<Relay>> {
        if let Some(reason) = self.dead_reason() {
            return Err(Error::PeerDisconnected { peer: self.peer.to_string(), reason });
        }
        if self.closing.load(Ordering::Acquire) {
            let reason = "the connection to the peer was closed".to_string();
            return Err(Error::PeerDisconnected { peer: self.peer.to_string(), reason });
        }
        if !fabric.delivery_complete {
            return Err(Error::TransportUnavailable(format!(
                "fabric: provider {} cannot complete writes on delivery, so it cannot stage the peer's memory",
                fabric.provider
            )));
        }
        let mut relay = self.relay.lock();
        if let Some(r) = relay.as_ref().filter(|r| !r.is_closed()) {
            return Ok(r.clone());
        }
        let opened = Arc::new(Relay::open((self.dial)()?, fabric, self.routes.clone(), self.peer.clone())?);
        tracing::info!(peer = %self.peer, docks = super::relay::DOCKS, "fabric relay up: the peer stages its memory");
        let closed = relay.replace(opened.clone());
        drop(relay);
        // Dropping a closed relay waits for its last wire reports, whose requests' hooks
        // may post again through this link: not under the lock.
        drop(closed);
        Ok(opened)
    }

    /// The peer revoked a region: its keys are dead.
    pub fn forget(&self, region: u64) {
        self.keys.write().remove(&region);
    }

    /// Hangs up the exchange and the relay (chunks in the peer's docks fail with
    /// `reason`); requests made before keep the link, so it may outlive this.
    pub fn shutdown(&self, reason: &str) {
        self.closing.store(true, Ordering::Release);
        // Out of the lock before it goes: dropping the last handle waits for its driver.
        let closed = self.relay.lock().take();
        if let Some(r) = closed {
            r.close(reason);
        }
        let _ = self.stream.lock().shutdown(Shutdown::Both);
    }
}

impl Drop for FabricLink {
    fn drop(&mut self) {
        self.shutdown("the connection to the peer was closed");
    }
}

/// Blocks until the other end of `stream` closes (without reading: replies to key
/// requests stay for their reader).
fn wait_for_hangup(stream: &TcpStream) {
    let mut fd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    loop {
        // SAFETY: one pollfd for a socket this thread owns a handle to.
        let n = unsafe { libc::poll(&mut fd, 1, -1) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n < 0 || fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            return;
        }
    }
}

/// The target's side: answers hellos, key requests and (on a relay connection) dock
/// requests and copies until the initiator closes.
pub fn serve_fabric(mut stream: TcpStream, registry: &Registry, fabric: Option<&Fabric>, from: &str) -> Result<()> {
    let mut docks: Option<Docks> = None;
    while let Some(frame) = frame_io::read_frame(&mut stream)? {
        let reply = match (frame, fabric) {
            (Frame::FabricHello { .. }, None) => {
                Frame::Refused { reason: "this agent has no fabric transport open".into() }
            }
            (Frame::FabricHello { provider }, Some(f)) if provider != f.provider => {
                Frame::Refused { reason: format!("this agent's fabric provider is '{}', not '{provider}'", f.provider) }
            }
            (Frame::FabricHello { .. }, Some(f)) => {
                Frame::FabricWelcome { provider: f.provider.clone(), rails: f.addresses(), virt_addr: f.virt_addr() }
            }
            (Frame::FabricKeys { regions }, Some(f)) => match region_keys(registry, f, &regions) {
                Ok(keys) => Frame::FabricKeysReply { keys, error: None },
                Err(e) => Frame::FabricKeysReply { keys: Vec::new(), error: Some(e.to_string()) },
            },
            // One set per connection: a peer that wants others opens another relay.
            (Frame::FabricDocks { .. }, Some(_)) if docks.is_some() => Frame::FabricDocksReply {
                docks: Vec::new(),
                error: Some("docks were lent on this connection already".into()),
            },
            (Frame::FabricDocks { count, size }, Some(f)) => match Docks::open(f, registry, count, size) {
                Ok(mut lent) => {
                    let described = lent.describe(f.virt_addr());
                    tracing::info!(peer = from, count, size, "lent fabric docks");
                    docks = Some(lent);
                    Frame::FabricDocksReply { docks: described, error: None }
                }
                Err(e) => Frame::FabricDocksReply { docks: Vec::new(), error: Some(e.to_string()) },
            },
            (Frame::FabricLand { token, dock, seg }, Some(_)) => {
                let done = docks.as_mut().ok_or_else(no_docks).and_then(|d| d.land(registry, dock, &seg));
                docked(token, done, from)
            }
            (Frame::FabricLift { token, dock, seg }, Some(_)) => {
                let done = docks.as_mut().ok_or_else(no_docks).and_then(|d| d.lift(registry, dock, &seg));
                docked(token, done, from)
            }
            (other, _) => {
                return Err(Error::Protocol(format!("fabric: unexpected {other:?} from '{from}'")));
            }
        };
        frame_io::write_frame(&mut stream, &reply, &[])?;
    }
    Ok(())
}

fn no_docks() -> Error {
    Error::Protocol("no docks were lent on this connection".into())
}

/// The answer to a `Land` or `Lift`.
fn docked(token: u64, done: Result<()>, from: &str) -> Frame {
    if let Err(e) = &done {
        tracing::warn!(peer = from, error = %e, "refused a staged copy");
    }
    Frame::FabricDocked { token, error: done.err().map(|e| e.to_string()) }
}

/// The rails' keys of regions a peer may reach: host memory, and GPU memory where the
/// provider registers it (`FI_HMEM`); other GPU memory has none, and goes through the
/// docks. A file region's address is an offset, not memory: refused.
fn region_keys(registry: &Registry, fabric: &Fabric, regions: &[u64]) -> Result<Vec<Option<Vec<u64>>>> {
    regions
        .iter()
        .map(|&k| match registry.get(k) {
            Some(r) if r.is_private() => Err(Error::UnknownRegion(k)),
            Some(r) if r.info.kind == MemKind::Dram => fabric.keys(&r.info).map(Some),
            Some(r) if r.info.kind == MemKind::Vram => Ok(fabric.gpu_keys(&r.info)),
            Some(r) => Err(Error::InvalidArgument(format!(
                "region {k} is {:?} memory: the fabric reaches host and GPU memory only",
                r.info.kind
            ))),
            None => Err(Error::UnknownRegion(k)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::fabric::{dock, FabricConfig};
    use freight_proto::frame::Seg;
    use freight_proto::region::MemKind;
    use std::net::TcpListener;

    /// libfabric's tcp provider on loopback, or `None` (and why) where it is missing.
    fn loopback_fabric() -> Option<Fabric> {
        let cfg = FabricConfig { provider: Some("tcp".into()), domains: vec!["lo".into()], ..FabricConfig::default() };
        Fabric::open(&cfg).map_err(|e| eprintln!("SKIPPED: libfabric's tcp provider is not available: {e}")).ok()
    }

    fn ask(stream: &mut TcpStream, frame: Frame) -> Option<Frame> {
        frame_io::write_frame(stream, &frame, &[]).unwrap();
        frame_io::read_frame(stream).unwrap()
    }

    /// The target side answers what it may and refuses the rest: no fabric open, private
    /// and unknown regions, frames that do not belong to the exchange.
    #[test]
    fn the_exchange_refuses_what_it_must() {
        let registry = Registry::new();
        let (public, private) = (vec![0u8; 4096], vec![0u8; 4096]);
        let open = registry.register(MemKind::Dram, public.as_ptr() as u64, 4096, 0).unwrap();
        let hidden = registry.register_private(MemKind::Dram, private.as_ptr() as u64, 4096, 0).unwrap();
        // A file region's address is an offset: no memory a provider may be pointed at.
        let on_file = registry.register(MemKind::File, 0, 4096, 0).unwrap();
        let fabric = Fabric::open(&FabricConfig {
            provider: Some("tcp".into()),
            domains: vec!["lo".into()],
            ..FabricConfig::default()
        })
        .ok();
        for with_fabric in [false, true] {
            if with_fabric && fabric.is_none() {
                eprintln!("SKIPPED the part with fabric open: libfabric's tcp provider is not available");
                continue;
            }
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, _) = listener.accept().unwrap();
            let f = if with_fabric { fabric.as_ref() } else { None };
            std::thread::scope(|s| {
                let served = s.spawn(|| serve_fabric(server, &registry, f, "tester"));
                let hello = ask(&mut client, Frame::FabricHello { provider: "tcp;ofi_rxm".into() });
                if !with_fabric {
                    assert!(matches!(hello, Some(Frame::Refused { reason }) if reason.contains("no fabric")));
                } else {
                    assert!(matches!(hello, Some(Frame::FabricWelcome { rails, .. }) if rails.len() == 1));
                    let other = ask(&mut client, Frame::FabricHello { provider: "efa".into() });
                    assert!(matches!(other, Some(Frame::Refused { reason }) if reason.contains("not 'efa'")));
                    let keys = ask(&mut client, Frame::FabricKeys { regions: vec![open] });
                    assert!(
                        matches!(&keys, Some(Frame::FabricKeysReply { keys, error: None })
                            if matches!(&keys[..], [Some(k)] if k.len() == 1)),
                        "{keys:?}"
                    );
                    let file = ask(&mut client, Frame::FabricKeys { regions: vec![open, on_file] });
                    assert!(
                        matches!(&file, Some(Frame::FabricKeysReply { keys, error: Some(e) })
                            if keys.is_empty() && e.contains("host and GPU memory only")),
                        "{file:?}"
                    );
                    for region in [hidden, 999] {
                        let refused = ask(&mut client, Frame::FabricKeys { regions: vec![open, region] });
                        assert!(
                            matches!(&refused, Some(Frame::FabricKeysReply { keys, error: Some(e) })
                                if keys.is_empty() && e.contains(&format!("unknown region key {region}"))),
                            "{refused:?}"
                        );
                    }
                }
                frame_io::write_frame(&mut client, &Frame::Wake, &[]).unwrap();
                let ended = served.join().unwrap();
                assert!(matches!(ended, Err(Error::Protocol(m)) if m.contains("unexpected")));
            });
        }
    }

    /// GPU memory the target's provider cannot register gets no keys: peers reach it
    /// through the docks. A provider without `FI_HMEM` (Debian's tcp) is not asked; one
    /// that offers it (Debian's shm, though built without CUDA) is, and after its first
    /// refusal the rails stage GPU memory for good. The "GPU memory" here is an address
    /// no provider can register as such, whatever its build.
    #[test]
    fn gpu_memory_the_provider_cannot_register_has_no_keys() {
        let mut tried = 0;
        for provider in ["tcp", "shm"] {
            let domains = if provider == "tcp" { vec!["lo".to_string()] } else { Vec::new() };
            let cfg = FabricConfig { provider: Some(provider.into()), domains, ..FabricConfig::default() };
            let Ok(fabric) = Fabric::open(&cfg) else {
                eprintln!("SKIPPED {provider}: libfabric's {provider} provider is not available");
                continue;
            };
            tried += 1;
            let registry = Registry::new();
            let host = vec![0u8; 4096];
            let open = registry.register(MemKind::Dram, host.as_ptr() as u64, 4096, 0).unwrap();
            let gpu = registry.register(MemKind::Vram, 0x7f00_0000_0000, 1 << 20, 0).unwrap();
            let offered = fabric.gpu_direct();
            let keys = region_keys(&registry, &fabric, &[open, gpu]).unwrap();
            assert!(matches!(&keys[..], [Some(k), None] if k.len() == 1), "{provider}: {keys:?}");
            assert!(!fabric.gpu_direct(), "{provider}: a refused GPU registration leaves the rails staging");
            let why = fabric.gpu_staged_why().unwrap();
            let expected = if offered { "the provider refused GPU memory" } else { "offers no FI_HMEM" };
            assert!(why.contains(expected), "{provider}: {why}");
            // Asked again, the rails do not try again.
            assert_eq!(region_keys(&registry, &fabric, &[gpu]).unwrap(), vec![None]);
            eprintln!("{provider}: FI_HMEM offered: {offered}");
        }
        if tried == 0 {
            eprintln!("SKIPPED: neither the tcp nor the shm provider of libfabric is available");
        }
    }

    /// Docks are lent within limits, and every copy between them and the target's
    /// memory is checked: copies on a connection that borrowed none, a dock that does
    /// not exist, more bytes than a dock holds, private, unknown or out-of-bounds memory
    /// are refused with the reason, and the connection goes on; good copies move bytes.
    #[test]
    fn docks_are_lent_within_limits_and_copies_are_checked() {
        let Some(fabric) = loopback_fabric() else { return };
        let registry = Registry::new();
        let mut memory: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let private = vec![0u8; 4096];
        let base = memory.as_mut_ptr() as u64;
        let open = registry.register(MemKind::Dram, base, 4096, 0).unwrap();
        let hidden = registry.register_private(MemKind::Dram, private.as_ptr() as u64, 4096, 0).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let seg = |region, at: u64, len| Seg { region, addr: base + at, len };
        let refused = |reply: Option<Frame>, why: &str| match reply {
            Some(Frame::FabricDocked { error: Some(e), .. }) => assert!(e.contains(why), "{e} (expected '{why}')"),
            other => panic!("expected a refusal for '{why}', got {other:?}"),
        };
        std::thread::scope(|s| {
            s.spawn(|| serve_fabric(server, &registry, Some(&fabric), "tester"));
            let land = |dock, seg| Frame::FabricLand { token: 1, dock, seg };
            refused(ask(&mut client, land(0, seg(open, 0, 16))), "no docks");
            for (count, size) in [(0, 4096), (dock::MAX_DOCKS + 1, 4096), (2, dock::MAX_DOCK_SIZE + 1)] {
                match ask(&mut client, Frame::FabricDocks { count, size }) {
                    Some(Frame::FabricDocksReply { docks, error: Some(e) }) => {
                        assert!(docks.is_empty() && e.contains("at most"), "{e}")
                    }
                    other => panic!("{count} docks of {size} bytes were lent: {other:?}"),
                }
            }
            match ask(&mut client, Frame::FabricDocks { count: 2, size: 1024 }) {
                Some(Frame::FabricDocksReply { docks, error: None }) => {
                    assert!(docks.len() == 2 && docks.iter().all(|(_, keys)| keys.len() == 1), "{docks:?}")
                }
                other => panic!("no docks lent: {other:?}"),
            }
            refused(ask(&mut client, land(2, seg(open, 0, 16))), "dock 2 does not exist");
            refused(ask(&mut client, land(0, seg(open, 0, 2048))), "do not fit");
            refused(ask(&mut client, land(0, seg(open, 4000, 200))), "out of bounds");
            refused(
                ask(&mut client, land(0, Seg { region: hidden, addr: private.as_ptr() as u64, len: 16 })),
                "unknown region",
            );
            refused(ask(&mut client, land(1, seg(999, 0, 16))), "unknown region key 999");
            // Lift 100 bytes into dock 1, land them 1000 bytes further on.
            let lift = Frame::FabricLift { token: 7, dock: 1, seg: seg(open, 0, 100) };
            assert_eq!(ask(&mut client, lift), Some(Frame::FabricDocked { token: 7, error: None }));
            let landed = ask(&mut client, Frame::FabricLand { token: 8, dock: 1, seg: seg(open, 1000, 100) });
            assert_eq!(landed, Some(Frame::FabricDocked { token: 8, error: None }));
            match ask(&mut client, Frame::FabricDocks { count: 2, size: 1024 }) {
                Some(Frame::FabricDocksReply { docks, error: Some(e) }) => {
                    assert!(docks.is_empty() && e.contains("already"), "{e}")
                }
                other => panic!("a second set of docks was lent: {other:?}"),
            }
            client.shutdown(std::net::Shutdown::Both).unwrap();
        });
        let expected: Vec<u8> = (0..100u32).map(|i| (i * 7) as u8).collect();
        assert_eq!(&memory[1000..1100], &expected[..]);
    }

    /// A relay that closed (the connection failed, the peer hung up) is not used again:
    /// the next staged request dials a new one. A link shut down opens none.
    #[test]
    fn a_closed_relay_is_opened_again() {
        let Some(fabric) = loopback_fabric() else { return };
        let fabric = Arc::new(fabric);
        let registry = Arc::new(Registry::new());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        {
            let (fabric, registry) = (fabric.clone(), registry.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming().take(3) {
                    let (fabric, registry) = (fabric.clone(), registry.clone());
                    std::thread::spawn(move || serve_fabric(stream.unwrap(), &registry, Some(&fabric), "tester"));
                }
            });
        }
        let dials = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let dial: Dial = {
            let dials = dials.clone();
            Box::new(move || {
                dials.fetch_add(1, Ordering::Relaxed);
                Ok(TcpStream::connect(addr)?)
            })
        };
        let link = FabricLink::connect(TcpStream::connect(addr).unwrap(), &fabric, "target", dial).unwrap();
        let first = link.relay(&fabric).unwrap();
        assert!(Arc::ptr_eq(&first, &link.relay(&fabric).unwrap()), "an open relay is reused");
        first.close("the test hung up");
        assert!(first.is_closed());
        let second = link.relay(&fabric).unwrap();
        assert!(!second.is_closed() && !Arc::ptr_eq(&first, &second));
        assert_eq!(dials.load(Ordering::Relaxed), 2);
        link.shutdown("the test is over");
        assert!(second.is_closed(), "shutting the link down closes its relay");
        let e = link.relay(&fabric).err().expect("no relay after a shutdown");
        assert!(matches!(e, Error::PeerDisconnected { .. }), "{e}");
        assert_eq!(dials.load(Ordering::Relaxed), 2);
    }

    /// A fake target on loopback: answers the hello with `welcome`, then each key
    /// request with the next of `replies` (none left: it hangs up).
    fn fake_target(welcome: Frame, replies: Vec<Frame>) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _hello = frame_io::read_frame(&mut stream).unwrap();
            frame_io::write_frame(&mut stream, &welcome, &[]).unwrap();
            for reply in replies {
                if frame_io::read_frame(&mut stream).ok().flatten().is_none() {
                    return;
                }
                frame_io::write_frame(&mut stream, &reply, &[]).unwrap();
            }
        });
        addr
    }

    fn no_dial() -> Dial {
        Box::new(|| Err(Error::TransportUnavailable("no relay in this test".into())))
    }

    /// What a peer sends goes to the provider and into indexing only once checked: a
    /// rail address of the wrong length, keys for fewer rails than it has.
    #[test]
    fn a_peer_s_addresses_and_keys_are_checked_before_use() {
        let Some(fabric) = loopback_fabric() else { return };
        let fabric = Arc::new(fabric);
        let provider = fabric.provider.clone();
        let short = Frame::FabricWelcome { provider: provider.clone(), rails: vec![vec![7]], virt_addr: false };
        let addr = fake_target(short, vec![]);
        let e = FabricLink::connect(TcpStream::connect(addr).unwrap(), &fabric, "target", no_dial()).err().unwrap();
        assert!(matches!(&e, Error::Protocol(m) if m.contains("an address of 1 bytes")), "{e}");

        let welcome = Frame::FabricWelcome { provider, rails: fabric.addresses(), virt_addr: false };
        let no_keys = Frame::FabricKeysReply { keys: vec![Some(vec![])], error: None };
        let good = Frame::FabricKeysReply { keys: vec![Some(vec![5])], error: None };
        let addr = fake_target(welcome, vec![no_keys, good]);
        let link = FabricLink::connect(TcpStream::connect(addr).unwrap(), &fabric, "target", no_dial()).unwrap();
        let e = link.keys(&[1]).unwrap_err();
        assert!(matches!(&e, Error::Protocol(m) if m.contains("on 1 rails")), "{e}");
        // The exchange is out of step now: no later answer is taken for another question's.
        let e = link.keys(&[2]).unwrap_err();
        assert!(matches!(&e, Error::PeerDisconnected { reason, .. } if reason.contains("key exchange")), "{e}");
        assert!(link.dead_reason().is_some());
    }
}
