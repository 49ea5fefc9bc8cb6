//! llama-server's flags for embeddings, reranking, aliases and tags, and sleeping, on the real
//! `hmoe serve` binary with the tiny fixture: `--embedding --pooling mean`, `--rerank`,
//! `--alias b,a --tags x,y`, `--sleep-idle-seconds 1` (the llama.cpp spellings, which the
//! command line rewrites to hmoe's), and the command lines that must fail.

#[path = "common/serve.rs"]
mod server;

use std::process::Command;
use std::time::{Duration, Instant};

use hmoe_testdata::fixtures;
use serde_json::{json, Value};
use server::{http, serve};

fn model() -> String {
    fixtures()
        .join("gpt-oss/gptoss-tiny.gguf")
        .to_string_lossy()
        .into_owned()
}

fn call(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, method, path, "", &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[test]
fn embedding_alias_and_tags_flags_serve() {
    let m = model();
    let s = serve(&[
        "-m",
        &m,
        "-c",
        "512",
        "--embedding",
        "--pooling",
        "mean",
        "--alias",
        "b,a",
        "--tags",
        "x,y",
    ]);
    let (status, body) = call(
        &s.addr,
        "POST",
        "/v1/embeddings",
        &json!({"input": ["hi", "yo"]}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    let v: Vec<f64> = (body["data"][0]["embedding"].as_array().unwrap().iter())
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert!((v.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-3);
    // Reranking needs --rerank.
    let (status, _) = call(
        &s.addr,
        "POST",
        "/rerank",
        &json!({"query": "a", "documents": ["b"]}),
    );
    assert_eq!(status, 501);
    let (_, models) = call(&s.addr, "GET", "/v1/models", &Value::Null);
    assert_eq!(models["data"][0]["id"], "a");
    assert_eq!(models["data"][0]["aliases"], json!(["a", "b"]));
    assert_eq!(models["data"][0]["tags"], json!(["x", "y"]));
}

#[test]
fn rerank_and_sleep_flags_serve() {
    let m = model();
    let s = serve(&["-m", &m, "-c", "512", "--rerank"]);
    let req = json!({"query": "a", "documents": ["b", "c"], "top_n": 1});
    let (status, body) = call(&s.addr, "POST", "/v1/rerank", &req);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"].as_array().unwrap().len(), 1);
    drop(s);

    let s = serve(&["-m", &m, "-c", "512", "--sleep-idle-seconds", "1"]);
    let t = Instant::now();
    let asleep = loop {
        let (_, props) = call(&s.addr, "GET", "/props", &Value::Null);
        if props["is_sleeping"] == true || t.elapsed() > Duration::from_secs(10) {
            break props["is_sleeping"] == true;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(asleep, "never slept: {}", s.stderr());
    let (status, body) = call(
        &s.addr,
        "POST",
        "/completion",
        &json!({"prompt": "x", "n_predict": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let (_, props) = call(&s.addr, "GET", "/props", &Value::Null);
    assert_eq!(props["is_sleeping"], false);
}

#[test]
fn contradictory_flags_fail_clearly() {
    let m = model();
    let dir = std::env::temp_dir().to_string_lossy().into_owned();
    for (args, why) in [
        (
            vec!["-m", &m, "--rerank", "--pooling", "mean"],
            "--reranking pools with rank",
        ),
        (
            vec!["-m", &m, "--sleep-idle-seconds", "0"],
            "--sleep-idle-seconds 0",
        ),
        (
            vec!["--models-dir", &dir, "--sleep-idle-seconds", "5"],
            "applies to a single model",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
            .arg("serve")
            .args(&args)
            .args(["--port", "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(err.contains(why), "{args:?}: {err}");
    }
}
