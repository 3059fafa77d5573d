//! `freight bench p2p --full-mesh N`: N processes that all write to each other at once,
//! like the launcher of a multi-GPU transport test: each member keeps one WRITE in flight
//! to every other member for the whole run, then every member checks what the others
//! wrote into it. Members get a GPU each, in turn, where GPUs exist (their buffers are
//! then GPU memory), host memory otherwise.
//!
//! The parent starts the members as child processes and speaks to each through its
//! stdin and stdout, one JSON message per line: a member says `hello` (its metadata and
//! where its slots are), the parent answers `peers` (everyone's hello); a member says
//! `ready` once its requests are made and warmed up; the parent says `go` to all at once;
//! a member says `done` (bytes and seconds); the parent says `check` once all are done;
//! a member says `checked` and exits. Member `i`'s WRITE lands in slot `i` of each peer.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use freight_core::{Agent, Desc, DescList, MemKind, OpKind, SharedSegment, Status};
use freight_cuda::driver::{self, DeviceBuffer};
use serde::{Deserialize, Serialize};

use crate::options::{format_size, parse_duration, CliError, CliResult, EngineOpts};
use crate::{emit, pattern, Context};

/// The hidden subcommand a member runs.
pub const SUBCOMMAND: &str = "__mesh-member";

#[derive(Debug, Args)]
pub struct MemberArgs {
    #[arg(long)]
    index: usize,
    #[arg(long)]
    members: usize,
    #[arg(long)]
    block: u64,
    #[arg(long, value_parser = parse_duration)]
    duration: Duration,
    /// The GPU whose memory this member uses (host memory without).
    #[arg(long)]
    gpu: Option<usize>,
    #[command(flatten)]
    engine: EngineOpts,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hello {
    index: usize,
    metadata: Vec<u8>,
    /// Where slot 0 starts in the member's address space (slot `i` is `i * block` on).
    slots: u64,
    kind: String,
    gpu: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Message {
    Hello(Hello),
    Peers(Vec<Hello>),
    Ready,
    Go,
    Done { bytes: u64, seconds: f64, transport: String },
    Check,
    Checked { errors: Vec<String> },
}

fn send(w: &mut impl Write, m: &Message) -> CliResult<()> {
    let line = serde_json::to_string(m).map_err(|e| CliError::runtime(e.to_string()))?;
    writeln!(w, "{line}").and_then(|()| w.flush()).map_err(|e| CliError::runtime(format!("mesh: cannot send: {e}")))
}

fn receive(r: &mut impl BufRead) -> CliResult<Message> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) => Err(CliError::runtime("mesh: the other side closed the conversation")),
        Ok(_) => serde_json::from_str(&line).map_err(|e| CliError::runtime(format!("mesh: bad message {line:?}: {e}"))),
        Err(e) => Err(CliError::runtime(format!("mesh: cannot read: {e}"))),
    }
}

fn unexpected(m: &Message, wanted: &str) -> CliError {
    CliError::runtime(format!("mesh: expected {wanted}, got {m:?}"))
}

// -- a member ------------------------------------------------------------------------------

/// A member's memory: its source block and `members` slots, in host or GPU memory.
enum Memory {
    Host { source: std::sync::Arc<SharedSegment>, slots: std::sync::Arc<SharedSegment> },
    Gpu { source: DeviceBuffer, slots: DeviceBuffer },
}

impl Memory {
    fn new(a: &MemberArgs) -> CliResult<Memory> {
        let (block, n) = (a.block as usize, a.members);
        let mut pattern_bytes = vec![0u8; block];
        pattern::fill(&mut pattern_bytes, a.index as u64);
        Ok(match a.gpu {
            None => {
                let source = SharedSegment::allocate(block)?;
                pattern::bytes_mut(&source, a.block).copy_from_slice(&pattern_bytes);
                let slots = SharedSegment::allocate(block * n)?;
                pattern::bytes_mut(&slots, a.block * n as u64).fill(pattern::POISON);
                Memory::Host { source, slots }
            }
            Some(g) => {
                let device = driver::Device::get(g)?;
                let source = DeviceBuffer::upload(device, &pattern_bytes)?;
                // Poisoned a slot at a time: a host copy of all of them would cost every
                // member as much host memory as GPU memory, all members at once.
                let slots = DeviceBuffer::alloc(device, block * n)?;
                let poison = vec![pattern::POISON; block];
                for j in 0..n {
                    driver::copy_sync(device, slots.addr() + (j * block) as u64, poison.as_ptr() as u64, block)?;
                }
                Memory::Gpu { source, slots }
            }
        })
    }

