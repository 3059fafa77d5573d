//! The target side of `demo` and `bench p2p`: an agent that owns a buffer, and does what
//! initiators ask of it through notifications (see [`messages`]).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use freight_core::{Agent, MemKind, Notification, SharedSegment};

use crate::options::{format_size, CliError, CliResult, EngineOpts};
use crate::pattern;

pub mod child;
pub mod messages;

use messages::{Command, Reply};

/// The hidden subcommand that starts a target as a child process.
pub const SUBCOMMAND: &str = "__target";

/// Initiators find the target under this peer name.
pub const NAME: &str = "freight-target";

#[derive(Debug, Args)]
pub struct TargetArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,

    /// The initiator's engine options: the target serves with the same configuration.
    #[command(flatten)]
    engine: EngineOpts,
}

/// As a child process: exits by itself when the parent goes away (its stdin closes).
pub fn run_child(a: &TargetArgs) -> CliResult<()> {
    child::exit_with_parent()?;
    serve(&a.listen, false, &a.engine)
}

/// The first line a target prints; its parent reads the address from it.
pub fn listen_line(addrs: &[String], pid: u32) -> String {
    format!("freight target: listening on {} (pid {pid})", addrs.join(", "))
}

/// Addresses and pid from a [`listen_line`].
pub fn parse_listen_line(line: &str) -> Option<(Vec<String>, u32)> {
    let rest = line.trim().strip_prefix("freight target: listening on ")?;
    let (addrs, pid) = rest.rsplit_once(" (pid ")?;
    let pid = pid.strip_suffix(')')?.parse().ok()?;
    let addrs: Vec<String> = addrs.split(", ").map(str::to_string).filter(|a| !a.is_empty()).collect();
    (!addrs.is_empty()).then_some((addrs, pid))
}

/// Serves initiators until one says bye. `standalone` targets narrate on stdout. The
/// fabric transport opens where `fabric` names a provider (or the environment does).
/// Serves initiators with the agent `engine` describes: the side that answers READs
/// sends with its own settings (zero-copy, pinning, streams), so they must be the run's.
pub fn serve(listen: &str, standalone: bool, engine: &EngineOpts) -> CliResult<()> {
    let agent = Agent::new(NAME, engine.agent_config(listen, engine.transport.require()))
        .map_err(|e| CliError::runtime(format!("cannot start the target agent on {listen}: {e}")))?;
    say(&listen_line(&agent.addresses(), std::process::id()));
    if standalone {
        say("waiting for an initiator (freight bench p2p --connect ADDRESS); it decides everything else");
    }
    let mut target = Target { agent: &agent, buffer: None, standalone };
    loop {
        for n in agent.wait_notifs(Duration::from_secs(60)) {
            if !target.handle(n)? {
                return Ok(());
            }
        }
    }
}

/// Best effort: whoever started us may have stopped reading after the address (`| head
/// -1`), and serving must go on regardless.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

struct Buffer {
    seg: Arc<SharedSegment>,
    key: u64,
    kind: MemKind,
}

struct Target<'a> {
    agent: &'a Agent,
    buffer: Option<Buffer>,
    standalone: bool,
}

