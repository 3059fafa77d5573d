//! The exchange that sets up fabric transfers between two agents, over a connection to
//! the target's listener (`Role::Fabric`):
//!
//! 1. `FabricHello { provider }` -> `FabricWelcome { provider, rails, virt_addr }`: the
//!    target's endpoint addresses, one per rail, or `Refused` with the reason (no fabric
//!    open, another provider). The initiator pairs its rail `i` with the target's rail
//!    `i mod n`, and adds those addresses to its rails' address vectors.
//! 2. `FabricKeys { regions }` -> `FabricKeysReply { keys }`: the keys of regions the
//!    initiator is about to use, registered by the target on first request. Private and
//!    unknown regions are refused alike.
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

use super::Fabric;
use crate::error::{Error, Result};
use crate::memory::Registry;
use crate::wire::{self, Frame};

/// The initiator's side of the exchange with one peer.
pub struct FabricLink {
    peer: Arc<str>,
    stream: Mutex<TcpStream>,
    /// Per local rail: the paired remote rail and its address-vector handle.
    routes: Vec<(u64, usize)>,
    virt_addr: bool,
    /// Region -> its key on each of the peer's rails.
    keys: RwLock<HashMap<u64, Vec<u64>>>,
    /// Why the peer is gone, once the watcher saw the exchange close.
    dead: Arc<Mutex<Option<String>>>,
    /// Set when this side closes the exchange (the watcher then leaves quietly).
    closing: Arc<AtomicBool>,
}

impl FabricLink {
    /// Runs step 1 on a connection the peer welcomed.
    pub fn connect(mut stream: TcpStream, fabric: &Arc<Fabric>, peer: &str) -> Result<FabricLink> {
        wire::write_frame(&mut stream, &Frame::FabricHello { provider: fabric.provider.clone() }, &[])?;
        let (rails, virt_addr) = match wire::read_frame(&mut stream)? {
            Some(Frame::FabricWelcome { provider, rails, virt_addr }) => {
                if provider != fabric.provider || rails.is_empty() {
                    return Err(Error::Protocol(format!(
                        "fabric: peer '{peer}' answered with provider '{provider}' and {} rails",
                        rails.len()
                    )));
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
            virt_addr,
            keys: RwLock::default(),
            dead: Arc::default(),
            closing: Arc::default(),
        };
        link.watch(Arc::downgrade(fabric))?;
        Ok(link)
    }

    /// Starts the thread that notices the peer going away (see the module docs).
    fn watch(&self, fabric: Weak<Fabric>) -> Result<()> {
        let stream = self.stream.lock().try_clone()?;
        let (dead, closing, routes, peer) =
            (self.dead.clone(), self.closing.clone(), self.routes.clone(), self.peer.clone());
        std::thread::Builder::new().name("freight-fabric-watch".into()).spawn(move || {
            wait_for_hangup(&stream);
            if closing.load(Ordering::Acquire) {
                return;
            }
            let reason = "the peer closed its fabric exchange (its agent closed or its process died)".to_string();
            tracing::info!(%peer, %reason, "fabric peer gone");
            *dead.lock() = Some(reason.clone());
            if let Some(f) = fabric.upgrade() {
                f.abandon(&routes, &reason);
            }
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

    pub fn virt_addr(&self) -> bool {
        self.virt_addr
    }

    /// The keys of `regions`, asking the peer for those not yet known (one round trip).
    pub fn keys(&self, regions: &[u64]) -> Result<HashMap<u64, Vec<u64>>> {
        let missing: Vec<u64> = {
            let known = self.keys.read();
            regions.iter().copied().filter(|r| !known.contains_key(r)).collect()
        };
        if !missing.is_empty() {
            let mut stream = self.stream.lock();
            wire::write_frame(&mut *stream, &Frame::FabricKeys { regions: missing.clone() }, &[])?;
            match wire::read_frame(&mut *stream)? {
                Some(Frame::FabricKeysReply { keys, error: None }) if keys.len() == missing.len() => {
                    self.keys.write().extend(missing.into_iter().zip(keys));
                }
                Some(Frame::FabricKeysReply { error: Some(reason), .. }) => {
                    return Err(Error::RemoteRejected { peer: self.peer.to_string(), reason });
                }
                other => return Err(Error::Protocol(format!("fabric: expected keys, got {other:?}"))),
            }
        }
        let known = self.keys.read();
        Ok(regions.iter().filter_map(|r| known.get(r).map(|k| (*r, k.clone()))).collect())
    }

    /// The peer revoked a region: its keys are dead.
    pub fn forget(&self, region: u64) {
        self.keys.write().remove(&region);
    }
}

impl Drop for FabricLink {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        let _ = self.stream.lock().shutdown(Shutdown::Both);
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

/// The target's side: answers hellos and key requests until the initiator closes.
pub fn serve_fabric(mut stream: TcpStream, registry: &Registry, fabric: Option<&Fabric>, from: &str) -> Result<()> {
    while let Some(frame) = wire::read_frame(&mut stream)? {
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
            (other, _) => {
                return Err(Error::Protocol(format!("fabric: unexpected {other:?} from '{from}'")));
            }
        };
        wire::write_frame(&mut stream, &reply, &[])?;
    }
    Ok(())
}

fn region_keys(registry: &Registry, fabric: &Fabric, regions: &[u64]) -> Result<Vec<Vec<u64>>> {
    regions
        .iter()
        .map(|&k| match registry.get(k) {
            Some(r) if !r.is_private() => fabric.keys(&r.info),
            _ => Err(Error::UnknownRegion(k)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemKind;
    use crate::transport::fabric::FabricConfig;
    use std::net::TcpListener;

    fn ask(stream: &mut TcpStream, frame: Frame) -> Option<Frame> {
        wire::write_frame(stream, &frame, &[]).unwrap();
        wire::read_frame(stream).unwrap()
    }

    /// The target side answers what it may and refuses the rest: no fabric open, private
    /// and unknown regions, frames that do not belong to the exchange.
    #[test]
    fn the_exchange_refuses_what_it_must() {
        let registry = Registry::new();
        let (public, private) = (vec![0u8; 4096], vec![0u8; 4096]);
        let open = registry.register(MemKind::Dram, public.as_ptr() as u64, 4096, 0).unwrap();
        let hidden = registry.register_private(MemKind::Dram, private.as_ptr() as u64, 4096, 0).unwrap();
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
                    assert!(matches!(keys, Some(Frame::FabricKeysReply { keys, error: None }) if keys[0].len() == 1));
                    for region in [hidden, 999] {
                        let refused = ask(&mut client, Frame::FabricKeys { regions: vec![open, region] });
                        assert!(
                            matches!(&refused, Some(Frame::FabricKeysReply { keys, error: Some(e) })
                                if keys.is_empty() && e.contains(&format!("unknown region key {region}"))),
                            "{refused:?}"
                        );
                    }
                }
                wire::write_frame(&mut client, &Frame::Wake, &[]).unwrap();
                let ended = served.join().unwrap();
                assert!(matches!(ended, Err(Error::Protocol(m)) if m.contains("unexpected")));
            });
        }
    }
}
