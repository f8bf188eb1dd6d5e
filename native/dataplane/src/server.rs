//! The client side: accepts connections (counting them against `max_connections`), serves HTTP/1.1 with
//! keep-alive (`header_timeout_s` for a head, `keepalive_s` for an idle connection), removes client
//! headers named `x-dyad-native-*`, sends what is not hot to the fallback (forward.rs) and hands hot
//! requests, with their body read, to the lane (attempt.rs). `serve` runs until Plane.stop.

use crate::attempt;
use crate::body::{ConnState, InFlight, OutBody, Stats};
use crate::forward;
use crate::pool::Pool;
use hyper::body::{Bytes, HttpBody};
use hyper::client::HttpConnector;
use hyper::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::Http;
use hyper::service::service_fn;
use hyper::{Body, Client, Method, Request, Response, StatusCode};
use pyo3::PyObject;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Limits {
    pub hot_paths: Vec<String>,
    pub max_body_bytes: usize,
    pub body_too_large: Bytes,
    pub max_connections: usize,
    pub overloaded: Bytes,
    pub header_timeout: Duration,
    pub keepalive: Duration,
    pub server_error: Bytes,
    pub retry_after: Bytes,
    pub client_write_timeout: Duration,
}

pub struct Shared {
    pub lane: PyObject,
    pub fallback: String,
    pub secret: HeaderValue,
    pub limits: Limits,
    pub stats: Arc<Stats>,
    pub fb: Client<HttpConnector, Body>,
    pub pool: Arc<Pool>,
}

