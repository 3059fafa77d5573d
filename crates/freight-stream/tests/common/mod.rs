//! Helpers shared by the stream tests: agents, and objects filled with patterns that
//! differ per key.
#![allow(dead_code)]

use std::sync::Arc;

use freight_core::{Agent, AgentConfig, Desc, MemKind, SharedSegment, TransportKind};
use freight_stream::{Outgoing, PipeListener};

pub fn agent(name: &str, require: Option<TransportKind>) -> Arc<Agent> {
    Arc::new(Agent::new(name, AgentConfig { require, ..AgentConfig::default() }).unwrap())
}

/// A receiving agent listening for pipes, and a sending agent that knows where.
pub struct Ends {
    pub rx: Arc<Agent>,
    pub tx: Arc<Agent>,
    /// The receiver's address, for the sender to connect to.
    pub addr: String,
    pub listener: PipeListener,
}

pub fn ends(rx_name: &str, tx_name: &str, require: Option<TransportKind>) -> Ends {
    let (rx, tx) = (agent(rx_name, require), agent(tx_name, require));
    let addr = rx.addresses()[0].clone();
    let listener = PipeListener::new(&rx);
    Ends { rx, tx, addr, listener }
}

pub fn pattern(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

/// Objects of the given sizes, laid out in one registered segment of `agent`.
pub fn objects(agent: &Agent, prefix: &str, sizes: &[usize]) -> (Arc<SharedSegment>, Vec<Outgoing>) {
    let total: usize = sizes.iter().sum();
    let seg = agent.alloc(total).unwrap();
    agent.register(MemKind::Dram, seg.addr(), total as u64, 0).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let key = format!("{prefix}{i}");
        // SAFETY: within the segment, which this test owns.
        unsafe { std::ptr::copy_nonoverlapping(pattern(&key, len).as_ptr(), seg.as_ptr().add(at), len) };
        let local = Desc { addr: seg.addr() + at as u64, len: len as u64, dev: 0 };
        out.push(Outgoing { key, kind: MemKind::Dram, local, meta: format!("len={len}").into_bytes() });
        at += len;
    }
    (seg, out)
}
