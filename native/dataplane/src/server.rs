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
use std::io::{self, Write};
use std::os::unix::io::{AsRawFd, FromRawFd};
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
    pub body_timeout: Duration,
    pub body_timeout_answer: Bytes,
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
/// timeout only fires when more bytes come: a head that stops is timed here), and that turns hyper's own
/// answers to bytes that are not HTTP (a bare 400, or 431 past the head's size) into OpenAI-shaped JSON, as
/// the Python plane answers them (http_server.py).
struct ClientIo {
    io: TcpStream,
    cs: Arc<ConnState>,
    pending: Vec<u8>, // a rewritten refusal still to be written
    heads: Arc<Mutex<Heads>>,
}

/// The largest request line + headers, as the Python plane's (`http_server.MAX_HEADER_BYTES`).
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// An HTTP/1.1 error answer in OpenAI's shape that closes the connection.
pub fn refusal(status: &str, message: &str, code: &str) -> Vec<u8> {
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null,
                                            "code": code}})
        .to_string();
    format!("HTTP/1.1 {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
            status, body.len(), body)
        .into_bytes()
}

/// hyper's answer to a head it could not parse (no content type: its own), rewritten; None for anything else.
fn rewritten(b: &[u8]) -> Option<Vec<u8>> {
    let head_end = b.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = &b[..head_end];
    if head.windows(13).any(|w| w.eq_ignore_ascii_case(b"content-type:")) {
        return None; // (an answer of the gateway's own)
    }
    if head.starts_with(b"HTTP/1.1 400 ") {
        Some(refusal("400 Bad Request", "The request is not valid HTTP/1.1.", "invalid_http"))
    } else if head.starts_with(b"HTTP/1.1 431 ") {
        Some(refusal("431 Request Header Fields Too Large",
                     &format!("The request line and headers exceed {} bytes.", MAX_HEAD_BYTES), "headers_too_large"))
    } else {
        None
    }
}

