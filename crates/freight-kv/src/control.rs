//! The control plane's protocol, as both ends speak it: its messages (generated from
//! proto/kv.proto), the shared secret every call carries, and where a server listens
//! unless told otherwise. The server's side is `server::rpc`; the client's, `client`.

use tonic::service::interceptor::Interceptor;
use tonic::{Request, Status};

use crate::index::Stats;

/// The control plane's default address: loopback only, unless told otherwise.
pub const DEFAULT_LISTEN: &str = "[::1]:50051";

#[allow(clippy::all)]
pub mod proto {
    tonic::include_proto!("freight.kv.v1");
}

impl proto::StatsReply {
    /// The reply that carries the pool's counters and the number of sessions open.
    pub fn new(pool: Stats, clients: u64) -> Self {
        proto::StatsReply {
            keys: pool.keys,
            bytes: pool.bytes,
            pool_used: pool.pool_used,
            capacity: pool.capacity,
            hits: pool.hits,
            misses: pool.misses,
            evictions: pool.evictions,
            expirations: pool.expirations,
            pending_puts: pool.pending_puts,
            clients,
            index_bytes: pool.index_bytes,
        }
    }

    /// The pool's counters it carries.
    pub fn pool(&self) -> Stats {
        Stats {
            keys: self.keys,
            bytes: self.bytes,
            pool_used: self.pool_used,
            capacity: self.capacity,
            index_bytes: self.index_bytes,
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            expirations: self.expirations,
            pending_puts: self.pending_puts,
        }
    }
}

/// The metadata key that carries the shared secret: "authorization: Bearer <token>".
pub const AUTHORIZATION: &str = "authorization";

/// Refuses calls without the server's token. The data plane needs no check of its own:
/// the engine accepts a connection only with the secret in the server agent's metadata,
/// which the server hands out only in answer to an authenticated Hello.
#[derive(Clone)]
pub(crate) struct TokenCheck {
    token: Option<String>,
}

impl TokenCheck {
    pub(crate) fn new(token: Option<String>) -> TokenCheck {
        TokenCheck { token }
    }
}

impl Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else { return Ok(request) };
        let given = request.metadata().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
        let given = given.strip_prefix("Bearer ").unwrap_or("");
        if freight_core::same_secret(given.as_bytes(), token.as_bytes()) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("missing or wrong token (the server was started with one)"))
        }
    }
}

/// Adds the token to every call of a client.
#[derive(Clone)]
pub struct TokenSend {
    header: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl TokenSend {
    pub fn new(token: Option<&str>) -> freight_core::Result<TokenSend> {
        let header = token
            .map(|t| {
                format!("Bearer {t}").parse().map_err(|_| {
                    freight_core::Error::InvalidArgument("a token must be printable ASCII without line breaks".into())
                })
            })
            .transpose()?;
        Ok(TokenSend { header })
    }
}

impl Interceptor for TokenSend {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            request.metadata_mut().insert(AUTHORIZATION, h.clone());
        }
        Ok(request)
    }
}
