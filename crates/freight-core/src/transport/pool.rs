//! Copy threads for large shm requests.
//!
//! A request's pieces go into one queue. Threads that finished a task recently poll the
//! queue for a short while (see [`crate::poll`]) before they sleep, and `submit` wakes
//! sleepers only for the pieces that pollers cannot take: back-to-back requests then
//! cost no system call on either side.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use freight_proto::error::Result;

pub type Task = Box<dyn FnOnce() + Send>;

/// How long an idle thread keeps polling before it sleeps.
const LINGER: Duration = Duration::from_micros(50);

#[derive(Default)]
struct Queue {
    tasks: Mutex<VecDeque<Task>>,
    /// `tasks.len()`, readable without the lock.
    queued: AtomicUsize,
    /// Threads polling right now: each will take a task without being woken.
    polling: AtomicUsize,
    wake: Condvar,
    closed: AtomicBool,
}

impl Queue {
    fn pop(&self) -> Option<Task> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut tasks = self.tasks.lock();
        let t = tasks.pop_front();
        self.queued.store(tasks.len(), Ordering::Release);
        t
    }

    fn work(&self) {
        loop {
            if let Some(task) = self.pop() {
                task();
                continue;
            }
            self.polling.fetch_add(1, Ordering::AcqRel);
            let found = freight_host::poll::briefly(LINGER, || (self.queued.load(Ordering::Acquire) > 0).then_some(()));
            self.polling.fetch_sub(1, Ordering::AcqRel);
            if found.is_some() {
                continue;
            }
            let mut tasks = self.tasks.lock();
            // Checked under the lock that `submit` pushes under: no wake-up is lost.
            while tasks.is_empty() {
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
                self.wake.wait(&mut tasks);
            }
        }
    }
}

/// A fixed set of copy threads; dropping the pool stops them once the queue is empty.
pub struct CopyPool {
    queue: Arc<Queue>,
}

impl CopyPool {
    pub fn new(threads: usize) -> Result<CopyPool> {
        let queue = Arc::new(Queue::default());
        for i in 0..threads.max(1) {
            let q = queue.clone();
            thread::Builder::new().name(format!("freight-copy{i}")).spawn(move || q.work())?;
        }
        Ok(CopyPool { queue })
    }

    /// Queues tasks and wakes as many sleeping threads as pollers cannot cover.
    pub fn submit(&self, batch: impl IntoIterator<Item = Task>) {
        let added = {
            let mut tasks = self.queue.tasks.lock();
            let before = tasks.len();
            tasks.extend(batch);
            self.queue.queued.store(tasks.len(), Ordering::Release);
            tasks.len() - before
        };
        let polling = self.queue.polling.load(Ordering::Acquire);
        for _ in 0..added.saturating_sub(polling) {
            self.queue.wake.notify_one();
        }
    }
}

impl Drop for CopyPool {
    fn drop(&mut self) {
        self.queue.closed.store(true, Ordering::Release);
        let _guard = self.queue.tasks.lock();
        self.queue.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn every_task_runs_once_across_bursts_and_idle_gaps() {
        let pool = CopyPool::new(3).unwrap();
        let (tx, rx) = mpsc::channel();
        for burst in 0..50u64 {
            let tasks: Vec<Task> = (0..7u64)
                .map(|i| {
                    let tx = tx.clone();
                    Box::new(move || tx.send(burst * 7 + i).unwrap()) as Task
                })
                .collect();
            pool.submit(tasks);
            if burst % 10 == 0 {
                // Long enough for every thread to stop polling and sleep.
                thread::sleep(Duration::from_millis(5));
            }
        }
        let mut seen: Vec<u64> = (0..350).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..350).collect::<Vec<_>>());
        assert!(rx.recv_timeout(Duration::from_millis(20)).is_err(), "a task ran twice");
    }

    #[test]
    fn dropping_the_pool_stops_its_threads() {
        let pool = CopyPool::new(2).unwrap();
        let weak = Arc::downgrade(&pool.queue);
        drop(pool);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while weak.upgrade().is_some() {
            assert!(std::time::Instant::now() < deadline, "copy threads kept running");
            thread::sleep(Duration::from_millis(1));
        }
    }
}
