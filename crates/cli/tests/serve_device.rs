//! `hmoe serve` on the device executor, on the reference device `REF0` (no GPU needed): the
//! seed's llama-server command line with `-dev REF0` serves the small gpt-oss fixture (heads of 64: q8_0 blocks) with its
//! dense part on REF0, four slots with continuous batching over device K/V caches, the prompt
//! cache, the placement in `/props`, the device memory and the steps run as two micro-batches
//! in flight in `/metrics`; a slot the device has
//! no K/V memory for gets 503 while the others go on; a device too small for the model fails at
//! start naming itself and the missing MiB. The official `openai` package drives part of it
//! (crates/cli/tests/serve_device_client.py, from `$HMOE_PYTHON`; without it `SKIPPED:`).

// Shared with the server's tests; this file does not use every helper in it.
#[allow(dead_code)]
#[path = "../../server/tests/common/python.rs"]
mod python;

#[path = "common/serve.rs"]
mod server;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use hmoe_testdata::fixtures;
use server::Server;

/// The K/V cache flags of the seed command line: q8_0 on the device, as the issue asks.
const KV: &[&str] = &["-ctk", "q8_0", "-ctv", "q8_0"];

/// The seed's command line (llama-server's, as the gpt-oss guides give it) with `-dev REF0`;
/// `-m`, `--host` and `--port` are added.
const SEED: &[&str] = &[
    "-dev",
    "REF0",
    "--n-cpu-moe",
    "2",
    "--n-gpu-layers",
    "999",
    "-c",
    "0",
    "-fa",
    "--jinja",
    "--reasoning-format",
    "none",
    "--api-key",
    "k",
    "-np",
    "4",
];

fn fixture_path(name: &str) -> String {
    fixtures()
        .join("gpt-oss")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// The seed line's model: heads of 64 values, whole q8_0 blocks.
fn fixture() -> String {
    fixture_path("gptoss-small.gguf")
}

/// `hmoe serve -m FIXTURE ARGS`, once the model is loaded.
fn serve(args: &[&str]) -> Server {
    let model = fixture();
    server::serve(&[&["-m", model.as_str()], args].concat())
}

/// `hmoe serve` of the tiny fixture (f16 K/V: its heads of 16 values take no q8_0), whose
/// memory figures the device-budget tests are sized for.
fn serve_tiny(args: &[&str]) -> Server {
    let model = fixture_path("gptoss-tiny.gguf");
    server::serve(&[&["-m", model.as_str()], args].concat())
}

/// One request with the API key `k`; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    server::http(addr, method, path, "k", body)
}

