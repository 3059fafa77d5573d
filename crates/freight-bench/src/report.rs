//! Turning numbers into tables and JSON (the statistics themselves are [`crate::stats`]'s).

use std::collections::BTreeSet;

use serde_json::{json, Value};

use super::measure::{Budget, Mode, RowResult};
use super::p2p::{Grid, P2pArgs, TargetInfo, DEFAULT_BATCHES};
use crate::options::format_size;

/// Rounds a bandwidth or ratio for JSON.
pub fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// A time (in any unit) with as many decimals as are meaningful.
pub fn fmt_us(us: f64) -> String {
    if us < 0.1 {
        format!("{us:.4}")
    } else if us < 10.0 {
        format!("{us:.2}")
    } else if us < 1000.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// A text table: first column left-aligned, the others right-aligned (numbers).
pub struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(head: &[&str]) -> Table {
        Table { head: head.iter().map(|h| h.to_string()).collect(), rows: Vec::new() }
    }

    pub fn push(&mut self, row: Vec<String>) {
        debug_assert_eq!(row.len(), self.head.len());
        self.rows.push(row);
    }

    pub fn render(&self) -> String {
        let widths: Vec<usize> = (0..self.head.len())
            .map(|c| self.rows.iter().map(|r| r[c].len()).chain([self.head[c].len()]).max().unwrap_or(0))
            .collect();
        let line = |cells: &[String]| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(
                    |(c, v)| {
                        if c == 0 {
                            format!("{v:<w$}", w = widths[c])
                        } else {
                            format!("{v:>w$}", w = widths[c])
                        }
                    },
                )
                .collect();
            parts.join("  ").trim_end().to_string() + "\n"
        };
        let total = widths.iter().sum::<usize>() + 2 * (widths.len().saturating_sub(1));
        let mut out = line(&self.head);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// Where the numbers were taken, for JSON consumers comparing runs.
pub fn host_json() -> Value {
    json!({
        "hostname": hostname(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "pid": std::process::id(),
    })
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

// ---------------------------------------------------------------------------------------
// `bench p2p` output.
// ---------------------------------------------------------------------------------------

pub(super) fn p2p_header(a: &P2pArgs, grid: &Grid, target: &TargetInfo, max: u64) -> String {
    let runs = match a.budget() {
        Budget::Iters(n) => format!("{n} timed iterations"),
        Budget::Time(d) => format!("{:.2}s of iterations", d.as_secs_f64()),
    };
    let whose = if target.child { "started by this command" } else { "started separately" };
    format!(
        "freight bench p2p: {}, {} requests, {} -> {}, transport {}{}\n\
         initiator pid {} -> target pid {} at {} ({whose}); buffers of {} on each side\n\
         {} row{}, each verified first, then {runs} after {} warm-up; GB/s = 10^9 bytes/s at the median transfer; times in microseconds\n\n",
        a.op.kind().as_str(),
        a.mode.as_str(),
        a.initiator_seg.mem_kind(),
        a.target_seg.mem_kind(),
        a.engine.transport.as_str(),
        if a.random_order { ", descriptors in random order" } else { "" },
        std::process::id(),
        target.pid,
        target.addr,
        format_size(max),
        grid.rows.len(),
        if grid.rows.len() == 1 { "" } else { "s" },
        a.warmup,
    )
}

pub(super) fn p2p_table(a: &P2pArgs, grid: &Grid, rows: &[RowResult]) -> String {
    let mut head =
        vec!["Block", "Batch", "GB/s", "Avg Prep", "P99 Prep", "Avg Post", "P99 Post", "Avg Xfer", "P99 Xfer", "Path"];
    if a.memcpy_baseline {
        head.extend(["memcpy GB/s", "vs memcpy"]);
    }
    let mut t = Table::new(&head);
    let dash = || "-".to_string();
    for r in rows {
        let mut cells = vec![
            format_size(r.block_size),
            r.batch_size.to_string(),
            format!("{:.3}", r.gbps),
            r.prepare_us.map_or_else(dash, |s| fmt_us(s.avg)),
            r.prepare_us.map_or_else(dash, |s| fmt_us(s.p99)),
            fmt_us(r.post_us.avg),
            fmt_us(r.post_us.p99),
            fmt_us(r.transfer_us.avg),
            fmt_us(r.transfer_us.p99),
            r.transport.clone(),
        ];
        if a.memcpy_baseline {
            cells.push(r.memcpy_gbps.map_or_else(dash, |g| format!("{g:.3}")));
            cells.push(r.memcpy_ratio.map_or_else(dash, |x| format!("{x:.2}x")));
        }
        t.push(cells);
    }
    let mut out = t.render();
    out.push('\n');
    let paths: BTreeSet<(&str, &str)> = rows.iter().map(|r| (r.transport.as_str(), r.path_reason.as_str())).collect();
    for (transport, reason) in paths {
        out.push_str(&format!("path {transport}: {reason}\n"));
    }
    out.push_str(match a.mode {
        Mode::Prepared => "Prep = prepare_local + prepare_remote + make_request; Post = until post() returns; Xfer = post until done\n",
        Mode::Oneshot => "oneshot: Post = the whole transfer() call (prepare + make_request + post); Xfer = until done\n",
    });
    let merged = rows.iter().find(|r| (r.copies as u64) < r.batch_size);
    if let (Some(r), false) = (merged, a.random_order) {
        out.push_str(&format!(
            "note: the engine merges blocks that are neighbours on both sides ({} x {} became {} cop{}); --random-order keeps them apart\n",
            r.batch_size,
            format_size(r.block_size),
            r.copies,
            if r.copies == 1 { "y" } else { "ies" }
        ));
    }
    if let (false, Some(total)) = (grid.over_total.is_empty(), a.total_bytes) {
        let sizes: Vec<String> = grid.over_total.iter().map(|&b| format_size(b)).collect();
        out.push_str(&format!(
            "note: skipped block size{} larger than --total-bytes {}: {}\n",
            if sizes.len() == 1 { "" } else { "s" },
            format_size(total),
            sizes.join(", ")
        ));
    }
    if !grid.skipped.is_empty() {
        let (b, n) = grid.skipped.iter().max_by_key(|(b, n)| b * n).expect("non-empty");
        out.push_str(&format!(
            "note: skipped {} rows above --max-request-bytes {} (up to {n} x {}); raise it to run them\n",
            grid.skipped.len(),
            format_size(a.max_request_bytes),
            format_size(*b)
        ));
    }
    out
}

/// The whole run as one pretty-printed JSON document.
pub(super) fn p2p_json(a: &P2pArgs, grid: &Grid, rows: &[RowResult], target: &TargetInfo) -> String {
    let e = &a.engine;
    let cfg = e.agent_config("", e.transport.require());
    let doc = json!({
        "tool": "freight bench p2p",
        "version": env!("CARGO_PKG_VERSION"),
        "percentile": crate::stats::PERCENTILE,
        "host": host_json(),
        "config": {
            "op": a.op.kind().as_str(),
            "mode": a.mode.as_str(),
            "transport": e.transport.as_str(),
            "initiator_seg": a.initiator_seg.mem_kind().as_str(),
            "target_seg": a.target_seg.mem_kind().as_str(),
            "block_sizes": a.block_sizes.0,
            "batch_sizes": a.batch_sizes.as_ref().map_or(DEFAULT_BATCHES.to_vec(), |l| l.0.clone()),
            "total_bytes": a.total_bytes,
            "max_request_bytes": a.max_request_bytes,
            "iters": a.duration.is_none().then_some(a.iters),
            "duration_s": a.duration.map(|d| d.as_secs_f64()),
            "warmup": a.warmup,
            "random_order": a.random_order,
            "memcpy_baseline": a.memcpy_baseline,
            "tcp": { "streams": cfg.tcp.streams, "chunk_size": cfg.tcp.chunk_size, "window": cfg.tcp.window },
            "shm": { "threads": cfg.shm.threads },
        },
        "target": { "address": target.addr, "pid": target.pid, "child_process": target.child },
        "rows": rows,
        "skipped": grid.skipped.iter().map(|(b, n)| json!({ "block_size": b, "batch_size": n })).collect::<Vec<_>>(),
        "skipped_over_total_bytes": grid.over_total,
        "verified": rows.iter().all(|r| r.verified),
    });
    serde_json::to_string_pretty(&doc).expect("json values always print") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["name", "value"]);
        t.push(vec!["a".into(), "1".into()]);
        t.push(vec!["longer".into(), "12345".into()]);
        let out = t.render();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "name    value");
        assert_eq!(lines[2], "a           1");
        assert_eq!(lines[3], "longer  12345");
    }
}
