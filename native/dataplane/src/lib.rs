//! `dyad_dataplane`: Dyad's native data plane. Compiled code carries the bytes; Python decides, judges and
//! accounts through synchronous callbacks under the GIL (the lane: `orchestrator/gateway/native/lane.py`).
//! What is not the plain case goes to the Python gateway behind it on loopback ("the fallback").
//! One OS thread runs a current-thread tokio runtime; the GIL is held only inside a callback.
//! Build: `bash scripts/build_dataplane.sh` (`--test`: also the Rust unit tests).
//!
//! - `server`: client connections, routing hot vs. not, limits
//! - `forward`: the fallback proxy to the Python gateway (and stream continuations)
//! - `attempt`: admit, the steps, one try on an engine (timers, Cancel)
//! - `relay`: a streamed answer, screened, to its end
//! - `screen`: SSE screening (pure)
//! - `pool`: engine keep-alive connections
//! - `body`, `cancel`, `py`: the answer body type, Cancel, the Python glue

mod attempt;
mod body;
mod cancel;
mod forward;
mod pool;
mod py;
mod relay;
pub mod screen;
mod server;

use body::Stats;
use hyper::body::Bytes;
use hyper::header::HeaderValue;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

struct Running {
    stop: watch::Sender<Option<f64>>,
    thread: std::thread::JoinHandle<()>,
}

/// The native data plane: one OS thread running a current-thread tokio runtime.
#[pyclass(module = "dyad_dataplane")]
struct Plane {
    host: String,
    port: u16,
    shared: Mutex<Option<server::Shared>>,
    stats: Arc<Stats>,
    pool: Arc<pool::Pool>,
    running: Mutex<Option<Running>>,
}

fn limit<'p, T: FromPyObject<'p>>(d: &'p PyDict, key: &str) -> PyResult<T> {
    d.get_item(key)
        .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(format!("limits[{:?}] is missing", key)))?
        .extract()
}

/// Seconds from Python as a Duration: negative or NaN is 0, infinite or huge is ~31 years (never a panic).
pub fn secs(x: f64) -> Duration {
    if x.is_nan() || x <= 0.0 {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(x.min(1e9))
    }
}

fn optional<'p, T: FromPyObject<'p>>(d: &'p PyDict, key: &str, default: T) -> PyResult<T> {
    match d.get_item(key) {
        Some(v) => v.extract(),
        None => Ok(default),
    }
}

fn bytes_limit(d: &PyDict, key: &str, default: &'static [u8]) -> PyResult<Bytes> {
    match d.get_item(key) {
        Some(v) => Ok(Bytes::copy_from_slice(v.downcast::<PyBytes>()?.as_bytes())),
        None => Ok(Bytes::from_static(default)),
    }
}

#[pymethods]
impl Plane {
    #[new]
    fn new(host: String, port: u16, lane: PyObject, fallback: String, secret: String, limits: &PyDict) -> PyResult<Self> {
        let secs = |k: &str| -> PyResult<Duration> { Ok(crate::secs(limit::<f64>(limits, k)?.max(0.001))) };
        let l = server::Limits {
            hot_paths: limit(limits, "hot_paths")?,
            max_body_bytes: limit(limits, "max_body_bytes")?,
            body_too_large: bytes_limit(limits, "body_too_large", b"{}")?,
            max_connections: limit(limits, "max_connections")?,
            overloaded: bytes_limit(limits, "overloaded",
                b"{\"error\": {\"message\": \"the gateway is overloaded\", \"type\": \"server_error\", \"param\": null, \"code\": \"overloaded\"}}")?,
            header_timeout: secs("header_timeout_s")?,
            // (optional: a hot request's body within this of its head, and the 408 that says so)
            body_timeout: crate::secs(optional::<f64>(limits, "body_timeout_s", 30.0)?.max(0.001)),
            body_timeout_answer: bytes_limit(limits, "body_timeout",
                b"{\"error\": {\"message\": \"the request body did not arrive in time\", \"type\": \"invalid_request_error\", \"param\": null, \"code\": \"request_timeout\"}}")?,
            keepalive: secs("keepalive_s")?,
            server_error: bytes_limit(limits, "server_error", b"{}")?,
            // (optional: Retry-After on the connection-limit 503; a client that takes no byte of its stream this long)
            retry_after: Bytes::from(optional::<u64>(limits, "retry_after_s", 1)?.max(1).to_string()),
            client_write_timeout: crate::secs(optional::<f64>(limits, "client_write_timeout_s", 120.0)?.max(0.001)),
        };
        let secret = HeaderValue::from_str(&secret).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        let stats = Arc::new(Stats::default());
        let pool: Arc<pool::Pool> = Default::default();
        let mut http = hyper::client::HttpConnector::new();
        http.set_nodelay(true);
        let shared = server::Shared {
            lane,
            fallback,
            secret,
            limits: l,
            stats: stats.clone(),
            fb: hyper::Client::builder().build(http),
            pool: pool.clone(),
        };
        Ok(Plane { host, port, shared: Mutex::new(Some(shared)), stats, pool, running: Mutex::new(None) })
    }

    /// Bind host:port (0: ephemeral) and start serving; returns the bound port.
    fn start(&self) -> PyResult<u16> {
        let shared = self.shared.lock().unwrap().take().ok_or_else(|| PyRuntimeError::new_err("the plane was started already"))?;
        let listener = std::net::TcpListener::bind((self.host.as_str(), self.port))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let (stop, stop_rx) = watch::channel(None);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let thread = std::thread::Builder::new().name("dyad-dataplane".into()).spawn(move || {
            // The thread keeps one Python thread state for its life (made here, the GIL released at once), so
            // each callback's `with_gil` only takes the GIL instead of making and freeing a thread state per
            // call (measured: docs/benchmarks.md, "the native data plane").
            Python::with_gil(|py| py.allow_threads(|| rt.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => server::serve(l, Arc::new(shared), stop_rx).await,
                    Err(e) => eprintln!("dyad_dataplane: {}", e),
                }
            })));
            drop(rt); // closes every connection left
        })?;
        *self.running.lock().unwrap() = Some(Running { stop, thread });
        Ok(port)
    }

    /// Stop accepting, wait up to grace_s for requests in flight, close everything, join the thread.
    fn stop(&self, py: Python, grace_s: f64) {
        let r = self.running.lock().unwrap().take();
        if let Some(r) = r {
            let _ = r.stop.send(Some(grace_s));
            py.allow_threads(move || {
                let _ = r.thread.join();
            });
        }
    }

    /// Close the idle pooled connections to `url`'s host and port (the Python health loop calls it when a probe
    /// fails: connections that went idle together lead nowhere together; transport.py `drop_idle`).
    fn drop_idle(&self, url: &str) {
        if let Ok(u) = url.parse::<hyper::Uri>() {
            let key = (u.host().unwrap_or("127.0.0.1").to_string(), u.port_u16().unwrap_or(80));
            self.pool.drop_idle(&key);
        }
    }

    fn stats<'p>(&self, py: Python<'p>) -> PyResult<&'p PyDict> {
        let d = PyDict::new(py);
        d.set_item("connections", self.stats.connections.load(Ordering::Relaxed))?;
        d.set_item("in_flight", self.stats.in_flight.load(Ordering::Relaxed))?;
        d.set_item("requests", self.stats.requests.load(Ordering::Relaxed))?;
        Ok(d)
    }
}

#[pymodule]
fn dyad_dataplane(_py: Python, m: &PyModule) -> PyResult<()> {
    m.add_class::<Plane>()?;
    m.add_class::<cancel::Cancel>()?;
    Ok(())
}
