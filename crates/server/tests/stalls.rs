//! Large bodies and load must not stall the server: parsing, tokenizing and template rendering
//! run off the async workers (so `/health` keeps answering), and a stop (SIGTERM) ends the
//! server within two seconds whatever it is doing.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// `{"prompt": [1, 1, ...]}` of about `bytes` bytes: the shape that costs most to parse.
fn token_array_body(bytes: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(bytes + 16);
    b.extend_from_slice(b"{\"prompt\":[1");
    while b.len() < bytes {
        b.extend_from_slice(b",1");
    }
    b.extend_from_slice(b"]}");
    b
}

/// Sends a POST and reads what comes back, whatever happens (the server may stop meanwhile).
fn send_ignoring_errors(addr: SocketAddr, path: &str, body: &[u8]) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return;
    };
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    if s.write_all(head.as_bytes()).is_ok() && s.write_all(body).is_ok() {
        let _ = std::io::copy(&mut s, &mut std::io::sink());
    }
}

/// A chat request whose one message is `bytes` of text.
fn chat_body(bytes: usize) -> Vec<u8> {
    let text = "hello world ".repeat(bytes / 12);
    json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        .to_string()
        .into_bytes()
}

/// Polls `/health` until `done` says stop; returns the answer times, sorted.
fn health_times(addr: SocketAddr, done: impl Fn() -> bool) -> Vec<Duration> {
    let mut times = Vec::new();
    while !done() {
        let t = Instant::now();
        let r = get(addr, "/health");
        times.push(t.elapsed());
        assert_eq!(r.status, 200, "{}", r.body);
        thread::sleep(Duration::from_millis(20));
    }
    times.sort();
    times
}

/// The two tests load the machine (2 cores in CI): one at a time, so that one's timing does
/// not measure the other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Four large requests at once (token arrays, a long chat message, a long text to tokenize):
/// `/health` keeps answering within 100 ms (nine answers in ten; the slowest within 500 ms, as
/// the machine's scheduler allows: before, it waited for whole parses, ~1 s), and each large
/// request gets its answer.
#[test]
fn large_bodies_do_not_stall_health() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let server = start(tiny_config());
    let addr = server.local_addr();
    let mb = 1 << 20;
    let text = json!({"content": "hello world ".repeat(8 * mb / 12)})
        .to_string()
        .into_bytes();
    let jobs: Vec<(&str, Vec<u8>)> = vec![
        ("/completion", token_array_body(12 * mb)),
        ("/completion", token_array_body(12 * mb)),
        ("/v1/chat/completions", chat_body(8 * mb)),
        ("/tokenize", text),
    ];
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|(path, body)| {
            thread::spawn(move || {
                let r = request(addr, "POST", path, &[], &body);
                (path, r.status, r.body.chars().take(300).collect::<String>())
            })
        })
        .collect();
    let times = health_times(addr, || handles.iter().all(|h| h.is_finished()));
    for h in handles {
        let (path, status, body) = h.join().unwrap();
        match path {
            // The prompts are far longer than a slot's context.
            "/completion" | "/v1/chat/completions" => {
                assert_eq!(status, 400, "{path}: {body}");
                assert!(body.contains("exceed"), "{path}: {body}");
            }
            _ => assert_eq!(status, 200, "{path}: {body}"),
        }
    }
    let polls = times.len();
    let (p90, worst) = (times[polls * 9 / 10], times[polls - 1]);
    eprintln!("/health: {polls} answers, 90% within {p90:?}, the slowest {worst:?}");
    assert!(
        polls >= 5,
        "the large requests ended too soon to measure ({polls} polls)"
    );
    assert!(
        p90 < Duration::from_millis(100) && worst < Duration::from_millis(500),
        "/health took {p90:?} (90%), {worst:?} (slowest) while large bodies were parsed"
    );
}

/// A stop (what SIGTERM does) ends the server within 2 s while generations stream, large
/// bodies are being parsed and a client is halfway through sending a body.
#[test]
fn stop_is_quick_under_load() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut config = tiny_config();
    config.engine.n_ctx = 8192;
    let server = start(config);
    let addr = server.local_addr();
    let long = json!({"prompt": "once upon a time", "n_predict": 100000, "ignore_eos": true,
                      "stream": true});
    let mut streams: Vec<Sse> = (0..2)
        .map(|_| Sse::open(addr, "/completion", &long))
        .collect();
    for s in &mut streams {
        assert_eq!(s.status, 200, "{}", s.error_body);
        assert!(s.next_data().is_some());
    }
    let bodies: Vec<_> = (0..2)
        .map(|_| {
            thread::spawn(move || {
                send_ignoring_errors(addr, "/completion", &token_array_body(16 << 20));
            })
        })
        .collect();
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(
        b"POST /completion HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{\"prompt\":",
    )
    .unwrap();
    thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    server.stop().unwrap();
    let took = t.elapsed();
    eprintln!("stopped in {took:?}");
    assert!(took < Duration::from_secs(2), "stopping took {took:?}");
    drop(streams);
    drop(half);
    for b in bodies {
        b.join().unwrap();
    }
}

/// Arrays of token ids are read compactly and mean what they meant: a prompt of ids generates
/// what its text does, ids outside the vocabulary are refused by `/detokenize`, and mixed or
/// nested prompts are read as before.
#[test]
fn token_arrays_keep_their_meaning() {
    let server = start(tiny_config());
    let a = server.local_addr();
    let ids = post(
        a,
        "/tokenize",
        &json!({"content": "once upon a time", "add_special": true}),
    )
    .json()["tokens"]
        .clone();
    let greedy = |prompt: serde_json::Value| {
        let r = post(
            a,
            "/completion",
            &json!({"prompt": prompt, "n_predict": 6, "temperature": 0.0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["content"].as_str().unwrap().to_string()
    };
    let text = greedy(json!("once upon a time"));
    assert_eq!(greedy(ids.clone()), text);
    assert_eq!(greedy(json!([ids.clone()])), text);
    let r = post(a, "/detokenize", &json!({"tokens": ids}));
    assert_eq!(r.json()["content"], "once upon a time", "{}", r.body);
    let r = post(a, "/detokenize", &json!({"tokens": [1, 99999999]}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("99999999"), "{}", r.body);
    let r = post(a, "/completion", &json!({"prompt": [1, -2]}));
    assert_eq!(r.status, 400, "{}", r.body);
}
