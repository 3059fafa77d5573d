//! The queue of notifications an agent has received, in arrival order.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

/// A message from a peer, delivered after the data of the request that carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub from: String,
    pub msg: Vec<u8>,
}

#[derive(Default)]
struct Queued {
    notifs: VecDeque<Notification>,
    /// A wake-up that no waiter has taken yet (see [`Waker`]).
    woken: bool,
}

#[derive(Default)]
pub struct NotifQueue {
    queue: Mutex<Queued>,
    cv: Condvar,
}

impl NotifQueue {
    pub fn push(&self, n: Notification) {
        self.queue.lock().notifs.push_back(n);
        self.cv.notify_all();
    }

    /// Puts `notifs` (taken earlier, oldest first) back at the front of the queue.
    pub fn give_back(&self, notifs: Vec<Notification>) {
        if notifs.is_empty() {
            return;
        }
        let mut q = self.queue.lock();
        for n in notifs.into_iter().rev() {
            q.notifs.push_front(n);
        }
        self.cv.notify_all();
    }

    /// Everything received so far, oldest first.
    pub fn drain(&self) -> Vec<Notification> {
        self.queue.lock().notifs.drain(..).collect()
    }

    /// Waits up to `timeout` for at least one notification or a wake-up, then drains.
    pub fn wait(&self, timeout: Duration) -> Vec<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock();
        while q.notifs.is_empty() && !q.woken {
            if self.cv.wait_until(&mut q, deadline).timed_out() {
                break;
            }
        }
        q.woken = false;
        q.notifs.drain(..).collect()
    }

    fn wake(&self) {
        self.queue.lock().woken = true;
        self.cv.notify_all();
    }
}

/// Ends a wait for notifications early, from any thread: for loops that wait for their
/// own events (a transfer that completed, a stop request) as well as for notifications.
/// A wake-up with nobody waiting is kept: the next wait returns at once.
#[derive(Clone)]
pub struct Waker(pub(crate) Arc<NotifQueue>);

impl Waker {
    pub fn wake(&self) {
        self.0.wake()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn order_is_preserved_and_wait_wakes() {
        let q = Arc::new(NotifQueue::default());
        assert!(q.wait(Duration::from_millis(5)).is_empty());
        let q2 = q.clone();
        let h = std::thread::spawn(move || q2.wait(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(10));
        for i in 0..3u8 {
            q.push(Notification { from: "a".into(), msg: vec![i] });
        }
        let mut got = h.join().unwrap();
        got.extend(q.drain());
        let msgs: Vec<u8> = got.iter().map(|n| n.msg[0]).collect();
        assert_eq!(msgs, vec![0, 1, 2]);
    }

    #[test]
    fn a_wake_up_ends_one_wait_and_is_kept_until_taken() {
        let q = Arc::new(NotifQueue::default());
        let waker = Waker(q.clone());
        let q2 = q.clone();
        let h = std::thread::spawn(move || {
            let start = Instant::now();
            (q2.wait(Duration::from_secs(10)), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(20));
        waker.wake();
        let (got, waited) = h.join().unwrap();
        assert!(got.is_empty());
        assert!(waited < Duration::from_secs(5), "the wake-up did not end the wait ({waited:?})");
        // Taken by that wait: the next one runs to its timeout.
        let start = Instant::now();
        assert!(q.wait(Duration::from_millis(30)).is_empty());
        assert!(start.elapsed() >= Duration::from_millis(30));
        // A wake-up before anyone waits makes the next wait return at once.
        waker.wake();
        let start = Instant::now();
        q.wait(Duration::from_secs(10));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
