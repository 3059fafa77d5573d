//! One thread per agent and GPU turns finished GPU work into finished requests.
//!
//! Each launch records an event (blocking-sync, so waiting sleeps in the driver rather
//! than spinning) and queues it here with what to do when it fires. A GPU's thread
//! takes them in order: launches on one stream finish in order anyway. How it waits for an
//! event is the agent's [`CompletionMode`]:
//!
//! - `Event`: it polls the event briefly first where that pays (see [`freight_host::poll`]): a
//!   small copy finishes within microseconds, and a sleeping wait would add a wake-up to
//!   every such request. Then it sleeps in the driver until the event fires.
//! - `Poll`: it sleeps until the earliest time the work can be done, as a [`Predictor`]
//!   works out from the request's size and the best rate seen on the GPU, then looks at
//!   the event every few microseconds, sleeping in between. A large request is then
//!   seen done within about [`POLL_SLEEP`] of its end, without a driver wake-up, and
//!   without a core spinning meanwhile. Only where polling pays; elsewhere `Event`.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};

use super::driver::{Device, Event};
use freight_proto::error::{Error, Result};

/// Called once with the outcome of the GPU work.
pub type OnDone = Box<dyn FnOnce(Result<()>) + Send>;

/// How the completion thread waits for GPU work (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionMode {
    /// Brief polling, then a sleeping wait in the driver: no CPU time beyond the brief
    /// polling, but a 4 GiB request of 4 KiB copies on two H200s took 10 to 15% longer
    /// than with `Poll` (the driver's wake-up, `bench/gpu_sweep.py`).
    Event,
    /// Sleep until the predicted end, then poll between short sleeps. Hosts with too
    /// few cores for polling to pay wait as `Event` does.
    #[default]
    Poll,
}

impl CompletionMode {
    pub fn parse(s: &str) -> Result<CompletionMode> {
        match s.to_ascii_lowercase().as_str() {
            "event" => Ok(CompletionMode::Event),
            "poll" => Ok(CompletionMode::Poll),
            _ => Err(Error::InvalidArgument(format!("cuda completion must be \"event\" or \"poll\", got {s:?}"))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CompletionMode::Event => "event",
            CompletionMode::Poll => "poll",
        }
    }
}

/// What the completion thread knows about a launch.
#[derive(Debug, Clone, Copy)]
pub struct Work {
    /// Bytes the launch moves.
    pub bytes: u64,
    /// Taken just before the launch: the GPU cannot have started earlier.
    pub launched: Instant,
}

struct Pending {
    device: &'static Device,
    event: Arc<Event>,
    work: Work,
    on_done: OnDone,
}

/// Polling budget before a sleeping wait on an event (`Event` mode).
const POLL: Duration = Duration::from_micros(100);

/// How long the thread keeps looking for new work after finishing some, before it
/// sleeps (`Event` mode): back-to-back requests then skip a wake-up each.
const LINGER: Duration = Duration::from_micros(200);

/// Requests at least this large teach a [`Predictor`] the GPU's rate: launching and
/// learning of completion are a small part of their time, so bytes / time is close to
/// what the GPU does.
pub const LEARN_MIN_BYTES: u64 = 64 << 20;

/// The best rate seen, times this, is taken as an upper bound of the rate: runs of one
/// machine vary by a few percent, and a bound that is too low would make the thread
/// sleep past the end of the work.
pub const RATE_MARGIN: f64 = 1.5;

/// Longest sleep before the event is looked at again (`Poll` mode): a prediction that
/// is too late (another agent's work on the stream finished early) costs at most this.
pub const MAX_SLEEP: Duration = Duration::from_millis(1);

/// Sleep between looks at the event once the work may be done (`Poll` mode).
pub const POLL_SLEEP: Duration = Duration::from_micros(10);

/// Polling stops after the earliest end plus this, or plus the predicted time, whichever
/// is longer, and a sleeping wait in the driver takes over: work that runs far longer
/// than predicted (a busy GPU, a rate not learned yet) must not cost a wake-up every
/// few microseconds for its whole run.
pub const MIN_POLL_SPAN: Duration = Duration::from_millis(2);

/// The thread's timer slack in `Poll` mode: Linux lets a sleep run over by the slack
/// (50 us by default), five times the sleep itself.
const TIMER_SLACK_NS: libc::c_ulong = 1_000;

/// When to look at a launch's event (`Poll` mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPlan {
    /// The work cannot be done before this: sleep until then.
    pub sleep_until: Instant,
    /// Poll until this, then wait in the driver.
    pub poll_until: Instant,
}

