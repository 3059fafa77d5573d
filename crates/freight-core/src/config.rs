//! Everything an agent can be told at creation, and the one place it is checked: the
//! Python API and the command line hand their settings here, and an error names the
//! setting as they spell it (`AgentConfig.tcp_streams`, `--tcp-streams`).

use std::time::Duration;

use freight_cuda::kernel;
use freight_host::nic::Pinning;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::frame;
use freight_proto::path_choice::TransportKind;

use crate::transport::cuda::CudaConfig;
use crate::transport::fabric::FabricConfig;
use crate::transport::shm::ShmConfig;
use crate::transport::tcp::TcpConfig;

/// Everything an agent can be told at creation.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Address of the agent's listener (peers connect here). Port 0 picks a free port.
    pub listen: String,
    /// Addresses to advertise instead of the bound ones (behind NAT, several NICs).
    pub advertise: Vec<String>,
    /// Transports this agent may use and serve.
    pub transports: Vec<TransportKind>,
    /// When set, every transfer must use this transport or fail.
    pub require: Option<TransportKind>,
    pub tcp: TcpConfig,
    pub shm: ShmConfig,
    pub cuda: CudaConfig,
    pub fabric: FabricConfig,
    /// A peer that does not answer for this long is declared dead.
    pub peer_timeout: Duration,
    /// Bound on connecting and on each handshake.
    pub connect_timeout: Duration,
    /// When set, every connection to this agent must present this token: metadata
    /// requests, control, data and fabric connections alike (compared in constant
    /// time). Unset, anyone who can reach the listener may ask for the metadata, whose
    /// secret opens every other connection: see docs/engine.md, "Security model".
    pub token: Option<Vec<u8>>,
    /// Whether the listener answers metadata requests ([`crate::Agent::connect`]). Off
    /// for an agent whose metadata travels another way only, as the KV server's and
    /// clients' do (over their authenticated control plane): then nothing on the
    /// listener hands out the secret, token or no token.
    pub serve_metadata: bool,
}

/// The longest access token (it travels in every hello).
pub const MAX_TOKEN: usize = 4096;

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: "127.0.0.1:0".into(),
            advertise: Vec::new(),
            transports: TransportKind::ALL.to_vec(),
            require: None,
            tcp: TcpConfig::default(),
            shm: ShmConfig::default(),
            cuda: CudaConfig::default(),
            fabric: FabricConfig::default(),
            peer_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            token: None,
            serve_metadata: true,
        }
    }
}

/// An invalid setting, named as users spell it.
fn bad(field: &str, why: impl std::fmt::Display) -> Error {
    invalid(format!("AgentConfig.{field} {why}"))
}

/// Names the setting a component's own check refused.
fn naming(field: &'static str) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::InvalidArgument(m) => bad(field, format!("is refused: {m}")),
        other => other,
    }
}

impl AgentConfig {
    /// Checks every setting. The error names the first one refused.
    pub fn validate(&self) -> Result<()> {
        if self.transports.is_empty() {
            return Err(bad("transports", "must enable at least one transport"));
        }
        if let Some(t) = self.require {
            if !self.transports.contains(&t) {
                return Err(bad("require", format!("= {t} is not among the enabled transports {:?}", self.transports)));
            }
        }
        for (field, value) in [("tcp_streams", self.tcp.streams), ("tcp_window", self.tcp.window)] {
            if value == 0 {
                return Err(bad(field, "must be at least 1, got 0"));
            }
        }
        if !(1..=frame::MAX_PAYLOAD).contains(&self.tcp.chunk_size) {
            return Err(bad(
                "tcp_chunk_size",
                format!("must be 1 to {} bytes, got {}", frame::MAX_PAYLOAD, self.tcp.chunk_size),
            ));
        }
        if matches!(&self.tcp.pin, Pinning::Cores(cores) if cores.is_empty()) {
            return Err(bad("tcp_pin", "names no core: pinning to cores needs at least one core"));
        }
        if self.shm.threads == 0 {
            return Err(bad("shm_threads", "must be at least 1, got 0"));
        }
        if self.fabric.chunk_size == 0 {
            return Err(bad("fabric_chunk_size", "must be at least 1, got 0"));
        }
        kernel::validate_item_bytes(self.cuda.kernel_item_bytes).map_err(naming("cuda_kernel_item_bytes"))?;
        self.cuda.kernel_shape.validate_threads().map_err(naming("cuda_kernel_threads"))?;
        self.cuda.kernel_shape.validate_blocks_per_sm().map_err(naming("cuda_kernel_blocks_per_sm"))?;
        for (field, t) in [("peer_timeout", self.peer_timeout), ("connect_timeout", self.connect_timeout)] {
            if t.is_zero() {
                return Err(bad(field, "must be a positive number of seconds"));
            }
        }
        match self.token.as_deref() {
            // A peer that presents none presents the empty token: it would match.
            Some([]) => Err(bad("token", "is empty, which every peer presents: give a non-empty one, or none")),
            Some(t) if t.len() > MAX_TOKEN => Err(bad("token", format!("is {} bytes; at most {MAX_TOKEN}", t.len()))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_pass() {
        AgentConfig::default().validate().unwrap();
    }

    #[test]
    fn each_refusal_names_its_setting() {
        type Change = Box<dyn Fn(&mut AgentConfig)>;
        let cases: Vec<(&str, Change)> = vec![
            ("transports", Box::new(|c| c.transports.clear())),
            (
                "require",
                Box::new(|c| {
                    c.transports = vec![TransportKind::Tcp];
                    c.require = Some(TransportKind::Shm);
                }),
            ),
            ("tcp_streams", Box::new(|c| c.tcp.streams = 0)),
            ("tcp_window", Box::new(|c| c.tcp.window = 0)),
            ("tcp_chunk_size", Box::new(|c| c.tcp.chunk_size = 0)),
            ("tcp_chunk_size", Box::new(|c| c.tcp.chunk_size = frame::MAX_PAYLOAD + 1)),
            ("tcp_pin", Box::new(|c| c.tcp.pin = Pinning::Cores(Vec::new()))),
            ("shm_threads", Box::new(|c| c.shm.threads = 0)),
            ("fabric_chunk_size", Box::new(|c| c.fabric.chunk_size = 0)),
            ("cuda_kernel_item_bytes", Box::new(|c| c.cuda.kernel_item_bytes = 1000)),
            ("cuda_kernel_threads", Box::new(|c| c.cuda.kernel_shape.threads = 100)),
            ("cuda_kernel_blocks_per_sm", Box::new(|c| c.cuda.kernel_shape.blocks_per_sm = 0)),
            ("peer_timeout", Box::new(|c| c.peer_timeout = Duration::ZERO)),
            ("connect_timeout", Box::new(|c| c.connect_timeout = Duration::ZERO)),
            ("token", Box::new(|c| c.token = Some(Vec::new()))),
            ("token", Box::new(|c| c.token = Some(vec![1; MAX_TOKEN + 1]))),
        ];
        for (field, change) in cases {
            let mut c = AgentConfig::default();
            change(&mut c);
            let e = c.validate().unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(&format!("AgentConfig.{field}"))),
                "{field}: {e}"
            );
        }
    }
}
