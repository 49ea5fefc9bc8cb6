//! One log line per request: method, path, status, the prompt, cached and generated token
//! counts when the answer reports them (its `timings`), and the milliseconds until the last byte
//! of the answer left (for a stream, until it ended or the client went away).
//!
//! Lines go to `tracing` at level INFO with target `hmoe_server::request`, e.g.
//! `POST /v1/chat/completions 200 prompt=25 cached=12 generated=40 812 ms`.

use std::fmt::Write as _;
use std::task::Poll;
use std::time::Instant;

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::stream::{self, StreamExt};
use serde_json::Value;

/// Whole bodies up to this size are read to find their token counts (larger ones pass as they
/// are: no answer with `timings` comes near it).
const MAX_INSPECT: u64 = 1 << 20;

/// Token counts of one answer, from its `timings` object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenCounts {
    /// Prompt tokens, cached ones included.
    pub prompt: u64,
    /// Prompt tokens taken from the slot's cache.
    pub cached: u64,
    /// Generated tokens.
    pub generated: u64,
}

impl TokenCounts {
    /// The counts in the `timings` of a JSON body or of an SSE event (`data: {...}`) holding
    /// one; `None` when there are none.
    pub fn find(chunk: &[u8]) -> Option<TokenCounts> {
        let text = std::str::from_utf8(chunk).ok()?;
        // An SSE chunk holds one or more events; the last one with timings counts.
        let candidates = text
            .split("\n\n")
            .filter_map(|event| {
                let data: String = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .collect();
                let json = if data.is_empty() { event } else { &data };
                serde_json::from_str::<Value>(json.trim()).ok()
            })
            .collect::<Vec<_>>();
        candidates.iter().rev().find_map(|v| {
            let t = v.get("timings")?;
            let n = |k: &str| t.get(k).and_then(Value::as_u64).unwrap_or(0);
            Some(TokenCounts {
                prompt: n("prompt_n") + n("cache_n"),
                cached: n("cache_n"),
                generated: n("predicted_n"),
            })
        })
    }
}

/// One request's log line (without the level and target).
pub fn format_line(
    method: &str,
    path: &str,
    status: u16,
    tokens: Option<TokenCounts>,
    ms: f64,
    complete: bool,
) -> String {
    let mut line = format!("{method} {path} {status}");
    if let Some(t) = tokens {
        let _ = write!(
            line,
            " prompt={} cached={} generated={}",
            t.prompt, t.cached, t.generated
        );
    }
    let _ = write!(line, " {ms:.0} ms");
    if !complete {
        line.push_str(" (client went away)");
    }
    line
}

/// The request being answered; logs its line when dropped.
struct Pending {
    start: Instant,
    method: String,
    path: String,
    status: u16,
    tokens: Option<TokenCounts>,
    complete: bool,
}

impl Pending {
    fn observe(&mut self, chunk: &[u8]) {
        // Only the closing event of a stream carries timings: skip the JSON parse otherwise.
        if has_timings(chunk) {
            if let Some(t) = TokenCounts::find(chunk) {
                self.tokens = Some(t);
            }
        }
    }
}

fn has_timings(chunk: &[u8]) -> bool {
    chunk.windows(9).any(|w| w == b"\"timings\"")
}

impl Drop for Pending {
    fn drop(&mut self) {
        let ms = self.start.elapsed().as_secs_f64() * 1e3;
        let line = format_line(
            &self.method,
            &self.path,
            self.status,
            self.tokens,
            ms,
            self.complete,
        );
        tracing::info!(target: "hmoe_server::request", "{line}");
    }
}

/// The middleware: wraps the answer so that its line is logged once the body has been sent.
pub async fn log_requests(req: Request, next: Next) -> Response {
    let mut pending = Pending {
        start: Instant::now(),
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        status: 0,
        tokens: None,
        complete: false,
    };
    let resp = next.run(req).await;
    pending.status = resp.status().as_u16();
    let (parts, body) = resp.into_parts();
    match body.size_hint().exact() {
        Some(n) if n <= MAX_INSPECT => {
            // A whole body (JSON, a page): read it now, keep its length header.
            match axum::body::to_bytes(body, n as usize).await {
                Ok(bytes) => {
                    pending.observe(&bytes);
                    pending.complete = true;
                    Response::from_parts(parts, Body::from(bytes))
                }
                Err(e) => {
                    tracing::warn!(
                        "{} {}: reading the answer: {e}",
                        pending.method,
                        pending.path
                    );
                    Response::from_parts(parts, Body::empty())
                }
            }
        }
        _ => {
            // A stream (SSE): pass every chunk on as it comes.
            let mut data = body.into_data_stream();
            let stream = stream::poll_fn(move |cx| {
                let next = data.poll_next_unpin(cx);
                match &next {
                    Poll::Ready(Some(Ok(chunk))) => pending.observe(chunk),
                    Poll::Ready(None) => pending.complete = true,
                    _ => {}
                }
                next
            });
            Response::from_parts(parts, Body::from_stream(stream))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_come_from_timings_of_json_and_sse() {
        let json = br#"{"choices":[],"timings":{"cache_n":3,"prompt_n":7,"predicted_n":11}}"#;
        let want = TokenCounts {
            prompt: 10,
            cached: 3,
            generated: 11,
        };
        assert_eq!(TokenCounts::find(json), Some(want));
        let sse = b"data: {\"choices\":[{\"delta\":{}}]}\n\ndata: {\"choices\":[],\"timings\":{\"cache_n\":3,\"prompt_n\":7,\"predicted_n\":11}}\n\n";
        assert_eq!(TokenCounts::find(sse), Some(want));
        assert_eq!(TokenCounts::find(b"data: [DONE]\n\n"), None);
        assert_eq!(TokenCounts::find(b"{\"status\":\"ok\"}"), None);
        assert_eq!(TokenCounts::find(&[0xff, 0xfe]), None);
    }

    #[test]
    fn line_format() {
        let t = TokenCounts {
            prompt: 10,
            cached: 3,
            generated: 11,
        };
        assert_eq!(
            format_line("POST", "/v1/chat/completions", 200, Some(t), 812.4, true),
            "POST /v1/chat/completions 200 prompt=10 cached=3 generated=11 812 ms"
        );
        assert_eq!(
            format_line("GET", "/health", 503, None, 0.2, false),
            "GET /health 503 0 ms (client went away)"
        );
    }
}