/// Predicts when the launches on one GPU's stream end, from what earlier ones took.
///
/// Launches on a stream run one after another, so a launch starts at the later of its
/// launch time and the end of the one before it (as seen here: a little after the real
/// end). Its end is no earlier than its start plus bytes / (best rate seen x
/// [`RATE_MARGIN`]); before any rate is known, no earlier than its start. Rates are
/// measured from that same start, so a late-seen end of the launch before makes a rate
/// look higher than it was, which only makes later sleeps shorter.
#[derive(Debug, Clone, Default)]
pub struct Predictor {
    /// Bytes per second, the best seen on a launch of at least [`LEARN_MIN_BYTES`].
    best_rate: Option<f64>,
    /// When the latest launch was seen done.
    last_done: Option<Instant>,
}

impl Predictor {
    /// When the GPU starts on work launched at `launched`, at the earliest.
    pub fn start(&self, launched: Instant) -> Instant {
        self.last_done.map_or(launched, |d| d.max(launched))
    }

    /// Shortest time `bytes` can take.
    pub fn least_time(&self, bytes: u64) -> Duration {
        match self.best_rate {
            Some(rate) => Duration::from_secs_f64(bytes as f64 / (rate * RATE_MARGIN)),
            None => Duration::ZERO,
        }
    }

    pub fn plan(&self, work: &Work) -> WaitPlan {
        let least = self.least_time(work.bytes);
        let sleep_until = self.start(work.launched) + least;
        WaitPlan { sleep_until, poll_until: sleep_until + least.max(MIN_POLL_SPAN) }
    }

    /// Takes note that `work` was seen done at `done`; `ok`: it succeeded (a failed
    /// launch says nothing about the rate).
    pub fn finished(&mut self, work: &Work, done: Instant, ok: bool) {
        let start = self.start(work.launched);
        if ok && work.bytes >= LEARN_MIN_BYTES {
            let took = done.saturating_duration_since(start).as_secs_f64();
            if took > 0.0 {
                let rate = work.bytes as f64 / took;
                if !self.best_rate.is_some_and(|best| best >= rate) {
                    tracing::debug!(gbps = rate / 1e9, "best GPU copy rate so far");
                    self.best_rate = Some(rate);
                }
            }
        }
        self.last_done = Some(self.last_done.map_or(done, |d| d.max(done)));
    }

    /// Bytes per second, once learned.
    pub fn best_rate(&self) -> Option<f64> {
        self.best_rate
    }
}

/// The agent's completion threads, one per GPU it launched on (started on first use):
/// events of one GPU's stream fire in order, those of two GPUs do not, and a long copy
/// on one must not hold up reporting a short one that finished on the other.
pub struct Completions {
    agent: String,
    polling: bool,
    queues: parking_lot::Mutex<HashMap<usize, Sender<Pending>>>,
}

impl Completions {
    pub fn start(agent: &str, mode: CompletionMode) -> Result<Completions> {
        let polling = mode == CompletionMode::Poll && freight_host::poll::polling_pays();
        if mode == CompletionMode::Poll && !polling {
            tracing::debug!(agent, "too few cores to poll for GPU completions: waiting on events instead");
        }
        Ok(Completions { agent: agent.to_string(), polling, queues: Default::default() })
    }

