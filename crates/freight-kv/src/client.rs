//! A client of the KV server: a session on the control plane, an engine agent of its
//! own, and a receive buffer registered with that agent (in shared memory, so that a
//! server on the same host writes values straight into it).
//!
//! A GET asks the server to write the value into the buffer; the reply arrives after
//! the bytes, so the value is there to read when [`Client::get_with`] returns it. A PUT
//! copies the value into the buffer and asks the server to read it from there. Where
//! the server reaches the client over tcp, requests and values take a direct
//! connection instead ([`crate::direct`]): the client reads a GET's value into the
//! same place in its buffer, and sends a PUT's from there. One request at a time per
//! client; threads use a client each.
//!
//! A call lasts [`ClientConfig::timeout`] at most: one deadline covers its wait for the
//! answer and any new session it opens. Only handing the request to the engine is
//! bounded by the engine's own timeouts instead: dialling the server's agent the first
//! time ([`AgentConfig::connect_timeout`]), and, for a server on the same host that does
//! not take its notifications, waiting for room in their queue
//! ([`AgentConfig::peer_timeout`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_core::{interrupt, Agent, AgentConfig, Error, MemKind, Result, SharedSegment};
use tonic::transport::Channel;

use tonic::service::interceptor::InterceptedService;

use crate::control::proto::kv_control_client::KvControlClient;
use crate::control::proto::*;
use crate::control::TokenSend;
use crate::wire::{self, Buffer, Outcome, Reply};

/// How a client connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The server's control plane: "http://[::1]:50051".
    pub server: String,
    /// Bytes of the receive buffer: the largest value a GET can fetch, and the most a
    /// batched PUT can send at once.
    pub buffer_bytes: u64,
    /// Shown in the server's logs; the agent's name adds the process id and a random
    /// suffix, so that many clients of one server stay distinct.
    pub name: String,
    pub engine: AgentConfig,
    /// The longest one call takes to get its answer, reconnecting to a server that went
    /// away included (see [`Client`] for what else may add to it). Connecting takes at
    /// most the longer of this and `connect_for`.
    pub timeout: Duration,
    /// How long to keep trying when the server does not accept connections yet (one
    /// starting up), or again after it went away (one restarting), within `timeout`.
    pub connect_for: Duration,
    /// The server's shared secret, if it was started with one.
    pub token: Option<String>,
    /// For an `https://` server: the certificate (PEM) of the authority that signed the
    /// server's, or the server's own when it signed itself (the system's roots are not
    /// consulted).
    pub tls_ca_pem: Option<Vec<u8>>,
    /// Take the direct connection the server offers a client it reaches over tcp
    /// ([`crate::direct`]); off, requests and values go through the engine there too.
    pub direct: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            server: format!("http://{}", crate::control::DEFAULT_LISTEN),
            buffer_bytes: 64 << 20,
            name: "freight-kv-client".into(),
            engine: AgentConfig::default(),
            timeout: Duration::from_secs(30),
            connect_for: Duration::from_secs(5),
            token: None,
            tls_ca_pem: None,
            direct: true,
        }
    }
}

const PEM_CERTIFICATE: &[u8] = b"-----BEGIN CERTIFICATE-----";

/// Whether the control plane's URL is https (else http). tonic takes an address without
/// a scheme too, and fails only when it dials, after `connect_for` of retries, with a
/// message that names no remedy.
fn check_url(url: &str) -> Result<bool> {
    use tonic::codegen::http::uri::{Scheme, Uri};
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "KV server address {url:?} {why}: write http://host:port (https://host:port for a server with TLS)"
        ))
    };
    let uri: Uri = url.parse().map_err(|_| bad("is not a URL"))?;
    if !matches!(uri.authority(), Some(a) if !a.host().is_empty()) {
        return Err(bad("names no host"));
    }
    match uri.scheme() {
        Some(s) if *s == Scheme::HTTPS => Ok(true),
        Some(s) if *s == Scheme::HTTP => Ok(false),
        Some(s) => Err(bad(&format!("has scheme {:?}", s.as_str()))),
        None => Err(bad("has no scheme")),
    }
}

/// The error for a value larger than the memory it was asked into.
pub fn too_small(value: u64, room: u64) -> Error {
    Error::InvalidArgument(format!("the value has {value} bytes; the output buffer has room for {room}"))
}

/// The receive buffer while it is pinned for GPU copies.
struct PinnedBuffer {
    owner: freight_cuda::pinned::Owner,
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        freight_cuda::pinned::release(self.owner);
    }
}

/// Server-side counters, as the control plane reports them.
pub type ServerStats = StatsReply;

pub struct Client {
    agent: Arc<Agent>,
    runtime: tokio::runtime::Runtime,
    rpc: Rpc,
    /// The server agent's engine name.
    server: String,
    /// The control plane's address and this client's name, for new sessions.
    url: String,
    name: String,
    client_id: u64,
    /// The session's secret, for Goodbye and in every request.
    session_token: wire::SessionToken,
    /// The server agent that may still carry out a request of this client whose answer
    /// never came (the connection broke while it waited): a new session with that same
    /// agent must not go on (see `call`).
    unsettled: Option<String>,
    /// Pins the buffer for GPU copies once one is asked for; unpins it before the buffer
    /// goes (fields drop in order).
    pinned: Option<PinnedBuffer>,
    /// This client's copy stream per GPU: clients of one process copy side by side
    /// instead of queueing on a shared stream.
    gpu_streams: Vec<(usize, Arc<freight_cuda::driver::Stream>)>,
    buffer: Arc<SharedSegment>,
    next_id: u64,
    timeout: Duration,
    reconnect_for: Duration,
    /// Why this client can take no more requests (one of them timed out).
    broken: Option<String>,
    /// Replies that arrived for requests other than the one awaited (late ones).
    early: HashMap<u64, Reply>,
    /// Whether to take a direct connection where the server offers one.
    take_direct: bool,
    /// The session's direct connection, where the server offered one.
    direct: Option<crate::direct::Link>,
}

