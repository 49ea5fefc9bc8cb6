//! `hmoe serve` as a user starts it: llama-server's command line for gpt-oss (`-c 0 -fa --jinja
//! -ngl 99 --n-cpu-moe N ...`) on the tiny fixture, driven by the official `openai` Python
//! package (crates/server/tests/openai_client.py) from `$HMOE_PYTHON` (the venv `.ci/run`
//! makes; else `python3`); without it the Python part prints `SKIPPED:`.

#[path = "../../server/tests/common/python.rs"]
mod python;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn fixtures() -> PathBuf {
    std::env::var_os("HMOE_FIXTURES").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../../shared/fixtures"
            ))
        },
        PathBuf::from,
    )
}

/// The server process; killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `hmoe serve ARGS --port 0` and reads the address it listens on.
fn serve(args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .arg("serve")
        .args(args)
        .args(["--host", "127.0.0.1", "--port", "0"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("hmoe serve starts");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = loop {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 || Instant::now() > deadline {
            let _ = child.kill();
            panic!("hmoe serve did not start: {line}");
        }
        if let Some(a) = line.trim().strip_prefix("hmoe serve: listening on http://") {
            break a.to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let server = Server { child, addr };
    for _ in 0..500 {
        if http(&server.addr, "GET", "/health", "", "").0 == 200 {
            return server;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("hmoe serve never became healthy");
}

/// A minimal HTTP/1.1 request; returns (status, body) (chunked bodies are returned raw).
fn http(addr: &str, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = if key.is_empty() {
        String::new()
    } else {
        format!("Authorization: Bearer {key}\r\n")
    };
    write!(s, "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{auth}Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

#[test]
fn seed_command_line_serves_the_openai_client() {
    let model = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    let model = model.to_str().unwrap();
    // As in the gpt-oss guides (main.rs rewrites -ngl, -fa, -np, -ub to long flags).
    let s = serve(&[
        "-m",
        model,
        "-c",
        "0",
        "-fa",
        "--jinja",
        "-ngl",
        "99",
        "--n-cpu-moe",
        "2",
        "-ub",
        "256",
        "-b",
        "2048",
        "--reasoning-format",
        "none",
        "--temp",
        "1.0",
        "--top-p",
        "1.0",
        "--top-k",
        "0",
        "--min-p",
        "0",
        "-np",
        "2",
        "--threads",
        "-1",
        "--api-key",
        "sk-test",
        "--metrics",
    ]);
    let (status, body) = http(&s.addr, "GET", "/props", "sk-test", "");
    assert_eq!(status, 200, "{body}");
    let props: serde_json::Value = serde_json::from_str(&body).unwrap();
    // -c 0: the trained context (131072), split over 2 slots.
    assert_eq!(props["default_generation_settings"]["n_ctx"], 65536);
    assert_eq!(props["total_slots"], 2);
    assert_eq!(http(&s.addr, "GET", "/props", "", "").0, 401);
    if let Some(py) = python::python_with(&["openai"]) {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../server/tests/openai_client.py"
        );
        python::run_checks(
            Command::new(&py)
                .arg(script)
                .args([
                    "--base-url",
                    &format!("http://{}/v1", s.addr),
                    "--api-key",
                    "sk-test",
                    "--model",
                    "gptoss-tiny",
                ])
                .args(["--reasoning-format", "none"]),
        );
    }
}

#[test]
fn bad_command_lines_fail_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(["serve", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-m MODEL"));
    let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(["serve", "-m", "/nonexistent/model.gguf", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model.gguf"));
    let _ = std::io::stdout().flush();
}
