//! The initiator's side of a session: starting the target as a child process, and the
//! conversation with a target (ours or one started by hand elsewhere).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use freight_core::{Agent, MemKind};

use super::messages::{Command, Reply};
use crate::options::{CliError, CliResult};
use crate::target;

/// A Python interpreter starting the CLI can take a while on a cold cache.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Checking 64 MiB takes milliseconds; this only bounds a target that went silent.
const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

/// In a child process: exits once the parent goes away, which closes our stdin (the
/// parent holds its end open on purpose, see [`TargetProcess`]). A child whose parent
/// died must not keep its memory and its port until its own timeouts run out.
pub fn exit_with_parent() -> CliResult<()> {
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(|| {
            let mut buf = [0u8; 64];
            while matches!(std::io::Read::read(&mut std::io::stdin(), &mut buf), Ok(n) if n > 0) {}
            tracing::debug!("parent closed our stdin; exiting");
            std::process::exit(0);
        })
        .map_err(|e| CliError::runtime(format!("cannot start a thread: {e}")))?;
    Ok(())
}

/// A target process we started. Dropping it without [`TargetProcess::finish`] stops it.
pub struct TargetProcess {
    child: Mutex<Child>,
    // Held open on purpose: the child exits when it sees EOF here, so it cannot outlive us.
    stdin: Mutex<Option<ChildStdin>>,
    pub addr: String,
    pub pid: u32,
}

impl TargetProcess {
    /// Starts a target process; `extra` are more of its options (`--fabric-provider`...).
    pub fn spawn(
        self_command: &[String],
        log_args: &[String],
        extra: &[String],
        env: &[(&str, String)],
    ) -> CliResult<TargetProcess> {
        let mut args: Vec<String> = [target::SUBCOMMAND, "--listen", "127.0.0.1:0"].map(String::from).to_vec();
        args.extend_from_slice(extra);
        TargetProcess::spawn_with(self_command, &args, log_args, env)
    }

    /// Starts this CLI again with `args` and `env` added to its environment (see
    /// `EngineOpts::child_env`); the child must print a [`target::listen_line`] first.
    pub fn spawn_with(
        self_command: &[String],
        args: &[String],
        log_args: &[String],
        env: &[(&str, String)],
    ) -> CliResult<TargetProcess> {
        let (prog, rest) = self_command
            .split_first()
            .ok_or_else(|| CliError::runtime("no command to start the target process with"))?;
        let mut cmd = std::process::Command::new(prog);
        cmd.args(rest).args(args).args(log_args).envs(env.iter().map(|(k, v)| (k, v)));
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let shown = self_command.join(" ");
        let mut child =
            cmd.spawn().map_err(|e| CliError::runtime(format!("cannot start the target process '{shown}': {e}")))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("target-stdout".into())
            .spawn(move || {
                let mut tx = Some(tx);
                // Keep reading after the address so that the child never blocks on a full pipe.
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    match target::parse_listen_line(&line) {
                        Some(found) if tx.is_some() => {
                            let _ = tx.take().map(|tx| tx.send(found));
                        }
                        // What the child narrates after that, the user sees, marked.
                        _ if tx.is_none() => eprintln!("  child | {line}"),
                        _ => {}
                    }
                }
            })
            .map_err(|e| CliError::runtime(format!("cannot start a thread: {e}")))?;
        let stdin = child.stdin.take();
        let mut process =
            TargetProcess { child: Mutex::new(child), stdin: Mutex::new(stdin), addr: String::new(), pid: 0 };
        match rx.recv_timeout(START_TIMEOUT) {
            Ok((addrs, pid)) => {
                process.addr = addrs[0].clone();
                process.pid = pid;
                Ok(process)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(CliError::runtime(format!(
                "the target process ('{shown}') did not report a listening address within {}s",
                START_TIMEOUT.as_secs()
            ))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = process.child.lock().unwrap().wait().map(|s| s.to_string()).unwrap_or_default();
                Err(CliError::runtime(format!("the target process ('{shown}') exited before listening ({status})")))
            }
        }
    }

    /// Fails once the child has exited (so that waits on it end early, with the reason).
    pub fn check_alive(&self) -> CliResult<()> {
        match self.child.lock().unwrap().try_wait() {
            Ok(Some(status)) => {
                Err(CliError::runtime(format!("the target process (pid {}) exited unexpectedly ({status})", self.pid)))
            }
            _ => Ok(()),
        }
    }

