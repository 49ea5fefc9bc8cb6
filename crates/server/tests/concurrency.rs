//! Slots under load: concurrent greedy streams give the same text as alone, disconnects free
//! their slots, a full queue answers 503.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Streams a greedy completion; returns its text, or `None` if it was cut off after `cut`
/// events on purpose.
fn stream_text(
    addr: std::net::SocketAddr,
    prompt: &str,
    n: usize,
    cut: Option<usize>,
) -> Option<String> {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true});
    let mut sse = Sse::open(addr, "/v1/completions", &body);
    assert_eq!(sse.status, 200, "{}", sse.error_body);
    let mut text = String::new();
    let mut events = 0;
    while let Some(d) = sse.next_data() {
        if d == "[DONE]" {
            return Some(text);
        }
        events += 1;
        if cut.is_some_and(|c| events >= c) {
            return None; // dropping `sse` closes the connection mid-stream
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        text.push_str(v["choices"][0]["text"].as_str().unwrap());
    }
    panic!("stream ended without [DONE]");
}

const PROMPTS: [&str; 8] = [
    "Once upon a time",
    "The capital of France is",
    "In 1969, astronauts",
    "def fibonacci(n):",
    "Roses are red,",
    "A quick brown fox jumps over the lazy dog. Then",
    "Q: What is two plus two?\nA:",
    "The weather today",
];

#[test]
fn concurrent_streams_match_solo_runs_and_disconnects_free_slots() {
    let mut c = tiny_config();
    c.engine.n_parallel = 4;
    c.engine.n_ctx = 4 * 512;
    c.engine.n_ubatch = 16; // prompts take several steps: prefill interleaves with decoding
    c.metrics = true;
    let s = start(c);
    let a = s.local_addr();
    const N: usize = 40;
    let solo: Vec<String> = PROMPTS
        .iter()
        .map(|p| stream_text(a, p, N, None).unwrap())
        .collect();
    wait_idle(a);
    let rss_before = rss_kib();

    let start_t = Instant::now();
    let handles: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || {
                let prompt = PROMPTS[i % PROMPTS.len()];
                // A quarter disconnect after a few chunks, asking for many tokens.
                let cut = (i % 4 == 3).then_some(3);
                let n = if cut.is_some() { 400 } else { N };
                (i, stream_text(a, prompt, n, cut))
            })
        })
        .collect();
    let mut completed = 0;
    for h in handles {
        let (i, text) = h.join().unwrap();
        match text {
            Some(t) => {
                assert_eq!(
                    t,
                    solo[i % PROMPTS.len()],
                    "client {i} differs from its solo run"
                );
                completed += 1;
            }
            None => assert_eq!(i % 4, 3),
        }
    }
    assert_eq!(completed, 24);
    assert!(start_t.elapsed() < Duration::from_secs(30));
    let slots = wait_idle(a);
    assert!(slots.as_array().unwrap().iter().all(|s| s["id_task"] == -1));
    let m = get(a, "/metrics").body;
    let metric = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in {m}"))
    };
    assert_eq!(metric("llamacpp:requests_processing"), 0.0);
    assert_eq!(metric("llamacpp:requests_deferred"), 0.0);
    assert!(metric("hmoe:requests_cancelled_total") >= 1.0);
    assert!(
        metric("llamacpp:n_busy_slots_per_decode") > 1.0,
        "steps were batched"
    );
    // The slots' caches were allocated up front: serving 32 clients does not grow memory much.
    let grown = rss_kib().saturating_sub(rss_before);
    assert!(grown < 64 * 1024, "RSS grew by {grown} KiB");
}

#[test]
fn full_queue_answers_503_and_disconnects_free_the_slot() {
    let mut c = tiny_config();
    c.engine.n_parallel = 1;
    c.engine.max_queue = 1;
    c.engine.n_ctx = 8192;
    let s = start(c);
    let a = s.local_addr();
    let long = json!({"prompt": "Tell me a story", "max_tokens": 8000, "stream": true});
    let mut first = Sse::open(a, "/v1/completions", &long);
    assert_eq!(first.status, 200);
    assert!(first.next_data().is_some());
    let second = Sse::open(a, "/v1/completions", &long);
    assert_eq!(second.status, 200, "queued");
    let third = Sse::open(a, "/v1/completions", &long);
    assert_eq!(third.status, 503);
    let err: Value = serde_json::from_str(&third.error_body).unwrap();
    assert_eq!(err["error"]["type"], "unavailable_error");
    assert_eq!(err["error"]["code"], 503);
    // Both clients go away: the slot is freed at once, not after 8000 tokens.
    drop(first);
    drop(second);
    let t = Instant::now();
    wait_idle(a);
    assert!(t.elapsed() < Duration::from_secs(3));
    // A non-streamed request whose client goes away frees its slot too.
    {
        let body = json!({"prompt": "Tell me a story", "max_tokens": 8000}).to_string();
        let mut conn = std::net::TcpStream::connect(a).unwrap();
        use std::io::Write;
        write!(
            conn,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(get(a, "/slots").json()[0]["is_processing"], true);
    }
    let t = Instant::now();
    wait_idle(a);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "slot freed after {:?}",
        t.elapsed()
    );
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}
