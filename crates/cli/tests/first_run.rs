//! What a newcomer meets: `make-test-model` stand-ins of every family chat at once (their chat
//! template is embedded), `hmoe serve` prints what it runs and logs each request, and `hmoe chat`
//! survives Ctrl-C during a reply (the partial reply is kept), leaves on Ctrl-C at the prompt,
//! and knows `/clear` and `/save FILE`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const HMOE: &str = env!("CARGO_BIN_EXE_hmoe");

fn scratch(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-first-run-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn make_model(arch: &str, out: &Path) {
    let o = Command::new(HMOE)
        .args(["make-test-model", "--arch", arch, "-o"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} failed");
}

/// Lines of a child's stream, as they come.
fn lines_of(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Reads lines until one contains `needle`; returns every line read.
fn until(rx: &mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => {
                let hit = l.contains(needle);
                seen.push(l);
                if hit {
                    return seen;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    panic!("no line with {needle:?} in:\n{}", seen.join("\n"));
}

/// Removes ANSI colour sequences (the log format of the binary is not this test's business).
fn plain(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap();
    let body = resp
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// A running `hmoe serve`, stopped with SIGTERM when dropped.
struct Serve {
    child: Child,
    addr: String,
    stderr: mpsc::Receiver<String>,
    startup: Vec<String>,
}

impl Serve {
    fn start(args: &[&str]) -> Serve {
        let mut child = Command::new(HMOE)
            .arg("serve")
            .args(args)
            .args(["--port", "0", "-t", "2"])
            .env("RUST_LOG", "hmoe_server::request=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = lines_of(child.stderr.take().unwrap());
        let startup = until(&stderr, "listening on http://");
        let addr = startup
            .last()
            .unwrap()
            .rsplit("http://")
            .next()
            .unwrap()
            .trim()
            .to_string();
        Serve {
            child,
            addr,
            stderr,
            startup,
        }
    }

    fn chat(&self, model: Option<&str>) -> (u16, Value) {
        let mut req = json!({"messages": [{"role": "user", "content": "Hello"}],
                             "max_tokens": 6, "temperature": 0});
        if let Some(m) = model {
            req["model"] = m.into();
        }
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (status, body) = http(&self.addr, "POST", "/v1/chat/completions", Some(&req));
            // 503 while a single model is still loading.
            if status != 503 || Instant::now() > end {
                return (status, serde_json::from_str(&body).unwrap_or(Value::Null));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

#[test]
fn stand_ins_chat_at_once_and_serve_explains_itself() {
    let dir = scratch("serve");
    for arch in ["gpt-oss", "qwen3moe", "deepseek2"] {
        make_model(arch, &dir.join(format!("{arch}.gguf")));
    }
    // Router mode: each family answers a chat request with no template given.
    let router = Serve::start(&["--models-dir", dir.to_str().unwrap(), "--models-max", "1"]);
    let text = router.startup.join("\n");
    assert!(
        text.contains("router mode: 3 model(s)") && text.contains("at most 1 loaded"),
        "{text}"
    );
    for arch in ["gpt-oss", "qwen3moe", "deepseek2"] {
        let (status, body) = router.chat(Some(arch));
        assert_eq!(status, 200, "{arch}: {body}");
        assert_eq!(
            body["usage"]["completion_tokens"].as_u64().map(|n| n > 0),
            Some(true),
            "{arch}: {body}"
        );
    }
    drop(router);

    let model = dir.join("qwen3moe.gguf");
    // llama-server's split: -c 512 -np 4 gives each slot 256 positions (its share padded to 256).
    let single = Serve::start(&["-m", model.to_str().unwrap(), "-c", "512", "-np", "4"]);
    // The model's own lines come when it has loaded, before or after "listening"; "ready"
    // comes once it serves.
    let mut lines = single.startup.clone();
    if !lines.iter().any(|l| l.contains("slot(s) of")) {
        lines.extend(until(&single.stderr, "slot(s) of"));
    }
    lines.extend(until(&single.stderr, "hmoe serve: ready"));
    let text = plain(&lines.join("\n"));
    let ready = format!(
        "hmoe serve: ready: the model is loaded, serving on http://{}",
        single.addr
    );
    assert_eq!(
        text.lines().last(),
        Some(ready.as_str()),
        "the ready line names the URL:\n{text}"
    );
    for want in [
        "hmoe serve: model: ",
        "architecture qwen3moe",
        "memory per device (MiB):",
        "context 512 (-c 512), 4 slot(s) of 256 positions (1024 in all: as in llama-server",
        "KV cache K f16 / V f16, flash attention on",
        "threads: 2",
        &format!("chat page http://{}/", single.addr),
    ] {
        assert!(
            text.contains(want),
            "{want:?} missing from the start-up lines:\n{text}"
        );
    }
    // Without a GPU the executor on the CPU runs it; with one, `-ngl auto` puts it on the device.
    assert!(
        text.contains("engine: CPU (") || text.contains("engine: the device executor on CUDA0"),
        "no engine line in the start-up lines:\n{text}"
    );
    let (status, body) = single.chat(None);
    assert_eq!(status, 200, "{body}");
    let (status, page) = http(&single.addr, "GET", "/", None);
    assert!(status == 200 && page.contains("<title>hmoe</title>"));
    let logged = until(&single.stderr, "POST /v1/chat/completions 200");
    let line = plain(logged.last().unwrap());
    let want = format!(
        "prompt={} cached={} generated={}",
        body["usage"]["prompt_tokens"],
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
        body["usage"]["completion_tokens"]
    );
    assert!(
        line.contains(&want) && line.trim_end().ends_with(" ms"),
        "{line} (want {want})"
    );
    drop(single);

    // The defaults, an API key, a GPU asked for: the banner says the context chosen (not
    // "-c 0"), 4 slots as llama-server, that a key is required (never the key), and why
    // there is no GPU once.
    let keyed = Serve::start(&[
        "-m",
        model.to_str().unwrap(),
        "--api-key",
        "sekrit-key-123",
        "-ngl",
        "99",
        "--reasoning-format",
        "none",
    ]);
    let mut lines = keyed.startup.clone();
    lines.extend(until(&keyed.stderr, "hmoe serve: ready"));
    let text = plain(&lines.join("\n"));
    for want in [
        "the model's trained context, -c not given), 4 slot(s) of ",
        "-np not given: 4 slots as llama-server serves",
        "API key required (1 key(s))",
        "--reasoning-format none: ",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
    assert!(!text.contains("-c 0") && !text.contains("sekrit"), "{text}");
    assert!(text.matches("no GPU").count() <= 1, "{text}");
    drop(keyed);
    let _ = std::fs::remove_dir_all(&dir);
}

fn chat_child(model: &Path) -> Child {
    Command::new(HMOE)
        .arg("chat")
        .arg("-m")
        .arg(model)
        .args(["-n", "200", "-c", "1024", "--temp", "0", "-t", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn saved(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn chat_keeps_the_conversation_over_ctrl_c() {
    let dir = scratch("chat");
    let model = dir.join("m.gguf");
    make_model("qwen3moe", &model);

    // The whole greedy reply, for comparison.
    let full = dir.join("full.json");
    let mut c = chat_child(&model);
    writeln!(
        c.stdin.as_mut().unwrap(),
        "Tell me a story\n/save {}",
        full.display()
    )
    .unwrap();
    drop(c.stdin.take());
    let out = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("Ctrl-C at the prompt or Ctrl-D leaves"),
        "banner: {err}"
    );
    let whole = saved(&full);
    assert_eq!(whole.len(), 2);
    let whole_reply = whole[1]["content"].as_str().unwrap().to_string();
    assert!(
        whole_reply.len() > 50,
        "the reply is too short to interrupt: {whole_reply:?}"
    );

    // Ctrl-C as soon as the reply starts: it stops, the conversation goes on.
    let mut c = chat_child(&model);
    let mut stdin = c.stdin.take().unwrap();
    let mut stdout = c.stdout.take().unwrap();
    let stderr = lines_of(c.stderr.take().unwrap());
    writeln!(stdin, "Tell me a story").unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    signal(&c, "-INT");
    until(&stderr, "[stopped]");
    let part = dir.join("part.json");
    let empty = dir.join("empty.json");
    writeln!(
        stdin,
        "/save {}\n/clear\n/save {}",
        part.display(),
        empty.display()
    )
    .unwrap();
    drop(stdin);
    let status = c.wait().unwrap();
    assert!(
        status.success(),
        "hmoe chat ended with {status} after Ctrl-C in a reply"
    );
    let kept = saved(&part);
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert_eq!(kept[0]["content"], "Tell me a story");
    let reply = kept[1]["content"].as_str().unwrap();
    assert!(
        reply.len() < whole_reply.len() && whole_reply.starts_with(reply),
        "the kept reply is not a cut of the whole one: {reply:?}"
    );
    assert_eq!(saved(&empty), Vec::<Value>::new());

    // Ctrl-C at the prompt leaves.
    let mut c = chat_child(&model);
    let stdin = c.stdin.take();
    let stderr = lines_of(c.stderr.take().unwrap());
    until(&stderr, "hmoe chat:");
    std::thread::sleep(Duration::from_millis(200));
    signal(&c, "-INT");
    let status = c.wait().unwrap();
    drop(stdin);
    assert!(
        !status.success(),
        "Ctrl-C at the prompt should end hmoe chat"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