impl ClientIo {
    /// Write what is left of a rewritten refusal.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            let n = match Pin::new(&mut self.io).poll_write(cx, &self.pending) {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            self.pending.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.heads.lock().unwrap().feed(&buf.filled()[before..]);
        }
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
        futures_util::ready!(self.drain(cx))?;
        if self.cs.active.load(Ordering::Relaxed) == 0 {
            if let Some(r) = rewritten(b) {
                // (the connection closes after it: what hyper meant to write is taken as written)
                self.pending = r;
                futures_util::ready!(self.drain(cx))?;
                return Poll::Ready(Ok(b.len()));
            }
        }
        Pin::new(&mut self.io).poll_write(cx, b)
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[io::IoSlice<'_>])
                           -> Poll<io::Result<usize>> {
        futures_util::ready!(self.drain(cx))?;
        if self.cs.active.load(Ordering::Relaxed) == 0 {
            if let Some(first) = b.iter().find(|s| !s.is_empty()) {
                if let Some(r) = rewritten(first) {
                    self.pending = r;
                    futures_util::ready!(self.drain(cx))?;
                    return Poll::Ready(Ok(b.iter().map(|s| s.len()).sum()));
                }
            }
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, b)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        futures_util::ready!(self.drain(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        futures_util::ready!(self.drain(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

async fn connection(io: TcpStream, peer: String, sh: Arc<Shared>, over: bool, mut shut: watch::Receiver<bool>) {
    let _ = io.set_nodelay(true);
    let cs = Arc::new(ConnState {
        active: Default::default(),
        last: Mutex::new(Instant::now()),
        head_since: Mutex::new(None),
        served: Default::default(),
    });
    let fd = io.as_raw_fd();
    let heads: Arc<Mutex<Heads>> = Default::default();
    let io = ClientIo { io, cs: cs.clone(), pending: Vec::new(), heads: heads.clone() };
    let svc = {
        let (sh, cs) = (sh.clone(), cs.clone());
        service_fn(move |req| {
            let verdict = heads.lock().unwrap().verdicts.pop_front().flatten();
            handle(req, sh.clone(), peer.clone(), cs.clone(), over, verdict)
        })
    };
    let conn = Http::new()
        .http1_only(true)
        .http1_keep_alive(true)
        .http1_header_read_timeout(sh.limits.header_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
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
                    let fresh = cs.served.load(Ordering::Relaxed) == 0;
                    let since_open = cs.last.lock().unwrap().elapsed();
                    let (expired, answer) = match head {
                        Some(t) => (t.elapsed() >= head_timeout, true), // a head that stopped arriving
                        // a connection that never sent a byte is a head that never came; an idle keep-alive one
                        // is closed quietly
                        None if fresh => (since_open >= head_timeout, true),
                        None => (since_open >= keepalive, false),
                    };
                    if expired {
                        if answer {
                            // 408 as the Python plane answers it (http_server.timeout_response), written straight to
                            // the socket: nothing of hyper's is being written (no request in flight)
                            let msg = format!("The request headers did not arrive within {} s.",
                                              head_timeout.as_secs_f64());
                            let bytes = refusal("408 Request Timeout", &msg, "request_timeout");
                            // SAFETY: `fd` is the socket hyper owns, still open (conn is alive until dropped
                            // below); ManuallyDrop keeps this second handle from closing it.
                            let s = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
                            let _ = (&*s).write(&bytes);
                        }
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

/// A 400 in OpenAI's shape (`invalid_http`, as the Python plane answers a request it cannot frame) that closes
/// the connection: what is pipelined behind such a request is not read as requests.
fn invalid(message: &str) -> Response<OutBody> {
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null,
                                            "code": "invalid_http"}});
    respond(400, &[], Bytes::from(body.to_string()), true)
}

async fn handle(mut req: Request<Body>, sh: Arc<Shared>, peer: String, cs: Arc<ConnState>, over: bool,
                framing: Option<String>) -> Result<Response<OutBody>, Infallible> {
    let t0 = Instant::now();
    sh.stats.requests.fetch_add(1, Ordering::Relaxed);
    *cs.head_since.lock().unwrap() = None;
    let guard = InFlight::new(sh.stats.clone(), cs);
    if over {
        let ra = [(Bytes::from_static(b"retry-after"), sh.limits.retry_after.clone())];
        let r = respond(503, &ra, sh.limits.overloaded.clone(), true);
        return Ok(r.map(|b| b.guarded(guard)));
    }
    if let Some(problem) = framing {
        // (a request framed two ways: RFC 9112 6.3 asks for an error and the connection closed after it)
        return Ok(invalid(&problem).map(|b| b.guarded(guard)));
    }
    // origin-form ("/..."), or absolute-form with a path (RFC 9112 3.2.2: a server must accept it; served by its
    // path, as the Python plane serves it); asterisk-form goes to the fallback (forward.rs), which answers it as
    // the Python plane does; anything else (authority-form, an absolute URL without a path) is refused
    let target = req.uri().path_and_query().map_or("", |p| p.as_str());
    if target != "*" && !target.starts_with('/') {
        let msg = format!("The request is not valid HTTP/1.1: its target {:?} is not a path.", req.uri().to_string());
        return Ok(invalid(&msg).map(|b| b.guarded(guard)));
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
        // (the body within body_timeout_s of the head, as the Python plane: it was header_timeout_s, 10 s by default,
        // so a body the Python plane takes in 10 to 30 s was a 408 here)
        let until = t0 + sh.limits.body_timeout;
        match read_body(body, sh.limits.max_body_bytes, until).await {
            Err(BodyErr::TooLarge) => respond(413, &[], sh.limits.body_too_large.clone(), true),
            Err(BodyErr::Timeout) => respond(408, &[], sh.limits.body_timeout_answer.clone(), true),
            Err(BodyErr::Broken) => respond(400, &[], Bytes::from_static(
                b"{\"error\": {\"message\": \"the request body broke off\", \"type\": \"invalid_request_error\", \"param\": null, \"code\": \"bad_request\"}}"), true),
            Ok(b) => attempt::hot(sh.clone(), attempt::Req { t0, parts, body: b, peer }).await,
        }
    };
    Ok(resp.map(|b| b.guarded(guard)))
}

/// Where the client's bytes are, for `Heads` (what hyper frames the same way).
enum Framing {
    Head(Vec<u8>),            // a head, up to its blank line
    Body(u64),                // Content-Length bytes left
    ChunkSize(Vec<u8>),       // a chunk-size line
    ChunkData(u64),           // chunk bytes left, then CRLF
    ChunkEnd(u8),             // the CRLF after a chunk's data (bytes of it seen)
    Trailers(Vec<u8>),        // the trailer section, up to its blank line
    Off,                      // lost track (hyper refuses such bytes itself): no more verdicts
}

/// Reads the client's bytes beside hyper to see each request's head as sent: hyper keeps neither a
/// Content-Length after a Transfer-Encoding nor a second equal Content-Length, so the head it hands over cannot
/// tell a request framed two ways (RFC 9112 6.3: the smuggling shape) from a plain one. One verdict per head,
/// in order (`None`: the head is sound; `Some(problem)`): `handle` takes one per request.
pub struct Heads {
    state: Framing,
    pub verdicts: std::collections::VecDeque<Option<String>>,
}

impl Default for Heads {
    fn default() -> Self {
        Heads { state: Framing::Head(Vec::new()), verdicts: Default::default() }
    }
}

/// What is wrong with a head's framing headers (None: nothing), and the body's framing (None: cannot tell).
fn judge(head: &[u8]) -> (Option<String>, Option<Framing>) {
    let (mut cls, mut codings, mut te_lines) = (Vec::new(), Vec::new(), 0);
    for line in head.split(|&b| b == b'\n').skip(1) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (name, value) = (&line[..colon], String::from_utf8_lossy(&line[colon + 1..]).trim().to_string());
        if name.eq_ignore_ascii_case(b"content-length") {
            cls.push(value);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            te_lines += 1;
            codings.extend(value.split(',').map(|c| c.trim().to_ascii_lowercase()).filter(|c| !c.is_empty()));
        }
    }
    let problem = if te_lines > 0 && !cls.is_empty() {
        Some("it has both Transfer-Encoding and Content-Length (RFC 9112 6.3)")
    } else if cls.len() > 1 {
        Some("it has more than one Content-Length")
    } else if codings.iter().filter(|c| *c == "chunked").count() > 1 {
        Some("its Transfer-Encoding applies chunked more than once")
    } else {
        None
    };
    let framing = if te_lines > 0 {
        (codings.last().map(|c| c.as_str()) == Some("chunked")).then(|| Framing::ChunkSize(Vec::new()))
    } else if let Some(cl) = cls.first() {
        cl.parse::<u64>().ok().map(|n| if n == 0 { Framing::Head(Vec::new()) } else { Framing::Body(n) })
    } else {
        Some(Framing::Head(Vec::new()))
    };
    (problem.map(|p| format!("The request is not valid HTTP/1.1: {}.", p)), framing)
}

impl Heads {
    /// Take in the next bytes the client sent.
    pub fn feed(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            match &mut self.state {
                Framing::Off => return,
                Framing::Head(h) => {
                    if h.is_empty() {
                        let skip = b.iter().take_while(|&&c| c == b'\r' || c == b'\n').count(); // (blank lines first)
                        b = &b[skip..];
                        if b.is_empty() {
                            return;
                        }
                    }
                    let start = h.len().saturating_sub(3);
                    let take = b.len().min(MAX_HEAD_BYTES + 4 - h.len());
                    h.extend_from_slice(&b[..take]);
                    match h[start..].windows(4).position(|w| w == b"\r\n\r\n") {
                        Some(p) => {
                            let end = start + p + 4;
                            let rest = h.len() - end; // bytes past the head, given back
                            let (verdict, next) = judge(&h[..end]);
                            let bad = verdict.is_some();
                            self.verdicts.push_back(verdict);
                            self.state = if bad { Framing::Off } else { next.unwrap_or(Framing::Off) };
                            b = &b[take - rest..];
                        }
                        None if h.len() > MAX_HEAD_BYTES => self.state = Framing::Off,
                        None => b = &b[take..],
                    }
                }
                Framing::Body(n) => {
                    let k = (*n).min(b.len() as u64);
                    *n -= k;
                    b = &b[k as usize..];
                    if *n == 0 {
                        self.state = Framing::Head(Vec::new());
                    }
                }
                Framing::ChunkSize(_) | Framing::Trailers(_) => {
                    let trailers = matches!(self.state, Framing::Trailers(_));
                    let line = match &mut self.state {
                        Framing::ChunkSize(l) | Framing::Trailers(l) => l,
                        _ => unreachable!(),
                    };
                    let nl = b.iter().position(|&c| c == b'\n');
                    let take = nl.map_or(b.len(), |p| p + 1);
                    line.extend_from_slice(&b[..take]);
                    b = &b[take..];
                    if line.len() > MAX_HEAD_BYTES {
                        self.state = Framing::Off;
                    } else if nl.is_some() {
                        let l = std::mem::take(line);
                        let text = l.strip_suffix(b"\n").unwrap_or(&l);
                        let text = text.strip_suffix(b"\r").unwrap_or(text);
                        self.state = if trailers {
                            if text.is_empty() { Framing::Head(Vec::new()) } else { Framing::Trailers(Vec::new()) }
                        } else {
                            let size = text.split(|&c| c == b';').next().unwrap_or(b"");
                            match u64::from_str_radix(String::from_utf8_lossy(size).trim(), 16) {
                                Ok(0) => Framing::Trailers(Vec::new()),
                                Ok(n) => Framing::ChunkData(n),
                                Err(_) => Framing::Off,
                            }
                        };
                    }
                }
                Framing::ChunkData(n) => {
                    let k = (*n).min(b.len() as u64);
                    *n -= k;
                    b = &b[k as usize..];
                    if *n == 0 {
                        self.state = Framing::ChunkEnd(0);
                    }
                }
                Framing::ChunkEnd(seen) => {
                    // "\r\n" (hyper also takes a bare "\n")
                    let c = b[0];
                    b = &b[1..];
                    self.state = match (*seen, c) {
                        (0, b'\r') => Framing::ChunkEnd(1),
                        (_, b'\n') => Framing::ChunkSize(Vec::new()),
                        _ => Framing::Off,
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(pieces: &[&[u8]]) -> Vec<Option<String>> {
        let mut h = Heads::default();
        for p in pieces {
            h.feed(p);
        }
        h.verdicts.into_iter().collect()
    }

    #[test]
    fn sound_requests_in_any_pieces_each_get_a_none() {
        let all: &[u8] = b"POST /a HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello\r\nGET /b HTTP/1.1\r\n\r\n\
POST /c HTTP/1.1\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\nx-t: 1\r\n\r\nGET /d HTTP/1.1\r\n\r\n";
        assert_eq!(verdicts(&[all]), vec![None, None, None, None]);
        let bytes: Vec<&[u8]> = all.chunks(1).collect();
        assert_eq!(verdicts(&bytes), vec![None, None, None, None]);
    }

    #[test]
    fn two_framings_are_named() {
        let te_cl = verdicts(&[b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n"]);
        assert_eq!(te_cl.len(), 1);
        assert!(te_cl[0].as_deref().unwrap().contains("both Transfer-Encoding and Content-Length"));
        let cl_cl = verdicts(&[b"POST / HTTP/1.1\r\nContent-Length: 1\r\ncontent-length: 1\r\n\r\nx"]);
        assert!(cl_cl[0].as_deref().unwrap().contains("more than one Content-Length"));
        let twice = verdicts(&[b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n"]);
        assert!(twice[0].as_deref().unwrap().contains("chunked more than once"));
    }
}
