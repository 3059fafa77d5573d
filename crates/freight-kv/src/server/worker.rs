//! The data-plane worker: one thread that takes clients' requests from the agent's
//! notifications, starts one engine transfer per request (a GET writes values from
//! the pool into the client's buffers, its reply riding on the transfer; a PUT reads
//! the client's buffers into fresh slots), and finishes each when its transfer
//! settles. [`crate::service`] decides what each request pins, reserves and answers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_core::{DescList, Error, MemKind, Notification, OpKind, Request, Result, Status};

use super::sessions::{Sender, Shared};
use crate::pool::Slot;
use crate::service::{GetPlan, PutPlan};
use crate::wire::{self, Buffer, FailCode, Outcome, Reply};

/// How long the worker sleeps in the notification queue when nothing is in flight;
/// a request wakes it at once.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// A request whose transfer is running.
enum InFlight {
    Get { client: Client, first_id: u64, transfer: Request, plan: GetPlan },
    Put { client: Client, first_id: u64, transfer: Request, plan: PutPlan },
}

/// The client a request came from: its agent's name and its session.
struct Client {
    agent: String,
    session: u64,
}

impl InFlight {
    fn transfer(&self) -> &Request {
        match self {
            InFlight::Get { transfer, .. } | InFlight::Put { transfer, .. } => transfer,
        }
    }
}

/// The data-plane loop: takes requests, starts their transfers, finishes them.
pub(super) struct Worker {
    shared: Arc<Shared>,
    in_flight: Vec<InFlight>,
    /// Set by a transfer that settled (with a wake-up of the notification wait), so one
    /// wait covers requests and completions alike; cleared before each look at them.
    settled: Arc<AtomicBool>,
    sweep_every: Duration,
    last_sweep: Instant,
}

impl Worker {
    pub(super) fn new(shared: Arc<Shared>, sweep_every: Duration) -> Worker {
        Worker {
            shared,
            in_flight: Vec::new(),
            settled: Arc::new(AtomicBool::new(false)),
            sweep_every,
            last_sweep: Instant::now(),
        }
    }

    pub(super) fn run(mut self) {
        loop {
            let stopping = self.shared.stop.load(Ordering::Acquire);
            if stopping && self.in_flight.is_empty() {
                break;
            }
            let settled = &self.settled;
            let notifs =
                crate::notif_wait::next_notifs(&self.shared.agent, IDLE_WAIT, || settled.load(Ordering::Acquire));
            self.settled.store(false, Ordering::Release);
            for n in notifs {
                self.take(n, stopping);
            }
            self.finish_done();
            if self.last_sweep.elapsed() >= self.sweep_every {
                self.last_sweep = Instant::now();
                let expired = self.shared.index.lock().expire(self.shared.now_ms());
                if expired > 0 {
                    tracing::debug!(expired, "swept expired values");
                }
                self.shared.drop_dead_clients();
            }
        }
    }

