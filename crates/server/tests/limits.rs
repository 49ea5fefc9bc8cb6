//! Hostile clients: stalled connections, slow and oversized bodies, broken chunked encoding,
//! API keys. Each test reproduces a case of the hostile-input issue and checks the bound.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use hmoe_server::{ModelSource, RunningServer, ServerConfig};
use serde_json::{json, Value};

/// A connection that sent `bytes` and then stalls.
fn stalled(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(bytes).unwrap();
    s
}

/// Whether the server closed `s` (EOF or reset) within `within`; returns what it sent.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<String> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None
            }
            Err(_) => return Some(String::from_utf8_lossy(&got).into_owned()),
        }
    }
}

/// The JSON body of a raw HTTP/1.1 response.
fn body_json(raw: &str) -> Value {
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {raw}"))
}

#[test]
fn stalled_connections_are_closed_and_health_answers_beyond_the_cap() {
    let mut c = tiny_config();
    c.limits.max_connections = 8;
    // Long enough that no stalled connection times out before the 503 is checked, even on a
    // loaded 2-core machine running other tests.
    let header_timeout = Duration::from_secs(10);
    c.limits.header_timeout = header_timeout;
    let s = start(c);
    let a = s.local_addr();
    // `start`'s last `/health` poll held a normal place; the server frees it just after the
    // client sees the connection close. Connecting the stalled clients in that moment leaves
    // a place free for `/v1/models` below (seen twice on the loaded CI machine), so let the
    // server finish with it first.
    std::thread::sleep(Duration::from_millis(300));
    let connected = Instant::now();
    // Eight normal places, then the reserve (8/8 + 16 = 17), then more: 60 clients that send
    // half a request head and stall.
    let mut held: Vec<TcpStream> = (0..60)
        .map(|_| {
            stalled(
                a,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // /health answers while every place is taken (it takes a reserve place, closing the
    // oldest stalled one); other routes on a reserve place get the JSON 503.
    for _ in 0..5 {
        let t = Instant::now();
        let h = get(a, "/health");
        assert_eq!(h.status, 200, "{}", h.body);
        assert!(t.elapsed() < Duration::from_secs(2));
    }
    let busy = get(a, "/v1/models");
    assert!(
        connected.elapsed() < header_timeout,
        "the checks took {:?}, past the header timeout",
        connected.elapsed()
    );
    assert_eq!(busy.status, 503, "{}", busy.body);
    assert!(busy.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-connections"));
    // Every stalled connection is closed within the header timeout (plus slack).
    let deadline = header_timeout + Duration::from_secs(5);
    for (i, conn) in held.iter_mut().enumerate() {
        let left = deadline.saturating_sub(connected.elapsed());
        assert!(
            closed_within(conn, left.max(Duration::from_millis(1))).is_some(),
            "stalled connection {i} still open after {:?}",
            connected.elapsed()
        );
    }
    drop(held);
    // Places are free again: normal routes answer.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(get(a, "/v1/models").status, 200);
}

#[test]
fn a_body_that_does_not_arrive_in_time_gets_408() {
    let mut c = tiny_config();
    c.limits.timeout = Duration::from_secs(1);
    let s = start(c);
    let mut conn = stalled(
        s.local_addr(),
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"",
    );
    let raw = closed_within(&mut conn, Duration::from_secs(5)).expect("answered and closed");
    assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");
    let e = body_json(&raw);
    assert_eq!(e["error"]["code"], 408);
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--timeout"));
}

#[test]
fn oversized_and_malformed_bodies_get_the_json_error_object() {
    let mut c = tiny_config();
    c.limits.max_body = 1 << 20;
    let s = start(c);
    let a = s.local_addr();
    // Declared too large: 413 before any of it is read.
    let mut conn = stalled(
        a,
        b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n",
    );
    let raw = closed_within(&mut conn, Duration::from_secs(5)).expect("answered");
    assert!(raw.starts_with("HTTP/1.1 413"), "{raw}");
    assert!(
        raw.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{raw}"
    );
    assert_eq!(body_json(&raw)["error"]["code"], 413);
    // Chunked past the limit: 413 too.
    let mut conn = stalled(
        a,
        b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    let chunk = vec![b'a'; 64 << 10];
    for _ in 0..20 {
        if conn
            .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .is_err()
            || conn.write_all(&chunk).is_err()
            || conn.write_all(b"\r\n").is_err()
        {
            break;
        }
    }
    let raw = closed_within(&mut conn, Duration::from_secs(5)).expect("answered");
    assert!(raw.starts_with("HTTP/1.1 413"), "{raw}");
    assert_eq!(body_json(&raw)["error"]["type"], "invalid_request_error");
    // Broken chunked encoding: 400 with the error object.
    let mut conn = stalled(
        a,
        b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    );
    let raw = closed_within(&mut conn, Duration::from_secs(5)).expect("answered");
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    let e = body_json(&raw);
    assert_eq!(e["error"]["code"], 400);
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("request body"));
    // The server still serves.
    assert_eq!(get(a, "/health").status, 200);
}

#[test]
fn empty_api_keys_are_refused_and_every_key_works() {
    for keys in [vec![String::new()], vec!["k1".into(), " ".into()]] {
        let mut c = tiny_config();
        c.api_keys = keys.clone();
        let e = RunningServer::start(c)
            .err()
            .expect("an empty key is refused");
        assert!(e.to_string().contains("empty"), "{keys:?}: {e}");
    }
    let mut c = tiny_config();
    c.api_keys = vec!["alpha".into(), "beta".into(), "gamma".into()];
    let s = start(c);
    let a = s.local_addr();
    for (key, status) in [
        ("alpha", 200),
        ("beta", 200),
        ("gamma", 200),
        ("gamm", 401),
        ("gammaa", 401),
        ("", 401),
    ] {
        let auth = format!("Bearer {key}");
        let r = request(a, "GET", "/props", &[("Authorization", &auth)], b"");
        assert_eq!(r.status, status, "key {key:?}: {}", r.body);
    }
}

#[test]
fn cors_preflight_answers_listed_origins_only() {
    let mut c = tiny_config();
    c.api_keys = vec!["k".into()];
    c.cors_origins = vec!["http://ui.example".into()];
    let s = start(c);
    let a = s.local_addr();
    let origin = ("Origin", "http://ui.example");
    let r = request(
        a,
        "OPTIONS",
        "/v1/chat/completions",
        &[origin, ("Access-Control-Request-Method", "POST")],
        b"",
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "");
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://ui.example")
    );
    assert_eq!(r.header("access-control-allow-methods"), Some("GET, POST"));
    assert_eq!(r.header("access-control-allow-headers"), Some("*"));
    assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
    // Errors carry the header too, so a browser can read them.
    let denied = request(a, "POST", "/completion", &[origin], b"{}");
    assert_eq!(denied.status, 401);
    assert_eq!(
        denied.header("access-control-allow-origin"),
        Some("http://ui.example")
    );
    // Another origin gets no CORS headers, the preflight included.
    let evil = ("Origin", "http://evil.example");
    let r = request(a, "OPTIONS", "/completion", &[evil], b"");
    assert_eq!(r.header("access-control-allow-origin"), None);
    let r = request(a, "GET", "/health", &[evil], b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), None);
    drop(s);

    // The default: no origin but the server's own is answered.
    let s = start(tiny_config());
    let a = s.local_addr();
    for o in ["http://evil.example", "null", "http://localhost:3000"] {
        let r = request(a, "OPTIONS", "/completion", &[("Origin", o)], b"");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("access-control-allow-origin"), None, "{o}");
        assert_eq!(r.header("access-control-allow-credentials"), None, "{o}");
    }
    drop(s);

    // `*`: any origin, without credentials; `localhost`: loopback origins, reflected.
    let mut c = tiny_config();
    c.cors_origins = vec!["*".into()];
    let s = start(c);
    let r = request(s.local_addr(), "GET", "/health", &[evil], b"");
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    assert_eq!(r.header("access-control-allow-credentials"), None);
    drop(s);
    let mut c = tiny_config();
    c.cors_origins = vec!["localhost".into()];
    let s = start(c);
    let dev = ("Origin", "http://localhost:5173");
    let r = request(s.local_addr(), "GET", "/health", &[dev], b"");
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:5173")
    );
    let r = request(s.local_addr(), "GET", "/health", &[evil], b"");
    assert_eq!(r.header("access-control-allow-origin"), None);
}

