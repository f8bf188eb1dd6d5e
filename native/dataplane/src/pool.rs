//! Engine connections: HTTP/1.1 keep-alive connections (hyper's low-level client, `tcp_nodelay`) kept
//! per host:port, most recently used first. A `PooledConn` owns its connection: dropping it closes the
//! socket (how a request is cancelled, and how a connection that cannot be reused is not).

use futures_util::future::poll_fn;
use futures_util::FutureExt;
use hyper::client::conn::{self, SendRequest};
use hyper::Body;
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

pub type Key = (String, u16);

/// How long a pooled connection may take to be ready for its next request.
const READY_WAIT: Duration = Duration::from_millis(50);

pub struct PooledConn {
    pub sr: SendRequest<Body>,
    /// a byte of an answer arrived since `got.store(false)` (reset for every request)
    pub got: Arc<AtomicBool>,
    _kill: oneshot::Sender<()>,
}

impl PooledConn {
    pub fn got_bytes(&self) -> bool {
        self.got.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<Key, Vec<PooledConn>>>,
}

/// A TcpStream that notes when a byte arrives.
struct Noting {
    io: TcpStream,
    got: Arc<AtomicBool>,
}

impl AsyncRead for Noting {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.got.store(true, Ordering::Relaxed);
        }
        r
    }
}

impl AsyncWrite for Noting {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, b)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
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

/// A fresh connection (errors are connect errors: nothing was sent).
pub async fn connect(key: &Key) -> io::Result<PooledConn> {
    let io = TcpStream::connect((key.0.as_str(), key.1)).await?;
    io.set_nodelay(true)?;
    let got = Arc::new(AtomicBool::new(false));
    let (sr, connection) = conn::Builder::new()
        .handshake::<_, Body>(Noting { io, got: got.clone() })
        .await
        .map_err(|e| io::Error::new(io::ErrorKind::Other, e))?;
    let (kill, killed) = oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            _ = connection => {}
            _ = killed => {} // the owner dropped it: close
        }
    });
    Ok(PooledConn { sr, got, _kill: kill })
}

impl Pool {
    /// The most recently returned open connection to `key` (one just returned may need a moment to be
    /// ready again: its connection task has not run since its answer ended; closed ones are dropped).
    pub async fn take(&self, key: &Key) -> Option<PooledConn> {
        loop {
            let mut c = self.idle.lock().unwrap().get_mut(key)?.pop()?;
            let ready = match poll_fn(|cx| c.sr.poll_ready(cx)).now_or_never() {
                Some(r) => r.is_ok(),
                None => matches!(tokio::time::timeout(READY_WAIT, poll_fn(|cx| c.sr.poll_ready(cx))).await, Ok(Ok(()))),
            };
            if ready {
                c.got.store(false, Ordering::Relaxed);
                return Some(c);
            }
        }
    }

    /// Back to the pool (its answer was read whole).
    pub fn put(&self, key: Key, c: PooledConn) {
        self.idle.lock().unwrap().entry(key).or_default().push(c);
    }

    /// Close every idle connection to `key` (one of them gave no answer at all: see transport.py drop_idle).
    pub fn drop_idle(&self, key: &Key) {
        self.idle.lock().unwrap().remove(key);
    }
}
