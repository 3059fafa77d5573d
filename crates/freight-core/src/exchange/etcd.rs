//! Agent metadata directory in etcd.
//!
//! Each agent publishes its metadata blob (opaque bytes) at `prefix + name`, attached to a
//! lease that a background task keeps alive. When the agent dies, or cannot reach etcd for
//! longer than the TTL, the lease expires and etcd deletes its entries, so peers never
//! connect to a stale agent for long.
//!
//! The API is synchronous. Each [`EtcdDirectory`] owns a current-thread tokio runtime that
//! one dedicated thread drives (it runs the keep-alive task and the I/O); callers' threads
//! enter it through `Handle::block_on`. Hence the methods must not be called from inside an
//! async runtime (they return `Error::InvalidState` there instead of panicking).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use tokio::runtime::Handle;
use tokio::sync::{oneshot, Mutex as AsyncMutex};
use tokio::task::JoinHandle;

use crate::interrupt;
use freight_proto::error::{Error, Result};

/// Longest accepted agent name, in characters.
pub const MAX_NAME_LEN: usize = 256;

/// Text of etcd's `ErrLeaseNotFound`; a put under an expired lease fails with it.
const LEASE_NOT_FOUND: &str = "requested lease not found";

/// A directory of agents' metadata blobs under one etcd key prefix.
pub struct EtcdDirectory {
    ctx: Ctx,
    /// Lease and published entries; also used by the keep-alive task, hence an async mutex
    /// (a blocking one held by a caller would stall the runtime thread that drives its I/O).
    state: Arc<AsyncMutex<State>>,
    keeper: parking_lot::Mutex<Option<JoinHandle<()>>>,
    closed: bool,
    /// Declared last so that it is dropped after everything that uses the runtime.
    driver: Driver,
}

/// Everything an etcd call needs; cheap to clone into tasks.
#[derive(Clone)]
struct Ctx {
    client: Client,
    prefix: String,
    ttl_secs: i64,
    timeout: Duration,
}

#[derive(Default)]
struct State {
    /// The lease our entries live under; `None` when none is known to be alive.
    lease: Option<i64>,
    /// What this directory has published, so it can be re-put if the lease is lost.
    entries: HashMap<String, Vec<u8>>,
}