/// A `POST` of `body` to `path` with exactly these optional `Origin` and `Content-Type`
/// headers (`request` marks a non-empty body as JSON); the whole raw response.
fn raw_post(
    a: SocketAddr,
    path: &str,
    origin: Option<&str>,
    ct: Option<&str>,
    body: &str,
) -> String {
    let line =
        |name: &str, v: Option<&str>| v.map_or(String::new(), |v| format!("{name}: {v}\r\n"));
    let raw = format!(
        "POST {path} HTTP/1.1\r\nHost: {a}\r\n{}{}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        line("Origin", origin),
        line("Content-Type", ct),
        body.len()
    );
    let mut conn = stalled(a, raw.as_bytes());
    closed_within(&mut conn, Duration::from_secs(30)).expect("answered")
}

/// What a web page of another origin can send without a preflight: a form or a `fetch` with
/// a "simple" content type. None of it may reach a state-changing route.
#[test]
fn simple_cross_origin_requests_are_refused_with_415() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let body = json!({"prompt": "Hi", "n_predict": 1}).to_string();
    let evil = "http://evil.example";
    for ct in [
        Some("text/plain"),
        Some("text/plain;charset=UTF-8"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        for path in ["/completion", "/v1/chat/completions", "/models/unload"] {
            let got = raw_post(a, path, Some(evil), ct, &body);
            assert!(got.starts_with("HTTP/1.1 415"), "{path} {ct:?}: {got}");
            let e = body_json(&got);
            let msg = e["error"]["message"].as_str().unwrap();
            assert!(
                msg.contains("application/json") && msg.contains("--cors-origins"),
                "{msg}"
            );
            assert!(!got
                .to_ascii_lowercase()
                .contains("access-control-allow-origin"));
        }
    }
    // The same bodies without an Origin (curl -d sends form-urlencoded), from the server's
    // own origin (the chat page), or as JSON run as before.
    let own = format!("http://{a}");
    for (ct, origin) in [
        ("application/x-www-form-urlencoded", None),
        ("text/plain", Some(own.as_str())),
        ("application/json", Some(evil)),
    ] {
        let got = raw_post(a, "/completion", origin, Some(ct), &body);
        assert!(got.starts_with("HTTP/1.1 200"), "{ct} {origin:?}: {got}");
    }
    // Reading routes stay open to simple requests (the browser hides the answer).
    let r = request(a, "GET", "/health", &[("Origin", evil)], b"");
    assert_eq!(r.status, 200);
}

