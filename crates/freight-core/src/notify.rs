//! The queue of notifications an agent has received, in arrival order.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// A message from a peer, delivered after the data of the request that carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub from: String,
    pub msg: Vec<u8>,
}

#[derive(Default)]
pub struct NotifQueue {
    queue: Mutex<VecDeque<Notification>>,
    cv: Condvar,
}

impl NotifQueue {
    pub fn push(&self, n: Notification) {
        self.queue.lock().push_back(n);
        self.cv.notify_all();
    }

    /// Everything received so far, oldest first.
    pub fn drain(&self) -> Vec<Notification> {
        self.queue.lock().drain(..).collect()
    }

    /// Waits up to `timeout` for at least one notification, then drains.
    pub fn wait(&self, timeout: Duration) -> Vec<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock();
        while q.is_empty() {
            if self.cv.wait_until(&mut q, deadline).timed_out() {
                break;
            }
        }
        q.drain(..).collect()
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
}
