//! `hmoe serve` as a child process for the tests: start it on a free port, read its stderr,
//! and talk to it with minimal HTTP/1.1 requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The server process (killed when dropped), its address and what it wrote to stderr so far.
pub struct Server {
    child: Child,
    /// `host:port` it listens on.
    pub addr: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Its stderr so far.
    #[allow(dead_code)] // not every test reads it
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Server {
    /// Sends SIGTERM and waits for the process to end: how long it took, and how it ended.
    #[allow(dead_code)] // not every test stops it so
    pub fn terminate(&mut self) -> (Duration, std::process::ExitStatus) {
        let t = Instant::now();
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM failed");
        let status = self.child.wait().expect("the server process ends");
        (t.elapsed(), status)
    }
}

/// Starts `hmoe serve ARGS --host 127.0.0.1 --port 0` and returns once `/health` answers 200
/// (the model is loaded).
pub fn serve(args: &[&str]) -> Server {
    serve_with_env(args, &[])
}

/// [`serve`] with environment variables `env` set.
#[allow(dead_code)] // not every test sets variables
pub fn serve_with_env(args: &[&str], env: &[(&str, &std::path::Path)]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .arg("serve")
        .args(args)
        .envs(env.iter().copied())
        .args(["--host", "127.0.0.1", "--port", "0"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("hmoe serve starts");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let stderr = Arc::new(Mutex::new(String::new()));
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = loop {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 || Instant::now() > deadline {
            let _ = child.kill();
            panic!("hmoe serve did not start: {}{line}", stderr.lock().unwrap());
        }
        stderr.lock().unwrap().push_str(&line);
        if let Some(a) = line.trim().strip_prefix("hmoe serve: listening on http://") {
            break a.to_string();
        }
    };
    // Keep reading stderr so the server never blocks on a full pipe.
    let sink = stderr.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        while err.read_line(&mut line).unwrap_or(0) > 0 {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&line);
            line.clear();
        }
    });
    let server = Server {
        child,
        addr,
        stderr,
    };
    // With one model (-m), its load report ends with the `ready:` line; it was written before
    // /health said 200, but the reader thread above may not have taken it in yet.
    let one_model = args.contains(&"-m");
    for _ in 0..1000 {
        if http(&server.addr, "GET", "/health", "", "").0 == 200 {
            for _ in 0..250 {
                if !one_model || server.stderr().contains("hmoe serve: ready:") {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            return server;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("hmoe serve never became healthy: {}", server.stderr());
}

/// A minimal HTTP/1.1 request with the API key `key` (empty: none); returns (status, body)
/// (chunked bodies are returned raw).
pub fn http(addr: &str, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let auth = if key.is_empty() {
        String::new()
    } else {
        format!("Authorization: Bearer {key}\r\n")
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = (resp.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}