/// Responses on a kept-alive connection say how long it stays open idle, and it does.
#[test]
fn keep_alive_header_matches_the_idle_close() {
    let mut c = tiny_config();
    c.limits.header_timeout = Duration::from_secs(2);
    let s = start(c);
    let mut conn = stalled(s.local_addr(), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 4096];
    let n = conn.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("\r\nkeep-alive: timeout=2\r\n"), "{head}");
    let idle = Instant::now();
    assert!(
        closed_within(&mut conn, Duration::from_secs(6)).is_some(),
        "the idle connection stayed open"
    );
    let waited = idle.elapsed();
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
        "closed after {waited:?}, announced 2 s"
    );
    // A request that closes its connection gets no Keep-Alive header.
    let r = get(s.local_addr(), "/health");
    assert_eq!(r.header("keep-alive"), None);
}

#[test]
fn bad_model_files_fail_before_listening() {
    let dir = scratch("badfiles");
    let text = dir.join("notes.txt");
    std::fs::write(&text, "not a model\n").unwrap();
    let truncated = dir.join("truncated.gguf");
    let tiny = std::fs::read(tiny_model()).unwrap();
    std::fs::write(&truncated, &tiny[..tiny.len() / 2]).unwrap();
    for path in [
        dir.join("nonexistent.gguf"),
        dir.clone(),
        text,
        truncated,
        "/dev/zero".into(),
    ] {
        let mut c = ServerConfig::new(ModelSource::File(path.clone()));
        c.port = 0;
        let t = Instant::now();
        let e = RunningServer::start(c)
            .err()
            .unwrap_or_else(|| panic!("{} was served", path.display()));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            e.to_string().contains(&path.display().to_string()),
            "{}: {e}",
            path.display()
        );
    }
}

