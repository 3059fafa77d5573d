//! A client of the KV server: a session on the control plane, an engine agent of its
//! own, and a receive buffer registered with that agent (in shared memory, so that a
//! server on the same host writes values straight into it).
//!
//! A GET asks the server to write the value into the buffer; the reply arrives after
//! the bytes, so the value is there to read when [`Client::get_with`] returns it. A PUT
//! copies the value into the buffer and asks the server to read it from there. One
//! request at a time per client; threads use a client each.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use freight_core::{cuda, Agent, AgentConfig, Error, MemKind, Result, SharedSegment};
use tonic::transport::Channel;

use tonic::service::interceptor::InterceptedService;

use crate::rpc::proto::kv_control_client::KvControlClient;
use crate::rpc::proto::*;
use crate::rpc::TokenSend;
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
    /// Longest wait for any answer from the server.
    pub timeout: Duration,
    /// How long to keep trying when the server does not accept connections yet (one
    /// starting up), or again after it went away (one restarting).
    pub connect_for: Duration,
    /// The server's shared secret, if it was started with one.
    pub token: Option<String>,
    /// For an `https://` server: the certificate (PEM) of the authority that signed the
    /// server's, or the server's own when it signed itself (the system's roots are not
    /// consulted).
    pub tls_ca_pem: Option<Vec<u8>>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            server: format!("http://{}", crate::server::DEFAULT_LISTEN),
            buffer_bytes: 64 << 20,
            name: "freight-kv-client".into(),
            engine: AgentConfig::default(),
            timeout: Duration::from_secs(30),
            connect_for: Duration::from_secs(5),
            token: None,
            tls_ca_pem: None,
        }
    }
}

/// The error for a value larger than the memory it was asked into.
pub fn too_small(value: u64, room: u64) -> Error {
    Error::InvalidArgument(format!("the value has {value} bytes; the output buffer has room for {room}"))
}

/// The receive buffer while it is pinned for GPU copies.
struct PinnedBuffer {
    owner: cuda::pinned::Owner,
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        cuda::pinned::release(self.owner);
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
    /// Pins the buffer for GPU copies once one is asked for; unpins it before the buffer
    /// goes (fields drop in order).
    pinned: Option<PinnedBuffer>,
    /// This client's copy stream per GPU: clients of one process copy side by side
    /// instead of queueing on a shared stream.
    gpu_streams: Vec<(usize, Arc<cuda::driver::Stream>)>,
    buffer: Arc<SharedSegment>,
    next_id: u64,
    timeout: Duration,
    reconnect_for: Duration,
    /// Why this client can take no more requests (one of them timed out).
    broken: Option<String>,
    /// Replies that arrived for requests other than the one awaited (late ones).
    early: HashMap<u64, Reply>,
}