    /// Starts one request (or answers it at once).
    fn take(&mut self, n: Notification, stopping: bool) {
        let (token, request) = match wire::Request::decode(&n.msg) {
            None => {
                tracing::debug!(from = %n.from, bytes = n.msg.len(), "ignored a notification that is no KV request");
                return;
            }
            Some(Err(e)) => return self.refuse_malformed(&n, &e),
            Some(Ok(r)) => r,
        };
        let first_id = request.first_id();
        let Some(client) = self.client(n.from, &token, first_id) else { return };
        let refuse = |why: &str| {
            let outcomes = vec![Outcome::Failed { code: FailCode::Refused, error: why.to_string() }; request.len()];
            self.reply(&client, Reply { first_id, outcomes });
        };
        if stopping {
            return refuse("the server is shutting down");
        }
        let (items, kind) = match &request {
            wire::Request::Get { items, .. } | wire::Request::Put { items, .. } => {
                (items, items.first().map(|i| i.1.kind))
            }
        };
        if items.iter().any(|(_, b)| Some(b.kind) != kind) {
            return refuse("a request's buffers must all be of one memory kind");
        }
        let now = self.shared.now_ms();
        match request {
            wire::Request::Get { first_id, items } => {
                let plan = GetPlan::new(&mut self.shared.index.lock(), &items, now);
                let reply = Reply { first_id, outcomes: plan.outcomes().to_vec() };
                if plan.copies.is_empty() {
                    return self.reply(&client, reply);
                }
                let started =
                    self.start(&client.agent, OpKind::Write, plan.copies.iter().copied(), Some(reply.encode()));
                match started {
                    Ok(transfer) => self.in_flight.push(InFlight::Get { client, first_id, transfer, plan }),
                    Err(e) => {
                        self.drop_if_unresponsive(&client, &e);
                        let outcomes = plan.finish(&mut self.shared.index.lock(), Err(e)).unwrap_or_default();
                        self.reply(&client, Reply { first_id, outcomes });
                    }
                }
            }
            wire::Request::Put { first_id, ttl_ms, items } => {
                let plan = PutPlan::new(&mut self.shared.index.lock(), &items, ttl_ms, now);
                if plan.copies.is_empty() {
                    let outcomes = plan.finish(&mut self.shared.index.lock(), Ok(()), now);
                    return self.reply(&client, Reply { first_id, outcomes });
                }
                let copies = plan.copies.iter().map(|&(buffer, slot)| (slot, buffer));
                match self.start(&client.agent, OpKind::Read, copies, None) {
                    Ok(transfer) => self.in_flight.push(InFlight::Put { client, first_id, transfer, plan }),
                    Err(e) => {
                        self.drop_if_unresponsive(&client, &e);
                        let outcomes = plan.finish(&mut self.shared.index.lock(), Err(e), now);
                        self.reply(&client, Reply { first_id, outcomes });
                    }
                }
            }
        }
    }

    /// The client whose session sent a request with `token`, or `None` when it is no
    /// session's: the request is then dropped unanswered. Anyone may connect under
    /// another client's name, so an answer would reach that client as the answer to a
    /// request it did make. An agent without a session is not answered either: its
    /// session ended, and with it its connections (see `end_session`), so there is
    /// usually no one to answer; and the agent saying hello right now must not be
    /// dialled, or hung up on, from here.
    fn client(&self, from: String, token: &wire::SessionToken, first_id: u64) -> Option<Client> {
        let sender = self.shared.clients.lock().sender(&from, token);
        match sender {
            Sender::Session(session) => Some(Client { agent: from, session }),
            Sender::NoSession => {
                tracing::info!(%from, first_id, "dropped a request from an agent without a session");
                None
            }
            Sender::Impostor => {
                tracing::warn!(%from, first_id, "dropped a request without its session's token");
                None
            }
        }
    }

    /// Answers a request that does not decode with a protocol error, so that its client
    /// fails at once instead of waiting out its timeout: where its head can be read and
    /// names its sender's session (see `client`).
    fn refuse_malformed(&self, n: &Notification, e: &Error) {
        let Some((token, first_id)) = wire::Request::recover_head(&n.msg) else {
            return tracing::warn!(from = %n.from, error = %e, "dropped a request that does not decode");
        };
        if let Some(client) = self.client(n.from.clone(), &token, first_id) {
            tracing::warn!(from = %n.from, first_id, error = %e, "refused a request that does not decode");
            let outcomes = vec![Outcome::Failed { code: FailCode::Protocol, error: e.to_string() }];
            self.reply(&client, Reply { first_id, outcomes });
        }
    }

    /// One transfer between pool slots and a client's buffers.
    fn start(
        &self,
        client: &str,
        op: OpKind,
        copies: impl Iterator<Item = (Slot, Buffer)>,
        notif: Option<Vec<u8>>,
    ) -> Result<Request> {
        let (mut local, mut remote) = (DescList::new(MemKind::Dram), None::<DescList>);
        for (slot, buffer) in copies {
            local.push(self.shared.pool_desc(slot))?;
            remote.get_or_insert_with(|| DescList::new(buffer.kind)).push(buffer.desc())?;
        }
        let remote = remote.expect("a transfer with something to copy");
        let transfer = self.shared.agent.transfer(op, &local, client, &remote, notif)?;
        let (settled, waker) = (self.settled.clone(), self.shared.agent.waker());
        transfer.on_settled(move || {
            settled.store(true, Ordering::Release);
            waker.wake();
        });
        Ok(transfer)
    }

