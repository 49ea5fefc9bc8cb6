//! The chat page at `/`: plain HTML, CSS and JavaScript from `crates/server/webui/`, built into
//! the binary (nothing is fetched from the network, at build or at run time).
//!
//! The page talks to the server's own API (`/props`, `/v1/models`, `/v1/chat/completions`,
//! `/models/load`, `/models/unload`). Its files are public even with `--api-key`: the page asks
//! for the key and sends it with every API call, which stays guarded.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The page.
const INDEX: &str = include_str!("../webui/index.html");
/// Its script.
const APP_JS: &str = include_str!("../webui/app.js");
/// Its style sheet.
const APP_CSS: &str = include_str!("../webui/app.css");

/// Paths of the page's files, each with its content type and content.
const FILES: [(&str, &str, &str); 4] = [
    ("/", "text/html; charset=utf-8", INDEX),
    ("/index.html", "text/html; charset=utf-8", INDEX),
    ("/webui/app.js", "text/javascript; charset=utf-8", APP_JS),
    ("/webui/app.css", "text/css; charset=utf-8", APP_CSS),
];

/// The page may load only its own files and talk only to this server.
const CSP: &str = "default-src 'self'; img-src 'self' data:; style-src 'self'; \
                   script-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// Whether `path` is one of the page's files (served without an API key).
pub fn is_webui_path(path: &str) -> bool {
    FILES.iter().any(|(p, _, _)| *p == path)
}

fn file(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

/// The routes of the page's files.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    FILES
        .iter()
        .fold(Router::new(), |router, &(path, content_type, body)| {
            router.route(path, get(move || async move { file(content_type, body) }))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_links_only_embedded_files() {
        assert!(is_webui_path("/") && is_webui_path("/webui/app.js"));
        assert!(!is_webui_path("/v1/chat/completions") && !is_webui_path("/webui/other.js"));
        // Every local file the page refers to is served, and nothing comes from elsewhere.
        for (attr, _) in INDEX
            .match_indices("src=\"")
            .chain(INDEX.match_indices("href=\""))
        {
            let rest = &INDEX[attr..];
            let start = rest.find('"').unwrap() + 1;
            let end = start + rest[start..].find('"').unwrap();
            let target = &rest[start..end];
            assert!(
                target.starts_with('#') || target == "data:," || is_webui_path(target),
                "index.html refers to {target}, which is not served"
            );
        }
        assert!(!INDEX.contains("://") && !APP_CSS.contains("://"));
    }
}
