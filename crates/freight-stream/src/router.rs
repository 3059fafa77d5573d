//! Sorts an agent's incoming notifications by pipe.
//!
//! The engine has one notification queue per agent. Once a pipe end exists on an agent,
//! a router thread owns that queue: it hands each pipe message to the pipe it names (by
//! sending peer and pipe id), queues `Open` requests for whoever accepts pipes, and keeps
//! any other notification for [`Router::foreign`], so nothing is lost. There is one
//! router per agent, shared by all its pipe ends, and it stops when the last one goes,
//! handing the agent back what it kept for it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use freight_core::{Agent, Notification, Result};
use parking_lot::{Condvar, Mutex};

use crate::proto::Msg;

/// How long the thread waits for notifications before it looks whether to stop.
const POLL: Duration = Duration::from_millis(50);

/// Where a pipe's messages go: (sending peer, pipe id).
type Route = (String, u64);

/// A request to open a pipe: (sending peer, its `Open` message).
type Open = (String, Msg);

#[derive(Default)]
struct Table {
    routes: HashMap<Route, Sender<Msg>>,
    /// Messages for a pipe not set up yet (a Data can overtake the Accept's effect).
    early: HashMap<Route, Vec<Msg>>,
    /// Pipes that ended here: late messages for them (a last credit) are dropped.
    ended: HashSet<Route>,
    foreign: VecDeque<Notification>,
}

struct Shared {
    table: Mutex<Table>,
    /// Signalled when foreign notifications arrive.
    foreign_ready: Condvar,
    opens: (Sender<Open>, Receiver<Open>),
    stop: AtomicBool,
    /// Set once its router is gone for good: thread joined, notifications given back.
    finished: AtomicBool,
}

pub struct Router {
    agent: Arc<Agent>,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A router as the registry keeps it: (agent's address, the router, its state).
type Registered = (usize, Weak<Router>, Arc<Shared>);

/// Routers by agent (keyed by the agent's address, which is stable while it lives),
/// kept until their drop has finished.
static ROUTERS: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

impl Router {
    /// The router of `agent`, started on first use.
    pub fn of(agent: &Arc<Agent>) -> Arc<Router> {
        let key = Arc::as_ptr(agent) as usize;
        let mut all = ROUTERS.lock();
        if let Some(r) = all.iter().find(|(k, ..)| *k == key).and_then(|(_, r, _)| r.upgrade()) {
            return r;
        }
        // A router of this agent whose last handle just went may still be stopping
        // (its drop does not take this lock): two threads must never both take from
        // the agent's queue.
        for (_, _, old) in all.iter().filter(|(k, ..)| *k == key) {
            while !old.finished.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        all.retain(|(_, r, shared)| r.strong_count() > 0 || !shared.finished.load(Ordering::Acquire));
        let shared = Arc::new(Shared {
            table: Mutex::new(Table::default()),
            foreign_ready: Condvar::new(),
            opens: crossbeam_channel::unbounded(),
            stop: AtomicBool::new(false),
            finished: AtomicBool::new(false),
        });
        let weak_agent = Arc::downgrade(agent);
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("freight-pipes-{}", agent.name()))
                .spawn(move || route(weak_agent, shared))
                .expect("cannot start the pipe router thread")
        };
        let router = Arc::new(Router { agent: agent.clone(), shared: shared.clone(), thread: Some(thread) });
        all.push((key, Arc::downgrade(&router), shared));
        router
    }

    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// Starts delivering the messages of pipe `pipe` from `peer`.
    pub fn subscribe(&self, peer: &str, pipe: u64) -> Receiver<Msg> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let route = (peer.to_string(), pipe);
        let mut table = self.shared.table.lock();
        for m in table.early.remove(&route).unwrap_or_default() {
            let _ = tx.send(m);
        }
        table.routes.insert(route, tx);
        rx
    }

    /// Whether the sender of pipe `pipe` gave it up before it was accepted (its
    /// `Abort` came first); if so, the pipe is ended here.
    pub fn withdrawn(&self, peer: &str, pipe: u64) -> bool {
        let route = (peer.to_string(), pipe);
        let mut table = self.shared.table.lock();
        let gave_up = table.early.get(&route).is_some_and(|m| m.iter().any(|m| matches!(m, Msg::Abort { .. })));
        if gave_up {
            table.early.remove(&route);
            table.ended.insert(route);
        }
        gave_up
    }

    pub fn unsubscribe(&self, peer: &str, pipe: u64) {
        let route = (peer.to_string(), pipe);
        let mut table = self.shared.table.lock();
        table.routes.remove(&route);
        table.early.remove(&route);
        table.ended.insert(route);
    }

    /// Pipe requests from senders: (sending peer, `Msg::Open`).
    pub fn opens(&self) -> &Receiver<(String, Msg)> {
        &self.shared.opens.1
    }

    /// Notifications that were not pipe messages, oldest first.
    pub fn foreign(&self) -> Vec<Notification> {
        self.shared.table.lock().foreign.drain(..).collect()
    }

    /// Like [`Router::foreign`], but waits up to `timeout` for at least one (the
    /// engine's `wait_notifs` for an agent whose queue the router took over).
    pub fn wait_foreign(&self, timeout: Duration) -> Vec<Notification> {
        let deadline = Instant::now() + timeout;
        let mut table = self.shared.table.lock();
        while table.foreign.is_empty() {
            if self.shared.foreign_ready.wait_until(&mut table, deadline).timed_out() {
                break;
            }
        }
        table.foreign.drain(..).collect()
    }

    /// Sends a pipe message to `peer`.
    pub fn send(&self, peer: &str, msg: &Msg) -> Result<()> {
        self.agent.notify(peer, msg.encode())
    }
}

impl Drop for Router {
    /// Stops the thread, and gives the agent back the notifications that were not the
    /// pipes', so that its own `get_notifs` sees them. A new router for the agent waits
    /// for this to finish (both threads would take from its queue).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let kept: Vec<Notification> = self.shared.table.lock().foreign.drain(..).collect();
        self.agent.give_back_notifs(kept);
        self.shared.finished.store(true, Ordering::Release);
    }
}

/// Holds messages for a pipe whose end does not exist yet, up to this many per pipe.
const EARLY_LIMIT: usize = 1 << 16;

fn route(agent: Weak<Agent>, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::Acquire) {
        let Some(agent) = agent.upgrade() else { break };
        let notifs = agent.wait_notifs(POLL);
        drop(agent);
        let mut table = shared.table.lock();
        for n in notifs {
            match Msg::decode(&n.msg) {
                None => {
                    table.foreign.push_back(n);
                    shared.foreign_ready.notify_all();
                }
                Some(Err(e)) => tracing::warn!(peer = %n.from, error = %e, "dropped a malformed pipe message"),
                Some(Ok(msg @ Msg::Open { .. })) => {
                    let _ = shared.opens.0.send((n.from, msg));
                }
                Some(Ok(msg)) => {
                    let route = (n.from, msg.pipe());
                    match table.routes.get(&route) {
                        Some(tx) => {
                            let _ = tx.send(msg);
                        }
                        None if table.ended.contains(&route) => {
                            tracing::debug!(peer = %route.0, pipe = route.1, "ignored a message for an ended pipe")
                        }
                        None => {
                            let early = table.early.entry(route.clone()).or_default();
                            if early.len() < EARLY_LIMIT {
                                early.push(msg);
                            } else {
                                tracing::warn!(peer = %route.0, pipe = route.1, "dropped a message for an unknown pipe");
                            }
                        }
                    }
                }
            }
        }
    }
}
