//! Soak: 4 slots, 48 clients looping over streaming and whole greedy completions, a quarter of
//! them hanging up mid-stream, 300 stalled connections held open meanwhile. Afterwards every
//! answer that was not cut equals the same request run alone, every slot is idle, RSS is back
//! within 10% of the warm baseline, the process has no more threads than then, and `/health`
//! answered every probe throughout. `HMOE_SOAK_SECS` sets the load phase (default 8 s).
//!
//! Also `/tokenize` with `with_pieces` on a 6 MB prompt (about 2 million tokens): the peak
//! memory must stay a small multiple of the ids, not gigabytes of JSON objects. The tests of
//! this file measure the process, so they run one at a time.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const PROMPTS: [&str; 4] = [
    "The quick brown fox",
    "Once upon a time",
    "In the beginning there was",
    "Hello world, this is",
];
const N: usize = 12;
const CLIENTS: usize = 48;
const STALLED: usize = 300;

fn status_field(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The tests of this file measure the process (RSS, threads): one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn body(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": N, "temperature": 0, "stream": stream})
}

/// A whole completion's text.
fn whole(a: SocketAddr, prompt: &str) -> String {
    let r = post(a, "/v1/completions", &body(prompt, false));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

/// A streamed completion's text, or `None` when cut after `cut` events on purpose.
fn streamed(a: SocketAddr, prompt: &str, cut: Option<usize>) -> Option<String> {
    let mut sse = Sse::open(a, "/v1/completions", &body(prompt, true));
    assert_eq!(sse.status, 200, "{}", sse.error_body);
    let mut text = String::new();
    let mut events = 0;
    while let Some(d) = sse.next_data() {
        if d == "[DONE]" {
            return Some(text);
        }
        events += 1;
        if cut.is_some_and(|c| events >= c) {
            return None;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
    }
    panic!("the stream ended without [DONE]");
}

/// Runs the client loop on `CLIENTS` threads until `stop`; returns (completed, cut) counts.
fn load(a: SocketAddr, solo: &Arc<Vec<String>>, stop: Duration) -> (usize, usize) {
    let done = Arc::new(AtomicUsize::new(0));
    let cut = Arc::new(AtomicUsize::new(0));
    let wrong: Arc<Mutex<Vec<String>>> = Arc::default();
    let until = Instant::now() + stop;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (solo, done, cut, wrong) = (solo.clone(), done.clone(), cut.clone(), wrong.clone());
            std::thread::spawn(move || {
                let mut i = c;
                while Instant::now() < until {
                    let p = i % PROMPTS.len();
                    let hangs_up = c % 4 == 0;
                    let got = if i % 2 == 0 {
                        streamed(a, PROMPTS[p], hangs_up.then_some(2))
                    } else {
                        Some(whole(a, PROMPTS[p]))
                    };
                    match got {
                        Some(text) if text == solo[p] => {
                            done.fetch_add(1, Relaxed);
                        }
                        Some(text) => wrong
                            .lock()
                            .unwrap()
                            .push(format!("client {c} prompt {p}: {text:?} != {:?}", solo[p])),
                        None => {
                            cut.fetch_add(1, Relaxed);
                        }
                    }
                    i += 1;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    let wrong = wrong.lock().unwrap();
    assert!(
        wrong.is_empty(),
        "{} answers differ: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    (done.load(Relaxed), cut.load(Relaxed))
}

#[test]
fn soak_slots_streams_disconnects_and_stalled_connections() {
    let _alone = serial();
    let secs: u64 = std::env::var("HMOE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let mut c = tiny_config();
    c.engine.n_parallel = 4;
    c.engine.n_ctx = 4 * 256;
    c.engine.n_ubatch = 64;
    // The stalled connections stay open for the whole test.
    c.limits.header_timeout = Duration::from_secs(300);
    let s = start(c);
    let a = s.local_addr();

    // Each prompt alone, whole and streamed: the answers the loaded runs must equal.
    let solo: Arc<Vec<String>> = Arc::new(PROMPTS.iter().map(|p| whole(a, p)).collect());
    for (p, text) in PROMPTS.iter().zip(solo.iter()) {
        assert!(!text.is_empty());
        assert_eq!(streamed(a, p, None).as_deref(), Some(text.as_str()));
    }

    let mut stalled: Vec<TcpStream> = (0..STALLED)
        .map(|_| {
            let mut t = TcpStream::connect(a).expect("connect");
            t.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
                .unwrap();
            t
        })
        .collect();

    // /health is probed every 50 ms from here to the end.
    let probing = Arc::new(AtomicBool::new(true));
    let probes: Arc<Mutex<Vec<(u16, Duration)>>> = Arc::default();
    let prober = {
        let (probing, probes) = (probing.clone(), probes.clone());
        std::thread::spawn(move || {
            while probing.load(Relaxed) {
                let t = Instant::now();
                let status = get(a, "/health").status;
                probes.lock().unwrap().push((status, t.elapsed()));
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    // Warm-up under the same load, then the baseline.
    let t0 = Instant::now();
    load(a, &solo, Duration::from_secs(3));
    wait_idle(a);
    let (rss0, threads0) = (status_field("VmRSS:"), status_field("Threads:"));

    let (done, cut) = load(a, &solo, Duration::from_secs(secs));
    let slots = wait_idle(a);
    // The blocking pool's threads (parsing, tokenizing) end after 2 s idle: wait for them.
    let settle = Instant::now();
    while status_field("Threads:") > threads0 && settle.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (rss1, threads1) = (status_field("VmRSS:"), status_field("Threads:"));
    probing.store(false, Relaxed);
    prober.join().unwrap();
    eprintln!(
        "soak: {done} answers equal to their solo runs, {cut} cut mid-stream, {} s; RSS {rss0} -> {rss1} KiB, threads {threads0} -> {threads1}, {} health probes",
        t0.elapsed().as_secs(),
        probes.lock().unwrap().len()
    );

    assert!(done > 4 * CLIENTS, "too few answers: {done}");
    assert!(cut > 0, "no client hung up");
    assert!(slots
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["is_processing"] == false));
    let probes = probes.lock().unwrap();
    assert!(probes.len() > 10);
    let worst = probes.iter().map(|p| p.1).max().unwrap();
    assert!(
        probes.iter().all(|p| p.0 == 200),
        "/health failed: {:?}",
        probes
            .iter()
            .filter(|p| p.0 != 200)
            .take(3)
            .collect::<Vec<_>>()
    );
    assert!(worst < Duration::from_secs(2), "/health took {worst:?}");
    assert!(
        rss1 as f64 <= rss0 as f64 * 1.10,
        "RSS grew from {rss0} KiB to {rss1} KiB"
    );
    assert!(
        threads1 <= threads0,
        "threads grew from {threads0} to {threads1}"
    );
    // The stalled connections were held (not closed) and the server still answers.
    stalled.retain(|t| {
        t.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        matches!(std::io::Read::read(&mut &*t, &mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    });
    assert_eq!(stalled.len(), STALLED);
    assert_eq!(whole(a, PROMPTS[0]), solo[0]);
}

#[test]
fn tokenize_with_pieces_has_bounded_memory() {
    let _alone = serial();
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        eprintln!("SKIPPED: cannot reset the peak RSS (/proc/self/clear_refs)");
        return;
    }
    let s = start(tiny_config());
    let content = "ab ".repeat(2_000_000);
    let body = json!({"content": content, "with_pieces": true}).to_string();
    drop(content);
    let before = status_field("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let mut conn = TcpStream::connect(s.local_addr()).unwrap();
    write!(
        conn,
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    conn.write_all(body.as_bytes()).unwrap();
    drop(body);
    // Read the answer without keeping it: count the pieces, check the ends.
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    if !line.starts_with("HTTP/1.1 200") {
        let mut rest = String::new();
        let _ = r.read_to_string(&mut rest);
        panic!("{line}{rest}");
    }
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
    }
    let (mut n_bytes, mut pieces, mut head, mut tail) = (0usize, 0usize, Vec::new(), Vec::new());
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        if head.len() < 64 {
            head.extend_from_slice(&chunk[..chunk.len().min(64)]);
        }
        tail.extend_from_slice(chunk);
        if tail.len() > 256 {
            tail.drain(..tail.len() - 256);
        }
        pieces += chunk.windows(7).filter(|w| w == b"\"piece\"").count();
        n_bytes += n;
    }
    let peak = status_field("VmHWM:");
    let head = String::from_utf8_lossy(&head);
    let tail = String::from_utf8_lossy(&tail);
    eprintln!(
        "tokenize: {n_bytes} bytes (chunked framing included), {pieces} pieces; RSS {before} KiB before, peak {peak} KiB"
    );
    // Chunked: `{"tokens":[` and `]}` come as chunks of their own.
    assert!(head.contains("{\"tokens\":["), "{head}");
    assert!(tail.contains("]}") && tail.contains("\"}"), "{tail}");
    // About 2 M tokens ("ab" and " "); a piece split across reads is not counted.
    assert!(pieces >= 1_900_000, "{pieces}");
    // The ids take 8 MB; a JSON tree of the pieces took gigabytes.
    let grown_mib = peak.saturating_sub(before) / 1024;
    assert!(grown_mib < 300, "peak RSS grew by {grown_mib} MiB");
}
