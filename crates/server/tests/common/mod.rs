//! Shared test helpers: fixture paths, a scripted token picker, a small HTTP/1.1 client over
//! std's TcpStream (whole responses and SSE streams) and server start-up on a free loopback port.

#![allow(dead_code)]

pub mod python;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hmoe_engine::{Sampler, SamplerParams};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_server::{ModelSource, PickerFactory, RunningServer, ServerConfig, TokenPicker};
use hmoe_tokenizer::Tokenizer;
use serde_json::Value;

pub use hmoe_testdata::fixtures;

/// The tiny gpt-oss fixture (1k vocabulary with harmony specials, gpt-oss chat template).
pub fn tiny_model() -> PathBuf {
    fixtures().join("gpt-oss/gptoss-tiny.gguf")
}

/// The tokenizer of a model file.
pub fn tokenizer(path: &std::path::Path) -> Tokenizer {
    let g = GgufModel::open(path, LoadOptions::default()).expect("fixture opens");
    Tokenizer::from_metadata(g.metadata()).expect("fixture tokenizer")
}

/// A fresh scratch directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-server-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replays fixed tokens, ignoring the logits.
struct Script {
    tokens: Vec<u32>,
    pos: usize,
}

impl TokenPicker for Script {
    fn accept(&mut self, _token: u32) {}
    fn pick(&mut self, _logits: &[f32]) -> u32 {
        let t = self.tokens[self.pos.min(self.tokens.len() - 1)];
        self.pos += 1;
        t
    }
}

/// A picker factory: requests whose `seed` is a key of `scripts` replay that text (special
/// tokens parsed); every other request samples normally.
pub fn scripted(tok: &Tokenizer, scripts: &[(u64, &str)]) -> PickerFactory {
    let map: HashMap<u64, Vec<u32>> = scripts
        .iter()
        .map(|(seed, text)| {
            (
                *seed,
                tok.encode(text, false, true).expect("script encodes"),
            )
        })
        .collect();
    Arc::new(move |p: &SamplerParams| -> Box<dyn TokenPicker> {
        match map.get(&p.seed) {
            Some(tokens) => Box::new(Script {
                tokens: tokens.clone(),
                pos: 0,
            }),
            None => Box::new(Sampler::new(p.clone())),
        }
    })
}

/// A config for the tiny fixture on a free loopback port with a small context.
pub fn tiny_config() -> ServerConfig {
    let mut c = ServerConfig::new(ModelSource::File(tiny_model()));
    c.port = 0;
    c.engine.n_ctx = 2048;
    c.engine.n_parallel = 2;
    c.engine.n_ubatch = 64;
    c
}

/// Starts a server and waits until `/health` answers 200.
pub fn start(config: ServerConfig) -> RunningServer {
    let server = RunningServer::start(config).expect("server starts");
    for _ in 0..200 {
        if get(server.local_addr(), "/health").status == 200 {
            return server;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the server did not become healthy");
}

/// A whole HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

fn write_request(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
}

fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    })
}

/// Reads one chunk of a chunked body; `None` at the end.
fn read_chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(line.trim().split(';').next()?, 16).ok()?;
    let mut buf = vec![0u8; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    (n > 0).then_some(buf)
}

/// Sends a request and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut s = connect(addr);
    write_request(&mut s, method, path, headers, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let mut body = Vec::new();
    if is_chunked(&headers) {
        while let Some(c) = read_chunk(&mut r) {
            body.extend(c);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Resp {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// An open SSE response, read event by event; dropping it disconnects.
pub struct Sse {
    pub status: u16,
    reader: BufReader<TcpStream>,
    pending: String,
    chunked: bool,
    pub error_body: String,
}

impl Sse {
    /// Opens a streaming POST.
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Sse {
        Sse::open_with(addr, path, body, &[])
    }

    pub fn open_with(addr: SocketAddr, path: &str, body: &Value, headers: &[(&str, &str)]) -> Sse {
        let mut s = connect(addr);
        write_request(&mut s, "POST", path, headers, body.to_string().as_bytes());
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader);
        let chunked = is_chunked(&headers);
        let mut sse = Sse {
            status,
            reader,
            pending: String::new(),
            chunked,
            error_body: String::new(),
        };
        if status != 200 {
            let mut body = Vec::new();
            if chunked {
                while let Some(c) = read_chunk(&mut sse.reader) {
                    body.extend(c);
                }
            } else {
                let _ = sse.reader.read_to_end(&mut body);
            }
            sse.error_body = String::from_utf8_lossy(&body).into_owned();
        }
        sse
    }

    /// The next `data:` payload (comments skipped); `None` at the end of the stream.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            let bytes = if self.chunked {
                read_chunk(&mut self.reader)?
            } else {
                let mut buf = [0u8; 4096];
                let n = self.reader.read(&mut buf).ok()?;
                if n == 0 {
                    return None;
                }
                buf[..n].to_vec()
            };
            self.pending.push_str(&String::from_utf8_lossy(&bytes));
        }
    }

    /// Every remaining `data:` payload.
    pub fn all(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }
}

/// Polls `/slots` until no slot is processing (bounded).
pub fn wait_idle(addr: SocketAddr) -> Value {
    let mut last = Value::Null;
    for _ in 0..1000 {
        last = get(addr, "/slots").json();
        if last
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["is_processing"] == false)
        {
            return last;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("slots still busy: {last}");
}

/// The prompt of a chat with one user message `content`, the token count the server gives it
/// (`/v1/messages/count_tokens` and a chat's `usage.prompt_tokens`), and what that count must
/// be with the content tokenized as text and the template's markup as control tokens; each of
/// `forgeries` (one control token of the vocabulary) must be absent from the content's tokens.
pub fn forged_turn_counts(a: SocketAddr, tok: &Tokenizer, content: &str, forgeries: &[&str]) {
    let messages = serde_json::json!([{"role": "user", "content": content}]);
    let text = post(
        a,
        "/apply-template",
        &serde_json::json!({ "messages": messages }),
    )
    .json()["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    let at = text
        .find(content)
        .expect("the content is in the prompt as written");
    // The content sits between control tokens, so the pieces tokenize on their own.
    let mut plain = tok.encode(&text[..at], true, true).unwrap();
    // Text through and through: not even the user-defined tokens (gpt-oss's markup) are cut.
    let content_ids = tok
        .encode_with_plain(content, false, std::slice::from_ref(&(0..content.len())))
        .unwrap();
    plain.extend(&content_ids);
    plain.extend(
        tok.encode(&text[at + content.len()..], false, true)
            .unwrap(),
    );
    let forged = tok.encode(&text, true, true).unwrap();
    assert!(
        forged.len() < plain.len(),
        "the content holds control-token text"
    );
    for forgery in forgeries {
        let [control] = tok.encode(forgery, false, true).unwrap()[..] else {
            panic!("{forgery} is one token of the vocabulary");
        };
        assert!(
            !content_ids.contains(&control),
            "{forgery} became a control token"
        );
    }
    let counted = post(
        a,
        "/v1/messages/count_tokens",
        &serde_json::json!({"model": "x", "messages": messages}),
    );
    assert_eq!(counted.status, 200, "{}", counted.body);
    assert_eq!(counted.json()["input_tokens"], plain.len(), "{text}");
    let r = post(
        a,
        "/v1/chat/completions",
        &serde_json::json!({"messages": messages, "max_tokens": 1}),
    )
    .json();
    assert_eq!(r["usage"]["prompt_tokens"], plain.len(), "{r}");
}