impl Client {
    /// Registers a receive buffer and opens a session with the server.
    pub fn connect(config: ClientConfig) -> Result<Client> {
        if config.buffer_bytes == 0 {
            return Err(Error::InvalidArgument("a client needs a receive buffer (buffer_bytes is 0)".into()));
        }
        let name = format!("{}-{}-{:08x}", config.name, std::process::id(), rand::random::<u32>());
        let remote = crate::reach::beyond_loopback(crate::reach::url_host(&config.server));
        let engine = crate::reach::open_to_other_hosts(config.engine.clone(), remote);
        let agent = Arc::new(Agent::new(&name, engine)?);
        let len = usize::try_from(config.buffer_bytes)
            .map_err(|_| Error::InvalidArgument(format!("a buffer of {} bytes is too large", config.buffer_bytes)))?;
        let buffer = agent.alloc(len)?;
        agent.register(MemKind::Dram, buffer.addr(), config.buffer_bytes, 0)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Io(format!("cannot start the client's runtime: {e}")))?;
        let mut endpoint = Channel::from_shared(config.server.clone())
            .map_err(|e| Error::InvalidArgument(format!("server address {:?}: {e}", config.server)))?
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .timeout(config.timeout);
        if config.server.starts_with("https://") {
            let ca = config.tls_ca_pem.as_ref().ok_or_else(|| {
                Error::InvalidArgument(format!("{} is https: give the certificate authority to trust", config.server))
            })?;
            let tls =
                tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(ca));
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| Error::InvalidArgument(format!("TLS settings for {}: {e}", config.server)))?;
        }
        let channel = runtime.block_on(connect(endpoint, config.connect_for)).map_err(|e| {
            Error::Io(format!(
                "cannot reach the KV server at {} (tried for {:?}): {}",
                config.server,
                config.connect_for,
                with_causes(&e)
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
            pinned: None,
            gpu_streams: Vec::new(),
            buffer,
            next_id: 1,
            timeout: config.timeout,
            reconnect_for: config.connect_for,
            broken: None,
            early: HashMap::new(),
        };
        client.hello()?;
        Ok(client)
    }

    /// Opens a session: the server learns this client's agent, and this client the
    /// server's.
    fn hello(&mut self) -> Result<()> {
        let hello = HelloRequest { agent_metadata: self.agent.metadata(), client_name: self.name.clone() };
        let reply = self.runtime.block_on(self.rpc.hello(hello)).map_err(|e| rpc_error(&self.url, e))?.into_inner();
        let server = self.agent.add_peer(&reply.server_metadata)?;
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
        tracing::debug!(client_id = reply.client_id, server = %self.url, "KV session opened");
        Ok(())
    }

    /// After the server's agent went away: a new session with whatever server answers
    /// at the same address now (a restarted one starts empty), tried for a while.
    fn reconnect(&mut self) -> Result<()> {
        let until = Instant::now() + self.reconnect_for;
        loop {
            match self.hello() {
                Ok(()) => {
                    tracing::info!(server = %self.url, "reconnected to the KV server");
                    return Ok(());
                }
                Err(e) if Instant::now() >= until => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.buffer.len() as u64
    }

    /// Stores `value` under `key`, expiring after `ttl` (zero: never). Returns the
    /// value's version.
    pub fn put(&mut self, key: &[u8], value: &[u8], ttl: Duration) -> Result<u64> {
        self.put_batch(&[(key, value)], ttl)?.remove(0)
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

    /// Stores several values in one request; one result per item.
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
        let reply = self.call(|first_id| wire::Request::Put { first_id, ttl_ms, items: wire_items })?;
        Ok(reply
            .outcomes
            .into_iter()
            .map(|o| match o {
                Outcome::Stored { version } => Ok(version),
                other => Err(self.unexpected(other)),
            })
            .collect())
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
            Some(Outcome::Found { len, .. }) => Ok(Some(f(self.view(0, len)))),
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
        let gpu = cuda::Device::get(device)?;
        if self.pinned.is_none() {
            let owner = cuda::pinned::Owner::Memory(self.buffer.addr());
            cuda::pinned::pin(gpu, self.buffer.addr(), self.buffer_bytes(), owner)?;
            self.pinned = Some(PinnedBuffer { owner });
        }
        let _ctx = gpu.bind()?;
        let stream = match self.gpu_streams.iter().find(|(d, _)| *d == device) {
            Some((_, s)) => s.clone(),
            None => {
                let s = Arc::new(cuda::driver::Stream::new(gpu)?);
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

    /// Several values in one request: the buffer is shared out evenly between the keys,
    /// so each value must fit its share.
    pub fn get_batch(&mut self, keys: &[&[u8]]) -> Result<Vec<Result<Option<Vec<u8>>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
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
        Ok(reply
            .outcomes
            .into_iter()
            .enumerate()
            .map(|(i, o)| match o {
                Outcome::Found { len, .. } => Ok(Some(self.view(i as u64 * share, len).to_vec())),
                Outcome::Missing => Ok(None),
                other => Err(self.unexpected(other)),
            })
            .collect())
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
        let request = GoodbyeRequest { client_id: self.client_id };
        self.runtime.block_on(self.rpc.goodbye(request)).map_err(|e| rpc_error(&self.url, e))?;
        self.agent.close();
        Ok(())
    }

    fn region(&self, offset: u64, len: u64) -> Buffer {
        Buffer { kind: MemKind::Dram, addr: self.buffer.addr() + offset, len, dev: 0 }
    }

    fn view(&self, offset: u64, len: u64) -> &[u8] {
        assert!(offset + len <= self.buffer_bytes(), "the server reported a value beyond the buffer");
        // SAFETY: within the buffer (asserted); the server wrote it before its reply
        // arrived, and nothing writes it while this client is borrowed.
        unsafe { std::slice::from_raw_parts(self.buffer.as_ptr().add(offset as usize), len as usize) }
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

    /// Sends a request made with its first id, and waits for its reply.
    fn call(&mut self, make: impl FnOnce(u64) -> wire::Request) -> Result<Reply> {
        self.check_usable()?;
        let request = make(self.next_id);
        let first_id = request.first_id();
        self.next_id += request.len().max(1) as u64;
        let sent = self.agent.notify(&self.server, request.encode()).and_then(|()| self.wait_reply(first_id));
        match sent {
            // The server's agent is gone (stopped, restarted): once more with a new
            // session. A request runs at most once per server.
            Err(Error::PeerDisconnected { .. } | Error::UnknownPeer(_)) => {
                self.reconnect()?;
                self.agent.notify(&self.server, request.encode())?;
                self.wait_reply(first_id)
            }
            other => other,
        }
    }

    fn wait_reply(&mut self, first_id: u64) -> Result<Reply> {
        if let Some(r) = self.early.remove(&first_id) {
            return Ok(r);
        }
        let deadline = Instant::now() + self.timeout;
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
            for n in crate::poll::next_notifs(&self.agent, left.min(Duration::from_millis(100)), || false) {
                match Reply::decode(&n.msg) {
                    Some(Ok(r)) if r.first_id == first_id => return Ok(r),
                    Some(Ok(r)) => {
                        // An answer to a request that timed out: kept a while, then dropped.
                        if self.early.len() < 1024 {
                            self.early.insert(r.first_id, r);
                        }
                    }
                    Some(Err(e)) => tracing::warn!(error = %e, "dropped a malformed reply"),
                    None => tracing::debug!(from = %n.from, "ignored a notification that is no KV reply"),
                }
            }
            self.agent.check_peer(&self.server)?;
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

/// Connects, trying again until `patience` has passed.
async fn connect(
    endpoint: tonic::transport::Endpoint,
    patience: Duration,
) -> std::result::Result<Channel, tonic::transport::Error> {
    let until = Instant::now() + patience;
    let mut pause = Duration::from_millis(20);
    loop {
        match endpoint.connect().await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() + pause >= until => return Err(e),
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
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
        // A call that ran out of time is cancelled by the client's own deadline.
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
            Error::Timeout(format!("the KV server at {server}: {}", e.message()))
        }
        _ => Error::PeerDisconnected { peer: server.to_string(), reason: format!("{}: {}", e.code(), e.message()) },
    }
}
