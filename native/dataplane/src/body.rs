//! The body of every answer the plane writes to a client: a whole buffer, a channel fed by a stream
//! relay (relay.rs), or a proxied hyper body (forward.rs). It carries the request's in-flight guard, so a
//! request counts as in flight until its body is written or dropped (the client went away).

use hyper::body::{Bytes, HttpBody, SizeHint};
use hyper::HeaderMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The plane's counters (Plane.stats()).
#[derive(Default)]
pub struct Stats {
    pub connections: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub requests: AtomicU64,
}

/// One client connection's state (for its keep-alive and head timers, server.rs).
pub struct ConnState {
    pub active: AtomicUsize,
    /// when the last request ended (or the connection opened)
    pub last: Mutex<Instant>,
    /// when the first byte of a head that is not yet a request arrived
    pub head_since: Mutex<Option<Instant>>,
    /// requests this connection has carried (0: a connection that never sent a whole head)
    pub served: AtomicUsize,
}

/// Counts a request in flight while alive.
pub struct InFlight {
    stats: Arc<Stats>,
    conn: Arc<ConnState>,
}

impl InFlight {
    pub fn new(stats: Arc<Stats>, conn: Arc<ConnState>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        conn.active.fetch_add(1, Ordering::Relaxed);
        conn.served.fetch_add(1, Ordering::Relaxed);
        InFlight { stats, conn }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.conn.active.fetch_sub(1, Ordering::Relaxed);
        *self.conn.last.lock().unwrap() = Instant::now();
    }
}

enum Kind {
    Full(Option<Bytes>),
    /// fed by a relay; `drained` fires once the last chunk was taken by hyper (dropped: the client left)
    Chan(mpsc::Receiver<Bytes>, Option<oneshot::Sender<()>>),
    Proxy(hyper::Body),
}

pub struct OutBody {
    kind: Kind,
    guard: Option<InFlight>,
}

impl OutBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        OutBody { kind: Kind::Full(Some(b.into())), guard: None }
    }
    pub fn proxy(b: hyper::Body) -> Self {
        OutBody { kind: Kind::Proxy(b), guard: None }
    }
    /// A streamed body: (body, sender, drained).
    pub fn channel() -> (Self, mpsc::Sender<Bytes>, oneshot::Receiver<()>) {
        let (tx, rx) = mpsc::channel(32);
        let (dtx, drx) = oneshot::channel();
        (OutBody { kind: Kind::Chan(rx, Some(dtx)), guard: None }, tx, drx)
    }
    pub fn guarded(mut self, g: InFlight) -> Self {
        self.guard = Some(g);
        self
    }
}

impl HttpBody for OutBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_data(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BoxError>>> {
        let this = &mut *self;
        let r = match &mut this.kind {
            Kind::Full(b) => Poll::Ready(b.take().map(Ok)),
            Kind::Chan(rx, drained) => match rx.poll_recv(cx) {
                Poll::Ready(None) => {
                    if let Some(d) = drained.take() {
                        let _ = d.send(());
                    }
                    Poll::Ready(None)
                }
                Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(b))),
                Poll::Pending => Poll::Pending,
            },
            Kind::Proxy(b) => Pin::new(b).poll_data(cx).map(|o| o.map(|r| r.map_err(|e| e.into()))),
        };
        if let Poll::Ready(None) = r {
            this.guard = None; // written: no longer in flight
        }
        r
    }

    fn poll_trailers(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<Option<HeaderMap>, BoxError>> {
        Poll::Ready(Ok(None))
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(b) => b.is_none(),
            Kind::Chan(..) => false,
            Kind::Proxy(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Kind::Full(None) => SizeHint::with_exact(0),
            Kind::Chan(..) => SizeHint::default(),
            Kind::Proxy(b) => b.size_hint(),
        }
    }
}
