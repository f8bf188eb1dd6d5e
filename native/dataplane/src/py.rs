//! The Python side of the contract: steps returned by the lane's callbacks, the attempt's attributes,
//! header lists, and reporting a callback's exception (`lane.internal_error`). Everything here runs under
//! the GIL and returns plain Rust values.

use hyper::body::Bytes;
use hyper::HeaderMap;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

pub type Headers = Vec<(Bytes, Bytes)>;

pub enum Step {
    Fallback(Headers),
    Reply(u16, Headers, Bytes),
    /// the attempt and its attributes (read with the step, under the same GIL)
    Send(PyObject, Box<AttemptParams>),
    Relay,
    End(Bytes),
    Continue(String, Headers, Bytes),
}

impl Step {
    pub fn name(&self) -> &'static str {
        match self {
            Step::Fallback(_) => "fallback",
            Step::Reply(..) => "reply",
            Step::Send(..) => "send",
            Step::Relay => "relay",
            Step::End(_) => "end",
            Step::Continue(..) => "continue",
        }
    }
}

pub fn bytes_of(o: &PyAny) -> PyResult<Bytes> {
    let b: &[u8] = o.extract()?;
    Ok(Bytes::copy_from_slice(b))
}

pub fn headers_of(o: &PyAny) -> PyResult<Headers> {
    let mut out = Vec::new();
    for item in o.iter()? {
        let (k, v): (&[u8], &[u8]) = item?.extract()?;
        out.push((Bytes::copy_from_slice(k), Bytes::copy_from_slice(v)));
    }
    Ok(out)
}

/// Append `extra` to `h`, skipping any pair that is not a valid header (Python's lists are not trusted blindly).
pub fn append_headers(h: &mut HeaderMap, extra: &Headers) {
    for (k, v) in extra {
        if let (Ok(k), Ok(v)) = (hyper::header::HeaderName::from_bytes(k), hyper::header::HeaderValue::from_bytes(v)) {
            h.append(k, v);
        }
    }
}

pub fn headers_to_py<'p>(py: Python<'p>, h: &HeaderMap) -> &'p PyList {
    let items: Vec<PyObject> = h
        .iter()
        .map(|(k, v)| (PyBytes::new(py, k.as_str().as_bytes()), PyBytes::new(py, v.as_bytes())).into_py(py))
        .collect();
    PyList::new(py, items)
}

pub fn step_of(o: &PyAny) -> PyResult<Step> {
    let t: &PyTuple = o.downcast()?;
    let kind: &str = t.get_item(0)?.extract()?;
    Ok(match kind {
        "fallback" => Step::Fallback(if t.len() > 1 { headers_of(t.get_item(1)?)? } else { Vec::new() }),
        "reply" => Step::Reply(t.get_item(1)?.extract()?, headers_of(t.get_item(2)?)?, bytes_of(t.get_item(3)?)?),
        "send" => {
            let a = t.get_item(1)?;
            Step::Send(a.into(), Box::new(AttemptParams::read(a)?))
        }
        "relay" => Step::Relay,
        "end" => Step::End(bytes_of(t.get_item(1)?)?),
        "continue" => Step::Continue(t.get_item(1)?.extract()?, headers_of(t.get_item(2)?)?, bytes_of(t.get_item(3)?)?),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("unknown step {:?}", other)));
        }
    })
}

/// `attempt`'s attributes, read once.
pub struct AttemptParams {
    pub url: String,
    pub body: Bytes,
    pub headers: Headers,
    pub stream: bool,
    pub delay_s: f64,
    pub first_byte_timeout: Option<f64>,
    pub idle_timeout: Option<f64>,
    pub deadline_s: Option<f64>,
    pub max_answer_bytes: usize,
    pub error_body_bytes: usize,
    pub reply_headers: Headers,
    pub strip_usage: bool,
}

impl AttemptParams {
    pub fn read(a: &PyAny) -> PyResult<Self> {
        let py = a.py();
        Ok(AttemptParams {
            url: a.getattr(intern!(py, "url"))?.extract()?,
            body: bytes_of(a.getattr(intern!(py, "body"))?)?,
            headers: headers_of(a.getattr(intern!(py, "headers"))?)?,
            stream: a.getattr(intern!(py, "stream"))?.extract()?,
            delay_s: a.getattr(intern!(py, "delay_s"))?.extract()?,
            first_byte_timeout: a.getattr(intern!(py, "first_byte_timeout"))?.extract()?,
            idle_timeout: a.getattr(intern!(py, "idle_timeout"))?.extract()?,
            deadline_s: a.getattr(intern!(py, "deadline_s"))?.extract()?,
            max_answer_bytes: a.getattr(intern!(py, "max_answer_bytes"))?.extract()?,
            error_body_bytes: a.getattr(intern!(py, "error_body_bytes"))?.extract()?,
            reply_headers: headers_of(a.getattr(intern!(py, "reply_headers"))?)?,
            strip_usage: a.getattr(intern!(py, "strip_usage"))?.extract()?,
        })
    }
}

/// Tell the lane a callback raised (`lane.internal_error(where, exc)`; it must not raise: if it does,
/// the exception is printed).
pub fn report(lane: &PyObject, where_: &str, err: PyErr) {
    Python::with_gil(|py| {
        let exc = err.into_value(py);
        if let Err(e) = lane.call_method1(py, "internal_error", (where_, exc)) {
            e.print(py);
        }
    })
}

/// Call `obj.name(*args)` and read the step it returns.
pub fn call_step(obj: &PyObject, name: &str, args: impl IntoPy<Py<PyTuple>>) -> PyResult<Step> {
    Python::with_gil(|py| step_of(obj.call_method1(py, name, args)?.as_ref(py)))
}

/// Call `obj.name(*args)`, ignoring what it returns.
pub fn call_none(obj: &PyObject, name: &str, args: impl IntoPy<Py<PyTuple>>) -> PyResult<()> {
    Python::with_gil(|py| obj.call_method1(py, name, args).map(|_| ()))
}
