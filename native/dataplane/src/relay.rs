//! The relay of a streamed 200: the engine's events screened (screen.rs) to the client, timed (idle,
//! deadline) and cancellable; then `attempt.stream_done` (complete: called before the chunk that holds
//! `[DONE]` is written, so a client with the whole stream finds it counted) or `attempt.stream_broken` (with
//! what the client was sent: up to `max_answer_bytes`, else None) and its `("end", data)` or `("continue", ...)`
//! (the fallback's body piped into the client's stream), or
//! `attempt.client_gone` when the client left. Runs as its own task: the client's head is already sent.

use crate::attempt::{self, far, Ctx, Stop};
use crate::server::Shared;
use crate::forward;
use crate::pool::{Key, PooledConn};
use crate::py::{self, AttemptParams, Step};
use crate::screen::Screener;
use hyper::body::{Bytes, HttpBody};
use hyper::{Body, HeaderMap, Method};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// After `[DONE]`, how long the engine's body may take to end before its connection is closed, not reused.
const DONE_GRACE: Duration = Duration::from_secs(1);
const INTERNAL_END: &[u8] = b"data: {\"error\": {\"message\": \"internal gateway error\", \"type\": \"server_error\", \"code\": \"internal_error\"}}\n\ndata: [DONE]\n\n";

fn error_end(message: &str, code: &str) -> Bytes {
    let err = serde_json::json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": code}});
    Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", err))
}