impl EtcdDirectory {
    /// Connects to etcd at `endpoints` (e.g. `http://127.0.0.1:2379`) and checks that one of
    /// them answers within `timeout`. `prefix` (e.g. `/freight/agents/`) gets a trailing `/`
    /// if it lacks one; `ttl` is rounded up to whole seconds (etcd's unit), at least 1 s.
    /// Every later etcd call is bounded by `timeout` as well.
    pub fn connect(endpoints: &[String], prefix: &str, ttl: Duration, timeout: Duration) -> Result<Self> {
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument("no etcd endpoints given".into()));
        }
        if prefix.is_empty() {
            return Err(Error::InvalidArgument("empty etcd key prefix".into()));
        }
        if ttl < Duration::from_secs(1) {
            return Err(Error::InvalidArgument(format!("lease ttl {ttl:?} is below etcd's 1 s resolution")));
        }
        if timeout.is_zero() {
            return Err(Error::InvalidArgument("zero etcd timeout".into()));
        }
        let prefix = if prefix.ends_with('/') { prefix.to_owned() } else { format!("{prefix}/") };
        let ttl_secs = i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
            .map_err(|_| Error::InvalidArgument(format!("lease ttl {ttl:?} too large")))?;

        let driver = Driver::start()?;
        let named = endpoints.join(",");
        let opts = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let probe = async {
            let mut client = Client::connect(endpoints, Some(opts)).await?;
            // `Client::connect` does not dial; a one-key read proves that etcd answers.
            let keys_only = GetOptions::new().with_keys_only().with_limit(1);
            client.get(prefix.as_str(), Some(keys_only)).await?;
            Ok::<_, etcd_client::Error>(client)
        };
        let client = match driver.block_on(async { tokio::time::timeout(timeout, probe).await })? {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(Error::Etcd(format!("cannot connect to etcd at {named}: {e}"))),
            Err(_) => {
                return Err(Error::Etcd(format!("cannot connect to etcd at {named}: no answer within {timeout:?}")))
            }
        };
        tracing::info!(endpoints = %named, %prefix, ttl_secs, "connected to etcd");
        Ok(Self {
            ctx: Ctx { client, prefix, ttl_secs, timeout },
            state: Arc::default(),
            keeper: parking_lot::Mutex::new(None),
            closed: false,
            driver,
        })
    }

    /// The key prefix, always ending in `/`.
    pub fn prefix(&self) -> &str {
        &self.ctx.prefix
    }

    /// Puts `prefix + name = metadata` under this directory's lease, replacing any previous
    /// value. The first call grants the lease and starts the keep-alive task.
    pub fn publish(&self, name: &str, metadata: &[u8]) -> Result<()> {
        validate_name(name)?;
        let (ctx, state) = (&self.ctx, &self.state);
        self.driver.block_on(async {
            let mut st = state.lock().await;
            if let Some(lease) = st.lease {
                match ctx.put(name, metadata, lease).await {
                    Ok(()) => {
                        st.entries.insert(name.to_owned(), metadata.to_vec());
                        return Ok(());
                    }
                    Err(Error::Etcd(msg)) if msg.contains(LEASE_NOT_FOUND) => {
                        tracing::warn!(lease, "etcd lease expired; granting a new one and re-publishing");
                    }
                    Err(e) => return Err(e),
                }
            }
            // No live lease: our other entries are gone too, so re-put all of them.
            let previous = st.entries.insert(name.to_owned(), metadata.to_vec());
            let res = ctx.regrant(&mut st).await;
            if res.is_err() {
                // A failed publish must not be resurrected later by the keep-alive task.
                match previous {
                    Some(v) => st.entries.insert(name.to_owned(), v),
                    None => st.entries.remove(name),
                };
            }
            res
        })??;
        self.keep_lease_alive();
        tracing::debug!(name, len = metadata.len(), "published metadata");
        Ok(())
    }

    /// Starts the keep-alive task, once.
    fn keep_lease_alive(&self) {
        let mut keeper = self.keeper.lock();
        if keeper.is_none() {
            *keeper = Some(self.driver.handle.spawn(keep_alive(self.ctx.clone(), self.state.clone())));
        }
    }

    /// Puts `prefix + name = metadata` under this directory's lease unless the key
    /// exists, whoever put it: true when this call put it. The check and the put are
    /// one etcd transaction, so of several processes claiming a name at once exactly
    /// one wins. A claimed name is kept alive and re-put like a published one.
    pub fn claim(&self, name: &str, metadata: &[u8]) -> Result<bool> {
        validate_name(name)?;
        let (ctx, state) = (&self.ctx, &self.state);
        let won = self.driver.block_on(async {
            let mut st = state.lock().await;
            let first = match st.lease {
                Some(lease) => ctx.put_if_absent(name, metadata, lease).await,
                None => Err(Error::Etcd(LEASE_NOT_FOUND.into())),
            };
            let won = match first {
                Err(Error::Etcd(msg)) if msg.contains(LEASE_NOT_FOUND) => {
                    // No live lease: grant one (re-putting the other entries), then claim.
                    ctx.regrant(&mut st).await?;
                    let lease = st.lease.expect("regrant sets the lease");
                    ctx.put_if_absent(name, metadata, lease).await?
                }
                other => other?,
            };
            if won {
                st.entries.insert(name.to_owned(), metadata.to_vec());
            }
            Ok::<_, Error>(won)
        })??;
        if won {
            self.keep_lease_alive();
        }
        tracing::debug!(name, won, "claimed a name");
        Ok(won)
    }

    /// Gets `prefix + name`; `Ok(None)` if it is absent.
    pub fn fetch(&self, name: &str) -> Result<Option<Vec<u8>>> {
        validate_name(name)?;
        self.driver.block_on(self.ctx.get(name))?
    }

    /// Waits until `prefix + name` exists and returns its value; `Error::Timeout` after
    /// `timeout`. The caller's interrupt check (see [`crate::interrupt`]) runs between
    /// slices of the wait, which keeps its watch across them.
    pub fn wait_for(&self, name: &str, timeout: Duration) -> Result<Vec<u8>> {
        validate_name(name)?;
        let deadline = tokio::time::Instant::now() + timeout;
        // Polled on this thread (the driver's `block_on`), where the check is installed.
        self.driver.block_on(async {
            let wait = self.ctx.wait(name);
            tokio::pin!(wait);
            loop {
                let slice_end = deadline.min(tokio::time::Instant::now() + interrupt::SLICE);
                match tokio::time::timeout_at(slice_end, &mut wait).await {
                    Ok(value) => return Ok(value),
                    Err(_) if tokio::time::Instant::now() >= deadline => {
                        return Err(Error::Timeout(format!(
                            "'{name}' did not appear under etcd prefix {} within {timeout:?}",
                            self.ctx.prefix
                        )))
                    }
                    Err(_) => interrupt::check()?,
                }
            }
        })?
    }

    /// Deletes `prefix + name` (no error if absent) and stops re-publishing it.
    pub fn withdraw(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let (ctx, state) = (&self.ctx, &self.state);
        self.driver.block_on(async {
            // Under the lock so that a concurrent lease recovery cannot put it back.
            let mut st = state.lock().await;
            ctx.delete(name).await?;
            st.entries.remove(name);
            Ok::<_, Error>(())
        })??;
        tracing::debug!(name, "withdrew metadata");
        Ok(())
    }

    /// Names currently under the prefix, sorted. Keys that are not valid names (nested
    /// paths, non-UTF-8) are skipped: they cannot have been published by this API.
    pub fn list(&self) -> Result<Vec<String>> {
        self.driver.block_on(self.ctx.list())?
    }

    /// Stops the keep-alive and closes the connection WITHOUT revoking the lease, as a
    /// crashed process would: the entries disappear only when the TTL runs out. For tests.
    #[doc(hidden)]
    pub fn forget_without_revoke(mut self) {
        self.shutdown(false);
    }

    fn shutdown(&mut self, revoke: bool) {
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        if let Some(keeper) = self.keeper.get_mut().take() {
            keeper.abort();
        }
        if !revoke {
            return;
        }
        let (ctx, state) = (&self.ctx, &self.state);
        let revoke = async {
            let Some(lease) = state.lock().await.lease.take() else {
                return Ok(());
            };
            let mut client = ctx.client.clone();
            bounded(ctx.timeout, format!("revoke lease {lease}"), client.lease_revoke(lease)).await?;
            tracing::debug!(lease, "revoked etcd lease");
            Ok::<_, Error>(())
        };
        // Bounded as a whole: the lock wait is included.
        let res = self.driver.block_on(async { tokio::time::timeout(self.ctx.timeout, revoke).await });
        match res {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "could not revoke etcd lease; entries expire with the ttl")
            }
            Ok(Err(_)) => {
                tracing::warn!("etcd lease revoke timed out; entries expire with the ttl")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not revoke etcd lease; entries expire with the ttl")
            }
        }
    }
}

