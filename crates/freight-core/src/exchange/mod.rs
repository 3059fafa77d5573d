//! Out-of-band exchange of agents' metadata blobs through a shared directory service.
#[cfg(feature = "etcd")]
pub mod etcd;