#[test]
fn tokenize_pieces_stream_and_match_the_ids() {
    let s = start(tiny_config());
    let a = s.local_addr();
    let content = "ab ".repeat(20_000);
    let ids = post(a, "/tokenize", &json!({"content": content})).json();
    let pieces = post(
        a,
        "/tokenize",
        &json!({"content": content, "with_pieces": true}),
    )
    .json();
    let ids = ids["tokens"].as_array().unwrap();
    let pieces = pieces["tokens"].as_array().unwrap();
    assert!(ids.len() > 10_000, "{}", ids.len());
    assert_eq!(ids.len(), pieces.len());
    let mut text = String::new();
    for (id, p) in ids.iter().zip(pieces) {
        assert_eq!(&p["id"], id);
        text.push_str(p["piece"].as_str().expect("ASCII pieces are strings"));
    }
    assert_eq!(text, content);
    assert_eq!(
        post(a, "/tokenize", &json!({"content": ""})).json(),
        json!({"tokens": []})
    );
}

#[test]
fn stop_strings_are_bounded() {
    let server = start(tiny_config());
    let a = server.local_addr();
    let ok = post(
        a,
        "/completion",
        &json!({"prompt": "hi", "n_predict": 2, "stop": vec!["x"; 64]}),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    for stop in [json!(vec!["x"; 65]), json!(["y".repeat(1025)])] {
        let r = post(
            a,
            "/completion",
            &json!({"prompt": "hi", "n_predict": 2, "stop": stop}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains("at most 64 strings"), "{}", r.body);
    }
}

/// A client that stops reading a response is dropped after `--timeout` instead of holding its
/// connection for ever: the response is cut short and the socket closed.
#[test]
fn a_client_that_stops_reading_is_dropped_after_the_timeout() {
    let mut c = tiny_config();
    c.limits.timeout = Duration::from_secs(2);
    let s = start(c);
    let a = s.local_addr();
    // A response of several MiB, more than the socket buffers on both sides hold.
    let body = json!({"content": "ab ".repeat(1_000_000), "with_pieces": true}).to_string();
    let request = format!(
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let started = Instant::now();
    let whole = post(
        a,
        "/tokenize",
        &serde_json::from_str::<Value>(&body).unwrap(),
    );
    let full_len = whole.body.len();
    let took = started.elapsed();
    assert!(full_len > 8 << 20, "{full_len}");
    let mut conn = stalled(a, request.as_bytes());
    // Long enough for the server to answer, fill the buffers and give up on the reader.
    std::thread::sleep(took * 2 + Duration::from_secs(5));
    let raw = closed_within(&mut conn, Duration::from_secs(20)).expect("the server closed it");
    assert!(
        raw.starts_with("HTTP/1.1 200"),
        "{}",
        &raw[..raw.len().min(200)]
    );
    assert!(raw.len() < full_len, "{} of {full_len} bytes", raw.len());
    // The server goes on serving.
    assert_eq!(get(a, "/health").status, 200);
}

/// As llama-server: a generation the full context stops is `"truncated": true` (one that
/// reaches `n_predict` is not); a `logit_bias` id outside the vocabulary is ignored and a
/// `top_p` beyond [0, 1] clamped, not refused; an empty Responses `input` is named as such.
#[test]
fn small_defects_answer_as_llama_server() {
    let mut c = tiny_config();
    c.engine.n_ctx = 1024;
    c.engine.n_parallel = 4;
    let server = start(c);
    let a = server.local_addr();
    let full = post(
        a,
        "/completion",
        &json!({"prompt": "hello", "n_predict": 5000, "ignore_eos": true}),
    );
    assert_eq!(full.status, 200, "{}", full.body);
    let j = full.json();
    assert_eq!(j["truncated"], true, "{j}");
    assert_eq!(j["stop_type"], "limit");
    let short = post(
        a,
        "/completion",
        &json!({"prompt": "hello", "n_predict": 3, "ignore_eos": true}),
    );
    assert_eq!(short.json()["truncated"], false, "{}", short.body);
    for extra in [
        json!({"logit_bias": {"999999999": 5}}),
        json!({"logit_bias": {"-3": 5, "7": -1}}),
        json!({"logit_bias": [[999999999, 5], [-1, false]]}),
        json!({"top_p": 1.5}),
        json!({"top_p": -0.5}),
    ] {
        let mut body = json!({"prompt": "hello", "n_predict": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(a, "/completion", &body);
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
    // Still refused: a bias that is not a number.
    let r = post(
        a,
        "/completion",
        &json!({"prompt": "hello", "logit_bias": {"5": "x"}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(a, "/v1/responses", &json!({"input": []}));
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("'input'") && !msg.contains("messages"),
        "{msg}"
    );
}