    fn kind(&self) -> MemKind {
        match self {
            Memory::Host { .. } => MemKind::Dram,
            Memory::Gpu { .. } => MemKind::Vram,
        }
    }

    fn source(&self) -> u64 {
        match self {
            Memory::Host { source, .. } => source.addr(),
            Memory::Gpu { source, .. } => source.addr(),
        }
    }

    fn slots(&self) -> u64 {
        match self {
            Memory::Host { slots, .. } => slots.addr(),
            Memory::Gpu { slots, .. } => slots.addr(),
        }
    }

    fn register(&self, agent: &Agent, a: &MemberArgs) -> CliResult<()> {
        let dev = a.gpu.unwrap_or(0) as u64;
        agent.register(self.kind(), self.source(), a.block, dev)?;
        agent.register(self.kind(), self.slots(), a.block * a.members as u64, dev)?;
        Ok(())
    }

    /// What the other members wrote, slot by slot (this member's own slot stays poisoned).
    fn check(&self, a: &MemberArgs) -> CliResult<Vec<String>> {
        let block = a.block as usize;
        // GPU slots come to the host one at a time, for the reason in `new`.
        let mut staging = match self {
            Memory::Host { .. } => Vec::new(),
            Memory::Gpu { .. } => vec![0u8; block],
        };
        let mut errors = Vec::new();
        for j in (0..a.members).filter(|&j| j != a.index) {
            let slot: &[u8] = match self {
                Memory::Host { slots, .. } => {
                    &pattern::bytes_mut(slots, a.block * a.members as u64)[j * block..(j + 1) * block]
                }
                Memory::Gpu { slots, .. } => {
                    let at = slots.addr() + (j * block) as u64;
                    driver::copy_sync(slots.device(), staging.as_mut_ptr() as u64, at, block)?;
                    &staging
                }
            };
            if let Err(e) = pattern::check(slot, j as u64) {
                errors.push(format!("slot of member {j}: {e}"));
            }
        }
        Ok(errors)
    }
}

/// Runs one member (a child process of [`run`]).
pub fn run_member(a: &MemberArgs) -> CliResult<()> {
    let (stdin, stdout) = (std::io::stdin(), std::io::stdout());
    let (mut input, mut output) = (stdin.lock(), stdout.lock());
    let name = format!("mesh-{}", a.index);
    let agent = Agent::new(&name, a.engine.agent_config("127.0.0.1:0", a.engine.transport.require()))?;
    let memory = Memory::new(a)?;
    memory.register(&agent, a)?;
    let hello = Hello {
        index: a.index,
        metadata: agent.metadata(),
        slots: memory.slots(),
        kind: memory.kind().as_str().to_string(),
        gpu: a.gpu,
    };
    send(&mut output, &Message::Hello(hello))?;
    let peers = match receive(&mut input)? {
        Message::Peers(p) => p,
        other => return Err(unexpected(&other, "peers")),
    };
    let local = DescList::from_descs(
        memory.kind(),
        [Desc { addr: memory.source(), len: a.block, dev: a.gpu.unwrap_or(0) as u64 }],
    )?;
    let prepared = agent.prepare_local(&local)?;
    let mut requests = Vec::new();
    for p in peers.iter().filter(|p| p.index != a.index) {
        // The members share this command's token, where it has one.
        let peer = agent.add_peer_with_token(&p.metadata, agent.config().token.as_deref())?;
        let kind = MemKind::parse(&p.kind)?;
        let slot = Desc { addr: p.slots + a.index as u64 * a.block, len: a.block, dev: p.gpu.unwrap_or(0) as u64 };
        let remote = agent.prepare_remote(&peer, &DescList::from_descs(kind, [slot])?)?;
        let request = agent.make_request(OpKind::Write, &prepared, None, &remote, None, None)?;
        // Warm up: connections, mappings and registrations happen here, not in the run.
        request.post()?;
        finished(&request, &peer)?;
        requests.push((peer, request));
    }
    let transport = requests.first().map_or("none".to_string(), |(_, r)| r.path().transport.to_string());
    send(&mut output, &Message::Ready)?;
    match receive(&mut input)? {
        Message::Go => {}
        other => return Err(unexpected(&other, "go")),
    }
    let started = Instant::now();
    let deadline = started + a.duration;
    let mut bytes = 0u64;
    for (_, r) in &requests {
        r.post()?;
    }
    // Which requests are out; each one is reposted as it completes until the deadline.
    let mut out = vec![true; requests.len()];
    while out.iter().any(|&o| o) {
        for ((peer, r), out) in requests.iter().zip(&mut out) {
            if !*out || r.status() == Status::Pending {
                continue;
            }
            finished(r, peer)?;
            bytes += a.block;
            *out = Instant::now() < deadline;
            if *out {
                r.post()?;
            }
        }
        std::thread::yield_now();
    }
    let seconds = started.elapsed().as_secs_f64();
    // Posted requests that finished after the deadline were counted: nothing is left out.
    send(&mut output, &Message::Done { bytes, seconds, transport })?;
    match receive(&mut input)? {
        Message::Check => {}
        other => return Err(unexpected(&other, "check")),
    }
    send(&mut output, &Message::Checked { errors: memory.check(a)? })
}