impl Drop for EtcdDirectory {
    fn drop(&mut self) {
        self.shutdown(true);
    }
}

impl Ctx {
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    async fn grant(&self) -> Result<i64> {
        let mut client = self.client.clone();
        let resp = bounded(self.timeout, "grant lease".into(), client.lease_grant(self.ttl_secs, None)).await?;
        tracing::debug!(lease = resp.id(), ttl = resp.ttl(), "granted etcd lease");
        Ok(resp.id())
    }

    async fn put(&self, name: &str, value: &[u8], lease: i64) -> Result<()> {
        let (mut client, key) = (self.client.clone(), self.key(name));
        let opts = PutOptions::new().with_lease(lease);
        bounded(self.timeout, format!("put {key}"), client.put(key.as_str(), value, Some(opts))).await?;
        Ok(())
    }

    /// Puts the key under `lease` if it does not exist; true when it was put.
    async fn put_if_absent(&self, name: &str, value: &[u8], lease: i64) -> Result<bool> {
        let (mut client, key) = (self.client.clone(), self.key(name));
        let absent = Compare::create_revision(key.as_str(), CompareOp::Equal, 0);
        let put = TxnOp::put(key.as_str(), value, Some(PutOptions::new().with_lease(lease)));
        let txn = Txn::new().when(vec![absent]).and_then(vec![put]);
        let resp = bounded(self.timeout, format!("claim {key}"), client.txn(txn)).await?;
        Ok(resp.succeeded())
    }

