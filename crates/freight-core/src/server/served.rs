//! What an agent serves its peers, and all that the listener's threads may use of the
//! agent: who it is and what a hello must present ([`Served::gate`]), the memory peers
//! may reach, where their notifications go, the fabric it serves, its metadata, and its
//! listeners and inbound connections ([`Server`]). The agent holds it; the listener's
//! threads hold it weakly and stop serving once it is closed or gone. The agent's peers,
//! its path policy and the transports of its own transfers are not here: serving a peer
//! never needs them.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use freight_proto::hello::Gate;
use freight_proto::metadata::{AgentMetadata, HostIdentity};
use freight_proto::path_choice::TransportKind;

use super::Server;
use crate::config::AgentConfig;
use crate::memory::Registry;
use crate::notify::NotifQueue;
use crate::transport::fabric::Fabric;

pub struct Served {
    pub name: String,
    /// Random per agent instance: a restarted agent has a new one.
    pub id: u64,
    /// What peers present on every connection (from the metadata they read).
    pub secret: [u8; 16],
    pub host: Arc<HostIdentity>,
    pub config: AgentConfig,
    pub registry: Registry,
    pub notifs: Arc<NotifQueue>,
    /// The fabric transport, where it was opened.
    pub fabric: Option<Arc<Fabric>>,
    pub server: Server,
    closed: AtomicBool,
}

impl Served {
    pub fn new(name: &str, host: HostIdentity, config: AgentConfig, fabric: Option<Arc<Fabric>>) -> Served {
        Served {
            name: name.to_string(),
            id: rand::random::<u64>() | 1,
            secret: rand::random(),
            host: Arc::new(host),
            config,
            registry: Registry::new(),
            notifs: Arc::default(),
            fabric,
            server: Server::default(),
            closed: AtomicBool::new(false),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks the agent closed; `false` where it was already.
    pub fn close(&self) -> bool {
        !self.closed.swap(true, Ordering::AcqRel)
    }

    /// What a hello must present to this agent.
    pub fn gate(&self) -> Gate<'_> {
        Gate {
            agent_id: self.id,
            secret: &self.secret,
            token: self.config.token.as_deref(),
            serve_metadata: self.config.serve_metadata,
        }
    }

    /// The addresses peers are told to use: the configured ones, or those listened on
    /// (every local address, for a listener on all of them).
    pub fn advertised(&self) -> Vec<String> {
        if !self.config.advertise.is_empty() {
            return self.config.advertise.clone();
        }
        let mut out = Vec::new();
        for a in self.server.addresses() {
            if a.ip().is_unspecified() {
                for ip in local_ips() {
                    out.push(SocketAddr::new(ip, a.port()).to_string());
                }
            } else {
                out.push(a.to_string());
            }
        }
        out
    }

    /// What peers are told: public regions only (see `Agent::register_private`).
    pub fn metadata_bytes(&self) -> Vec<u8> {
        let (_, regions) = self.registry.snapshot();
        AgentMetadata {
            name: self.name.clone(),
            agent_id: self.id,
            secret: self.secret,
            host: (*self.host).clone(),
            addresses: self.advertised(),
            transports: self
                .config
                .transports
                .iter()
                .filter(|&&t| t != TransportKind::Fabric || self.fabric.is_some())
                .map(|t| t.as_str().to_string())
                .collect(),
            regions,
        }
        .encode()
    }
}

/// The host's IPv4 addresses, non-loopback first (for listeners bound to 0.0.0.0).
fn local_ips() -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = freight_host::nic::local_nics().into_iter().map(|n| IpAddr::V4(n.addr)).collect();
    ips.sort_by_key(|ip| ip.is_loopback());
    ips.dedup();
    if ips.is_empty() {
        ips.push(IpAddr::from([127, 0, 0, 1]));
    }
    ips
}
