//! libfabric, where this machine has it (loaded at run time, nothing at build time): its
//! version, and the providers and domains that the fabric transport could use here.

use freight_core::transport::fabric;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Fabric {
    /// The library that loaded ("libfabric.so.1"), or `None`.
    pub library: Option<String>,
    /// "1.17".
    pub version: Option<String>,
    /// Providers offering reliable datagram endpoints with RMA (each once, e.g.
    /// "tcp;ofi_rxm", "shm", "efa"): what `FREIGHT_FABRIC_PROVIDER` may name.
    pub providers: Vec<String>,
    /// Their domains as "provider/domain" (for the tcp provider, one per interface):
    /// what `FREIGHT_FABRIC_DOMAINS` may name.
    pub domains: Vec<String>,
    /// Of those providers, the ones that offer GPU memory (`FI_HMEM`). A libfabric built
    /// without CUDA may still list some (for other devices): freight then finds out at
    /// the first registration, and stages GPU memory.
    pub gpu_memory_providers: Vec<String>,
    /// Why there is nothing to report, where there is not.
    pub note: Option<String>,
}

pub fn probe() -> Fabric {
    match fabric::discover_domains() {
        Err(why) => Fabric {
            library: None,
            version: None,
            providers: Vec::new(),
            domains: Vec::new(),
            gpu_memory_providers: Vec::new(),
            note: Some(why),
        },
        Ok(found) => {
            let mut providers: Vec<String> = Vec::new();
            let mut domains: Vec<String> = Vec::new();
            for d in found.domains {
                if !providers.contains(&d.provider) {
                    providers.push(d.provider.clone());
                }
                let name = format!("{}/{}", d.provider, d.domain);
                if !domains.contains(&name) {
                    domains.push(name);
                }
            }
            let mut gpu_memory_providers: Vec<String> = Vec::new();
            for d in found.gpu_memory_domains {
                if providers.contains(&d.provider) && !gpu_memory_providers.contains(&d.provider) {
                    gpu_memory_providers.push(d.provider);
                }
            }
            let note = providers.is_empty().then(|| "no provider offers RDMA reads and writes here".to_string());
            Fabric {
                library: Some(found.library),
                version: Some(found.version),
                providers,
                domains,
                gpu_memory_providers,
                note,
            }
        }
    }
}