/// A request that is no longer pending must have succeeded.
fn finished(r: &freight_core::Request, peer: &str) -> CliResult<()> {
    match r.wait(Some(Duration::from_secs(60))) {
        Status::Done => Ok(()),
        Status::Error(e) => Err(CliError::runtime(format!("mesh: a write to {peer} failed: {e}"))),
        other => Err(CliError::runtime(format!("mesh: a write to {peer} did not finish ({other:?})"))),
    }
}

// -- the parent ------------------------------------------------------------------------------

struct Member {
    index: usize,
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Member {
    fn talk(&mut self, m: &Message) -> CliResult<()> {
        send(&mut self.input, m).map_err(|e| self.failed(e))
    }
    fn listen(&mut self) -> CliResult<Message> {
        receive(&mut self.output).map_err(|e| self.failed(e))
    }

    /// A conversation that broke: says whether the member died (its own error is on
    /// stderr, above).
    fn failed(&mut self, e: CliError) -> CliError {
        std::thread::sleep(Duration::from_millis(100));
        match self.child.try_wait() {
            Ok(Some(status)) => {
                CliError::runtime(format!("mesh member {} exited ({status}); its error is above", self.index))
            }
            _ => e,
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one member measured.
#[derive(Debug, Serialize)]
pub struct MemberResult {
    pub index: usize,
    pub gpu: Option<usize>,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub transport: String,
    pub errors: Vec<String>,
}

/// Where the members' buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MeshMemory {
    /// GPU memory where GPUs exist, else host memory.
    Auto,
    /// Host memory.
    Host,
    /// GPU memory (an error without a GPU).
    Gpu,
}

/// Starts `n` members writing blocks of `block` bytes to each other for `duration`.
pub fn run(
    n: usize,
    memory: MeshMemory,
    block: u64,
    duration: Duration,
    engine: &EngineOpts,
    json: bool,
    ctx: &Context,
) -> CliResult<()> {
    if n < 2 {
        return Err(CliError::usage("--full-mesh needs at least 2 processes"));
    }
    let gpus = match memory {
        MeshMemory::Host => 0,
        _ if driver::available() => driver::device_count().unwrap_or(0),
        _ => 0,
    };
    if memory == MeshMemory::Gpu && gpus == 0 {
        let why = driver::unavailable_reason().unwrap_or_else(|| "no GPU is visible".into());
        return Err(CliError::runtime(format!("--mesh-memory gpu, but there is no GPU here: {why}")));
    }
    ensure_host_room(n, block, gpus > 0)?;
    let (prog, rest) =
        ctx.self_command.split_first().ok_or_else(|| CliError::runtime("no command to start the members with"))?;
    let mut members = Vec::with_capacity(n);
    for i in 0..n {
        let mut cmd = std::process::Command::new(prog);
        cmd.args(rest).args([SUBCOMMAND, "--index", &i.to_string(), "--members", &n.to_string()]);
        cmd.args(["--block", &block.to_string(), "--duration", &format!("{}us", duration.as_micros())]);
        if gpus > 0 {
            cmd.args(["--gpu", &(i % gpus).to_string()]);
        }
        cmd.args(engine.to_args()).envs(engine.child_env());
        cmd.args(&ctx.log_args);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| CliError::runtime(format!("cannot start mesh member {i}: {e}")))?;
        let (input, output) = (child.stdin.take().expect("piped"), child.stdout.take().expect("piped"));
        members.push(Member { index: i, child, input, output: BufReader::new(output) });
    }
    let mut hellos = Vec::with_capacity(n);
    for m in &mut members {
        match m.listen()? {
            Message::Hello(h) => hellos.push(h),
            other => return Err(unexpected(&other, "hello")),
        }
    }
    for m in &mut members {
        m.talk(&Message::Peers(hellos.clone()))?;
    }
    for m in &mut members {
        match m.listen()? {
            Message::Ready => {}
            other => return Err(unexpected(&other, "ready")),
        }
    }
    for m in &mut members {
        m.talk(&Message::Go)?;
    }
    let mut results = Vec::with_capacity(n);
    for (i, m) in members.iter_mut().enumerate() {
        match m.listen()? {
            Message::Done { bytes, seconds, transport } => results.push(MemberResult {
                index: i,
                gpu: hellos[i].gpu,
                bytes,
                seconds,
                gbps: bytes as f64 / seconds / 1e9,
                transport,
                errors: Vec::new(),
            }),
            other => return Err(unexpected(&other, "done")),
        }
    }
    for (m, r) in members.iter_mut().zip(&mut results) {
        m.talk(&Message::Check)?;
        match m.listen()? {
            Message::Checked { errors } => r.errors = errors,
            other => return Err(unexpected(&other, "checked")),
        }
    }
    report(&results, n, block, duration, engine, json)?;
    match results.iter().find(|r| !r.errors.is_empty()) {
        Some(r) => Err(CliError::runtime(format!("member {} received wrong bytes: {}", r.index, r.errors.join("; ")))),
        None => Ok(()),
    }
}

/// Refuses a mesh whose members, all at once, would take more host memory than there
/// is. Each holds a block of its own and a slot for every member, plus a block of
/// pattern to fill them from; on GPUs only the pattern and one slot in transit are on
/// the host.
fn ensure_host_room(n: usize, block: u64, on_gpus: bool) -> CliResult<()> {
    let blocks_each = if on_gpus { 2 } else { n as u64 + 2 };
    let mut remedy = "lower --full-mesh or the largest of --block-sizes (each process holds a block for every \
                      process)"
        .to_string();
    if !on_gpus {
        remedy.push_str(", or keep the blocks on GPUs (--mesh-memory gpu) where there are some");
    }
    crate::host_memory::ensure_room(
        block.saturating_mul(blocks_each).saturating_mul(n as u64),
        &format!("--full-mesh {n} with {} blocks", format_size(block)),
        &remedy,
    )
}

fn report(
    results: &[MemberResult],
    n: usize,
    block: u64,
    duration: Duration,
    engine: &EngineOpts,
    json: bool,
) -> CliResult<()> {
    let total: f64 = results.iter().map(|r| r.gbps).sum();
    if json {
        let doc = serde_json::json!({
            "benchmark": "full-mesh",
            "members": n,
            "block_bytes": block,
            "seconds": duration.as_secs_f64(),
            "transport": engine.transport.as_str(),
            "verified": results.iter().all(|r| r.errors.is_empty()),
            "total_gbps": total,
            "results": results,
        });
        return emit(&format!("{doc:#}\n"));
    }
    let mut out = format!(
        "full mesh: {n} processes, each writing {} blocks to every other one at once for {:.1} s\n\
         process  GPU   transport  sent GB/s  verified\n",
        format_size(block),
        duration.as_secs_f64()
    );
    for r in results {
        let gpu = r.gpu.map_or("-".to_string(), |g| g.to_string());
        let ok = if r.errors.is_empty() { "yes" } else { "NO" };
        out.push_str(&format!("{:<8} {gpu:<5} {:<10} {:>9.2}  {ok}\n", r.index, r.transport, r.gbps));
    }
    out.push_str(&format!("total                          {total:>9.2}\n"));
    emit(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mesh_the_host_cannot_hold_is_refused_before_any_member_starts() {
        // Each member holds N + 2 blocks: 64 members of 16 TiB exceed any host.
        let err = ensure_host_room(64, 16 << 40, false).unwrap_err();
        assert!(matches!(&err, CliError::Usage(m) if m.contains("--full-mesh 64") && m.contains("--block-sizes")));
        ensure_host_room(3, 1 << 20, false).unwrap();
        ensure_host_room(64, 1 << 20, true).unwrap();
    }
}
