//! A hot request: `lane.admit`, then the steps Python returns, and one try on an engine per `("send",
//! attempt)` — delay, a pooled connection (a stale one retried once on a fresh one), the first-byte
//! timer, the request's deadline, Cancel — ending in `attempt.failed`, `attempt.answered` or, for a 200
//! event stream, `attempt.streaming` and the stream relay (relay.rs).

use crate::body::OutBody;
use crate::cancel::{Cancel, CancelInner};
use crate::forward;
use crate::pool::{self, Key, PooledConn};
use crate::py::{self, AttemptParams, Headers, Step};
use crate::relay;
use crate::server::{respond, Shared};
use hyper::body::{Bytes, HttpBody};
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use hyper::http::request::Parts;
use hyper::{Body, Method, Request, Response, Uri};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A hot request with its body read.
pub struct Req {
    pub t0: Instant,
    pub parts: Parts,
    pub body: Bytes,
    pub peer: String,
}

/// The request-wide context of a try: when it began, its deadline, its Cancel.
pub struct Ctx {
    pub sh: Arc<Shared>,
    pub t0: Instant,
    pub deadline: Option<Instant>,
    pub cancel: Arc<CancelInner>,
}

/// How an upstream operation ended early.
pub enum Stop {
    Cancelled(String),
    Deadline,
}

impl Ctx {
    /// Run `fut` until it ends, the deadline passes or a cancel comes.
    pub async fn guard<T>(&self, fut: impl Future<Output = T>) -> Result<T, Stop> {
        tokio::select! {
            biased;
            r = self.cancel.wait() => Err(Stop::Cancelled(r)),
            _ = sleep_opt(self.deadline) => Err(Stop::Deadline),
            v = fut => Ok(v),
        }
    }
}

pub async fn sleep_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

/// What one try gave.
enum Outcome {
    Failed(String, String),
    Answered { status: u16, headers: hyper::HeaderMap, body: Option<Bytes> },
    Stream(Response<Body>, PooledConn, Key),
}

fn fail(kind: &str, detail: impl Into<String>) -> Outcome {
    Outcome::Failed(kind.to_string(), detail.into())
}

fn stopped(s: Stop) -> Outcome {
    match s {
        Stop::Cancelled(k) => fail(&k, "cancelled"),
        Stop::Deadline => fail("deadline", "the request's deadline passed"),
    }
}

/// Calls `attempt.client_gone()` if dropped while armed (hyper drops a request's future when its client
/// goes away; the engine connection, owned by that future, closes with it).
struct Gone<'a>(&'a Shared, Option<PyObject>);

impl Drop for Gone<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.1.take() {
            client_gone(self.0, &a);
        }
    }
}

/// `attempt.client_gone()` (an exception goes to `lane.internal_error`).
pub fn client_gone(sh: &Shared, attempt: &PyObject) {
    if let Err(e) = py::call_none(attempt, "client_gone", ()) {
        py::report(&sh.lane, "client_gone", e);
    }
}

pub fn internal(sh: &Shared, where_: &str, e: PyErr) -> Response<OutBody> {
    py::report(&sh.lane, where_, e);
    respond(500, &[], sh.limits.server_error.clone(), false)
}

fn with_headers(mut r: Response<OutBody>, extra: &Headers) -> Response<OutBody> {
    py::append_headers(r.headers_mut(), extra);
    r
}

