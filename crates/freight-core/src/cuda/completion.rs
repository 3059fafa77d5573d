//! One thread per agent turns finished GPU work into finished requests.
//!
//! Each launch records an event (blocking-sync, so waiting sleeps in the driver rather
//! than spinning) and queues it here with what to do when it fires. The thread takes
//! them in order: launches on one stream finish in order anyway. It polls an event
//! briefly first where that pays (see [`crate::poll`]): a small copy finishes within
//! microseconds, and a sleeping wait would add a wake-up to every such request.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};

use super::driver::{Device, Event};
use crate::error::Result;

/// Called once with the outcome of the GPU work.
pub type OnDone = Box<dyn FnOnce(Result<()>) + Send>;

struct Pending {
    device: &'static Device,
    event: Arc<Event>,
    on_done: OnDone,
}

/// Polling budget before a sleeping wait on an event.
const POLL: Duration = Duration::from_micros(100);

/// How long the thread keeps looking for new work after finishing some, before it
/// sleeps: back-to-back requests then skip a wake-up each.
const LINGER: Duration = Duration::from_micros(200);

pub struct Completions {
    queue: Sender<Pending>,
}

impl Completions {
    pub fn start(agent: &str) -> Result<Completions> {
        let (tx, rx) = unbounded::<Pending>();
        thread::Builder::new().name(format!("freight-gpu-{agent}")).spawn(move || {
            loop {
                let next = crate::poll::briefly(LINGER, || rx.try_recv().ok()).map(Ok).unwrap_or_else(|| rx.recv());
                let Ok(p) = next else { break };
                let outcome = p.device.bind().and_then(|_| {
                    // An error from the query ends the polling; the sleeping wait reports it.
                    let ready = crate::poll::briefly(POLL, || match p.event.query() {
                        Ok(true) => Some(()),
                        Ok(false) => None,
                        Err(_) => Some(()),
                    });
                    match ready {
                        Some(()) => p.event.query().map(|_| ()),
                        None => p.event.synchronize(),
                    }
                });
                (p.on_done)(outcome);
            }
        })?;
        Ok(Completions { queue: tx })
    }

    /// Calls `on_done` once `event` (already recorded on `device`'s stream) fires.
    pub fn watch(&self, device: &'static Device, event: Arc<Event>, on_done: OnDone) {
        if let Err(e) = self.queue.send(Pending { device, event, on_done }) {
            // The thread is gone only when the agent is: report rather than hang.
            (e.into_inner().on_done)(Err(crate::error::Error::InvalidState("the agent is closed".into())));
        }
    }
}