    async fn get(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let (mut client, key) = (self.client.clone(), self.key(name));
        let resp = bounded(self.timeout, format!("get {key}"), client.get(key.as_str(), None)).await?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn delete(&self, name: &str) -> Result<()> {
        let (mut client, key) = (self.client.clone(), self.key(name));
        bounded(self.timeout, format!("delete {key}"), client.delete(key.as_str(), None)).await?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<String>> {
        let mut client = self.client.clone();
        let opts = GetOptions::new().with_prefix().with_keys_only();
        let what = format!("list {}", self.prefix);
        let resp = bounded(self.timeout, what, client.get(self.prefix.as_str(), Some(opts))).await?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| std::str::from_utf8(kv.key().strip_prefix(self.prefix.as_bytes())?).ok())
            .filter(|name| validate_name(name).is_ok())
            .map(str::to_owned)
            .collect())
    }

    /// Grants a new lease and re-puts every entry under it. On failure the state is left
    /// without a lease, so the next publish or keep-alive round tries again (a lease granted
    /// meanwhile simply expires, nothing keeps it alive).
    async fn regrant(&self, st: &mut State) -> Result<()> {
        st.lease = None;
        let lease = self.grant().await?;
        for (name, value) in &st.entries {
            self.put(name, value, lease).await?;
        }
        st.lease = Some(lease);
        Ok(())
    }