impl Client {
    /// Registers a receive buffer and opens a session with the server.
    pub fn connect(config: ClientConfig) -> Result<Client> {
        let tls = check_url(&config.server)?;
        if config.buffer_bytes == 0 {
            return Err(Error::InvalidArgument("a client needs a receive buffer (buffer_bytes is 0)".into()));
        }
        let name = format!("{}-{}-{:08x}", config.name, std::process::id(), rand::random::<u32>());
        let remote = crate::reach::beyond_loopback(crate::reach::url_host(&config.server));
        let engine = crate::reach::data_plane(config.engine.clone(), remote);
        let agent = Arc::new(Agent::new(&name, engine)?);
        let len = usize::try_from(config.buffer_bytes)
            .map_err(|_| Error::InvalidArgument(format!("a buffer of {} bytes is too large", config.buffer_bytes)))?;
        let buffer = agent.alloc(len)?;
        agent.register(MemKind::Dram, buffer.addr(), config.buffer_bytes, 0)?;
        // One deadline for reaching the server and for its answer to the hello.
        let deadline = Instant::now() + config.timeout.max(config.connect_for);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Io(format!("cannot start the client's runtime: {e}")))?;
        let mut endpoint = Channel::from_shared(config.server.clone())
            .map_err(|e| Error::InvalidArgument(format!("server address {:?}: {e}", config.server)))?
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .timeout(config.timeout);
        if tls {
            let ca = config.tls_ca_pem.as_ref().ok_or_else(|| {
                Error::InvalidArgument(format!("{} is https: give the certificate authority to trust", config.server))
            })?;
            // Anything else would only fail at the handshake, retried for `connect_for`
            // and then reported as a server that cannot be reached.
            if !ca.windows(PEM_CERTIFICATE.len()).any(|w| w == PEM_CERTIFICATE) {
                return Err(Error::InvalidArgument(format!(
                    "the certificate authority to trust for {} holds no PEM certificate (\"-----BEGIN \
                     CERTIFICATE-----\")",
                    config.server
                )));
            }
            let tls =
                tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(ca));
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| Error::InvalidArgument(format!("TLS settings for {}: {e}", config.server)))?;
        }
        let until = (Instant::now() + config.connect_for).min(deadline);
        let channel = runtime.block_on(connect(endpoint, until)).map_err(|e| {
            Error::Io(format!(
                "cannot reach the KV server at {} (tried for {:?}): {e}",
                config.server, config.connect_for
            ))
        })?;
        let rpc = KvControlClient::with_interceptor(channel, TokenSend::new(config.token.as_deref())?);
        let mut client = Client {
            agent,
            runtime,
            rpc,
            server: String::new(),
            url: config.server.clone(),
            name: config.name.clone(),
            client_id: 0,
            session_token: [0; 16],
            unsettled: None,
            pinned: None,
            gpu_streams: Vec::new(),
            buffer,
            next_id: 1,
            timeout: config.timeout,
            reconnect_for: config.connect_for,
            broken: None,
            early: HashMap::new(),
            take_direct: config.direct,
            direct: None,
        };
        client.hello(deadline)?;
        Ok(client)
    }

    /// Opens a session: the server learns this client's agent, and this client the
    /// server's.
    fn hello(&mut self, deadline: Instant) -> Result<()> {
        let hello = HelloRequest {
            agent_metadata: self.agent.metadata(),
            client_name: self.name.clone(),
            wire_version: wire::VERSION.into(),
            agent_token: self.agent.config().token.clone().unwrap_or_default(),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let call = self.rpc.hello(hello);
        // Made inside the runtime: a timer needs its clock.
        let answer = self.runtime.block_on(async { tokio::time::timeout(left, call).await });
        let reply = match answer {
            Ok(answer) => answer.map_err(|e| rpc_error(&self.url, e))?.into_inner(),
            Err(_) => {
                return Err(Error::Timeout(format!("the KV server at {} did not answer within {left:?}", self.url)))
            }
        };
        if reply.wire_version != u32::from(wire::VERSION) {
            return Err(Error::Protocol(format!(
                "the KV server at {} speaks data-plane protocol version {} (0: older than this client, which speaks \
                 version {}): use the same freight release on both sides",
                self.url,
                reply.wire_version,
                wire::VERSION
            )));
        }
        if reply.agent_token.is_empty() {
            return Err(Error::Protocol(format!(
                "the KV server at {} names no token for its agent (a server older than this client, whose \
                 data-plane agents each require one): use the same freight release on both sides",
                self.url
            )));
        }
        let server = self.agent.add_peer_with_token(&reply.server_metadata, Some(&reply.agent_token))?;
        if server != reply.server_agent {
            return Err(Error::Protocol(format!(
                "the server's metadata names agent {server:?}, its hello {:?}",
                reply.server_agent
            )));
        }
        if !self.server.is_empty() && self.server != server {
            // A restarted server is a new agent: forget the old one.
            let _ = self.agent.remove_peer(&self.server);
        }
        self.server = server;
        self.client_id = reply.client_id;
        self.session_token = reply.session_token.as_slice().try_into().map_err(|_| {
            Error::Protocol(format!(
                "the KV server at {} handed out a session token of {} bytes (16 expected)",
                self.url,
                reply.session_token.len()
            ))
        })?;
        // A new session's direct connection, or none: the old one's session is over.
        self.direct = None;
        if self.take_direct && !reply.direct_addresses.is_empty() {
            let open = crate::direct::Open { client_id: self.client_id, session_token: self.session_token };
            match crate::direct::Link::open(&reply.direct_addresses, &open, deadline, self.timeout) {
                Ok(link) => self.direct = Some(link),
                // The engine still moves everything, only slower.
                Err(e) => tracing::warn!(server = %self.url, error = %e, "no direct connection to the KV server"),
            }
        }
        tracing::debug!(client_id = reply.client_id, server = %self.url, direct = self.direct.is_some(), "KV session opened");
        if self.unsettled.as_deref() == Some(self.server.as_str()) {
            let why = format!(
                "the connection to the KV server at {} broke while a request was under way, and the same server \
                 answered again: it may still carry that request out in this client's buffer; connect a new client",
                self.url
            );
            self.broken = Some(why.clone());
            return Err(Error::PeerDisconnected { peer: self.url.clone(), reason: why });
        }
        self.unsettled = None;
        Ok(())
    }

    /// After the server's agent went away: a new session with whatever server answers
    /// at the same address now (a restarted one starts empty), tried for a while but
    /// not past `deadline`.
    fn reconnect(&mut self, deadline: Instant) -> Result<()> {
        let until = (Instant::now() + self.reconnect_for).min(deadline);
        loop {
            match self.hello(deadline) {
                Ok(()) => {
                    tracing::info!(server = %self.url, "reconnected to the KV server");
                    return Ok(());
                }
                // The same server: trying again would not change that.
                Err(e) if self.broken.is_some() => return Err(e),
                Err(e @ (Error::InvalidArgument(_) | Error::Auth(_) | Error::Protocol(_))) => return Err(e),
                Err(e) if Instant::now() >= until => {
                    return Err(Error::PeerDisconnected {
                        peer: self.url.clone(),
                        reason: format!("lost the KV server and found none to open a new session with: {e}"),
                    })
                }
                Err(_) => {
                    std::thread::sleep(until.saturating_duration_since(Instant::now()).min(Duration::from_millis(50)))
                }
            }
        }
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.buffer.len() as u64
    }

    /// Whether requests and values take a direct connection to the server (see
    /// [`crate::direct`]) rather than the engine.
    pub fn direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Where this client's engine agent listens: the addresses the server's agent dials
    /// to move values. It answers no metadata request there, and with a server token
    /// it requires that token on every connection (see docs/kv.md, "Trust").
    pub fn engine_addresses(&self) -> Vec<String> {
        self.agent.addresses()
    }

    /// Stores `value` under `key`, expiring after `ttl` (zero: never). Returns the
    /// value's version.
    pub fn put(&mut self, key: &[u8], value: &[u8], ttl: Duration) -> Result<u64> {
        let mut results = self.put_batch(&[(key, value)], ttl)?.into_iter();
        results.next().unwrap_or_else(|| Err(Error::Protocol("the KV server answered a PUT with no outcome".into())))
    }

    /// Stores a value of `len` bytes that `fill` writes straight into the client's
    /// buffer (no copy of the caller's own). Returns the value's version.
    pub fn put_with(&mut self, key: &[u8], len: u64, ttl: Duration, fill: impl FnOnce(&mut [u8])) -> Result<u64> {
        if len > self.buffer_bytes() {
            return Err(Error::InvalidArgument(format!(
                "a value of {len} bytes does not fit the client's buffer of {} bytes",
                self.buffer_bytes()
            )));
        }
        // SAFETY: within the buffer (checked); exclusively borrowed through `self`.
        fill(unsafe { std::slice::from_raw_parts_mut(self.buffer.as_ptr(), len as usize) });
        let items = vec![(key.to_vec(), self.region(0, len))];
        let ttl_ms = ttl_ms(ttl);
        let reply = self.call(|first_id| wire::Request::Put { first_id, ttl_ms, items })?;
        match reply.outcomes.into_iter().next() {
            Some(Outcome::Stored { version }) => Ok(version),
            Some(other) => Err(self.unexpected(other)),
            None => Err(Error::Protocol("the server answered a PUT with no outcome".into())),
        }
    }

    /// Stores several values; one result per item. They go in one request, or in as few
    /// as keep each request within the engine's notification limit (see
    /// [`wire::notification_batches`]), one after the other: where one of those fails as
    /// a whole, so does the call, and the items of the requests before it are stored.
    pub fn put_batch(&mut self, items: &[(&[u8], &[u8])], ttl: Duration) -> Result<Vec<Result<u64>>> {
        let total: u64 = items.iter().map(|(_, v)| v.len() as u64).sum();
        if total > self.buffer_bytes() {
            return Err(Error::InvalidArgument(format!(
                "{total} bytes of values do not fit the client's buffer of {} bytes",
                self.buffer_bytes()
            )));
        }
        let mut at = 0usize;
        let mut wire_items = Vec::with_capacity(items.len());
        for (key, value) in items {
            // SAFETY: `at + value.len()` is within the buffer (checked above); the server
            // reads it only during this call.
            unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), self.buffer.as_ptr().add(at), value.len()) };
            wire_items.push((key.to_vec(), self.region(at as u64, value.len() as u64)));
            at += value.len();
        }
        let ttl_ms = ttl_ms(ttl);
        let mut results = Vec::with_capacity(items.len());
        let mut wire_items = wire_items.into_iter();
        for run in wire::notification_batches(items.iter().map(|(k, _)| k.len())) {
            let items: Vec<_> = wire_items.by_ref().take(run.len()).collect();
            let reply = self.call(|first_id| wire::Request::Put { first_id, ttl_ms, items })?;
            results.extend(reply.outcomes.into_iter().map(|o| match o {
                Outcome::Stored { version } => Ok(version),
                other => Err(self.unexpected(other)),
            }));
        }
        Ok(results)
    }

    /// The value of `key`, copied out of the receive buffer.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.get_with(key, |v| v.to_vec())
    }

    /// Runs `f` on the value of `key` where the server wrote it, in the receive buffer
    /// (no copy); `None` when there is no such key.
    pub fn get_with<R>(&mut self, key: &[u8], f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        let whole = self.region(0, self.buffer_bytes());
        let reply = self.call(|first_id| wire::Request::Get { first_id, items: vec![(key.to_vec(), whole)] })?;
        match reply.outcomes.into_iter().next() {
            Some(Outcome::Found { len, .. }) => Ok(Some(f(self.view(0, len, self.buffer_bytes())?))),
            Some(Outcome::Missing) => Ok(None),
            Some(other) => Err(self.unexpected(other)),
            None => Err(Error::Protocol("the server answered a GET with no outcome".into())),
        }
    }

    /// Copies the value of `key` into GPU memory: `capacity` bytes at device address
    /// `dst` on GPU `device` (as this process numbers them); returns the value's length,
    /// or `None` when there is no such key. The server writes the value into the
    /// receive buffer, pinned at the first call, and one copy-engine transfer moves it to
    /// the GPU; it has landed when this returns. The caller orders its own GPU work on
    /// that memory before the call (synchronize its stream), as for any transfer.
    pub fn get_to_gpu(&mut self, key: &[u8], dst: u64, capacity: u64, device: usize) -> Result<Option<u64>> {
        let gpu = freight_cuda::Device::get(device)?;
        if self.pinned.is_none() {
            let owner = freight_cuda::pinned::Owner::Memory(self.buffer.addr());
            freight_cuda::pinned::pin(gpu, self.buffer.addr(), self.buffer_bytes(), owner)?;
            self.pinned = Some(PinnedBuffer { owner });
        }
        let _ctx = gpu.bind()?;
        let stream = match self.gpu_streams.iter().find(|(d, _)| *d == device) {
            Some((_, s)) => s.clone(),
            None => {
                let s = Arc::new(freight_cuda::driver::Stream::new(gpu)?);
                self.gpu_streams.push((device, s.clone()));
                s
            }
        };
        self.get_with(key, |value| {
            if value.len() as u64 > capacity {
                return Err(too_small(value.len() as u64, capacity));
            }
            // SAFETY: the caller vouches for the destination; the source is the pinned
            // receive buffer, which outlives the copy (it is waited for right here).
            unsafe { stream.copy(dst, value.as_ptr() as u64, value.len())? };
            stream.synchronize()?;
            Ok(value.len() as u64)
        })?
        .transpose()
    }

    /// Several values, in one request or in as few as keep each within the engine's
    /// notification limit (see [`wire::notification_batches`]), one after the other: the
    /// buffer is shared out evenly between the keys of a request, so each value must fit
    /// its share. Where one request fails as a whole, so does the call.
    pub fn get_batch(&mut self, keys: &[&[u8]]) -> Result<Vec<Result<Option<Vec<u8>>>>> {
        let mut values = Vec::with_capacity(keys.len());
        for run in wire::notification_batches(keys.iter().map(|k| k.len())) {
            values.extend(self.get_request(&keys[run])?);
        }
        Ok(values)
    }

    /// Several values in one request (see [`Client::get_batch`]).
    fn get_request(&mut self, keys: &[&[u8]]) -> Result<Vec<Result<Option<Vec<u8>>>>> {
        let share = self.buffer_bytes() / keys.len() as u64 / crate::pool::ALIGN * crate::pool::ALIGN;
        if share == 0 {
            return Err(Error::InvalidArgument(format!(
                "{} keys at once do not fit the client's buffer of {} bytes",
                keys.len(),
                self.buffer_bytes()
            )));
        }
        let items: Vec<_> =
            keys.iter().enumerate().map(|(i, k)| (k.to_vec(), self.region(i as u64 * share, share))).collect();
        let reply = self.call(|first_id| wire::Request::Get { first_id, items })?;
        let mut values = Vec::with_capacity(keys.len());
        for (i, outcome) in reply.outcomes.into_iter().enumerate() {
            values.push(match outcome {
                // A value past its share would be another key's bytes: the whole reply is suspect.
                Outcome::Found { len, .. } => Ok(Some(self.view(i as u64 * share, len, share)?.to_vec())),
                Outcome::Missing => Ok(None),
                other => Err(self.unexpected(other)),
            });
        }
        Ok(values)
    }

    pub fn exists(&mut self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        self.check_usable()?;
        let request = KeysRequest { keys: keys.iter().map(|k| k.to_vec()).collect() };
        let reply = self.runtime.block_on(self.rpc.exists(request)).map_err(|e| rpc_error(&self.url, e))?;
        Ok(reply.into_inner().exists)
    }

    /// Deletes the keys; says for each whether it was there.
    pub fn delete(&mut self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        self.check_usable()?;
        let request = KeysRequest { keys: keys.iter().map(|k| k.to_vec()).collect() };
        let reply = self.runtime.block_on(self.rpc.delete(request)).map_err(|e| rpc_error(&self.url, e))?;
        Ok(reply.into_inner().deleted)
    }

    pub fn stats(&mut self) -> Result<ServerStats> {
        self.check_usable()?;
        let reply = self.runtime.block_on(self.rpc.stats(StatsRequest {})).map_err(|e| rpc_error(&self.url, e))?;
        Ok(reply.into_inner())
    }

    /// Ends the session (dropping the client without it works too: the server notices
    /// the lost connection).
    pub fn close(mut self) -> Result<()> {
        let request = GoodbyeRequest { client_id: self.client_id, session_token: self.session_token.to_vec() };
        self.runtime.block_on(self.rpc.goodbye(request)).map_err(|e| rpc_error(&self.url, e))?;
        self.agent.close();
        Ok(())
    }

    fn region(&self, offset: u64, len: u64) -> Buffer {
        Buffer { kind: MemKind::Dram, addr: self.buffer.addr() + offset, len, dev: 0 }
    }

    /// The `len` bytes at `offset` of the buffer, where the server says it put a value
    /// into the `room` bytes there.
    fn view(&self, offset: u64, len: u64, room: u64) -> Result<&[u8]> {
        match offset.checked_add(len) {
            Some(end) if len <= room && end <= self.buffer_bytes() => {}
            _ => {
                return Err(Error::Protocol(format!(
                    "the KV server reported a value of {len} bytes where it had room for {room}"
                )))
            }
        }
        // SAFETY: within the buffer (checked); the server wrote it before its reply
        // arrived, and nothing writes it while this client is borrowed.
        Ok(unsafe { std::slice::from_raw_parts(self.buffer.as_ptr().add(offset as usize), len as usize) })
    }

    /// Whether requests can still be made: not after one timed out (see
    /// [`ClientConfig::timeout`]); only [`Client::close`] is left then.
    pub fn usable(&self) -> bool {
        self.broken.is_none()
    }

    fn check_usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::InvalidState(why.clone())),
            None => Ok(()),
        }
    }

    /// Sends a request made with its first id, and waits for its reply: one outcome per
    /// item.
    fn call(&mut self, make: impl FnOnce(u64) -> wire::Request) -> Result<Reply> {
        self.check_usable()?;
        let deadline = Instant::now() + self.timeout;
        let request = make(self.next_id);
        let items = request.len();
        self.next_id += items.max(1) as u64;
        // A connection known broken before anything goes out, or an earlier request left
        // unsettled: a new session first (`hello` refuses to go on where that request
        // may still run).
        if self.unsettled.is_some() || self.agent.check_peer(&self.server).is_err() {
            self.reconnect(deadline)?;
        }
        let direct = self.direct.is_some();
        let reply = match self.exchange(&request, deadline) {
            // Through the engine, the request may have reached the server: only another
            // server (a restarted one, which has none of this client's requests) gets it
            // again, so that it runs at most once per server. The same server may still
            // be carrying it out: a PUT reading the buffer that the caller refills next,
            // a GET writing into it. A direct connection is different: the server
            // touches the client's values only through it, so once it is closed (a
            // session the server ended, say) the request goes again to whichever server
            // answers, the same one included (a PUT it had stored is stored again).
            Err(Error::PeerDisconnected { .. } | Error::UnknownPeer(_)) => {
                if !direct {
                    self.unsettled = Some(self.server.clone());
                }
                self.reconnect(deadline)?;
                self.exchange(&request, deadline)?
            }
            other => other?,
        };
        if reply.outcomes.len() == items {
            return Ok(reply);
        }
        match reply.outcomes.as_slice() {
            // The server could not read the request (FailCode::Protocol): no item ran.
            [Outcome::Failed { code, error }] => Err(code.error(&self.server, error.clone())),
            _ => Err(Error::Protocol(format!(
                "the KV server answered a request of {items} items with {} outcomes",
                reply.outcomes.len()
            ))),
        }
    }

    /// Sends a request and takes its reply: on the direct connection, else through the
    /// engine.
    fn exchange(&mut self, request: &wire::Request, deadline: Instant) -> Result<Reply> {
        let Some(mut link) = self.direct.take() else {
            self.agent.notify(&self.server, request.encode(&self.session_token))?;
            return self.wait_reply(request.first_id(), deadline);
        };
        match self.exchange_direct(&mut link, request, deadline) {
            Ok(reply) => {
                self.direct = Some(link);
                Ok(reply)
            }
            // The connection stops mid-turn: it goes (a new session opens another).
            Err(e) => {
                if !matches!(e, Error::PeerDisconnected { .. }) {
                    // As after a timeout on the engine's path: the same session cannot go on.
                    self.broken = Some(format!(
                        "a request to the KV server at {} failed partway ({e}); connect a new client",
                        self.url
                    ));
                }
                Err(e)
            }
        }
    }

    fn exchange_direct(
        &self,
        link: &mut crate::direct::Link,
        request: &wire::Request,
        deadline: Instant,
    ) -> Result<Reply> {
        let body = request.encode(&self.session_token);
        match request {
            wire::Request::Put { items, .. } => {
                let values = items.iter().map(|(_, b)| self.own_bytes(b)).collect::<Result<Vec<_>>>()?;
                link.send(&body, &values)?;
            }
            wire::Request::Get { .. } => link.send(&body, &[])?,
        }
        let reply = link.receive(deadline)?;
        if reply.first_id != request.first_id() {
            return Err(Error::Protocol(format!(
                "the KV server answered request {} on the direct connection where {} was asked",
                reply.first_id,
                request.first_id()
            )));
        }
        if let wire::Request::Get { items, .. } = request {
            let found = reply.outcomes.iter().filter(|o| matches!(o, Outcome::Found { .. })).count();
            if found > 0 && reply.outcomes.len() != items.len() {
                return Err(Error::Protocol(
                    "the KV server found values for a GET it did not answer item by item".into(),
                ));
            }
            for ((_, buffer), outcome) in items.iter().zip(&reply.outcomes) {
                if let Outcome::Found { len, .. } = outcome {
                    if *len > buffer.len {
                        return Err(Error::Protocol(format!(
                            "the KV server sent a value of {len} bytes where it had room for {}",
                            buffer.len
                        )));
                    }
                    let offset = buffer.addr.wrapping_sub(self.buffer.addr());
                    self.view(offset, *len, buffer.len)?;
                    // SAFETY: within this client's own buffer (checked just above), which
                    // nothing else touches while the client is borrowed for the call.
                    let into = unsafe {
                        std::slice::from_raw_parts_mut(self.buffer.as_ptr().add(offset as usize), *len as usize)
                    };
                    link.read(into, deadline)?;
                }
            }
        }
        Ok(reply)
    }

    /// The bytes of this client's buffer that `b` names.
    fn own_bytes(&self, b: &Buffer) -> Result<&[u8]> {
        let offset = b.addr.wrapping_sub(self.buffer.addr());
        self.view(offset, b.len, b.len)
    }

    fn wait_reply(&mut self, first_id: u64, deadline: Instant) -> Result<Reply> {
        if let Some(r) = self.early.remove(&first_id) {
            return Ok(r);
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The server may still carry the request out later and write into the
                // buffer that the next request uses: this client is done.
                self.broken = Some(format!(
                    "a request to the KV server at {} timed out and may still write into this client's buffer; connect a new client",
                    self.url
                ));
                return Err(Error::Timeout(format!(
                    "no answer from the KV server within {:?}; this client is closed now, as the server may \
                     still carry the request out in its buffer: connect a new one",
                    self.timeout
                )));
            }
            let mut answer = None;
            for n in crate::notif_wait::next_notifs(&self.agent, left.min(Duration::from_millis(100)), || false) {
                match Reply::decode(&n.msg) {
                    Some(Ok(r)) if r.first_id == first_id && answer.is_none() => answer = Some(r),
                    Some(Ok(r)) => self.keep_other(r),
                    Some(Err(e)) => tracing::warn!(error = %e, "dropped a malformed reply"),
                    None if n.msg == wire::WELCOME => {}
                    None => tracing::debug!(from = %n.from, "ignored a notification that is no KV reply"),
                }
            }
            if let Some(r) = answer {
                return Ok(r);
            }
            self.agent.check_peer(&self.server)?;
            if let Err(e) = interrupt::check() {
                // As after a timeout: the server may still carry the request out.
                self.broken = Some(format!(
                    "a request to the KV server at {} was interrupted and may still write into this client's buffer; connect a new client",
                    self.url
                ));
                return Err(e);
            }
        }
    }

    /// Keeps a reply to a request other than the one awaited (an answer that came after
    /// its request timed out) a while; drops one to a request this client never sent: it
    /// answers someone else's doing, and kept, it would pass for the answer to the
    /// request that gets its id later.
    fn keep_other(&mut self, r: Reply) {
        if r.first_id >= self.next_id {
            tracing::warn!(
                first_id = r.first_id,
                next_id = self.next_id,
                "dropped a reply to no request of this client"
            );
        } else if self.early.len() < 1024 {
            self.early.insert(r.first_id, r);
        }
    }

    fn unexpected(&self, outcome: Outcome) -> Error {
        match outcome {
            Outcome::TooLarge { value, buffer } => Error::InvalidArgument(format!(
                "the value has {value} bytes; the client's buffer for it has {buffer} (raise the buffer size)"
            )),
            Outcome::Failed { code, error } => code.error(&self.server, error),
            other => Error::Protocol(format!("unexpected answer from the KV server: {other:?}")),
        }
    }
}