struct Timing {
    first: Option<f64>,
    last: Option<f64>,
    last_write: Option<Instant>, // the last write that held a token event (ITL: stream_timing.TokenTimer)
    gaps: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
pub async fn relay(ctx: Ctx, a: AttemptParams, attempt: PyObject, mut body: Body, conn: PooledConn, key: Key,
                   tx: mpsc::Sender<Bytes>, drained: oneshot::Receiver<()>) {
    let mut scr = Screener::new(a.strip_usage);
    // What the client was sent, for a continuation (`stream_broken`), kept up to `max_answer_bytes`: past it the
    // stream is relayed on but no longer kept (`sent_cut`; handed to Python as None: not continuable).
    let mut sent: Vec<u8> = Vec::new();
    let mut sent_cut = false;
    let mut tm = Timing { first: None, last: None, last_write: None, gaps: Vec::new() };
    let idle = a.idle_timeout.map(|t| crate::secs(t.max(0.0)));
    // until the first data event the wait is the first-byte timeout (the engine may still be prefilling)
    let first_wait = a.first_byte_timeout.map(|t| crate::secs(t.max(0.0))).or(idle);
    let write_timeout = ctx.sh.limits.client_write_timeout;
    let idle_sleep = tokio::time::sleep_until(far(first_wait.map(|d| Instant::now() + d)).into());
    tokio::pin!(idle_sleep);
    let broke: (String, String) = loop {
        let next = tokio::select! {
            biased;
            _ = tx.closed() => None,
            r = ctx.guard(async { tokio::select! {
                _ = &mut idle_sleep => None,
                c = body.data() => Some(c),
            }}) => Some(r),
        };
        let r = match next {
            None => return gone(&ctx.sh, conn, &attempt),
            Some(r) => r,
        };
        let chunk = match r {
            Err(Stop::Cancelled(k)) => break (k, "cancelled".into()),
            Err(Stop::Deadline) => break ("deadline".into(), "the request's deadline passed".into()),
            Ok(None) => break ("idle".into(), "no event within the idle timeout".into()),
            Ok(Some(None)) => break ("eof".into(), "the stream ended without [DONE]".into()),
            Ok(Some(Some(Err(e)))) => break ("reset".into(), format!("the stream broke off: {}", e)),
            Ok(Some(Some(Ok(c)))) => c,
        };
        let f = scr.feed(&chunk);
        let mut first_now = None;
        if f.content_events > 0 {
            let at = Instant::now();
            let now = at.duration_since(ctx.t0).as_secs_f64();
            if tm.first.is_none() {
                tm.first = Some(now);
                first_now = Some(now);
            }
            tm.last = Some(now);
            if let Some(prev) = tm.last_write {
                tm.gaps.push(at.duration_since(prev).as_secs_f64());
            }
            tm.gaps.extend(std::iter::repeat(0.0).take(f.content_events as usize - 1));
            tm.last_write = Some(at);
        }
        if f.data_events > 0 {
            ctx.cancel.mark_event(true);
            if let Some(d) = idle {
                idle_sleep.as_mut().reset((Instant::now() + d).into());
            }
        }
        let complete = f.done && f.problem.is_none();
        if complete {
            // The stream is whole: its accounting (usage, ITL, the request's end) before its last bytes go out, as
            // the Python plane observes a stream's timing before it writes (a client that has the whole stream
            // finds the metrics already counted).
            if let Some(first_s) = first_now.take() {
                if let Err(e) = py::call_none(&attempt, "first_event", (first_s,)) {
                    py::report(&ctx.sh.lane, "first_event", e);
                }
            }
            ctx.cancel.mark_event(false);
            let gaps = std::mem::take(&mut tm.gaps);
            let r = Python::with_gil(|py| {
                attempt.call_method1(py, "stream_done", (scr.usage.clone(), scr.events, tm.first, tm.last, gaps)).map(|_| ())
            });
            if let Err(e) = r {
                py::report(&ctx.sh.lane, "stream_done", e);
            }
        }
        if !f.out.is_empty() {
            if !sent_cut {
                if sent.len() + f.out.len() > a.max_answer_bytes {
                    sent_cut = true;
                    sent = Vec::new();
                } else {
                    sent.extend_from_slice(&f.out);
                }
            }
            // a client that takes nothing for client_write_timeout_s stopped reading: let go of it and its engine
            match tokio::time::timeout(write_timeout, tx.send(Bytes::from(f.out))).await {
                Ok(Ok(())) => {}
                _ => {
                    ctx.cancel.mark_event(false);
                    return gone(&ctx.sh, conn, &attempt);
                }
            }
        }
        if let Some(first_s) = first_now {
            if let Err(e) = py::call_none(&attempt, "first_event", (first_s,)) {
                py::report(&ctx.sh.lane, "first_event", e);
            }
        }
        if let Some(p) = f.problem {
            break ("garbage".into(), p);
        }
        if complete {
            drop(tx);
            if drained.await.is_err() {
                return gone(&ctx.sh, conn, &attempt); // (the client left during the last write: nothing more to do)
            }
            // the connection is reused only if the engine's body ends cleanly soon
            if let Ok(None) = tokio::time::timeout(DONE_GRACE, body.data()).await {
                ctx.sh.pool.put(key, conn);
            }
            return;
        }
    };
    drop(body);
    drop(conn); // (a broken stream's connection is not reused)
    ctx.cancel.mark_event(false);
    let (kind, detail) = broke;
    let gaps = std::mem::take(&mut tm.gaps);
    let step = Python::with_gil(|py| {
        let sent: PyObject = if sent_cut { py.None() } else { PyBytes::new(py, &sent).into() };
        let args = (kind, detail, sent, scr.usage.clone(), scr.events, tm.first, tm.last, gaps);
        py::step_of(attempt.call_method1(py, "stream_broken", args)?.as_ref(py))
    });
    match step {
        Ok(Step::End(data)) => {
            let _ = tx.send(data).await;
        }
        Ok(Step::Continue(path, headers, b)) => continuation(&ctx, &tx, &path, headers, b).await,
        Ok(other) => {
            let e = pyo3::exceptions::PyValueError::new_err(format!("step {:?} is not allowed from stream_broken", other.name()));
            py::report(&ctx.sh.lane, "stream_broken", e);
            let _ = tx.send(Bytes::from_static(INTERNAL_END)).await;
        }
        Err(e) => {
            py::report(&ctx.sh.lane, "stream_broken", e);
            let _ = tx.send(Bytes::from_static(INTERNAL_END)).await;
        }
    }
}

fn gone(sh: &Shared, conn: PooledConn, attempt: &PyObject) {
    drop(conn); // the engine sees its connection close
    attempt::client_gone(sh, attempt);
}

/// POST the continuation to the fallback and pipe its body into the client's stream.
async fn continuation(ctx: &Ctx, tx: &mpsc::Sender<Bytes>, path: &str, headers: py::Headers, body: Bytes) {
    let mut hm = HeaderMap::new();
    py::append_headers(&mut hm, &headers);
    let req = forward::fallback_request(&ctx.sh, Method::POST, path, hm, Body::from(body), None);
    let resp = match ctx.guard(ctx.sh.fb.request(req)).await {
        Ok(Ok(r)) if r.status().as_u16() == 200 => r,
        Ok(Ok(r)) => {
            let _ = tx.send(error_end(&format!("the continuation failed: status {}", r.status().as_u16()), "continuation_failed")).await;
            return;
        }
        Ok(Err(e)) => {
            let _ = tx.send(error_end(&format!("the continuation failed: {}", e), "continuation_failed")).await;
            return;
        }
        Err(_) => {
            let _ = tx.send(error_end("the continuation was cancelled", "continuation_failed")).await;
            return;
        }
    };
    let mut b = resp.into_body();
    loop {
        let next = tokio::select! {
            _ = tx.closed() => return,
            r = ctx.guard(b.data()) => r,
        };
        match next {
            Ok(Some(Ok(c))) => {
                if tx.send(c).await.is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Ok(Some(Err(e))) => {
                let _ = tx.send(error_end(&format!("the continuation broke off: {}", e), "continuation_failed")).await;
                return;
            }
            Err(_) => {
                let _ = tx.send(error_end("the continuation was cancelled", "continuation_failed")).await;
                return;
            }
        }
    }
}
