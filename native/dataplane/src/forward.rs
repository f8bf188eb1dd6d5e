//! The fallback: requests the plane does not serve itself go to the Python gateway on loopback, as a
//! proxy forwards them (method, path+query, headers without hop-by-hop ones, body streamed both ways),
//! with `x-dyad-native-secret` and `x-dyad-native-peer` added. Also the POST of a stream continuation.

use crate::body::OutBody;
use crate::server::{respond, Shared};
use hyper::body::Bytes;
use hyper::header::{HeaderName, HeaderValue, CONNECTION};
use hyper::{Body, HeaderMap, Method, Request, Response, Uri};

const HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Remove hop-by-hop headers (the fixed ones and those the Connection header names).
pub fn strip_hop(h: &mut HeaderMap) {
    let named: Vec<String> = h
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .filter(|s| !s.is_empty())
        .collect();
    for n in HOP.iter() {
        h.remove(*n);
    }
    let close = named.iter().any(|n| n == "close");
    for n in named {
        h.remove(n.as_str());
    }
    if close {
        // the fallback ends its connection after this answer (e.g. a refusal of a malformed head): so does the
        // client's, as it would without the plane in front
        h.insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
    }
}

/// A request to the fallback at `path_query` with the secret (and, when known, the peer) header.
pub fn fallback_request(sh: &Shared, method: Method, path_query: &str, mut headers: HeaderMap, body: Body,
                        peer: Option<&str>) -> Request<Body> {
    strip_hop(&mut headers);
    headers.insert(HeaderName::from_static("x-dyad-native-secret"), sh.secret.clone());
    if let Some(p) = peer {
        if let Ok(v) = HeaderValue::from_str(p) {
            headers.insert(HeaderName::from_static("x-dyad-native-peer"), v);
        }
    }
    let uri: Uri = format!("http://{}{}", sh.fallback, path_query).parse().unwrap_or_else(|_| Uri::from_static("/"));
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req
}

/// The answer when a request could not be carried to the fallback or its answer back (`e`: hyper's client
/// error): the client's own body broke off (400), else the fallback could not be reached (502; not the
/// connection limit's 503, which is answered where it applies, server.rs).
pub fn unreachable(e: &hyper::Error) -> Response<OutBody> {
    let (status, message, kind, code) = if e.is_user() {
        (400, "the request body broke off".to_string(), "invalid_request_error", "bad_request")
    } else {
        (502, format!("The gateway could not reach its own fallback (the Python gateway behind the native data \
                       plane): {}.", e), "server_error", "fallback_unreachable")
    };
    let body = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    respond(status, &[], Bytes::from(body.to_string()), true)
}

/// Forward a client's request to the fallback and its answer to the client (`unreachable` if that fails).
/// An asterisk-form target (`OPTIONS *`) goes as the path `/*`, the path the Python plane gives it.
pub async fn forward(sh: &Shared, method: Method, uri: &Uri, headers: HeaderMap, body: Body, peer: &str)
                     -> Response<OutBody> {
    let pq = match uri.path_and_query().map(|p| p.as_str()) {
        Some("*") => "/*",
        Some(p) => p,
        None => "/",
    };
    let req = fallback_request(sh, method, pq, headers, body, Some(peer));
    match sh.fb.request(req).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop(&mut parts.headers);
            Response::from_parts(parts, OutBody::proxy(body))
        }
        Err(e) => unreachable(&e),
    }
}
