//! The gRPC control plane: sessions, and the operations that move no value (exists,
//! delete, stats). Generated from proto/kv.proto.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::server::Shared;

#[allow(clippy::all)]
pub mod proto {
    tonic::include_proto!("freight.kv.v1");
}

use proto::kv_control_server::{KvControl, KvControlServer};
use proto::*;

pub(crate) fn service(shared: Arc<Shared>) -> KvControlServer<Control> {
    KvControlServer::new(Control { shared })
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
        other => Status::unavailable(other.to_string()),
    }
}

#[tonic::async_trait]
impl KvControl for Control {
    async fn hello(&self, request: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
        let r = request.into_inner();
        let (client_id, agent) = self.shared.hello(&r.agent_metadata).map_err(status)?;
        tracing::debug!(client_id, %agent, name = %r.client_name, "hello");
        Ok(Response::new(HelloReply {
            client_id,
            server_metadata: self.shared.agent.metadata(),
            server_agent: self.shared.agent.name().to_string(),
            pool_bytes: self.shared.pool_bytes(),
        }))
    }

    async fn refresh(&self, request: Request<RefreshRequest>) -> Result<Response<RefreshReply>, Status> {
        let r = request.into_inner();
        self.shared.refresh(r.client_id, &r.agent_metadata).map_err(status)?;
        Ok(Response::new(RefreshReply {}))
    }

    async fn goodbye(&self, request: Request<GoodbyeRequest>) -> Result<Response<GoodbyeReply>, Status> {
        self.shared.goodbye(request.into_inner().client_id);
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
        let s = self.shared.index.lock().stats();
        Ok(Response::new(StatsReply {
            keys: s.keys,
            bytes: s.bytes,
            pool_used: s.pool_used,
            capacity: s.capacity,
            hits: s.hits,
            misses: s.misses,
            evictions: s.evictions,
            expirations: s.expirations,
            pending_puts: s.pending_puts,
            clients: self.shared.clients.lock().len() as u64,
        }))
    }
}