impl Target<'_> {
    /// Handles one message; false once the session is over.
    fn handle(&mut self, n: Notification) -> CliResult<bool> {
        let cmd = match serde_json::from_slice::<Command>(&n.msg) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(from = %n.from, error = %e, "ignoring a message that is not a command");
                return Ok(true);
            }
        };
        tracing::debug!(from = %n.from, ?cmd, "command");
        let reply = match cmd {
            Command::Bye => {
                if self.standalone {
                    say(&format!("initiator '{}' finished; exiting", n.from));
                }
                self.reply(&n.from, Reply::Done);
                return Ok(false);
            }
            Command::Setup { bytes, kind, reply_to } => match self.setup(&n.from, bytes, &kind, &reply_to) {
                Ok(r) => r,
                Err(e) => {
                    // Without a route back, the initiator can only time out; say why here.
                    eprintln!("freight target: setup for '{}' failed: {e}", n.from);
                    Reply::Failed { error: e }
                }
            },
            Command::Poison { len } => self.with_bytes(len, |b| {
                b.fill(pattern::POISON);
                Ok(())
            }),
            Command::Fill { seed, len } => self.with_bytes(len, |b| {
                pattern::fill(b, seed);
                Ok(())
            }),
            Command::Check { seed, len } => self.with_bytes(len, |b| pattern::check(b, seed)),
        };
        self.reply(&n.from, reply);
        Ok(true)
    }

    fn reply(&self, to: &str, reply: Reply) {
        if let Err(e) = self.agent.notify(to, reply.encode()) {
            eprintln!("freight target: cannot answer '{to}': {e}");
        }
    }

    fn setup(&mut self, from: &str, bytes: u64, kind: &str, reply_to: &[String]) -> Result<Reply, String> {
        let kind = MemKind::parse(kind).map_err(|e| e.to_string())?;
        // The way back first: a buffer that cannot be had (too large for this host) is
        // then a reply the initiator reads, not a wait for one that never comes.
        let mut last = String::from("the initiator sent no address to answer on");
        let mut connected = None;
        for a in reply_to {
            match self.agent.connect(a, self.agent.config().token.as_deref()) {
                Ok(name) => {
                    connected = Some(name);
                    break;
                }
                Err(e) => last = format!("cannot connect back to the initiator at {a}: {e}"),
            }
        }
        let name = connected.ok_or(last)?;
        if name != from {
            tracing::warn!(%from, %name, "the initiator answered under another name");
        }
        let fits = self.buffer.as_ref().is_some_and(|b| b.kind == kind && b.seg.len() as u64 >= bytes);
        if !fits {
            if let Some(old) = self.buffer.take() {
                self.agent.deregister(old.key).map_err(|e| e.to_string())?;
            }
            let len = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes do not fit in memory"))?;
            let remedy = "the initiator must ask for less (bench p2p: smaller --block-sizes x --batch-sizes, \
                          --total-bytes or --max-request-bytes)";
            crate::host_memory::ensure_room(bytes, "the target's buffer", remedy).map_err(|e| e.to_string())?;
            let seg = self.agent.alloc(len).map_err(|e| e.to_string())?;
            // Registered under the kind the initiator asked for, so that the engine itself
            // reports which kinds it cannot move.
            let key = self.agent.register(kind, seg.addr(), bytes, 0).map_err(|e| e.to_string())?;
            self.buffer = Some(Buffer { seg, key, kind });
        }
        let b = self.buffer.as_ref().expect("set above");
        if self.standalone {
            say(&format!("initiator '{from}': {} of {} registered at {:#x}", format_size(bytes), kind, b.seg.addr()));
        }
        Ok(Reply::Ready { addr: b.seg.addr(), len: bytes, pid: std::process::id() })
    }

    fn with_bytes(&self, len: u64, f: impl FnOnce(&mut [u8]) -> Result<(), String>) -> Reply {
        let outcome = match &self.buffer {
            None => Err("no buffer: the initiator must send setup first".to_string()),
            Some(b) if len > b.seg.len() as u64 => Err(format!("{len} bytes asked of a {}-byte buffer", b.seg.len())),
            Some(b) => f(pattern::bytes_mut(&b.seg, len)),
        };
        match outcome {
            Ok(()) => Reply::Done,
            Err(error) => Reply::Failed { error },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listen_line_round_trips() {
        let addrs = vec!["10.0.0.2:7000".to_string(), "127.0.0.1:7000".to_string()];
        let line = listen_line(&addrs, 42);
        assert_eq!(parse_listen_line(&line), Some((addrs, 42)));
        assert_eq!(parse_listen_line("something else"), None);
        assert_eq!(parse_listen_line("freight target: listening on  (pid 1)"), None);
    }
}
