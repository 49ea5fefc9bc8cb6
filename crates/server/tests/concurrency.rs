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

/// Streams a greedy completion; returns its text and the prompt tokens taken from the cache,
/// or `None` if it was cut off after `cut` events on purpose.
fn stream_text(
    addr: std::net::SocketAddr,
    prompt: &str,
    n: usize,
    cut: Option<usize>,
) -> Option<(String, u64)> {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}, "ignore_eos": cut.is_some()});
    let mut sse = Sse::open(addr, "/v1/completions", &body);
    assert_eq!(sse.status, 200, "{}", sse.error_body);
    let mut text = String::new();
    let mut cached = 0;
    let mut events = 0;
    while let Some(d) = sse.next_data() {
        if d == "[DONE]" {
            return Some((text, cached));
        }
        events += 1;
        if cut.is_some_and(|c| events >= c) {
            return None; // dropping `sse` closes the connection mid-stream
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        match v["choices"].get(0) {
            Some(c) => text.push_str(c["text"].as_str().unwrap()),
            None => {
                cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
            }
        }
    }
    panic!("stream ended without [DONE]");
}

/// The tests of this file measure the process (RSS, timing): one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
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
    let _alone = serial();
    let mut c = tiny_config();
    c.engine.n_parallel = 4;
    c.engine.n_ctx = 4 * 512;
    c.engine.n_ubatch = 4; // prompts take several steps: prefill interleaves with decoding
    c.metrics = true;
    const N: usize = 40;
    // Each prompt alone, on a fresh server.
    let solo: Vec<String> = {
        let fresh = start(c.clone());
        PROMPTS
            .iter()
            .map(|p| stream_text(fresh.local_addr(), p, N, None).unwrap().0)
            .collect()
    };
    let s = start(c);
    let a = s.local_addr();
    let round = |solo: &[String]| {
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
                Some((t, _)) => {
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
        wait_idle(a);
    };
    let start_t = Instant::now();
    round(&solo);
    let rss_before = rss_kib();
    round(&solo);
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
    // A pass holds at most one micro-batch of prompt tokens beside the other slots' decode
    // tokens: a new prompt never stalls the running streams for longer than that.
    assert!(metric("llamacpp:n_tokens_max") <= (4 + 3) as f64);
    // The slots' caches were allocated up front: a second round of 32 clients leaves memory
    // where the first left it.
    let grown = rss_kib().saturating_sub(rss_before);
    assert!(grown < 16 * 1024, "RSS grew by {grown} KiB");
}

/// Waits (bounded) until the server has counted `n` cancelled requests; returns the count.
fn cancelled(a: std::net::SocketAddr, n: f64) -> f64 {
    let mut count = 0.0;
    for _ in 0..500 {
        let m = get(a, "/metrics").body;
        count = m
            .lines()
            .find_map(|l| {
                l.strip_prefix("hmoe:requests_cancelled_total")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no cancellation count in {m}"));
        if count >= n {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    count
}

#[test]
fn full_queue_answers_503_and_disconnects_free_the_slot() {
    let _alone = serial();
    let mut c = tiny_config();
    c.engine.n_parallel = 1;
    c.engine.max_queue = 1;
    c.engine.n_ctx = 8192;
    c.metrics = true;
    let s = start(c);
    let a = s.local_addr();
    let long = json!({"prompt": "Tell me a story", "max_tokens": 8000, "stream": true, "ignore_eos": true});
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
    // Both clients go away: the running request is cancelled (not run to 8000 tokens) and the
    // queued one never starts.
    drop(first);
    drop(second);
    wait_idle(a);
    assert_eq!(cancelled(a, 2.0), 2.0, "{}", get(a, "/metrics").body);
    // A non-streamed request whose client goes away is cancelled too.
    {
        let body = json!({"prompt": "Tell me a story", "max_tokens": 8000, "ignore_eos": true})
            .to_string();
        let mut conn = std::net::TcpStream::connect(a).unwrap();
        use std::io::Write;
        write!(
            conn,
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut running = false;
        for _ in 0..500 {
            if get(a, "/slots").json()[0]["is_processing"] == true {
                running = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(running);
    }
    wait_idle(a);
    assert_eq!(cancelled(a, 3.0), 3.0, "{}", get(a, "/metrics").body);
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}

/// Reusing a slot's cached prompt prefix gives the same tokens and log-probabilities as a
/// fresh server, with F32 and F16 caches (where a lone token and a batch of several are
/// computed differently) and with flash attention.
#[test]
fn prompt_cache_reuse_gives_fresh_results() {
    let _alone = serial();
    let complete = |a, p: &str, n: usize| -> Value {
        let r = post(
            a,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": n, "temperature": 0, "logprobs": 2, "ignore_eos": true}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    use hmoe_model::kv_cache::{CacheType, FlashAttn};
    let flash = hmoe_model::KvType::new(CacheType::F16, CacheType::F16, FlashAttn::On).unwrap();
    for kv in [hmoe_model::KvType::F32, hmoe_model::KvType::F16, flash] {
        let mut c = tiny_config();
        c.engine.n_parallel = 1;
        c.engine.n_ubatch = 4;
        c.engine.kv_type = kv;
        let prompts = [
            "A quick brown fox jumps over the lazy dog. Then",
            "A quick brown fox jumps over the lazy cat and",
        ];
        let fresh: Vec<Value> = prompts
            .iter()
            .map(|p| {
                let s = start(c.clone());
                complete(s.local_addr(), p, 16)
            })
            .collect();
        let s = start(c);
        let a = s.local_addr();
        for (p, expect) in prompts.iter().zip(&fresh) {
            // One token only: the sliding-window layers can then roll back to the prompt prefix.
            complete(a, p, 1);
            let r = complete(a, p, 16);
            let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(cached > 0, "{kv:?}: nothing reused");
            assert_eq!(
                r["choices"][0]["text"], expect["choices"][0]["text"],
                "{kv:?}: {p}"
            );
            assert_eq!(
                r["choices"][0]["logprobs"], expect["choices"][0]["logprobs"],
                "{kv:?}: {p}"
            );
        }
    }
}
