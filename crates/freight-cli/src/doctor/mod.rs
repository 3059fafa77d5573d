//! `freight doctor`: what a transfer performance investigation needs to know about this
//! machine, in one place: CPUs and their governors, NUMA nodes, NICs (speed, MTU, NUMA
//! node, IRQ affinity), GPUs and the NICs closest to each, which GPUs reach each other's
//! memory, and the libfabric providers found. It needs no GPU and changes nothing.

mod fabric;
mod gpu;
mod host;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use freight_bench::options::{CliError, CliResult};
use host::Root;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print one JSON document instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Read sysfs and procfs under this directory instead of / (for tests).
    #[arg(long, default_value = "/", hide = true)]
    pub root: PathBuf,
}

#[derive(Serialize)]
struct Report {
    hostname: Option<String>,
    kernel: Option<String>,
    cpus: host::Cpus,
    numa_nodes: Vec<host::NumaNode>,
    nics: Vec<host::Nic>,
    #[serde(flatten)]
    gpus: gpu::Gpus,
    libfabric: fabric::Fabric,
}

fn report(root: &Root) -> Report {
    let nics = host::nics(root);
    Report {
        hostname: root.read("proc/sys/kernel/hostname"),
        kernel: root.read("proc/sys/kernel/osrelease"),
        cpus: host::cpus(root),
        numa_nodes: host::numa_nodes(root),
        gpus: gpu::probe(root, &nics),
        nics,
        libfabric: fabric::probe(),
    }
}

pub fn run(args: &DoctorArgs) -> CliResult<()> {
    let root = Root(args.root.clone());
    if !root.0.join("sys").is_dir() {
        return Err(CliError::usage(format!("{} holds no sys/ directory to read", args.root.display())));
    }
    let report = report(&root);
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::Runtime(e.to_string()))?;
        freight_bench::emit(&format!("{text}\n"))
    } else {
        freight_bench::emit(&render(&report))
    }
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// "24 IRQs: CPUs 0-7 (16), 8-15 (8)".
fn irq_summary(irqs: &[host::Irq]) -> String {
    if irqs.is_empty() {
        return "-".into();
    }
    let mut by_cpus: BTreeMap<&str, usize> = BTreeMap::new();
    for i in irqs {
        *by_cpus.entry(i.cpus.as_deref().unwrap_or("?")).or_insert(0) += 1;
    }
    let sets: Vec<String> = by_cpus.iter().map(|(cpus, n)| format!("{cpus} ({n})")).collect();
    format!("{} IRQs on CPUs {}", irqs.len(), sets.join(", "))
}

fn speed(mbps: Option<u64>) -> String {
    match mbps {
        Some(m) if m >= 1000 => format!("{} Gb/s", m / 1000),
        Some(m) => format!("{m} Mb/s"),
        None => "-".into(),
    }
}

fn render(r: &Report) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "host       {} (Linux {})", or_dash(r.hostname.as_ref()), or_dash(r.kernel.as_ref()));
    let governors = if r.cpus.governors.is_empty() {
        "no frequency scaling exposed".to_string()
    } else {
        r.cpus.governors.iter().map(|(g, n)| format!("{g} x{n}")).collect::<Vec<_>>().join(", ")
    };
    let _ = writeln!(
        w,
        "CPUs       {} online ({}), {}; governor: {governors}",
        r.cpus.count,
        r.cpus.online,
        or_dash(r.cpus.model.as_ref())
    );
    let nodes: Vec<String> = r.numa_nodes.iter().map(|n| format!("node {}: CPUs {}", n.node, n.cpus)).collect();
    let _ = writeln!(w, "NUMA       {}", if nodes.is_empty() { "not exposed".into() } else { nodes.join("; ") });

    let _ = writeln!(w, "\nNICs");
    let _ = writeln!(
        w,
        "  {:<12} {:<8} {:>10} {:>6}  {:<12} {:<13} {:>4}  IRQs",
        "name", "state", "speed", "MTU", "driver", "PCI", "NUMA"
    );
    for n in &r.nics {
        let _ = writeln!(
            w,
            "  {:<12} {:<8} {:>10} {:>6}  {:<12} {:<13} {:>4}  {}",
            n.name,
            or_dash(n.state.as_ref()),
            speed(n.speed_mbps),
            or_dash(n.mtu),
            or_dash(n.driver.as_ref()),
            n.pci.as_ref().map_or("virtual", |p| p.address.as_str()),
            or_dash(n.pci.as_ref().and_then(|p| p.numa_node)),
            irq_summary(&n.irqs)
        );
    }

    let cuda = &r.gpus.cuda;
    let _ = match (&cuda.reason, &cuda.driver) {
        (Some(why), _) => writeln!(w, "\nCUDA       not available: {why}"),
        (None, driver) => writeln!(w, "\nCUDA       driver supports CUDA {}", or_dash(driver.as_ref())),
    };
    if !r.gpus.gpus.is_empty() {
        let _ = writeln!(w, "GPUs");
        let _ = writeln!(
            w,
            "  {:>2}  {:<28} {:<13} {:>4} {:>4} {:>4}  closest NICs",
            "#", "name", "PCI", "CC", "SMs", "NUMA"
        );
        for g in &r.gpus.gpus {
            let near: Vec<String> =
                g.nics.iter().take(3).map(|n| format!("{} ({})", n.nic, n.closeness.label())).collect();
            let _ = writeln!(
                w,
                "  {:>2}  {:<28} {:<13} {:>4} {:>4} {:>4}  {}",
                g.ordinal,
                g.name,
                g.pci,
                g.compute_capability,
                g.multiprocessors,
                or_dash(g.numa_node),
                if near.is_empty() { "-".into() } else { near.join(", ") }
            );
        }
        let _ = writeln!(w, "peer access (row reaches column)");
        let header: String = (0..r.gpus.peer_access.len()).map(|j| format!("{j:>4}")).collect();
        let _ = writeln!(w, "      {header}");
        for (i, row) in r.gpus.peer_access.iter().enumerate() {
            let cells: String = row.iter().map(|ok| format!("{:>4}", if *ok { "yes" } else { "no" })).collect();
            let _ = writeln!(w, "  {i:>2}  {cells}");
        }
    }

    let f = &r.libfabric;
    let _ = match (&f.library, &f.version) {
        (Some(lib), Some(v)) => writeln!(
            w,
            "\nlibfabric  {v} ({lib}); providers with RDMA reads and writes: {}\n           domains: {}\n           \
             offering GPU memory (FI_HMEM): {}",
            if f.providers.is_empty() { "none".into() } else { f.providers.join(", ") },
            if f.domains.is_empty() { "none".into() } else { f.domains.join(", ") },
            if f.gpu_memory_providers.is_empty() { "none".into() } else { f.gpu_memory_providers.join(", ") }
        ),
        _ => writeln!(w, "\nlibfabric  {}", or_dash(f.note.as_ref())),
    };
    if let (Some(note), Some(_)) = (&f.note, &f.version) {
        let _ = writeln!(w, "           {note}");
    }
    out
}
