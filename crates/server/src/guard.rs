//! What every request passes before a route sees it: CORS (preflight answered as llama-server
//! does), the API-key check (constant time over every configured key), and the body, read
//! whole within `--timeout` and [`crate::config::Limits::max_body`] so that a slow or oversized
//! upload gets the JSON error object (408/413/400) instead of holding a connection or memory.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::state::AppState;

/// The health routes (answered even beyond the connection cap).
pub fn is_health(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health")
}

/// Routes anyone may call.
pub fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health" | "/models" | "/v1/models")
        || crate::webui::is_webui_path(path)
}

/// Whether two byte strings are equal, in time that depends only on `expected`'s length (the
/// configured key), never on where or whether `presented` differs.
fn same_bytes(expected: &[u8], presented: &[u8]) -> bool {
    let mut diff = u8::from(expected.len() != presented.len());
    for (i, &x) in expected.iter().enumerate() {
        let y = presented.get(i).copied().unwrap_or(!x);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Whether `presented` is one of `keys`, comparing against every key (no early exit), each
/// through `eq`.
fn matches_any(keys: &[String], presented: &str, mut eq: impl FnMut(&[u8], &[u8]) -> bool) -> bool {
    let mut found = false;
    for k in keys {
        found |= eq(k.as_bytes(), presented.as_bytes());
    }
    found
}

fn presented_key(h: &HeaderMap) -> Option<&str> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if v.len() > 7 && v.is_char_boundary(7) && v[..7].eq_ignore_ascii_case("bearer ") {
            return Some(v[7..].trim());
        }
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Whether a request with these headers may use guarded routes (always, without keys).
pub fn authorized(config: &ServerConfig, headers: &HeaderMap) -> bool {
    config.api_keys.is_empty()
        || presented_key(headers).is_some_and(|k| matches_any(&config.api_keys, k, same_bytes))
}

/// How the server answers a browser's `Origin` (see docs/server.md, "CORS").
#[derive(Debug, PartialEq, Eq)]
enum Cors {
    /// No `Origin`, or the server's own (the chat page): no CORS headers needed.
    SameOrNone,
    /// `--cors-origins *`: any origin, `Access-Control-Allow-Origin: *` without credentials.
    Any,
    /// An origin `--cors-origins` names (or a loopback one under `localhost`): reflected, with
    /// credentials.
    Listed(HeaderValue),
    /// Any other origin: no CORS headers, and no "simple" state-changing requests.
    Foreign,
}

/// Whether `origin` is `http(s)://` followed by `host` (the request's `Host`).
fn is_same_origin(origin: &[u8], host: Option<&HeaderValue>) -> bool {
    let Some(host) = host else { return false };
    [&b"http://"[..], b"https://"].iter().any(|scheme| {
        origin.len() == scheme.len() + host.len()
            && origin.starts_with(scheme)
            && origin[scheme.len()..].eq_ignore_ascii_case(host.as_bytes())
    })
}

/// Whether `origin` is a loopback one (`http(s)://localhost`, `127.x.x.x` or `[::1]`, any port).
fn is_loopback_origin(origin: &str) -> bool {
    let Some(rest) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    let host = match rest.strip_prefix("[::1]") {
        Some(tail) => return tail.is_empty() || tail.starts_with(':'),
        None => rest.split(':').next().unwrap_or(""),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The CORS standing of a request from `origin` to `host`.
fn cors_for(
    config: &ServerConfig,
    origin: Option<&HeaderValue>,
    host: Option<&HeaderValue>,
) -> Cors {
    let Some(o) = origin else {
        return Cors::SameOrNone;
    };
    if is_same_origin(o.as_bytes(), host) {
        return Cors::SameOrNone;
    }
    let listed = config.cors_origins.iter().any(|a| {
        a.as_bytes() == o.as_bytes()
            || (a == "localhost" && o.to_str().is_ok_and(is_loopback_origin))
    });
    if listed {
        Cors::Listed(o.clone())
    } else if config.cors_origins.iter().any(|a| a == "*") {
        Cors::Any
    } else {
        Cors::Foreign
    }
}

/// Whether a `Content-Type` names JSON (`application/json` or `…/…+json`, any parameters).
fn is_json_type(content_type: Option<&HeaderValue>) -> bool {
    let Some(t) = content_type.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let t = t
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    t == "application/json" || (t.starts_with("application/") && t.ends_with("+json"))
}

/// The refusal of a state-changing request a web page of a foreign origin could send without
/// a preflight: any content type but JSON (a form's `text/plain`, `x-www-form-urlencoded`,
/// `multipart/form-data`, or none).
fn simple_request_refusal(req: &Request) -> Option<ApiError> {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let ct = req.headers().get(header::CONTENT_TYPE);
    if is_json_type(ct) {
        return None;
    }
    let shown = ct.and_then(|v| v.to_str().ok()).unwrap_or("none");
    Some(ApiError::unsupported_media_type(format!(
        "a {} request from another origin must send Content-Type: application/json (it sent \
         {shown}); a web page can send other types without the browser asking the server first, \
         so they are refused; allow the origin with --cors-origins",
        req.method()
    )))
}

/// The middleware: preflight, CORS headers, simple cross-origin requests, API key, body.
pub async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let config = &st.config;
    let h = req.headers();
    let standing = cors_for(config, h.get(header::ORIGIN), h.get(header::HOST));
    let cors = |mut r: Response| {
        let h = r.headers_mut();
        match &standing {
            Cors::Any => {
                h.insert(
                    header::ACCESS_CONTROL_ALLOW_ORIGIN,
                    HeaderValue::from_static("*"),
                );
            }
            Cors::Listed(o) => {
                h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o.clone());
                h.insert(
                    header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                    HeaderValue::from_static("true"),
                );
            }
            Cors::SameOrNone | Cors::Foreign => {}
        }
        h.append(header::VARY, HeaderValue::from_static("Origin"));
        r
    };
    if req.method() == Method::OPTIONS {
        // llama-server: 200 with an empty body, methods GET and POST, any header.
        let mut r = StatusCode::OK.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("*"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("86400"),
        );
        return cors(r);
    }
    if standing == Cors::Foreign {
        if let Some(e) = simple_request_refusal(&req) {
            return cors(e.into_response());
        }
    }
    if !is_public(req.uri().path()) && !authorized(config, req.headers()) {
        return cors(ApiError::unauthorized().into_response());
    }
    let req = match read_body(config, req).await {
        Ok(r) => r,
        Err(e) => return cors(e.into_response()),
    };
    cors(next.run(req).await)
}

/// Reads the whole body within the time and size limits.
async fn read_body(config: &ServerConfig, req: Request) -> Result<Request, ApiError> {
    let max = config.limits.max_body;
    let too_large = || {
        ApiError::too_large(format!(
            "the request body is larger than the {} MiB allowed",
            max >> 20
        ))
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let (parts, body) = req.into_parts();
    let read = axum::body::to_bytes(body, max);
    let bytes = match tokio::time::timeout(config.limits.timeout, read).await {
        Err(_) => {
            return Err(ApiError::timeout(format!(
                "the request body did not arrive within {} s (--timeout)",
                config.limits.timeout.as_secs()
            )))
        }
        Ok(Err(e)) if is_length_limit(&e) => return Err(too_large()),
        Ok(Err(e)) => {
            return Err(ApiError::bad_request(format!(
                "reading the request body: {}",
                error_chain(&e)
            )))
        }
        Ok(Ok(b)) => b,
    };
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

fn error_chain(e: &axum::Error) -> String {
    let mut out = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(err) = cur {
        let s = err.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = err.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_from_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  sk-1 "),
        );
        assert_eq!(presented_key(&h), Some("sk-1"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k2"));
        assert_eq!(presented_key(&h), Some("k2"));
        assert!(is_public("/health") && !is_public("/v1/chat/completions"));
    }

    #[test]
    fn key_comparison_is_exact() {
        for (a, b, eq) in [
            ("abc", "abc", true),
            ("abc", "abd", false),
            ("ab", "abc", false),
            ("abc", "ab", false),
            ("abc", "", false),
            // A presented key padded with what the loop substitutes past its end.
            ("a", "a\u{0}", false),
            ("", "", true),
        ] {
            assert_eq!(same_bytes(a.as_bytes(), b.as_bytes()), eq, "{a:?} {b:?}");
        }
    }

    #[test]
    fn every_key_is_compared_even_after_a_match() {
        let keys: Vec<String> = ["first", "second", "third"].map(String::from).to_vec();
        let mut calls = 0;
        let ok = matches_any(&keys, "first", |a, b| {
            calls += 1;
            same_bytes(a, b)
        });
        assert!(ok);
        assert_eq!(calls, 3, "the comparison must not stop at the first match");
        assert!(!matches_any(&keys, "fourth", same_bytes));
        assert!(matches_any(&keys, "third", same_bytes));
    }

    #[test]
    fn cors_origins() {
        let mut c = ServerConfig::new(crate::ModelSource::File("x".into()));
        let o = HeaderValue::from_static("http://app.example");
        let host = HeaderValue::from_static("127.0.0.1:8080");
        let own = HeaderValue::from_static("http://127.0.0.1:8080");
        // The default: only the server's own origin (and clients sending none).
        assert_eq!(cors_for(&c, Some(&o), Some(&host)), Cors::Foreign);
        assert_eq!(cors_for(&c, Some(&own), Some(&host)), Cors::SameOrNone);
        assert_eq!(cors_for(&c, None, Some(&host)), Cors::SameOrNone);
        let null = HeaderValue::from_static("null");
        assert_eq!(cors_for(&c, Some(&null), Some(&host)), Cors::Foreign);
        c.cors_origins = vec!["*".into()];
        assert_eq!(cors_for(&c, Some(&o), Some(&host)), Cors::Any);
        c.cors_origins = vec!["http://other.example".into()];
        assert_eq!(cors_for(&c, Some(&o), None), Cors::Foreign);
        c.cors_origins.push("http://app.example".into());
        assert_eq!(cors_for(&c, Some(&o), None), Cors::Listed(o.clone()));
        c.cors_origins = vec!["localhost".into()];
        assert_eq!(cors_for(&c, Some(&o), None), Cors::Foreign);
        for (origin, ok) in [
            ("http://localhost:3000", true),
            ("https://127.0.0.2", true),
            ("http://[::1]:5173", true),
            ("http://localhost.evil.example", false),
            ("http://[::1].evil.example", false),
            ("http://128.0.0.1", false),
        ] {
            assert_eq!(is_loopback_origin(origin), ok, "{origin}");
        }
    }

    #[test]
    fn json_content_types() {
        for (t, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/vnd.api+json", true),
            ("text/plain", false),
            ("text/plain; a=application/json", false),
            ("application/x-www-form-urlencoded", false),
            ("multipart/form-data; boundary=x", false),
        ] {
            assert_eq!(is_json_type(Some(&HeaderValue::from_static(t))), ok, "{t}");
        }
        assert!(!is_json_type(None));
    }
}
