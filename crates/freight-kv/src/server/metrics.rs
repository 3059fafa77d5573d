//! The server's counters as Prometheus metrics: `GET /metrics` on an HTTP port, in the
//! text exposition format.

use std::fmt::Write;
use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;

use super::Shared;
use crate::index::Stats;

pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new().route("/metrics", get(metrics)).with_state(shared)
}

async fn metrics(State(shared): State<Arc<Shared>>) -> String {
    let stats = shared.index.lock().stats();
    let clients = shared.clients.lock().len() as u64;
    render(&stats, clients)
}

/// The exposition of `stats` and the number of connected clients.
pub fn render(stats: &Stats, clients: u64) -> String {
    let metrics: [(&str, &str, &str, u64); 11] = [
        ("freight_kv_keys", "gauge", "Keys with a value (expired ones not yet swept included).", stats.keys),
        ("freight_kv_value_bytes", "gauge", "Bytes of the values stored.", stats.bytes),
        (
            "freight_kv_pool_used_bytes",
            "gauge",
            "Bytes of the pool in use, alignment and pins included.",
            stats.pool_used,
        ),
        ("freight_kv_pool_capacity_bytes", "gauge", "Bytes of the value pool.", stats.capacity),
        (
            "freight_kv_index_bytes",
            "gauge",
            "Bytes of the capacity counted for the index's keys: each key plus a fixed estimate per entry.",
            stats.index_bytes,
        ),
        ("freight_kv_hits_total", "counter", "Values served to GETs (copied into the reader's buffer).", stats.hits),
        ("freight_kv_misses_total", "counter", "GETs of a key without a value.", stats.misses),
        ("freight_kv_evictions_total", "counter", "Values evicted to make room.", stats.evictions),
        ("freight_kv_expirations_total", "counter", "Values that expired.", stats.expirations),
        (
            "freight_kv_pending_puts",
            "gauge",
            "Values reserved by PUTs and not yet committed or aborted (one per item of a batch).",
            stats.pending_puts,
        ),
        ("freight_kv_clients", "gauge", "Clients with a session.", clients),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in metrics {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_type_and_value() {
        let stats = Stats { keys: 3, hits: 7, capacity: 1 << 20, ..Default::default() };
        let text = render(&stats, 2);
        assert!(text.contains("# TYPE freight_kv_hits_total counter\nfreight_kv_hits_total 7\n"), "{text}");
        assert!(text.contains("\nfreight_kv_keys 3\n"));
        assert!(text.contains("\nfreight_kv_pool_capacity_bytes 1048576\n"));
        assert!(text.contains("\nfreight_kv_clients 2\n"));
        // A batch's items each reserve a value; transfers are per request.
        assert!(text.contains("# HELP freight_kv_pending_puts Values reserved by PUTs"), "{text}");
        assert!(text.contains("# HELP freight_kv_hits_total Values served"), "{text}");
        let samples = text.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples, 11);
        assert_eq!(text.matches("# HELP ").count(), samples);
    }
}