/// Serve a hot request: admit, then follow the steps.
pub async fn hot(sh: Arc<Shared>, rq: Req) -> Response<OutBody> {
    let cancel = Arc::new(CancelInner::default());
    let admitted = Python::with_gil(|py| -> PyResult<Step> {
        let headers = py::headers_to_py(py, &rq.parts.headers);
        let c = Py::new(py, Cancel { inner: cancel.clone() })?;
        let args = (
            rq.parts.uri.path(),
            rq.parts.uri.query().unwrap_or(""),
            headers,
            PyBytes::new(py, &rq.body),
            rq.peer.as_str(),
            c,
        );
        py::step_of(sh.lane.call_method1(py, intern!(py, "admit"), args)?.as_ref(py))
    });
    let step = match admitted {
        Ok(s) => s,
        Err(e) => return internal(&sh, "admit", e),
    };
    let mut ctx = Ctx { sh: sh.clone(), t0: rq.t0, deadline: None, cancel };
    let mut step = step;
    let mut answer: Option<(u16, hyper::HeaderMap, Option<Bytes>, Headers)> = None;
    loop {
        match step {
            Step::Fallback(extra) => {
                let mut hm = rq.parts.headers.clone();
                py::append_headers(&mut hm, &extra);
                let req = forward::fallback_request(&sh, Method::POST, rq.parts.uri.path_and_query().map_or("/", |p| p.as_str()),
                                                    hm, Body::from(rq.body.clone()), Some(&rq.peer));
                return match sh.fb.request(req).await {
                    Ok(resp) => {
                        let (mut parts, body) = resp.into_parts();
                        forward::strip_hop(&mut parts.headers);
                        Response::from_parts(parts, OutBody::proxy(body))
                    }
                    Err(e) => forward::unreachable(&e),
                };
            }
            Step::Reply(status, headers, body) => return respond(status, &headers, body, false),
            Step::Relay => {
                let (status, headers, body, extra) = match answer.take() {
                    Some(a) => a,
                    None => return internal(&sh, "relay", PyValueError::new_err("relay without an answer")),
                };
                let mut hs: Headers = Vec::new();
                if let Some(ct) = headers.get(CONTENT_TYPE) {
                    hs.push((Bytes::from_static(b"content-type"), Bytes::copy_from_slice(ct.as_bytes())));
                }
                hs.extend(extra);
                return respond(status, &hs, body.unwrap_or_default(), false);
            }
            Step::Send(attempt, a) => {
                ctx.deadline = a.deadline_s.map(|d| rq.t0 + crate::secs(d.max(0.0)));
                let mut gone = Gone(&sh, Some(attempt.clone()));
                let outcome = try_once(&ctx, &a).await;
                gone.1 = None;
                let (called, r) = match outcome {
                    Outcome::Failed(kind, detail) => ("failed", py::call_step(&attempt, "failed", (kind, detail))),
                    Outcome::Answered { status, headers, body } => {
                        let r = Python::with_gil(|py| {
                            let hs = py::headers_to_py(py, &headers);
                            let b = body.as_ref().map(|b| PyBytes::new(py, b));
                            py::step_of(attempt.call_method1(py, intern!(py, "answered"), (status, hs, b))?.as_ref(py))
                        });
                        answer = Some((status, headers, body, a.reply_headers.clone()));
                        ("answered", r)
                    }
                    Outcome::Stream(resp, conn, key) => {
                        if let Err(e) = py::call_none(&attempt, "streaming", ()) {
                            return internal(&sh, "streaming", e);
                        }
                        let (body, tx, drained) = OutBody::channel();
                        let mut out = Response::new(body);
                        let h = out.headers_mut();
                        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
                        h.insert(HeaderName::from_static("cache-control"), HeaderValue::from_static("no-cache"));
                        let out = with_headers(out, &a.reply_headers);
                        tokio::spawn(relay::relay(ctx, *a, attempt, resp.into_body(), conn, key, tx, drained));
                        return out;
                    }
                };
                step = match r {
                    Ok(s) => s,
                    Err(e) => return internal(&sh, called, e),
                };
            }
            other => {
                let e = pyo3::exceptions::PyValueError::new_err(format!("step {:?} is not allowed here", other.name()));
                return internal(&sh, "step", e);
            }
        }
    }
}

fn classify(e: &hyper::Error) -> &'static str {
    if e.is_parse() || e.is_parse_status() || e.is_parse_too_large() {
        "bad_http"
    } else {
        "reset"
    }
}

