//! Cancel: one per hot request, handed to `lane.admit`. `cancel(reason)` may come from any thread; the
//! request's current upstream operation (attempt.rs, relay.rs) then ends as kind "cancelled:<reason>".
//! A cancel is consumed by the operation it ends (or, when none runs, by the next one): a later try or a
//! stream's continuation is not cancelled by it. Idempotent: a reason cancels at most once (calling
//! `cancel("x")` again, before or after, does nothing); `.cancelled` stays true.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

#[derive(Default)]
pub struct CancelInner {
    pending: Mutex<Option<String>>,
    used: Mutex<Vec<String>>,
    ever: AtomicBool,
    notify: Notify,
    last_event: Mutex<Option<Instant>>, // the relayed stream's last data event (None: none yet, or not streaming)
}

impl CancelInner {
    /// The relay wrote a data event now (or, with `false`, its stream is over).
    pub fn mark_event(&self, streaming: bool) {
        *self.last_event.lock().unwrap() = if streaming { Some(Instant::now()) } else { None };
    }

    pub fn cancel(&self, reason: &str) {
        let mut used = self.used.lock().unwrap();
        if used.iter().any(|r| r == reason) {
            return;
        }
        used.push(reason.to_string());
        drop(used);
        let mut p = self.pending.lock().unwrap();
        if p.is_none() {
            *p = Some(reason.to_string());
        }
        self.ever.store(true, Ordering::SeqCst);
        drop(p);
        self.notify.notify_waiters();
    }

    /// Resolves with "cancelled:<reason>" once a cancel is pending (takes it).
    pub async fn wait(&self) -> String {
        loop {
            let n = self.notify.notified();
            if let Some(r) = self.pending.lock().unwrap().take() {
                return format!("cancelled:{}", r);
            }
            n.await;
        }
    }
}

#[pyclass(module = "dyad_dataplane")]
pub struct Cancel {
    pub inner: Arc<CancelInner>,
}

#[pymethods]
impl Cancel {
    /// End the request's current upstream operation as failure kind "cancelled:<reason>". Idempotent.
    fn cancel(&self, py: Python, reason: &str) {
        py.allow_threads(|| self.inner.cancel(reason))
    }

    /// Seconds since the relayed stream's last data event; None before its first one or once it is over
    /// (Python's ``Attempt.quiet_for``: a worker marked down keeps the streams that deliver).
    fn quiet_for(&self) -> Option<f64> {
        self.inner.last_event.lock().unwrap().map(|t| t.elapsed().as_secs_f64())
    }

    #[getter]
    fn cancelled(&self) -> bool {
        self.inner.ever.load(Ordering::SeqCst)
    }
}
