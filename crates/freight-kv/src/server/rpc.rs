//! The gRPC control plane's service: sessions, and the operations that move no value
//! (exists, delete, stats). Its messages and the token check are [`crate::control`]'s.

use std::sync::Arc;

use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::Shared;

use crate::control::proto;
use crate::control::TokenCheck;

use proto::kv_control_server::{KvControl, KvControlServer};
use proto::*;

/// The control plane, behind a check of the shared secret when there is one.
pub(crate) fn service(
    shared: Arc<Shared>,
    token: Option<String>,
) -> InterceptedService<KvControlServer<Control>, TokenCheck> {
    InterceptedService::new(KvControlServer::new(Control { shared }), TokenCheck::new(token))
}

pub(crate) struct Control {
    shared: Arc<Shared>,
}

/// The gRPC status for an engine error.
fn status(e: freight_core::Error) -> Status {
    use freight_core::Error as E;
    match e {
        E::InvalidArgument(m) | E::Metadata(m) => Status::invalid_argument(m),
        E::Auth(m) => Status::unauthenticated(m),
        E::NoSpace(m) => Status::resource_exhausted(m),
        E::Timeout(m) => Status::deadline_exceeded(m),
        E::Protocol(m) => Status::failed_precondition(m),
        other => Status::unavailable(other.to_string()),
    }
}

/// Runs session work that may block (connecting to the client's agent, closing its
/// connections) off the runtime's few threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> freight_core::Result<T> + Send + 'static,
) -> Result<T, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result.map_err(status),
        Err(e) => Err(Status::internal(format!("the session's task failed: {e}"))),
    }
}

/// Refuses a client of another data-plane protocol before it sends a request the server
/// would misread, or that would misread the server's replies.
fn check_version(client: u32) -> Result<(), Status> {
    let server = u32::from(crate::wire::VERSION);
    match client {
        v if v == server => Ok(()),
        0 => Err(Status::failed_precondition(format!(
            "the client states no KV data-plane protocol version (it is older than this server, which speaks \
             version {server}): use the same freight release on both sides"
        ))),
        v => Err(Status::failed_precondition(format!(
            "the client speaks KV data-plane protocol version {v} and this server version {server}: use the same \
             freight release on both sides"
        ))),
    }
}

#[tonic::async_trait]
impl KvControl for Control {
    async fn hello(&self, request: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
        let r = request.into_inner();
        check_version(r.wire_version)?;
        let shared = self.shared.clone();
        let opened = blocking(move || shared.hello(&r.agent_metadata, &r.agent_token)).await?;
        tracing::debug!(client_id = opened.id, agent = %opened.agent, name = %r.client_name, "hello");
        Ok(Response::new(HelloReply {
            client_id: opened.id,
            server_metadata: self.shared.agent.metadata(),
            server_agent: self.shared.agent.name().to_string(),
            pool_bytes: self.shared.pool_bytes(),
            session_token: opened.token.to_vec(),
            wire_version: crate::wire::VERSION.into(),
            agent_token: self.shared.agent.config().token.clone().unwrap_or_default(),
            direct_addresses: match opened.transport {
                freight_core::TransportKind::Tcp => self.shared.direct_addresses.clone(),
                _ => Vec::new(),
            },
        }))
    }

    async fn refresh(&self, request: Request<RefreshRequest>) -> Result<Response<RefreshReply>, Status> {
        let r = request.into_inner();
        let shared = self.shared.clone();
        blocking(move || shared.refresh(r.client_id, &r.session_token, &r.agent_metadata)).await?;
        Ok(Response::new(RefreshReply {}))
    }

    async fn goodbye(&self, request: Request<GoodbyeRequest>) -> Result<Response<GoodbyeReply>, Status> {
        let r = request.into_inner();
        let shared = self.shared.clone();
        blocking(move || {
            shared.goodbye(r.client_id, &r.session_token);
            Ok(())
        })
        .await?;
        Ok(Response::new(GoodbyeReply {}))
    }

    async fn exists(&self, request: Request<KeysRequest>) -> Result<Response<ExistsReply>, Status> {
        let keys = request.into_inner().keys;
        let now = self.shared.now_ms();
        let mut index = self.shared.index.lock();
        let exists = keys.iter().map(|k| index.exists(k, now)).collect();
        Ok(Response::new(ExistsReply { exists }))
    }

    async fn delete(&self, request: Request<KeysRequest>) -> Result<Response<DeleteReply>, Status> {
        let keys = request.into_inner().keys;
        let mut index = self.shared.index.lock();
        let deleted = keys.iter().map(|k| index.delete(k)).collect();
        Ok(Response::new(DeleteReply { deleted }))
    }

    async fn stats(&self, _request: Request<StatsRequest>) -> Result<Response<StatsReply>, Status> {
        let pool = self.shared.index.lock().stats();
        Ok(Response::new(StatsReply::new(pool, self.shared.clients.lock().len() as u64)))
    }
}