/// `method path body` as JSON, which must answer 200.
fn json_ok(addr: &str, method: &str, path: &str, body: &Value) -> Value {
    let (status, text) = http(addr, method, path, &body.to_string());
    assert_eq!(status, 200, "{method} {path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

/// A greedy chat completion of `question`: its content.
fn ask(addr: &str, question: &str) -> String {
    let body = json!({
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 12,
    });
    let r = json_ok(addr, "POST", "/v1/chat/completions", &body);
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {r}"))
        .to_string()
}

fn questions() -> Vec<String> {
    (0..8)
        .map(|i| format!("Question {i}: what comes after {}?", i * 7))
        .collect()
}

/// The seed command line on REF0: what start-up says, `/props`' placement, `/metrics`' device
/// memory, 8 concurrent greedy chats equal to each alone and to the CPU's, and a
/// second turn served from the first's cache.
#[test]
fn seed_command_line_serves_on_ref0() {
    let args: Vec<&str> = [SEED, KV, &["--metrics"]].concat();
    let s = serve(&args);
    let err = s.stderr();
    for want in [
        "hmoe serve: engine: the device executor on REF0",
        "hmoe serve: memory per device (MiB):",
        "context 131072 (-c 0: the model's trained context), 4 slot(s) of 32768 positions",
        "hmoe serve: threads: ",
    ] {
        assert!(err.contains(want), "no `{want}` in:\n{err}");
    }
    let ref0_row = err.lines().find(|l| {
        l.trim_start_matches("hmoe serve:")
            .trim()
            .starts_with("REF0")
    });
    assert!(ref0_row.is_some(), "no REF0 row in the table:\n{err}");
    assert!(
        !err.contains("default loader runs the model on the CPU"),
        "{err}"
    );

    // /props: the model runs on REF0, with every layer's dense part and half the experts.
    let props = json_ok(&s.addr, "GET", "/props", &Value::Null);
    let p = &props["placement"];
    assert_eq!(p["engine"], "REF0", "{p}");
    assert_eq!(p["why_cpu"], Value::Null, "{p}");
    assert_eq!(p["n_ctx"], 131072, "{p}");
    let device = |name: &str| {
        (p["devices"].as_array().unwrap().iter())
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {p}"))
            .clone()
    };
    let (ref0, cpu) = (device("REF0"), device("CPU"));
    assert_eq!(
        (ref0["layers"].as_u64(), ref0["expert_layers"].as_u64()),
        (Some(4), Some(2))
    );
    assert_eq!(cpu["expert_layers"], 2, "--n-cpu-moe 2: {p}");
    assert!(ref0["weight_bytes"].as_u64() > Some(0) && ref0["kv_bytes"].as_u64() > Some(0));
    assert_eq!(props["total_slots"], 4);

    // 8 at once return what each returns alone (and what the executor on the CPU returns).
    let qs = questions();
    let alone: Vec<String> = qs.iter().map(|q| ask(&s.addr, q)).collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = (qs.iter()).map(|q| sc.spawn(|| ask(&s.addr, q))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    assert!(alone.iter().any(|a| !a.is_empty()), "{alone:?}");
    let distinct: std::collections::HashSet<_> = alone.iter().collect();
    assert!(
        distinct.len() > 1,
        "the questions should differ in answer: {alone:?}"
    );

    // A second turn starts from the first turn's cache, and answers as without it.
    let first_turn = json!([{"role": "user", "content": "Name a colour."}]);
    let turn = |messages: &Value, cache_prompt: bool| {
        let body = json!({
            "messages": messages, "temperature": 0, "max_tokens": 8, "cache_prompt": cache_prompt,
        });
        json_ok(&s.addr, "POST", "/v1/chat/completions", &body)
    };
    let first = turn(&first_turn, true);
    let mut second_turn = first_turn.as_array().unwrap().clone();
    second_turn
        .push(json!({"role": "assistant", "content": first["choices"][0]["message"]["content"]}));
    second_turn.push(json!({"role": "user", "content": "And another one?"}));
    let second = turn(&Value::Array(second_turn.clone()), true);
    let t = &second["timings"];
    let (cached, computed) = (
        t["cache_n"].as_u64().unwrap(),
        t["prompt_n"].as_u64().unwrap(),
    );
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached >= first_prompt,
        "cached {cached} of the first turn's {first_prompt}: {t}"
    );
    assert_eq!(
        cached + computed,
        second["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    let cold = turn(&Value::Array(second_turn), false);
    assert_eq!(cold["timings"]["cache_n"], 0, "{cold}");
    assert_eq!(
        cold["choices"][0]["message"]["content"],
        second["choices"][0]["message"]["content"]
    );

    // /metrics: the weights and K/V caches the model holds on REF0.
    let (status, metrics) = http(&s.addr, "GET", "/metrics", "");
    assert_eq!(status, 200, "{metrics}");
    // The slots decoding together ran as two micro-batches in flight (CPU experts, several
    // slots a step), with the answers above equal to each alone.
    let split: u64 = (metrics.lines())
        .find_map(|l| l.strip_prefix("hmoe:device_split_steps_total "))
        .unwrap_or_else(|| panic!("no split steps line in:\n{metrics}"))
        .parse()
        .unwrap();
    assert!(split > 0, "{metrics}");
    let used = (metrics.lines())
        .find_map(|l| l.strip_prefix("hmoe:device_memory_used_bytes{device=\"REF0\"} "))
        .unwrap_or_else(|| panic!("no device memory line in:\n{metrics}"));
    let used: u64 = used.parse().unwrap();
    assert!(
        used > ref0["weight_bytes"].as_u64().unwrap() / 2,
        "{used} bytes in use"
    );
    assert!(
        metrics.contains("hmoe:device_kv_cache_bytes{device=\"REF0\"} "),
        "{metrics}"
    );

    // The same answers from the executor on the CPU (REF0 equals it bit for bit).
    let cpu_args: Vec<&str> = [SEED, KV].concat();
    let cpu_args: Vec<&str> = (cpu_args.iter())
        .map(|&a| if a == "REF0" { "none" } else { a })
        .collect();
    let c = serve(&cpu_args);
    assert!(
        c.stderr().contains("hmoe serve: engine: CPU ("),
        "{}",
        c.stderr()
    );
    let on_cpu: Vec<String> = qs.iter().map(|q| ask(&c.addr, q)).collect();
    assert_eq!(alone, on_cpu);
}

/// A greedy completion of `prompt` (`/completion`, no chat template): its text.
fn complete(addr: &str, prompt: &str) -> String {
    let body = json!({"prompt": prompt, "temperature": 0, "n_predict": 12});
    let r = json_ok(addr, "POST", "/completion", &body);
    r["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {r}"))
        .to_string()
}

/// Qwen3-MoE on the device executor: the qwen3moe fixture with `-dev REF0` and
/// one layer's experts on the CPU starts on REF0, and 8 concurrent greedy completions equal
/// each alone and the CPU's.
#[test]
fn qwen3moe_serves_on_ref0() {
    let model = fixtures().join("qwen3moe/qwen3moe-tiny.gguf");
    let model = model.to_str().unwrap();
    let args = [
        "-m",
        model,
        "-ngl",
        "all",
        "--n-cpu-moe",
        "1",
        "-c",
        "1024",
        "-np",
        "4",
        "--api-key",
        "k",
    ];
    let s = server::serve(&[&args[..], &["-dev", "REF0"]].concat());
    let err = s.stderr();
    assert!(
        err.contains("hmoe serve: engine: the device executor on REF0"),
        "{err}"
    );
    let qs = questions();
    let alone: Vec<String> = qs.iter().map(|q| complete(&s.addr, q)).collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = (qs.iter())
            .map(|q| sc.spawn(|| complete(&s.addr, q)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    assert!(alone.iter().any(|a| !a.is_empty()), "{alone:?}");
    let c = server::serve(&[&args[..], &["-dev", "none"]].concat());
    assert!(
        c.stderr().contains("hmoe serve: engine: CPU ("),
        "{}",
        c.stderr()
    );
    let on_cpu: Vec<String> = qs.iter().map(|q| complete(&c.addr, q)).collect();
    assert_eq!(alone, on_cpu);
}

/// The same through the official `openai` package: 8 concurrent chats equal to each alone,
/// and a second turn that reuses the first's cache.
#[test]
fn openai_client_on_ref0() {
    let Some(py) = python::python_with(&["openai"]) else {
        return;
    };
    let args: Vec<&str> = [SEED, KV].concat();
    let s = serve(&args);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/serve_device_client.py");
    let out = Command::new(&py)
        .arg(script)
        .args(["--base-url", &format!("http://{}/v1", s.addr)])
        .args(["--api-key", "k", "--model", "gptoss-small"])
        .output()
        .expect("python runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(r["alone"], r["together"], "{r}");
    assert_eq!(r["alone"].as_array().map(Vec::len), Some(8), "{r}");
    let t = &r["second_timings"];
    assert!(t["cache_n"].as_u64() > Some(0), "{r}");
    assert_eq!(
        t["cache_n"].as_u64().unwrap() + t["prompt_n"].as_u64().unwrap(),
        r["second_usage"]["prompt_tokens"].as_u64().unwrap(),
        "{r}"
    );
}

/// With room on REF0 for one slot's K/V cache only, a second request while the first runs
/// gets a 503 JSON error, and the first ends as it would alone; once the first is done, the
/// second runs.
#[test]
fn slot_without_device_memory_gets_503() {
    // 2 slots of 65536 positions: about 16 MiB of K/V each, the weights 0.4 MiB and a
    // micro-batch's scratch about 4 MiB.
    let s = serve_tiny(&[
        "-dev",
        "REF0",
        "-ngl",
        "all",
        "-c",
        "131072",
        "-np",
        "2",
        "--fit",
        "off",
        "--gpu-mem",
        "30MiB",
        "--api-key",
        "k",
    ]);
    let long = json!({"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": true, "temperature": 0});
    let alone = json_ok(&s.addr, "POST", "/completion", &long);
    let addr = s.addr.clone();
    let body = long.clone();
    let first = std::thread::spawn(move || json_ok(&addr, "POST", "/completion", &body));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let slots = json_ok(&s.addr, "GET", "/slots", &Value::Null);
        // The second task (the first was `alone`), generating: its cache is on REF0.
        let running = (slots.as_array().unwrap().iter()).any(|v| {
            v["is_processing"] == true
                && v["id_task"] == 1
                && v["next_token"]["n_decoded"].as_u64() > Some(0)
        });
        if running {
            break;
        }
        assert!(Instant::now() < deadline, "the first request never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    let other = json!({"prompt": "Something else entirely", "n_predict": 4, "temperature": 0});
    let (status, body) = http(&s.addr, "POST", "/completion", &other.to_string());
    assert_eq!(status, 503, "{body}");
    let e: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("REF0") && msg.contains("out of memory"), "{e}");
    assert_eq!(e["error"]["code"], 503, "{e}");
    let first = first.join().unwrap();
    assert_eq!(first["content"], alone["content"]);
    assert_eq!(first["tokens_predicted"], 400, "{first}");
    // Now the other request runs, in the free slot, freeing the idle slot's device cache to
    // make room; the long prompt, sent again, is then computed afresh, as alone.
    json_ok(&s.addr, "POST", "/completion", &other);
    let again = json_ok(&s.addr, "POST", "/completion", &long);
    assert_eq!(again["content"], alone["content"]);
    assert_eq!(again["tokens_cached"], 0, "{again}");
}

/// Without `-c`, `--fit` cuts the context to what REF0 holds, and the slots get that. (The
/// whole context plans 352 MiB with the 1024 MiB margin's 1376; 1340 holds about 73k.)
#[test]
fn fit_cuts_the_context_to_the_device() {
    let s = serve_tiny(&[
        "-dev",
        "REF0",
        "-ngl",
        "all",
        "--gpu-mem",
        "1340MiB",
        "-np",
        "2",
        "--api-key",
        "k",
    ]);
    let err = s.stderr();
    let line = (err.lines())
        .find(|l| l.contains("(--fit: context reduced from 131072 to "))
        .unwrap_or_else(|| panic!("no context line:\n{err}"));
    let props = json_ok(&s.addr, "GET", "/props", &Value::Null);
    let n_ctx = props["placement"]["n_ctx"].as_u64().unwrap();
    assert!(
        n_ctx < 131072 && line.contains(&format!("context {n_ctx} ")),
        "{line}"
    );
    assert_eq!(props["default_generation_settings"]["n_ctx"], n_ctx / 2);
}

/// `-nkvo` keeps the K/V cache in RAM: the executor on the CPU, which says why.
#[test]
fn no_kv_offload_runs_on_the_cpu() {
    let args: Vec<&str> = [SEED, KV, &["-nkvo"]].concat();
    let s = serve(&args);
    let props = json_ok(&s.addr, "GET", "/props", &Value::Null);
    let p = &props["placement"];
    assert_eq!(p["engine"], "CPU", "{p}");
    assert!(
        p["why_cpu"].as_str().unwrap().contains("--no-kv-offload"),
        "{p}"
    );
    assert!(s
        .stderr()
        .contains("hmoe serve: engine: CPU (--no-kv-offload"));
    assert!(!s.stderr().contains("--no-kv-offload does not apply"));
}

/// A REF0 too small for the model fails at start with the device and the missing MiB: the
/// plan (with its --fit-target margin), and without --fit the device itself.
#[test]
fn too_small_a_device_fails_at_start() {
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
            .args(["serve", "-m", &fixture()])
            .args(SEED)
            .args(KV)
            .args(extra)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .stdout(Stdio::null())
            .output()
            .expect("hmoe serve runs");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        err
    };
    let err = run(&["--gpu-mem", "64MiB"]);
    assert!(
        err.contains("REF0 is") && err.contains("MiB short"),
        "{err}"
    );
    let err = run(&["--gpu-mem", "100KiB", "--fit", "off"]);
    assert!(
        err.contains("REF0: out of memory") && err.contains("MiB missing"),
        "{err}"
    );
}