    fn queue(&self, device: &Device) -> Result<Sender<Pending>> {
        let mut queues = self.queues.lock();
        if let Some(q) = queues.get(&device.ordinal) {
            return Ok(q.clone());
        }
        let (tx, rx) = unbounded::<Pending>();
        let name = format!("freight-gpu{}-{}", device.ordinal, self.agent);
        if self.polling {
            thread::Builder::new().name(name).spawn(move || run_polling(rx))?;
        } else {
            thread::Builder::new().name(name).spawn(move || run_event(rx))?;
        }
        queues.insert(device.ordinal, tx.clone());
        Ok(tx)
    }

    /// Calls `on_done` once `event` (already recorded on `device`'s stream after `work`)
    /// fires.
    pub fn watch(&self, device: &'static Device, event: Arc<Event>, work: Work, on_done: OnDone) {
        let pending = Pending { device, event, work, on_done };
        let sent = match self.queue(device) {
            Ok(q) => q.send(pending).map_err(|e| (e.into_inner(), Error::InvalidState("the agent is closed".into()))),
            Err(e) => Err((pending, e)),
        };
        if let Err((pending, e)) = sent {
            // Report rather than leave the request waiting for ever.
            let e = once_fired(pending.device, &pending.event, e);
            (pending.on_done)(Err(e));
        }
    }
}

/// `e`, returned once `event` fired: the work queued before it still reads and writes
/// the request's memory, which a finished request lets its owner release or reuse.
fn once_fired(device: &Device, event: &Event, e: Error) -> Error {
    let _ctx = device.bind();
    if let Err(wait) = event.synchronize() {
        tracing::warn!(error = %wait, "cannot wait for a failed request's GPU work");
    }
    e
}

fn run_event(rx: Receiver<Pending>) {
    loop {
        let next = freight_host::poll::briefly(LINGER, || rx.try_recv().ok()).map(Ok).unwrap_or_else(|| rx.recv());
        let Ok(p) = next else { break };
        let outcome = match p.device.bind() {
            Ok(_ctx) => {
                // An error from the query ends the polling; the sleeping wait reports it.
                let ready = freight_host::poll::briefly(POLL, || match p.event.query() {
                    Ok(true) => Some(()),
                    Ok(false) => None,
                    Err(_) => Some(()),
                });
                match ready {
                    Some(()) => p.event.query().map(|_| ()),
                    None => p.event.synchronize(),
                }
            }
            Err(e) => Err(once_fired(p.device, &p.event, e)),
        };
        (p.on_done)(outcome);
    }
}

fn run_polling(rx: Receiver<Pending>) {
    // SAFETY: prctl with PR_SET_TIMERSLACK only changes this thread's timer slack.
    if unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot shorten the timer slack");
    }
    let mut predictors: HashMap<usize, Predictor> = HashMap::new();
    // No lingering for new work here: the wake-up for a new launch overlaps the GPU's
    // work on it, and small requests are watched by their posting thread.
    while let Ok(p) = rx.recv() {
        let predictor = predictors.entry(p.device.ordinal).or_default();
        let outcome = match p.device.bind() {
            Ok(_ctx) => wait_planned(&p.event, predictor.plan(&p.work)),
            Err(e) => Err(once_fired(p.device, &p.event, e)),
        };
        predictor.finished(&p.work, Instant::now(), outcome.is_ok());
        (p.on_done)(outcome);
    }
}