    /// Finishes every request whose transfer has ended.
    fn finish_done(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            let result = match self.in_flight[i].transfer().status() {
                Status::Done => Ok(()),
                Status::Error(e) => Err(e),
                Status::Idle | Status::Pending => {
                    i += 1;
                    continue;
                }
            };
            let in_flight = self.in_flight.swap_remove(i);
            if let Err(e) = &result {
                let (InFlight::Get { client, .. } | InFlight::Put { client, .. }) = &in_flight;
                self.drop_if_unresponsive(client, e);
            }
            match in_flight {
                InFlight::Get { client, first_id, plan, .. } => {
                    // Bound first: the index lock must not be held while replying.
                    let failed = plan.finish(&mut self.shared.index.lock(), result);
                    if let Some(outcomes) = failed {
                        self.reply(&client, Reply { first_id, outcomes });
                    }
                }
                InFlight::Put { client, first_id, plan, .. } => {
                    let now = self.shared.now_ms();
                    let outcomes = plan.finish(&mut self.shared.index.lock(), result, now);
                    self.reply(&client, Reply { first_id, outcomes });
                }
            }
        }
    }

    /// Answers a client. One that cannot be answered loses its session: for a client on
    /// this host that takes no notifications, each answer would wait out the engine's
    /// peer timeout for room in its queue, holding up every other client meanwhile;
    /// without a session its answers fail at once.
    fn reply(&self, client: &Client, reply: Reply) {
        if let Err(e) = self.shared.agent.notify(&client.agent, reply.encode()) {
            tracing::warn!(client = client.session, agent = %client.agent, error = %e, "could not answer a client");
            self.shared.end_session(&client.agent, client.session, "its answers cannot be delivered");
        }
    }

    /// Ends the session of a client that a transfer found gone or unresponsive (a GET's
    /// answer rides on its transfer, so it fails the same way): answering it, or moving
    /// its next request's values, would wait the same way again.
    fn drop_if_unresponsive(&self, client: &Client, e: &Error) {
        if matches!(e, Error::Timeout(_) | Error::PeerDisconnected { .. }) {
            self.shared.end_session(&client.agent, client.session, "a transfer found it unresponsive");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{agent, dial_server, sessions, test_server as server, UNCHECKED};
    use super::super::Server;
    use super::*;
    use freight_core::Agent;

    /// A worker of the test's own: it takes the requests that the test hands it as if
    /// they came from the named agent.
    fn worker(s: &Server) -> Worker {
        Worker::new(s.shared.clone(), Duration::from_secs(3600))
    }

    fn from(agent: &str, msg: Vec<u8>) -> Notification {
        Notification { from: agent.to_string(), msg }
    }

    fn put_request(first_id: u64, token: &wire::SessionToken) -> Vec<u8> {
        let buffer = wire::Buffer { kind: MemKind::Dram, addr: 1, len: 1, dev: 0 };
        wire::Request::Put { first_id, ttl_ms: 0, items: vec![(b"k".to_vec(), buffer)] }.encode(token)
    }

    /// A request that does not decode, its head intact: a PUT cut short.
    fn malformed(first_id: u64, token: &wire::SessionToken) -> Vec<u8> {
        let mut put = put_request(first_id, token);
        put.truncate(put.len() - 3);
        put
    }

    /// The replies `client` receives until the one to `first_id`, that one included.
    fn replies_until(client: &Agent, first_id: u64) -> Vec<Reply> {
        let until = Instant::now() + Duration::from_secs(5);
        let mut got: Vec<Reply> = Vec::new();
        while !matches!(got.last(), Some(r) if r.first_id == first_id) {
            assert!(Instant::now() < until, "no answer to request {first_id}; got {got:?}");
            got.extend(replies_within(client, Duration::from_millis(100)));
        }
        got
    }

    fn replies_within(client: &Agent, wait: Duration) -> Vec<Reply> {
        client.wait_notifs(wait).iter().filter_map(|n| Reply::decode(&n.msg)).map(|r| r.unwrap()).collect()
    }

    #[test]
    fn a_request_that_does_not_decode_is_answered_at_once_when_its_id_can_be_read() {
        let s = server();
        let client = agent(&format!("raw-{}", rand::random::<u32>()));
        let opened = s.shared.hello(&client.metadata(), UNCHECKED).unwrap();
        let server_agent = dial_server(&client, &s).unwrap();
        client.notify(&server_agent, malformed(41, &opened.token)).unwrap();
        let reply = replies_until(&client, 41).pop().unwrap();
        assert!(
            matches!(&reply.outcomes[..], [Outcome::Failed { code: FailCode::Protocol, error }] if error.contains("malformed")),
            "{reply:?}"
        );
    }

    /// Anyone may connect under a client's name: an answer to such an agent's request
    /// reaches the client, which takes it for the answer to its own request of that id
    /// (and fails that one while the server still carries it out in its buffer).
    #[test]
    fn requests_without_their_sessions_token_are_not_answered() {
        let s = server();
        let victim = agent(&format!("victim-{}", rand::random::<u32>()));
        let opened = s.shared.hello(&victim.metadata(), UNCHECKED).unwrap();
        let mut w = worker(&s);
        let forged = [0; 16];
        w.take(from(&opened.agent, malformed(41, &forged)), false);
        let stopping = true;
        w.take(from(&opened.agent, put_request(42, &forged)), stopping);
        // The session's own, answered in order after whatever the others got.
        w.take(from(&opened.agent, malformed(43, &opened.token)), false);
        w.take(from(&opened.agent, put_request(44, &opened.token)), stopping);
        let got = replies_until(&victim, 44);
        assert_eq!(got.iter().map(|r| r.first_id).collect::<Vec<_>>(), [43, 44], "{got:?}");
        assert!(
            matches!(&got[1].outcomes[..], [Outcome::Failed { code: FailCode::Refused, error }] if error.contains("shutting down")),
            "{got:?}"
        );
    }

    /// The worker reads the sessions under their lock, but a hello of the request's
    /// agent may add its peer and session right after: hanging up on that agent then
    /// would drop its new session's peer, and answering it would dial it from the
    /// worker. Such a request is dropped, nothing more.
    #[test]
    fn a_request_from_an_agent_without_a_session_is_dropped_and_its_peer_left_alone() {
        let s = server();
        let client = agent(&format!("early-{}", rand::random::<u32>()));
        // The peer that the agent's hello adds, as if it came right after the lookup.
        let name = s.shared.agent.add_peer(&client.metadata()).unwrap();
        worker(&s).take(from(&name, put_request(1, &[0; 16])), false);
        assert!(s.shared.agent.peers().contains(&name), "its peer was removed");
        assert!(replies_within(&client, Duration::from_millis(300)).is_empty(), "it was answered");
    }

    /// Every client knows the server agent's secret, so another agent may introduce
    /// itself under a client's name: its requests, lacking that client's session
    /// token, must not move that client's memory (here: store it under a key of its
    /// choosing, to GET later).
    #[test]
    fn a_request_without_its_sessions_token_is_not_carried_out() {
        let s = server();
        let name = format!("victim-{}", rand::random::<u32>());
        let victim = agent(&name);
        let secret = victim.alloc(4096).unwrap();
        victim.register(MemKind::Dram, secret.addr(), 4096, 0).unwrap();
        let opened = s.shared.hello(&victim.metadata(), UNCHECKED).unwrap();
        let impostor = agent(&name);
        let server_agent = dial_server(&impostor, &s).unwrap();
        let put = |key: &[u8], first_id, token| {
            let buffer = wire::Buffer { kind: MemKind::Dram, addr: secret.addr(), len: 4096, dev: 0 };
            wire::Request::Put { first_id, ttl_ms: 0, items: vec![(key.to_vec(), buffer)] }.encode(token)
        };
        impostor.notify(&server_agent, put(b"forged", 1, &[0; 16])).unwrap();
        // The same connection with the session's token: taken, after the forged one.
        impostor.notify(&server_agent, put(b"genuine", 2, &opened.token)).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while !s.shared.index.lock().exists(b"genuine", s.shared.now_ms()) {
            assert!(Instant::now() < until, "the request with the session's token never ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!s.shared.index.lock().exists(b"forged", s.shared.now_ms()), "a forged request ran");
        assert_eq!(sessions(&s), 1);
    }
}