/// One try: send, wait for the head, read a body that is not a stream.
async fn try_once(ctx: &Ctx, a: &AttemptParams) -> Outcome {
    if a.delay_s > 0.0 {
        if let Err(s) = ctx.guard(tokio::time::sleep(crate::secs(a.delay_s))).await {
            return stopped(s);
        }
    }
    let uri: Uri = match a.url.parse() {
        Ok(u) => u,
        Err(e) => return fail("connect", format!("bad url {:?}: {}", a.url, e)),
    };
    let key: Key = (uri.host().unwrap_or("127.0.0.1").to_string(), uri.port_u16().unwrap_or(80));
    let pq = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let first_byte = a.first_byte_timeout.map(|t| Instant::now() + crate::secs(t.max(0.0)));
    let mut taken = ctx.sh.pool.take(&key).await;
    let (resp, conn) = loop {
        let reused = taken.is_some();
        let mut conn = match taken.take() {
            Some(c) => c,
            None => match ctx.guard(tokio::time::timeout_at(far(first_byte).into(), pool::connect(&key))).await {
                Err(s) => return stopped(s),
                Ok(Err(_)) => return fail("connect", format!("connecting to {}:{} timed out", key.0, key.1)),
                Ok(Ok(Err(e))) => return fail("connect", format!("cannot connect to {}:{}: {}", key.0, key.1, e)),
                Ok(Ok(Ok(c))) => c,
            },
        };
        let mut req = Request::new(Body::from(a.body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = pq.parse().unwrap_or_else(|_| Uri::from_static("/"));
        let h = req.headers_mut();
        for (k, v) in &a.headers {
            if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k), HeaderValue::from_bytes(v)) {
                if k != HOST && k != CONTENT_LENGTH {
                    h.append(k, v);
                }
            }
        }
        let host = if key.1 == 80 { key.0.clone() } else { format!("{}:{}", key.0, key.1) };
        h.insert(HOST, HeaderValue::from_str(&host).unwrap_or(HeaderValue::from_static("localhost")));
        h.insert(CONTENT_LENGTH, HeaderValue::from(a.body.len()));
        let sent = conn.sr.send_request(req);
        match ctx.guard(tokio::time::timeout_at(far(first_byte).into(), sent)).await {
            Err(s) => return stopped(s),
            Ok(Err(_)) => {
                if reused && !conn.got_bytes() {
                    ctx.sh.pool.drop_idle(&key); // (those went idle with it: see transport.py drop_idle)
                }
                return fail("timeout", "no answer within the first-byte timeout");
            }
            Ok(Ok(Err(e))) => {
                if reused && !conn.got_bytes() && !e.is_parse() {
                    continue; // a stale keep-alive connection: once more on a fresh one
                }
                return fail(classify(&e), e.to_string());
            }
            Ok(Ok(Ok(r))) => break (r, conn),
        }
    };
    let status = resp.status().as_u16();
    let is_sse = resp
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map_or(false, |v| v.contains("event-stream"));
    if a.stream && status == 200 && is_sse {
        return Outcome::Stream(resp, conn, key);
    }
    let limit = if status == 200 { a.max_answer_bytes } else { a.error_body_bytes };
    let (parts, mut body) = resp.into_parts();
    let stall = a.first_byte_timeout.map(|t| crate::secs(t.max(0.0)));
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let next = ctx.guard(async {
            match stall {
                Some(d) => tokio::time::timeout(d, body.data()).await.ok(),
                None => Some(body.data().await),
            }
        });
        match next.await {
            Err(s) => return stopped(s),
            Ok(None) => return fail("stalled_body", "the answer's body stopped arriving"),
            Ok(Some(None)) => break,
            Ok(Some(Some(Err(e)))) => return fail("broke_off", format!("the answer's body broke off: {}", e)),
            Ok(Some(Some(Ok(c)))) => {
                if buf.len() + c.len() > limit {
                    // longer than the bound: the rest is dropped with the connection
                    let body = if status == 200 {
                        None
                    } else {
                        buf.extend_from_slice(&c[..limit - buf.len()]);
                        Some(Bytes::from(buf))
                    };
                    return Outcome::Answered { status, headers: parts.headers, body };
                }
                buf.extend_from_slice(&c);
            }
        }
    }
    ctx.sh.pool.put(key, conn);
    Outcome::Answered { status, headers: parts.headers, body: Some(Bytes::from(buf)) }
}

/// An instant for an optional timer (none: far away).
pub fn far(t: Option<Instant>) -> Instant {
    t.unwrap_or_else(|| Instant::now() + Duration::from_secs(86400 * 365))
}
