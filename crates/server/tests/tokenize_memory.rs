//! `/tokenize` with `with_pieces` on a 6 MB prompt (about 2 million tokens): the peak memory
//! of the process must stay a small multiple of the ids, not gigabytes of JSON objects. Alone
//! in its test binary, since it measures the process's peak RSS.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use common::*;
use serde_json::json;

fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn tokenize_with_pieces_has_bounded_memory() {
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        eprintln!("SKIPPED: cannot reset the peak RSS (/proc/self/clear_refs)");
        return;
    }
    let s = start(tiny_config());
    let content = "ab ".repeat(2_000_000);
    let body = json!({"content": content, "with_pieces": true}).to_string();
    drop(content);
    let before = status_kib("VmRSS:");
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
    let peak = status_kib("VmHWM:");
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
