//! Slots saved to disk (`--slot-save-path`, `POST /slots/{id}?action=save|restore|erase`) on
//! `hmoe serve` processes, over plain HTTP as curl sends it: a slot saved, the server
//! stopped, a new one started and the file restored into another slot; the next turn there
//! reuses the restored prompt (`timings.cache_n`) and answers exactly what the uninterrupted
//! server answered. Hostile requests (file names leaving the directory, a truncated file, a
//! file of another model, a busy slot, slot ids out of range) are each a clear 4xx, and the
//! slot stays usable; without the flag the routes answer 501 as llama-server's do.

#[path = "common/serve.rs"]
mod server;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hmoe_testdata::fixtures;
use serde_json::{json, Value};
use server::{http, serve, Server};

const PROMPT: &str = "The committee met on a grey morning to read the long report about the \
    river, the old mill, the bridge that the winter floods had damaged twice, and the plan to \
    rebuild it before the next harvest. Everyone agreed that";

fn model(dir: &str, file: &str) -> String {
    fixtures()
        .join(dir)
        .join(file)
        .to_str()
        .unwrap()
        .to_string()
}

/// `hmoe serve` of `model` with 2 slots of `n_ctx / 2` positions and slot files in `slot_dir`.
fn start(model: &str, n_ctx: &str, slot_dir: Option<&Path>) -> Server {
    let mut args = vec!["-m", model, "-c", n_ctx, "-np", "2", "-ub", "16"];
    if let Some(d) = slot_dir {
        args.extend(["--slot-save-path", d.to_str().unwrap()]);
    }
    serve(&args)
}

fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(&s.addr, "POST", path, "", &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|_| json!({ "raw": text }));
    (status, v)
}

