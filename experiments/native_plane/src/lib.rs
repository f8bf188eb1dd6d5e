//! Spike (not shipped, built by nothing in CI): a native HTTP data plane that asks Python only to decide.
//! One tokio runtime serves clients (hyper, HTTP/1.1); per request it reads the body, calls Python's
//! `decide(path, body)` under the GIL, forwards to the chosen engine on a pooled keep-alive connection and,
//! for a non-streamed answer, calls `check(status, body, context)` before writing it. See run.py.
use hyper::body::Bytes;
use hyper::client::HttpConnector;
use hyper::service::{make_service_fn, service_fn};
use hyper::{Body, Client, Method, Request, Response, Server, StatusCode};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

struct State {
    client: Client<HttpConnector>,
    upstreams: Vec<String>,
    rr: AtomicUsize,
    decide: Option<PyObject>,
    check: Option<PyObject>,
    check_stream: Option<PyObject>,
}

fn text(status: u16, msg: &str) -> Response<Body> {
    let mut r = Response::new(Body::from(msg.to_string()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    r
}

async fn handle(req: Request<Body>, st: Arc<State>) -> Result<Response<Body>, Infallible> {
    if req.method() == Method::GET {
        return Ok(text(200, "{\"object\":\"list\",\"data\":[]}"));
    }
    let path = req.uri().path().to_string();
    let body = match hyper::body::to_bytes(req.into_body()).await {
        Ok(b) => b,
        Err(_) => return Ok(text(400, "bad body")),
    };
    // decide(path, body) -> (url, new body or None, stream, context for check)
    let (url, out_body, stream, ctx) = match &st.decide {
        None => {
            let i = st.rr.fetch_add(1, Ordering::Relaxed) % st.upstreams.len();
            let stream = body.windows(14).any(|w| w == b"\"stream\": true" || w == b"\"stream\":true,");
            (format!("{}{}", st.upstreams[i], path), body, stream, None)
        }
        Some(f) => {
            let r: PyResult<(String, Option<Vec<u8>>, bool, PyObject)> = Python::with_gil(|py| {
                f.call1(py, (path.as_str(), PyBytes::new(py, &body)))?.extract(py)
            });
            match r {
                Ok((u, b, s, c)) => (u, b.map(Bytes::from).unwrap_or(body), s, Some(c)),
                Err(e) => return Ok(text(400, &format!("{}", e))),
            }
        }
    };
    let up = Request::post(url)
        .header("content-type", "application/json")
        .body(Body::from(out_body))
        .unwrap();
    let resp = match st.client.request(up).await {
        Ok(r) => r,
        Err(e) => return Ok(text(502, &format!("{}", e))),
    };
    let (parts, b) = resp.into_parts();
    let ctype = parts.headers.get("content-type").cloned();
    let mut out = if stream && st.check.is_some() && parts.status.as_u16() == 200 {
        // screened natively: whole events only, each a JSON object (or [DONE]); the usage chunk the
        // gateway asked for is withheld from a client that did not; an end without [DONE] gets an SSE
        // error event and [DONE]; then check_stream(context, usage, events relayed, ended) in Python
        let (tx, body) = Body::channel();
        let st2 = st.clone();
        tokio::spawn(relay_stream(b, tx, st2, ctx));
        Response::new(body)
    } else if stream || st.check.is_none() {
        Response::new(b)
    } else {
        let whole = match hyper::body::to_bytes(b).await {
            Ok(x) => x,
            Err(_) => return Ok(text(502, "broke off")),
        };
        let ok: PyResult<bool> = Python::with_gil(|py| {
            let c = match &ctx { Some(c) => c.clone_ref(py), None => py.None() };
            st.check.as_ref().unwrap().call1(py, (parts.status.as_u16(), PyBytes::new(py, &whole), c))?.extract(py)
        });
        if !matches!(ok, Ok(true)) {
            return Ok(text(502, "bad answer"));
        }
        Response::new(Body::from(whole))
    };
    *out.status_mut() = parts.status;
    if let Some(ct) = ctype {
        out.headers_mut().insert("content-type", ct);
    }
    Ok(out)
}

async fn relay_stream(mut up: Body, mut tx: hyper::body::Sender, st: Arc<State>, ctx: Option<PyObject>) {
    use hyper::body::HttpBody;
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    let mut events: u64 = 0;
    let mut usage: Option<String> = None;
    let mut problem: Option<&'static str> = None;
    'outer: while let Some(chunk) = up.data().await {
        let chunk = match chunk { Ok(c) => c, Err(_) => { problem = Some("upstream broke off"); break } };
        buf.extend_from_slice(&chunk);
        let mut out: Vec<u8> = Vec::new();
        let mut start = 0;
        while let Some(pos) = buf[start..].windows(2).position(|w| w == b"\n\n") {
            let event = &buf[start..start + pos];
            start += pos + 2;
            if event == b"data: [DONE]" { done = true; out.extend_from_slice(b"data: [DONE]\n\n"); continue; }
            if !event.starts_with(b"data: ") { problem = Some("not server-sent events"); break 'outer; }
            let v: serde_json::Value = match serde_json::from_slice(&event[6..]) {
                Ok(v) => v, Err(_) => { problem = Some("an event that is not JSON"); break 'outer; }
            };
            if !v.is_object() { problem = Some("an event that is not a JSON object"); break 'outer; }
            if let Some(u) = v.get("usage") {
                if !u.is_null() && v.get("choices").and_then(|c| c.as_array()).map_or(false, |c| c.is_empty()) {
                    usage = Some(u.to_string());
                    continue; // withheld (the spike's client never asks for it)
                }
            }
            events += 1;
            out.extend_from_slice(event);
            out.extend_from_slice(b"\n\n");
        }
        buf.drain(..start);
        if !out.is_empty() && tx.send_data(Bytes::from(out)).await.is_err() { return; }
    }
    if !done {
        let msg = problem.unwrap_or("the stream ended without [DONE]");
        let err = format!("data: {{\"error\": {{\"message\": \"{}\", \"type\": \"upstream_error\"}}}}\n\ndata: [DONE]\n\n", msg);
        let _ = tx.send_data(Bytes::from(err)).await;
    }
    drop(tx);
    if let Some(f) = &st.check_stream {
        Python::with_gil(|py| {
            let c = match &ctx { Some(c) => c.clone_ref(py), None => py.None() };
            let _ = f.call1(py, (c, usage, events, done));
        });
    }
}

#[pyfunction]
fn serve(py: Python, port: u16, upstreams: Vec<String>, decide: Option<PyObject>, check: Option<PyObject>,
         check_stream: Option<PyObject>, threads: usize) -> PyResult<()> {
    let st = Arc::new(State { client: Client::new(), upstreams, rr: AtomicUsize::new(0), decide, check, check_stream });
    py.allow_threads(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build().unwrap();
        rt.block_on(async move {
            let addr = ([127, 0, 0, 1], port).into();
            let make = make_service_fn(move |_| {
                let st = st.clone();
                async move { Ok::<_, Infallible>(service_fn(move |req| handle(req, st.clone()))) }
            });
            let server = Server::bind(&addr).tcp_nodelay(true).serve(make);
            let _ = server.await;
        });
    });
    Ok(())
}

#[pymodule]
fn dyad_native(_py: Python, m: &PyModule) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    Ok(())
}
