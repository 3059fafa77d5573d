//! Agents and a store over real sockets, for the engine's tests (the integration tests,
//! and the unit tests in `src/engine.rs`, which include this file).
#![allow(dead_code)]

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use freight_core::{Agent, AgentConfig, TransportKind};
use freight_stream::{
    Buffer, ChannelReceiver, ChannelSender, PipeConfig, PipeListener, PipeSender, StoreReceiver, StoreSender,
};

pub const WAIT: Duration = Duration::from_secs(10);

pub fn agent(name: &str, require: Option<TransportKind>) -> Arc<Agent> {
    Arc::new(Agent::new(name, AgentConfig { require, ..AgentConfig::default() }).unwrap())
}

/// A store sender on `tx` (commits of 4), and the store it feeds on `rx` through a pipe
/// buffer of `buffer` bytes.
pub fn store_pair(tx: &Arc<Agent>, rx: &Arc<Agent>, buffer: u64) -> (StoreSender, StoreReceiver) {
    let config = PipeConfig { timeout: WAIT, ..PipeConfig::default() };
    let listener = PipeListener::new(rx);
    let addr = rx.addresses()[0].clone();
    let (tx, config2) = (tx.clone(), config.clone());
    let opener = thread::spawn(move || {
        let pipe = PipeSender::connect(&tx, &addr, &config2).unwrap();
        StoreSender::new(ChannelSender::new(pipe, 8, None).unwrap(), 4).unwrap()
    });
    let pipe = listener.accept(Buffer::Host { capacity: buffer }, &config).unwrap();
    let store = StoreReceiver::new(ChannelReceiver::new(vec![pipe], WAIT), None);
    (opener.join().unwrap(), store)
}