/// A greedy completion in slot `slot`: (content, timings).
fn complete(s: &Server, prompt: &str, slot: usize) -> (String, Value) {
    let (status, r) = post(
        s,
        "/completion",
        &json!({"prompt": prompt, "n_predict": 12, "temperature": 0, "id_slot": slot,
                "cache_prompt": true, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{r}");
    (
        r["content"].as_str().unwrap().to_string(),
        r["timings"].clone(),
    )
}

fn action(s: &Server, slot: &str, action: &str, file: Option<&str>) -> (u16, Value) {
    let body = file.map_or(json!({}), |f| json!({ "filename": f }));
    post(s, &format!("/slots/{slot}?action={action}"), &body)
}

fn error_message(v: &Value) -> String {
    v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-slot-save-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_saved_slot_survives_a_restart_and_serves_the_next_turn() {
    let dir = temp_dir("restart");
    let gpt = model("gpt-oss", "gptoss-tiny.gguf");

    // The uninterrupted run: two turns in slot 1, the second reusing the first.
    let a = start(&gpt, "1024", Some(&dir));
    let (first, t1) = complete(&a, PROMPT, 1);
    let n_prompt = t1["prompt_n"].as_u64().unwrap();
    assert_eq!(t1["cache_n"], 0);
    let (status, saved) = action(&a, "1", "save", Some("agent.bin"));
    assert_eq!(status, 200, "{saved}");
    let n_saved = saved["n_saved"].as_u64().unwrap();
    assert!(n_saved >= n_prompt, "{saved}");
    assert_eq!(saved["id_slot"], 1);
    assert_eq!(saved["filename"], "agent.bin");
    let file_len = std::fs::metadata(dir.join("agent.bin")).unwrap().len();
    assert_eq!(saved["n_written"].as_u64(), Some(file_len));
    assert!(saved["timings"]["save_ms"].as_f64().is_some(), "{saved}");
    let turn2 = format!("{PROMPT}{first} Then the chair asked");
    let (want, t2) = complete(&a, &turn2, 1);
    let want_cached = t2["cache_n"].as_u64().unwrap();
    // The first turn's prompt at least (its last token may merge with the reply's first).
    assert!(want_cached + 1 >= n_prompt, "{t2}");
    drop(a);

    // A new process: the file restored into slot 0 serves the same turn from its cache.
    let b = start(&gpt, "1024", Some(&dir));
    let (status, restored) = action(&b, "0", "restore", Some("agent.bin"));
    assert_eq!(status, 200, "{restored}");
    assert_eq!(restored["n_restored"].as_u64(), Some(n_saved));
    assert_eq!(restored["n_read"].as_u64(), Some(file_len));
    assert!(restored["timings"]["restore_ms"].as_f64().is_some());
    let slots: Value = serde_json::from_str(&http(&b.addr, "GET", "/slots", "", "").1).unwrap();
    assert_eq!(slots[0]["n_past"].as_u64(), Some(n_saved), "{slots}");
    let (got, t) = complete(&b, &turn2, 0);
    assert_eq!(t["cache_n"].as_u64(), Some(want_cached), "{t}");
    assert_eq!(
        got, want,
        "the restored slot answers as the uninterrupted one"
    );

    // Erase empties the slot: the same turn is computed in full.
    let (status, erased) = action(&b, "0", "erase", None);
    assert_eq!((status, erased["n_erased"].as_u64().is_some()), (200, true));
    assert_eq!(erased["id_slot"], 0);
    let (again, t) = complete(&b, &turn2, 0);
    assert_eq!((t["cache_n"].as_u64(), again), (Some(0), want));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Streams a long generation in `slot`; returns the connection (dropping it cancels it).
fn busy(s: &Server, slot: usize) -> TcpStream {
    let body = json!({"prompt": "Once upon a time", "n_predict": 100000, "ignore_eos": true,
                      "stream": true, "id_slot": slot})
    .to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /completion HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = c.read(&mut first).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let slots: Value = serde_json::from_str(&http(&s.addr, "GET", "/slots", "", "").1).unwrap();
        if slots[slot]["is_processing"] == true {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "slot {slot} never became busy: {slots}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn hostile_slot_actions_are_clear_4xx_and_the_slot_stays_usable() {
    let dir = temp_dir("hostile");
    let (gpt, qwen) = (
        model("gpt-oss", "gptoss-tiny.gguf"),
        model("qwen3moe", "qwen3moe-tiny.gguf"),
    );
    // A file of another model, saved by a server of that model.
    {
        let q = start(&qwen, "1024", Some(&dir));
        complete(&q, PROMPT, 0);
        assert_eq!(action(&q, "0", "save", Some("qwen.bin")).0, 200);
    }
    // Slots long enough that a generation to the end of one keeps it busy for seconds.
    let s = start(&gpt, "65536", Some(&dir));
    complete(&s, PROMPT, 1);
    let (status, saved) = action(&s, "1", "save", Some("good.bin"));
    assert_eq!(status, 200, "{saved}");

    for name in [
        "../escape.bin",
        "a/b.bin",
        "/tmp/abs.bin",
        "..",
        "a\\b.bin",
        "",
    ] {
        for act in ["save", "restore"] {
            let (status, r) = action(&s, "0", act, Some(name));
            assert_eq!(status, 400, "{act} {name:?}: {r}");
            assert_eq!(error_message(&r), "Invalid filename", "{act} {name:?}");
        }
    }
    assert!(!dir.parent().unwrap().join("escape.bin").exists());
    let (status, r) = post(&s, "/slots/0?action=save", &json!({}));
    assert_eq!(status, 400, "{r}");

    // Damaged and foreign files.
    let good = std::fs::read(dir.join("good.bin")).unwrap();
    std::fs::write(dir.join("cut.bin"), &good[..good.len() / 2]).unwrap();
    std::fs::write(dir.join("empty.bin"), b"").unwrap();
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x10;
    std::fs::write(dir.join("flipped.bin"), &flipped).unwrap();
    for (file, says) in [
        ("cut.bin", "truncated"),
        ("empty.bin", "truncated"),
        ("flipped.bin", "checksum"),
        ("qwen.bin", "another model"),
        ("missing.bin", "does not exist"),
    ] {
        let (status, r) = action(&s, "0", "restore", Some(file));
        assert_eq!(status, 400, "{file}: {r}");
        assert!(error_message(&r).contains(says), "{file}: {r}");
        // The slot is still usable.
        complete(&s, "A short prompt", 0);
    }

    // Slot ids and actions.
    for (path, says) in [
        ("/slots/7?action=restore", "Invalid slot ID"),
        ("/slots/abc?action=save", "Invalid slot ID"),
        ("/slots/-1?action=erase", "Invalid slot ID"),
        ("/slots/0?action=copy", "Invalid action"),
        ("/slots/0", "Invalid action"),
    ] {
        let (status, r) = post(&s, path, &json!({"filename": "good.bin"}));
        assert_eq!(status, 400, "{path}: {r}");
        assert!(error_message(&r).contains(says), "{path}: {r}");
    }

    // A slot that runs a request: 409 for every action, and it goes on running.
    let stream = busy(&s, 1);
    for act in ["restore", "save", "erase"] {
        let (status, r) = action(&s, "1", act, Some("good.bin"));
        assert_eq!(status, 409, "{act}: {r}");
        assert!(error_message(&r).contains("processing"), "{act}: {r}");
    }
    drop(stream);
    // The other slot restores meanwhile, and the file still serves.
    let (status, r) = action(&s, "0", "restore", Some("good.bin"));
    assert_eq!(status, 200, "{r}");
    let (_, t) = complete(&s, PROMPT, 0);
    assert!(t["cache_n"].as_u64().unwrap() > 0, "{t}");
    drop(s);

    // Without --slot-save-path: llama-server's 501.
    let plain = start(&gpt, "1024", None);
    let (status, r) = action(&plain, "0", "save", Some("x.bin"));
    assert_eq!(status, 501, "{r}");
    assert_eq!(
        error_message(&r),
        "This server does not support slots action. Start it with `--slot-save-path`"
    );
    // A directory that is not there: the server does not start.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(["serve", "-m", &gpt, "--port", "0", "--slot-save-path"])
        .arg(dir.join("missing"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--slot-save-path") && err.contains("not a directory"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