type Rpc = KvControlClient<InterceptedService<Channel, TokenSend>>;

/// An error and what caused it ("transport error" alone says little: the cause says
/// "connection refused" or which certificate check failed).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// Connects, trying again until `until`; the error says why the last try failed.
async fn connect(endpoint: tonic::transport::Endpoint, until: Instant) -> std::result::Result<Channel, String> {
    let mut pause = Duration::from_millis(20);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let why = match tokio::time::timeout(left, endpoint.connect()).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => with_causes(&e),
            Err(_) => "no connection in time".to_string(),
        };
        if Instant::now() + pause >= until {
            return Err(why);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Whole milliseconds, rounded up: a TTL under a millisecond must not become 0 ("never").
fn ttl_ms(ttl: Duration) -> u64 {
    ttl.as_nanos().div_ceil(1_000_000).min(u64::MAX as u128) as u64
}

fn rpc_error(server: &str, e: tonic::Status) -> Error {
    match e.code() {
        tonic::Code::InvalidArgument => Error::InvalidArgument(e.message().to_string()),
        tonic::Code::ResourceExhausted => Error::NoSpace(e.message().to_string()),
        tonic::Code::Unauthenticated => Error::Auth(e.message().to_string()),
        tonic::Code::FailedPrecondition => Error::Protocol(e.message().to_string()),
        // A call that ran out of time is cancelled by the client's own deadline.
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
            Error::Timeout(format!("the KV server at {server}: {}", e.message()))
        }
        _ => Error::PeerDisconnected { peer: server.to_string(), reason: format!("{}: {}", e.code(), e.message()) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::test_support::{test_config, test_server as server};
    use crate::server::{Server, ServerConfig};

    fn client(server: &Server) -> Client {
        Client::connect(ClientConfig {
            server: server.url(),
            buffer_bytes: 1 << 16,
            timeout: Duration::from_secs(10),
            ..Default::default()
        })
        .unwrap()
    }

    /// Holds the server's index for `how_long` (its worker waits, as on a long
    /// transfer); returns once it is held.
    fn stall_worker(s: &Server, how_long: Duration) -> std::thread::JoinHandle<()> {
        let shared = s.shared().clone();
        let (stalled, is_stalled) = std::sync::mpsc::channel();
        let stall = std::thread::spawn(move || {
            let _index = shared.index.lock();
            stalled.send(()).unwrap();
            std::thread::sleep(how_long);
        });
        is_stalled.recv().unwrap();
        stall
    }

    #[test]
    fn a_connection_lost_mid_request_to_a_server_that_answers_again_ends_the_call_and_the_client() {
        let s = server();
        let mut c = client(&s);
        c.put(b"k", b"first", Duration::ZERO).unwrap();
        // The server's worker stalls (as on a long transfer) while the request is out...
        let stall = stall_worker(&s, Duration::from_millis(1500));
        // ...and the client's connection to it breaks, though the server lives on.
        let (agent, server) = (c.agent.clone(), c.server.clone());
        let cut = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            agent.remove_peer(&server).unwrap();
        });
        let started = Instant::now();
        let e = c.put(b"k", b"second", Duration::ZERO).unwrap_err();
        assert!(started.elapsed() < Duration::from_millis(1500), "it did not wait for the stalled server");
        assert!(matches!(&e, Error::PeerDisconnected { reason, .. } if reason.contains("same server")), "{e}");
        assert!(!c.usable(), "the server may still read this client's buffer: the client is done");
        let e = c.get(b"k").unwrap_err();
        assert!(matches!(&e, Error::InvalidState(m) if m.contains("new client")), "{e}");
        cut.join().unwrap();
        stall.join().unwrap();
        // The request ran once, once the server went on.
        let mut other = client(&s);
        let deadline = Instant::now() + Duration::from_secs(5);
        while other.get(b"k").unwrap().as_deref() != Some(&b"second"[..]) {
            assert!(Instant::now() < deadline, "the PUT in flight did not finish");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(s.stats().keys, 1);
        c.close().unwrap();
    }

    #[test]
    fn an_interrupted_call_ends_at_once_and_leaves_the_client_unusable() {
        let s = server();
        let mut c = client(&s);
        // The server's worker stalls, so the answer does not come before the interrupt.
        let stall = stall_worker(&s, Duration::from_millis(1000));
        let started = Instant::now();
        let e = interrupt::interruptible(|| true, || c.put(b"k", b"v", Duration::ZERO).unwrap_err());
        assert!(matches!(e, Error::Interrupted(_)), "{e}");
        assert!(started.elapsed() < Duration::from_millis(900), "it waited for the stalled server");
        assert!(!c.usable(), "the server may still read this client's buffer: the client is done");
        stall.join().unwrap();
    }

    #[test]
    fn a_connection_found_lost_before_sending_is_made_again_and_the_request_goes_once() {
        let s = server();
        let mut c = client(&s);
        c.put(b"k", b"before", Duration::ZERO).unwrap();
        c.agent.remove_peer(&c.server).unwrap();
        c.put(b"k", b"after", Duration::ZERO).unwrap();
        assert!(c.usable());
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"after"[..]));
    }

    /// A server that ends a client's session (its sweep found the server's connection
    /// to the client broken) hangs up the client's connections too: the client opens a
    /// new session before its next request, instead of sending it into no session and
    /// waiting out its timeout.
    /// A session the server ended closes its direct connection: the client's next
    /// request finds it closed (or its engine connection gone, whichever it sees
    /// first), opens a new session and connection, and goes there.
    #[test]
    fn a_session_the_server_ended_gets_a_new_direct_connection_before_the_next_request() {
        let s = server();
        let tcp = freight_core::TransportKind::Tcp;
        let engine = AgentConfig { require: Some(tcp), transports: vec![tcp], ..Default::default() };
        let mut c =
            Client::connect(ClientConfig { server: s.url(), buffer_bytes: 1 << 16, engine, ..Default::default() })
                .unwrap();
        assert!(c.direct());
        c.put(b"k", b"before", Duration::ZERO).unwrap();
        let first = c.client_id;
        s.shared().end_session_of(c.agent.name(), "test");
        // Whether or not the client has noticed yet.
        c.put(b"k", b"after", Duration::ZERO).unwrap();
        assert!(c.usable() && c.direct());
        assert_ne!(c.client_id, first, "a new session");
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"after"[..]));
    }

    #[test]
    fn a_session_the_server_ended_is_opened_again_before_the_next_request() {
        let s = server();
        let mut c = client(&s);
        c.put(b"k", b"before", Duration::ZERO).unwrap();
        s.shared().end_session_of(c.agent.name(), "test");
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.agent.check_peer(&c.server).is_ok() {
            assert!(Instant::now() < deadline, "the client never learnt its session ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        let started = Instant::now();
        c.put(b"k", b"after", Duration::ZERO).unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(c.usable());
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"after"[..]));
    }

    /// Sends this client a reply for its next request, as a misbehaving server would.
    fn forge(s: &Server, c: &Client, outcomes: Vec<Outcome>) {
        let reply = Reply { first_id: c.next_id, outcomes };
        s.shared().agent.notify(c.agent.name(), reply.encode()).unwrap();
    }

    #[test]
    fn a_reply_that_makes_no_sense_is_a_protocol_error_not_a_panic() {
        let s = server();
        let mut c = client(&s);
        c.put(b"k", b"v", Duration::ZERO).unwrap();
        let beyond = c.buffer_bytes() + 1;
        forge(&s, &c, vec![Outcome::Found { len: beyond, version: 1 }]);
        assert!(matches!(c.get(b"k"), Err(Error::Protocol(_))), "a value past the buffer");
        forge(&s, &c, vec![]);
        assert!(matches!(c.put(b"k", b"v", Duration::ZERO), Err(Error::Protocol(_))), "no outcome");
        forge(&s, &c, vec![Outcome::Missing]);
        assert!(matches!(c.get_batch(&[b"a", b"b"]), Err(Error::Protocol(_))), "one outcome for two keys");
        forge(&s, &c, vec![Outcome::Found { len: c.buffer_bytes() / 2 + 64, version: 1 }, Outcome::Missing]);
        assert!(matches!(c.get_batch(&[b"a", b"b"]), Err(Error::Protocol(_))), "a value past its share");
        // One failure for a whole request: the server could not read it.
        forge(&s, &c, vec![Outcome::Failed { code: wire::FailCode::Protocol, error: "cut short".into() }]);
        let e = c.get_batch(&[b"a", b"b"]).unwrap_err();
        assert!(matches!(&e, Error::Protocol(m) if m.contains("cut short")), "{e}");
        assert!(c.usable());
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]), "real replies still come through");
    }

    /// A reply with the id of a request not made yet did not answer this client (the
    /// server answered another agent under its name, say): kept, it would pass for the
    /// answer to the request that gets that id.
    #[test]
    fn a_reply_to_a_request_never_sent_is_dropped() {
        let s = server();
        let mut c = client(&s);
        let reply = Reply {
            first_id: c.next_id + 1,
            outcomes: vec![Outcome::Failed { code: wire::FailCode::Protocol, error: "not the server's".into() }],
        };
        s.shared().agent.notify(c.agent.name(), reply.encode()).unwrap();
        c.put(b"k", b"v", Duration::ZERO).unwrap();
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]), "the GET got that reply");
    }

    /// Keys of `len` bytes, each its number and then padding.
    fn long_keys(n: usize, len: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| format!("{i:0len$}").into_bytes()).collect()
    }

    #[test]
    fn a_batch_past_the_engines_notification_limit_goes_as_several_requests() {
        let s = Server::start(ServerConfig { memory_bytes: 64 << 20, ..test_config() }).unwrap();
        let mut c =
            Client::connect(ClientConfig { server: s.url(), buffer_bytes: 1 << 20, ..Default::default() }).unwrap();
        // Small values under long keys: some 20 MB of request.
        let keys = long_keys(5000, wire::MAX_KEY - 96);
        let values: Vec<[u8; 8]> = (0..keys.len() as u64).map(u64::to_le_bytes).collect();
        let items: Vec<(&[u8], &[u8])> = keys.iter().zip(&values).map(|(k, v)| (&k[..], &v[..])).collect();
        let stored = c.put_batch(&items, Duration::ZERO).unwrap();
        assert_eq!(stored.len(), keys.len());
        assert!(stored.iter().all(Result::is_ok), "{:?}", stored.iter().find(|r| r.is_err()));
        assert_eq!(s.stats().keys, keys.len() as u64);
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let got = c.get_batch(&refs).unwrap();
        assert_eq!(got.len(), keys.len());
        for (value, got) in values.iter().zip(got) {
            assert_eq!(got.unwrap().as_deref(), Some(&value[..]));
        }
    }

    /// The environment variable that makes `a_client_process_that_takes_no_answers` run,
    /// in a process of its own: "URL FILE".
    const STALLED_CLIENT: &str = "FREIGHT_KV_TEST_STALLED_CLIENT";

    /// The stalled client of the test below, in a process of its own: connects to the
    /// server at URL, sends requests whose answers overflow its notification queue (each
    /// item an empty key, answered by a failure with its reason), writes FILE, and waits
    /// for the test to stop it and then kill it. Not a test by itself: ignored in test
    /// runs, started by the test with `--ignored`, and a failure without its variable.
    #[test]
    #[ignore = "the stalled client process of a_client_that_takes_no_answers_..., which starts it"]
    fn a_client_process_that_takes_no_answers() {
        let spec = std::env::var(STALLED_CLIENT)
            .unwrap_or_else(|_| panic!("{STALLED_CLIENT} is unset: this is a child process of another test"));
        let (url, sent) = spec.split_once(' ').unwrap();
        let mut c = Client::connect(ClientConfig { server: url.into(), ..Default::default() }).unwrap();
        let items = 30_000;
        for _ in 0..3 {
            let request = wire::Request::Get { first_id: c.next_id, items: vec![(Vec::new(), c.region(0, 1)); items] };
            c.next_id += items as u64;
            c.agent.notify(&c.server, request.encode(&c.session_token)).unwrap();
        }
        std::fs::write(sent, b"sent").unwrap();
        std::thread::sleep(Duration::from_secs(600));
    }

    /// A child process, killed when dropped.
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Child {
        /// Stops it (SIGSTOP); returns once it is stopped.
        fn stop(&self) {
            let pid = self.0.id().to_string();
            assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
            let stat = format!("/proc/{pid}/stat");
            // The state follows the command's name, in parentheses.
            let state = || std::fs::read_to_string(&stat).unwrap().rsplit_once(") ").unwrap().1.chars().next();
            while state() != Some('T') {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// A client on this host whose process takes no notifications (stopped, here)
    /// fills its queue: each answer to it would wait out the server's peer timeout for
    /// room, on the one worker that serves every client. The first that cannot be
    /// delivered ends its session, so the others fail at once.
    #[test]
    fn a_client_that_takes_no_answers_loses_its_session_instead_of_holding_up_the_others() {
        let peer_timeout = Duration::from_secs(1);
        let engine = AgentConfig { peer_timeout, ..Default::default() };
        let s = Server::start(ServerConfig { engine, ..test_config() }).unwrap();
        let mut other = client(&s);
        let sent = std::env::temp_dir().join(format!(
            "freight-kv-stalled-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        // The worker waits on the index until the stalled client is stopped.
        let index = s.shared().index.lock();
        let stalled = Child(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "--ignored", "client::tests::a_client_process_that_takes_no_answers"])
                .env(STALLED_CLIENT, format!("{} {}", s.url(), sent.display()))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !sent.exists() {
            assert!(Instant::now() < deadline, "the stalled client never sent its requests");
            std::thread::sleep(Duration::from_millis(10));
        }
        stalled.stop();
        drop(index);
        let started = Instant::now();
        other.put(b"k", b"v", Duration::ZERO).unwrap();
        let waited = started.elapsed();
        assert!(waited < peer_timeout * 2, "the other client waited {waited:?} behind the stalled one");
        assert_eq!(s.shared().clients.lock().len(), 1, "the stalled client's session ended");
        let _ = std::fs::remove_file(&sent);
    }

    #[test]
    fn an_address_that_is_not_an_http_url_is_refused_before_anything_is_tried() {
        for url in ["127.0.0.1:50051", "localhost:50051", "ftp://127.0.0.1:50051", "http://", "not a url"] {
            let started = Instant::now();
            let e = Client::connect(ClientConfig { server: url.into(), ..Default::default() }).err().unwrap();
            assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("http://host:port")), "{url}: {e}");
            assert!(started.elapsed() < ClientConfig::default().connect_for, "{url}: it was dialled");
        }
        let s = server();
        let upper = s.url().replacen("http", "HTTP", 1);
        let mut c = Client::connect(ClientConfig { server: upper, ..Default::default() }).unwrap();
        assert!(c.stats().is_ok(), "schemes are case-insensitive");
    }

    #[test]
    fn a_certificate_authority_that_is_not_pem_is_refused_before_anything_is_tried() {
        let e = Client::connect(ClientConfig {
            server: "https://127.0.0.1:1".into(),
            tls_ca_pem: Some(b"not a certificate".to_vec()),
            ..Default::default()
        })
        .err()
        .unwrap();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("no PEM certificate")), "{e}");
    }

    #[test]
    fn a_server_of_another_protocol_version_is_refused_by_name() {
        let s = server();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let agent = Agent::new(&format!("old-client-{}", rand::random::<u32>()), AgentConfig::default()).unwrap();
        for version in [0, u32::from(wire::VERSION) + 1] {
            let status = runtime
                .block_on(async {
                    let mut rpc = KvControlClient::connect(s.url()).await.unwrap();
                    let hello = HelloRequest {
                        agent_metadata: agent.metadata(),
                        client_name: "old".into(),
                        wire_version: version,
                        ..HelloRequest::default()
                    };
                    rpc.hello(hello).await
                })
                .unwrap_err();
            assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
            let e = rpc_error(&s.url(), status);
            assert!(matches!(&e, Error::Protocol(m) if m.contains("protocol version")), "{e}");
        }
        assert_eq!(s.stats().keys, 0);
    }
}
