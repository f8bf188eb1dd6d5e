//! The fallback: requests the plane does not serve itself go to the Python gateway on loopback, as a
//! proxy forwards them (method, path+query, headers without hop-by-hop ones, body streamed both ways),
//! with `x-dyad-native-secret` and `x-dyad-native-peer` added. Also the POST of a stream continuation.

use crate::body::OutBody;
use crate::server::{respond, Shared};
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

/// Forward a client's request to the fallback and its answer to the client (503 `overloaded` if the
/// fallback cannot be reached).
pub async fn forward(sh: &Shared, method: Method, uri: &Uri, headers: HeaderMap, body: Body, peer: &str)
                     -> Response<OutBody> {
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let req = fallback_request(sh, method, pq, headers, body, Some(peer));
    match sh.fb.request(req).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop(&mut parts.headers);
            Response::from_parts(parts, OutBody::proxy(body))
        }
        Err(_) => respond(503, &[], sh.limits.overloaded.clone(), true),
    }
}