    /// Waits for the child to exit after the session ended, and checks that it succeeded.
    pub fn finish(self) -> CliResult<()> {
        match self.wait_for(Duration::from_secs(10)) {
            Some(status) if status.success() => Ok(()),
            Some(status) => Err(CliError::runtime(format!("the target process exited with {status}"))),
            None => Err(CliError::runtime("the target process did not exit after the session ended")),
        }
    }

    fn wait_for(&self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.lock().unwrap().try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        self.stdin.lock().unwrap().take();
        if self.wait_for(Duration::from_secs(2)).is_none() {
            let mut child = self.child.lock().unwrap();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Where the target's buffer lives, in the target's address space.
#[derive(Debug, Clone, Copy)]
pub struct Remote {
    pub addr: u64,
    pub pid: u32,
}

/// The conversation with a target through one initiator agent.
pub struct Link<'a> {
    agent: &'a Agent,
    pub peer: String,
    process: Option<&'a TargetProcess>,
    pending: VecDeque<Reply>,
}

impl<'a> Link<'a> {
    /// Fetches the target's metadata from its listener at `addr`, presenting this
    /// agent's token (the target has the same one, where there is one).
    pub fn open(agent: &'a Agent, addr: &str, process: Option<&'a TargetProcess>) -> CliResult<Link<'a>> {
        let peer = agent
            .connect(addr, agent.config().token.as_deref())
            .map_err(|e| CliError::runtime(format!("cannot reach the target at {addr}: {e}")))?;
        Ok(Link { agent, peer, process, pending: VecDeque::new() })
    }

    pub fn send(&self, cmd: &Command) -> CliResult<()> {
        self.agent
            .notify(&self.peer, cmd.encode())
            .map_err(|e| CliError::runtime(format!("cannot send to the target: {e}")))
    }

    /// The next reply from the target.
    pub fn recv(&mut self) -> CliResult<Reply> {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        loop {
            if let Some(r) = self.pending.pop_front() {
                return Ok(r);
            }
            for n in self.agent.wait_notifs(Duration::from_millis(200)) {
                if n.from != self.peer {
                    tracing::debug!(from = %n.from, "ignoring a notification from another peer");
                    continue;
                }
                match serde_json::from_slice::<Reply>(&n.msg) {
                    Ok(r) => self.pending.push_back(r),
                    Err(e) => {
                        tracing::warn!(error = %e, "ignoring a malformed reply from the target")
                    }
                }
            }
            if self.pending.is_empty() {
                if let Some(p) = self.process {
                    p.check_alive()?;
                }
                if Instant::now() >= deadline {
                    return Err(CliError::runtime(format!(
                        "no answer from the target within {}s (it must be able to connect back to this process at {})",
                        REPLY_TIMEOUT.as_secs(),
                        self.agent.addresses().join(", ")
                    )));
                }
            }
        }
    }

    /// The outcome of something the target did: `Ok(Err(why))` when it reported failure.
    pub fn outcome(&mut self) -> CliResult<Result<(), String>> {
        match self.recv()? {
            Reply::Done => Ok(Ok(())),
            Reply::Failed { error } => Ok(Err(error)),
            other => Err(CliError::runtime(format!("unexpected answer from the target: {other:?}"))),
        }
    }

    /// Sends a command that must succeed.
    pub fn call(&mut self, cmd: &Command) -> CliResult<()> {
        self.send(cmd)?;
        self.outcome()?.map_err(|e| CliError::runtime(format!("the target could not do {cmd:?}: {e}")))
    }

    /// Has the target allocate and register `bytes` of `kind`, and learns where they are.
    pub fn setup(&mut self, bytes: u64, kind: MemKind) -> CliResult<Remote> {
        self.send(&Command::Setup { bytes, kind: kind.as_str().into(), reply_to: self.agent.addresses() })?;
        match self.recv()? {
            Reply::Ready { len, .. } if len < bytes => {
                Err(CliError::runtime(format!("the target registered {len} bytes, {bytes} were asked for")))
            }
            Reply::Ready { addr, pid, .. } => {
                // The target registered its buffer after we first read its metadata.
                self.agent.refresh_peer(&self.peer, None)?;
                Ok(Remote { addr, pid })
            }
            Reply::Failed { error } => {
                Err(CliError::runtime(format!("the target could not set up its buffer: {error}")))
            }
            other => Err(CliError::runtime(format!("unexpected answer from the target: {other:?}"))),
        }
    }

    /// Ends the session; the target exits.
    pub fn bye(&mut self) -> CliResult<()> {
        self.send(&Command::Bye)?;
        self.outcome()?.map_err(CliError::runtime)
    }
}