/// A whole answer (`close`: tell the client the connection ends with it).
pub fn respond(status: u16, headers: &[(Bytes, Bytes)], body: Bytes, close: bool) -> Response<OutBody> {
    let mut r = Response::new(OutBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k), HeaderValue::from_bytes(v)) {
            if k == CONTENT_LENGTH {
                continue; // (hyper writes the body's length)
            }
            h.append(k, v);
        }
    }
    if !h.contains_key(CONTENT_TYPE) {
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    if close {
        h.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

/// Accept until `stop` says how long to wait for requests in flight (seconds); then wait that long.
pub async fn serve(listener: TcpListener, sh: Arc<Shared>, mut stop: watch::Receiver<Option<f64>>) {
    let (shut_tx, shut_rx) = watch::channel(false);
    let grace = loop {
        tokio::select! {
            r = listener.accept() => {
                if let Ok((io, peer)) = r {
                    let over = sh.limits.max_connections > 0
                        && sh.stats.connections.load(Ordering::Relaxed) >= sh.limits.max_connections;
                    sh.stats.connections.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(connection(io, peer.to_string(), sh.clone(), over, shut_rx.clone()));
                }
            }
            _ = stop.changed() => break stop.borrow().unwrap_or(0.0),
        }
    };
    drop(listener);
    let _ = shut_tx.send(true);
    let until = Instant::now() + crate::secs(grace.max(0.0));
    while sh.stats.in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A client's socket that notes when the first byte of a new head arrives (hyper 0.14.19's own header
/// timeout only fires when more bytes come: a head that stops is timed here).
struct ClientIo {
    io: TcpStream,
    cs: Arc<ConnState>,
}

impl AsyncRead for ClientIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before && self.cs.active.load(Ordering::Relaxed) == 0 {
            let mut h = self.cs.head_since.lock().unwrap();
            if h.is_none() {
                *h = Some(Instant::now());
            }
        }
        r
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, b)
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[io::IoSlice<'_>])
                           -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, b)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

async fn connection(io: TcpStream, peer: String, sh: Arc<Shared>, over: bool, mut shut: watch::Receiver<bool>) {
    let _ = io.set_nodelay(true);
    let cs = Arc::new(ConnState {
        active: Default::default(),
        last: Mutex::new(Instant::now()),
        head_since: Mutex::new(None),
    });
    let io = ClientIo { io, cs: cs.clone() };
    let svc = {
        let (sh, cs) = (sh.clone(), cs.clone());
        service_fn(move |req| handle(req, sh.clone(), peer.clone(), cs.clone(), over))
    };
    let conn = Http::new()
        .http1_only(true)
        .http1_keep_alive(true)
        .http1_header_read_timeout(sh.limits.header_timeout)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let keepalive = sh.limits.keepalive;
    let head_timeout = sh.limits.header_timeout;
    let tick = (keepalive.min(head_timeout) / 4).max(Duration::from_millis(10));
    let mut shutting = *shut.borrow();
    if shutting {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            _ = &mut conn => break,
            _ = shut.changed(), if !shutting => {
                shutting = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep(tick) => {
                if cs.active.load(Ordering::Relaxed) == 0 {
                    let head = *cs.head_since.lock().unwrap();
                    let expired = match head {
                        Some(t) => t.elapsed() >= head_timeout, // a head that stopped arriving
                        None => cs.last.lock().unwrap().elapsed() >= keepalive, // idle
                    };
                    if expired {
                        break; // (no request in flight: closed by dropping it)
                    }
                }
            }
        }
    }
    sh.stats.connections.fetch_sub(1, Ordering::Relaxed);
}

pub enum BodyErr {
    TooLarge,
    Timeout,
    Broken,
}

/// The request body, bounded by `max` bytes and `until`.
pub async fn read_body(mut body: Body, max: usize, until: Instant) -> Result<Bytes, BodyErr> {
    if let Some(n) = body.size_hint().exact() {
        if n as usize > max {
            return Err(BodyErr::TooLarge);
        }
    }
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let next = tokio::time::timeout_at(until.into(), body.data()).await;
        match next {
            Err(_) => return Err(BodyErr::Timeout),
            Ok(None) => return Ok(Bytes::from(buf)),
            Ok(Some(Err(_))) => return Err(BodyErr::Broken),
            Ok(Some(Ok(c))) => {
                if buf.len() + c.len() > max {
                    return Err(BodyErr::TooLarge);
                }
                if buf.is_empty() && body.is_end_stream() {
                    return Ok(c);
                }
                buf.extend_from_slice(&c);
            }
        }
    }
}

async fn handle(mut req: Request<Body>, sh: Arc<Shared>, peer: String, cs: Arc<ConnState>, over: bool)
                -> Result<Response<OutBody>, Infallible> {
    let t0 = Instant::now();
    sh.stats.requests.fetch_add(1, Ordering::Relaxed);
    *cs.head_since.lock().unwrap() = None;
    let guard = InFlight::new(sh.stats.clone(), cs);
    if over {
        let ra = [(Bytes::from_static(b"retry-after"), sh.limits.retry_after.clone())];
        let r = respond(503, &ra, sh.limits.overloaded.clone(), true);
        return Ok(r.map(|b| b.guarded(guard)));
    }
    let forged: Vec<HeaderName> =
        req.headers().keys().filter(|k| k.as_str().starts_with("x-dyad-native-")).cloned().collect();
    for k in forged {
        req.headers_mut().remove(&k);
    }
    let hot = req.method() == Method::POST && sh.limits.hot_paths.iter().any(|p| p == req.uri().path());
    let (parts, body) = req.into_parts();
    let resp = if !hot {
        forward::forward(&sh, parts.method, &parts.uri, parts.headers, body, &peer).await
    } else {
        let until = t0 + sh.limits.header_timeout;
        match read_body(body, sh.limits.max_body_bytes, until).await {
            Err(BodyErr::TooLarge) => respond(413, &[], sh.limits.body_too_large.clone(), true),
            Err(BodyErr::Timeout) => respond(408, &[], Bytes::from_static(
                b"{\"error\": {\"message\": \"the request body did not arrive in time\", \"type\": \"invalid_request_error\", \"param\": null, \"code\": \"request_timeout\"}}"), true),
            Err(BodyErr::Broken) => respond(400, &[], Bytes::from_static(
                b"{\"error\": {\"message\": \"the request body broke off\", \"type\": \"invalid_request_error\", \"param\": null, \"code\": \"bad_request\"}}"), true),
            Ok(b) => attempt::hot(sh.clone(), attempt::Req { t0, parts, body: b, peer }).await,
        }
    };
    Ok(resp.map(|b| b.guarded(guard)))
}