/// Waits for `event` as `plan` says: sleeps (looking at the event at least every
/// [`MAX_SLEEP`]) until the work may be done, then polls every [`POLL_SLEEP`], then
/// sleeps in the driver.
fn wait_planned(event: &Event, plan: WaitPlan) -> Result<()> {
    loop {
        if event.query()? {
            return Ok(());
        }
        let now = Instant::now();
        if now >= plan.poll_until {
            return event.synchronize();
        }
        let nap = if now < plan.sleep_until { (plan.sleep_until - now).min(MAX_SLEEP) } else { POLL_SLEEP };
        thread::sleep(nap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ms(n: f64) -> Duration {
        Duration::from_secs_f64(n / 1e3)
    }

    #[test]
    fn before_any_rate_is_known_the_work_may_be_done_at_once() {
        let p = Predictor::default();
        let t0 = Instant::now();
        let plan = p.plan(&Work { bytes: 4 << 30, launched: t0 });
        assert_eq!(plan.sleep_until, t0);
        assert_eq!(plan.poll_until, t0 + MIN_POLL_SPAN);
    }

    #[test]
    fn the_best_rate_of_large_requests_bounds_the_sleep() {
        let mut p = Predictor::default();
        let t0 = Instant::now();
        // 256 MiB in 1 ms; then 256 MiB in 2 ms (slower: the best stays).
        let a = Work { bytes: 256 * MIB, launched: t0 };
        p.finished(&a, t0 + ms(1.0), true);
        let b = Work { bytes: 256 * MIB, launched: t0 + ms(5.0) };
        p.finished(&b, t0 + ms(7.0), true);
        let best = p.best_rate().unwrap();
        assert!((best - 256.0 * MIB as f64 / 1e-3).abs() / best < 1e-6, "{best}");
        // 512 MiB launched at 10 ms: no earlier than 2 ms / 1.5 later.
        let c = Work { bytes: 512 * MIB, launched: t0 + ms(10.0) };
        let plan = p.plan(&c);
        let least = plan.sleep_until - c.launched;
        assert!((least.as_secs_f64() - 2e-3 / RATE_MARGIN).abs() < 1e-6, "{least:?}");
        assert_eq!(plan.poll_until, plan.sleep_until + MIN_POLL_SPAN);
        // A long request polls for as long as it is predicted to take, at least.
        let huge = Work { bytes: 64 << 30, launched: t0 + ms(10.0) };
        let plan = p.plan(&huge);
        assert_eq!(plan.poll_until - plan.sleep_until, plan.sleep_until - huge.launched);
    }

    #[test]
    fn small_and_failed_requests_teach_nothing() {
        let mut p = Predictor::default();
        let t0 = Instant::now();
        p.finished(&Work { bytes: LEARN_MIN_BYTES - 1, launched: t0 }, t0 + ms(0.01), true);
        p.finished(&Work { bytes: LEARN_MIN_BYTES, launched: t0 + ms(1.0) }, t0 + ms(1.001), false);
        assert_eq!(p.best_rate(), None);
        p.finished(&Work { bytes: LEARN_MIN_BYTES, launched: t0 + ms(2.0) }, t0 + ms(3.0), true);
        assert!(p.best_rate().is_some());
    }

    #[test]
    fn queued_work_starts_when_the_work_before_it_ends() {
        let mut p = Predictor::default();
        let t0 = Instant::now();
        // Two 256 MiB launches 10 us apart; the first is seen done at 2 ms, the second
        // at 4 ms: it ran from 2 to 4 ms, not from 10 us.
        let a = Work { bytes: 256 * MIB, launched: t0 };
        let b = Work { bytes: 256 * MIB, launched: t0 + ms(0.01) };
        p.finished(&a, t0 + ms(2.0), true);
        assert_eq!(p.start(b.launched), t0 + ms(2.0));
        assert_eq!(p.plan(&b).sleep_until, t0 + ms(2.0) + p.least_time(b.bytes));
        p.finished(&b, t0 + ms(4.0), true);
        let best = p.best_rate().unwrap();
        assert!((best - 256.0 * MIB as f64 / 2e-3).abs() / best < 1e-6, "{best}");
        // Work launched after an idle spell starts at its launch.
        let c = Work { bytes: MIB, launched: t0 + ms(50.0) };
        assert_eq!(p.start(c.launched), c.launched);
    }

    #[test]
    fn modes_parse_and_say_what_they_accept() {
        assert_eq!(CompletionMode::parse("POLL").unwrap(), CompletionMode::Poll);
        assert_eq!(CompletionMode::parse("event").unwrap().as_str(), "event");
        let e = CompletionMode::parse("spin").unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("\"event\" or \"poll\"")), "{e}");
    }
}
