//! The chat page at `/`: served from the binary, public with `--api-key` while the API stays
//! guarded, off with `webui = false`; and the request log: one line per request with method,
//! path, status, token counts (from the answer's timings, streamed or not) and milliseconds,
//! without colour codes. (The page in a real browser: tests/webui_browser.rs.)

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use serde_json::json;

const KEY: &str = "sk-webui";

/// A writer for the tracing subscriber that keeps everything logged.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn page_is_public_api_guarded_and_requests_logged() {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "hmoe_server::request=info",
        ))
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    let mut c = tiny_config();
    c.api_keys = vec![KEY.into()];
    c.picker = Some(scripted(
        &tokenizer(&tiny_model()),
        &[(1, "one two three four five six seven eight")],
    ));
    let s = start(c);
    let a = s.local_addr();
    let page = get(a, "/");
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    assert!(page.body.contains("<title>hmoe</title>"));
    assert!(page
        .header("content-security-policy")
        .unwrap()
        .contains("connect-src 'self'"));
    let js = get(a, "/webui/app.js");
    assert_eq!(js.status, 200);
    assert!(js
        .header("content-type")
        .unwrap()
        .starts_with("text/javascript"));
    assert!(js.body.contains("/v1/chat/completions"));
    assert_eq!(get(a, "/webui/app.css").status, 200);
    assert_eq!(
        get(a, "/webui/missing.js").status,
        401,
        "other paths stay guarded"
    );
    assert_eq!(get(a, "/props").status, 401);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1});
    assert_eq!(post(a, "/v1/chat/completions", &body).status, 401);
    let auth = format!("Bearer {KEY}");
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", &auth)],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let usage = r.json()["usage"].clone();
    let streamed = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                          "seed": 1, "stream": true});
    let mut sse = Sse::open_with(
        a,
        "/v1/chat/completions",
        &streamed,
        &[("Authorization", &auth)],
    );
    assert_eq!(sse.status, 200);
    let events = sse.all();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    drop(sse);
    drop(s);

    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let find = |needle: &str| lines.iter().filter(|l| l.contains(needle)).count();
    assert!(!text.contains('\x1b'), "no colour codes: {text}");
    assert_eq!(find("GET / 200 "), 1, "{text}");
    assert_eq!(find("GET /props 401 "), 1, "{text}");
    assert_eq!(find("POST /v1/chat/completions 401 "), 1, "{text}");
    let want = format!(
        "POST /v1/chat/completions 200 prompt={} cached={} generated={} ",
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["completion_tokens"]
    );
    assert_eq!(find(&want), 1, "{want} in\n{text}");
    // The streamed answer: its counts come from the closing event; the prompt is cached now.
    let streamed_line = lines
        .iter()
        .filter(|l| l.contains("POST /v1/chat/completions 200 "))
        .nth(1)
        .unwrap_or_else(|| panic!("no second chat line in\n{text}"));
    assert!(streamed_line.contains("generated=4 "), "{streamed_line}");
    assert!(streamed_line.trim_end().ends_with(" ms"), "{streamed_line}");

    let mut off = tiny_config();
    off.webui = false;
    let s = start(off);
    assert_eq!(get(s.local_addr(), "/").status, 404);
    assert_eq!(get(s.local_addr(), "/webui/app.js").status, 404);
}