    /// Waits (unbounded; the caller bounds it) for the key: read it, and if absent watch it
    /// from the revision after that read, so that a put in between is not missed. Watch
    /// failures fall back to re-reading with exponential backoff.
    async fn wait(&self, name: &str) -> Vec<u8> {
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.watch_once(name).await {
                Ok(Some(value)) => return value,
                Ok(None) => tracing::debug!(name, "etcd watch ended without the key; retrying"),
                Err(e) => tracing::debug!(name, error = %e, "etcd watch failed; retrying"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    async fn watch_once(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let (mut client, key) = (self.client.clone(), self.key(name));
        let resp = bounded(self.timeout, format!("get {key}"), client.get(key.as_str(), None)).await?;
        if let Some(kv) = resp.kvs().first() {
            return Ok(Some(kv.value().to_vec()));
        }
        let after = resp.header().map_or(0, |h| h.revision()) + 1;
        let opts = WatchOptions::new().with_start_revision(after);
        // The watcher must stay alive while we read the stream.
        let (_watcher, mut stream) =
            bounded(self.timeout, format!("watch {key}"), client.watch(key.as_str(), Some(opts))).await?;
        loop {
            let Some(resp) = stream.message().await.map_err(|e| Error::Etcd(format!("watch {key}: {e}")))? else {
                return Ok(None);
            };
            if resp.canceled() {
                return Ok(None);
            }
            let put = resp.events().iter().find(|ev| ev.event_type() == EventType::Put);
            if let Some(kv) = put.and_then(|ev| ev.kv()) {
                return Ok(Some(kv.value().to_vec()));
            }
        }
    }
}

/// Background task: renews the lease every ttl/3 over one keep-alive stream (reopened
/// when it breaks); if etcd reports the lease gone, grants a new one and re-publishes.
async fn keep_alive(ctx: Ctx, state: Arc<AsyncMutex<State>>) {
    let period = Duration::from_secs(ctx.ttl_secs.unsigned_abs()) / 3;
    let mut stream = None;
    loop {
        let current = state.lock().await.lease;
        match current {
            None => recover(&ctx, &state, None).await,
            Some(lease) => {
                if !matches!(&stream, Some((id, _, _)) if *id == lease) {
                    let mut client = ctx.client.clone();
                    let what = format!("open keep-alive for lease {lease}");
                    stream = match bounded(ctx.timeout, what, client.lease_keep_alive(lease)).await {
                        Ok((keeper, responses)) => Some((lease, keeper, responses)),
                        Err(e) => {
                            tracing::warn!(lease, error = %e, "cannot open etcd keep-alive; will retry");
                            None
                        }
                    };
                }
                if let Some((_, keeper, responses)) = stream.as_mut() {
                    let renew = async {
                        keeper.keep_alive().await?;
                        responses.message().await
                    };
                    match bounded(ctx.timeout, format!("renew lease {lease}"), renew).await {
                        Ok(Some(resp)) if resp.ttl() > 0 => {
                            tracing::trace!(lease, ttl = resp.ttl(), "renewed etcd lease")
                        }
                        Ok(Some(_)) => {
                            tracing::warn!(lease, "etcd lease expired; granting a new one and re-publishing");
                            stream = None;
                            recover(&ctx, &state, Some(lease)).await;
                        }
                        Ok(None) | Err(_) => {
                            tracing::warn!(lease, "etcd keep-alive stream broke; reopening");
                            stream = None;
                        }
                    }
                }
            }
        }
        tokio::time::sleep(period).await;
    }
}

/// Re-grants unless someone (a concurrent publish) already replaced the `stale` lease.
async fn recover(ctx: &Ctx, state: &AsyncMutex<State>, stale: Option<i64>) {
    let mut st = state.lock().await;
    if st.lease != stale {
        return;
    }
    if let Err(e) = ctx.regrant(&mut st).await {
        tracing::warn!(error = %e, "cannot re-publish under a new etcd lease; will retry");
    }
}

/// Bounds an etcd call by `limit`, naming `what` in either error.
async fn bounded<T>(
    limit: Duration,
    what: String,
    call: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::Etcd(format!("{what}: {e}"))),
        Err(_) => Err(Error::Timeout(format!("etcd {what}: no answer within {limit:?}"))),
    }
}

fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("empty agent name".into()));
    }
    if name.contains('/') {
        return Err(Error::InvalidArgument(format!("agent name '{name}' contains '/'")));
    }
    if name.chars().count() > MAX_NAME_LEN {
        return Err(Error::InvalidArgument(format!("agent name longer than {MAX_NAME_LEN} characters")));
    }
    Ok(())
}

/// The runtime thread: drives I/O, timers and the keep-alive task until dropped.
struct Driver {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Driver {
    fn start() -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Etcd(format!("cannot start the etcd client runtime: {e}")))?;
        let handle = rt.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("freight-etcd".into()).spawn(move || {
            rt.block_on(async {
                let _ = stopped.await;
            });
            // Bounded: aborts leftover tasks instead of waiting on them.
            rt.shutdown_timeout(Duration::from_millis(100));
        })?;
        Ok(Self { handle, stop: Some(stop), thread: Some(thread) })
    }

    /// Runs `fut` to completion on the calling thread (the driver thread does the I/O).
    /// Timers must be created inside `fut`: outside it there is no runtime context.
    fn block_on<F: Future>(&self, fut: F) -> Result<F::Output> {
        if Handle::try_current().is_ok() {
            return Err(Error::InvalidState(
                "EtcdDirectory is blocking; call it outside async code (e.g. from spawn_blocking)".into(),
            ));
        }
        Ok(self.handle.block_on(fut))
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_name("agent-0").is_ok());
        assert!(validate_name(&"x".repeat(MAX_NAME_LEN)).is_ok());
        for bad in ["", "a/b", "/", &"x".repeat(MAX_NAME_LEN + 1)] {
            assert!(matches!(validate_name(bad), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn directory_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<EtcdDirectory>();
    }
}
