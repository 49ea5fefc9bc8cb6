//! Router mode: three models in a directory (one of them split in three shards), at most two
//! loaded; requests alternate, the least recently used idle model is unloaded, and every answer
//! equals the engine's own greedy generation for that model.

mod common;

use std::path::Path;

use common::*;
use hmoe_engine::{Generator, Sampler, SamplerParams};
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::KvType;
use hmoe_server::{ModelSource, ServerConfig};
use serde_json::{json, Value};

const PROMPT: &str = "Hello world, this is";
const N: usize = 10;

/// Greedy continuation computed directly with the engine.
fn reference(path: &Path) -> Vec<u32> {
    let g = GgufModel::open(path, LoadOptions::default()).unwrap();
    let tok = hmoe_tokenizer::Tokenizer::from_metadata(g.metadata()).unwrap();
    let model = hmoe_model::load(g).unwrap();
    let prompt = tok.encode(PROMPT, true, true).unwrap();
    let mut sampler = Sampler::new(SamplerParams {
        temperature: 0.0,
        ..SamplerParams::default()
    });
    let mut gen = Generator::new(model.as_ref(), KvType::F16, 256, 64);
    gen.generate(&prompt, N, &mut sampler, None, 0, &|_| false, &mut |_| true)
        .unwrap()
        .generated
}

fn status_of(models: &Value, id: &str) -> String {
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == id)
        .unwrap()["status"]["value"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn router_loads_on_demand_and_evicts_the_least_recently_used() {
    let dir = scratch("router");
    let gpt = fixtures().join("gpt-oss");
    std::fs::copy(gpt.join("gptoss-tiny.gguf"), dir.join("alpha.gguf")).unwrap();
    std::fs::create_dir(dir.join("beta")).unwrap();
    std::fs::copy(gpt.join("gptoss-openai.gguf"), dir.join("beta/model.gguf")).unwrap();
    for i in 1..=3 {
        let f = format!("gptoss-tiny-split-0000{i}-of-00003.gguf");
        std::fs::copy(
            gpt.join(&f),
            dir.join(f.replace("gptoss-tiny-split", "gamma")),
        )
        .unwrap();
    }
    std::fs::write(dir.join("README.txt"), "not a model").unwrap();
    let expected: Vec<(&str, Vec<u32>)> = vec![
        ("alpha", reference(&dir.join("alpha.gguf"))),
        ("beta", reference(&dir.join("beta/model.gguf"))),
        ("gamma", reference(&dir.join("gamma-00001-of-00003.gguf"))),
    ];

    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    c.engine.n_ctx = 256;
    c.engine.n_ubatch = 64;
    c.models_max = 2;
    let s = start(c);
    let a = s.local_addr();
    let models = get(a, "/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["alpha", "beta", "gamma"]);
    assert!(ids.iter().all(|id| status_of(&models, id) == "unloaded"));

    // Without a model name, and with an unknown one: 400.
    assert_eq!(post(a, "/completion", &json!({"prompt": "x"})).status, 400);
    assert_eq!(
        post(a, "/completion", &json!({"prompt": "x", "model": "delta"})).status,
        400
    );

    for round in 0..2 {
        for (name, tokens) in &expected {
            let r = post(
                a,
                "/completion",
                &json!({"model": name, "prompt": PROMPT, "n_predict": N, "temperature": 0}),
            );
            assert_eq!(r.status, 200, "{name}: {}", r.body);
            let got: Vec<u32> = r.json()["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(&got, tokens, "round {round}, model {name}");
            let models = get(a, "/v1/models").json();
            let loaded = ids
                .iter()
                .filter(|id| status_of(&models, id) == "loaded")
                .count();
            assert!(loaded <= 2, "{models}");
            assert_eq!(status_of(&models, name), "loaded");
        }
    }
    // After alpha, beta, gamma: alpha was the least recently used and is unloaded.
    let models = get(a, "/v1/models").json();
    assert_eq!(status_of(&models, "alpha"), "unloaded");
    assert_eq!(status_of(&models, "beta"), "loaded");
    // Per-model GET routes take ?model=.
    let props = get(a, "/props?model=gamma").json();
    assert_eq!(props["model_alias"], "gamma");
    assert_eq!(
        post(a, "/models/unload", &json!({"model": "gamma"})).status,
        200
    );
    assert_eq!(status_of(&get(a, "/v1/models").json(), "gamma"), "unloaded");
    assert_eq!(
        post(a, "/models/load", &json!({"model": "alpha"})).status,
        200
    );
    assert_eq!(status_of(&get(a, "/v1/models").json(), "alpha"), "loaded");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_with_a_request_in_flight_is_never_unloaded() {
    let (dir, s) = two_model_router("router-busy", 1);
    let a = s.local_addr();
    let busy = hold_alpha(a);
    let r = post(
        a,
        "/completion",
        &json!({"model": "beta", "prompt": "x", "n_predict": 2}),
    );
    // It waited for --timeout (1 s here), then gave up.
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("--timeout"), "{}", r.body);
    assert_eq!(status_of(&get(a, "/v1/models").json(), "alpha"), "loaded");
    drop(busy);
    // Once alpha's request is gone, beta may replace it (the lease ends with the stream).
    let mut ok = false;
    for _ in 0..100 {
        let r = post(
            a,
            "/completion",
            &json!({"model": "beta", "prompt": "x", "n_predict": 2}),
        );
        if r.status == 200 {
            ok = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(ok);
    let models = get(a, "/v1/models").json();
    assert_eq!(
        (status_of(&models, "alpha"), status_of(&models, "beta")),
        ("unloaded".into(), "loaded".into())
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A long streaming request on alpha, read until its first event (alpha is then busy until
/// the stream is dropped).
fn hold_alpha(a: std::net::SocketAddr) -> Sse {
    let mut busy = Sse::open(
        a,
        "/v1/completions",
        &json!({"model": "alpha", "prompt": "Tell me", "max_tokens": 8000, "stream": true, "ignore_eos": true}),
    );
    assert_eq!(busy.status, 200);
    assert!(busy.next_data().is_some());
    busy
}

/// Two tiny models in a directory, at most one loaded.
fn two_model_router(
    name: &str,
    timeout_s: u64,
) -> (std::path::PathBuf, hmoe_server::RunningServer) {
    let dir = scratch(name);
    let gpt = fixtures().join("gpt-oss");
    std::fs::copy(gpt.join("gptoss-tiny.gguf"), dir.join("alpha.gguf")).unwrap();
    std::fs::copy(gpt.join("gptoss-tiny.gguf"), dir.join("beta.gguf")).unwrap();
    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    c.engine.n_ctx = 8192;
    c.models_max = 1;
    c.limits.timeout = std::time::Duration::from_secs(timeout_s);
    (dir, start(c))
}

#[test]
fn a_request_for_another_model_waits_while_every_loaded_one_is_busy() {
    let (dir, s) = two_model_router("router-queue", 30);
    let a = s.local_addr();
    let busy = hold_alpha(a);
    let waiter = std::thread::spawn(move || {
        let t = std::time::Instant::now();
        let r = post(
            a,
            "/completion",
            &json!({"model": "beta", "prompt": "x", "n_predict": 2}),
        );
        (r.status, r.body, t.elapsed())
    });
    std::thread::sleep(std::time::Duration::from_millis(600));
    // The router reports the waiting request.
    let props = get(a, "/props").json();
    assert_eq!(props["role"], "router");
    assert_eq!(props["models_max"], 1);
    assert_eq!(props["waiting"], 1, "{props}");
    assert_eq!(props["loaded_models"], json!(["alpha"]));
    drop(busy);
    let (status, body, waited) = waiter.join().unwrap();
    // Queued, not refused: it got its answer once alpha's request ended.
    assert_eq!(status, 200, "{body}");
    assert!(
        waited >= std::time::Duration::from_millis(500),
        "{waited:?}"
    );
    let models = get(a, "/v1/models").json();
    assert_eq!(status_of(&models, "beta"), "loaded");
    assert_eq!(get(a, "/props").json()["waiting"], 0);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_that_fails_to_load_evicts_nothing() {
    let (dir, s) = two_model_router("router-bad", 5);
    let tiny = std::fs::read(dir.join("alpha.gguf")).unwrap();
    std::fs::write(dir.join("bad.gguf"), &tiny[..tiny.len() / 3]).unwrap();
    let a = s.local_addr();
    let ok = json!({"model": "alpha", "prompt": "x", "n_predict": 2});
    assert_eq!(post(a, "/completion", &ok).status, 200);
    let r = post(
        a,
        "/completion",
        &json!({"model": "bad", "prompt": "x", "n_predict": 2}),
    );
    assert_eq!(r.status, 500, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("bad.gguf"), "{msg}");
    let models = get(a, "/v1/models").json();
    assert_eq!(status_of(&models, "alpha"), "loaded", "{models}");
    let bad = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "bad")
        .unwrap()
        .clone();
    assert_eq!(bad["status"]["failed"], true, "{bad}");
    // alpha still answers without being loaded again.
    assert_eq!(post(a, "/completion", &ok).status, 200);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_the_key_the_model_list_shows_names_and_status_only() {
    let dir = scratch("router-auth");
    std::fs::copy(tiny_model(), dir.join("alpha.gguf")).unwrap();
    std::fs::write(dir.join("broken.gguf"), b"GGUF").unwrap();
    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    c.engine.n_ctx = 256;
    c.api_keys = vec!["secret".into()];
    let s = start(c);
    let a = s.local_addr();
    let auth = [("Authorization", "Bearer secret")];
    // A failed load leaves a message (with the path) in the full listing.
    let r = request(
        a,
        "POST",
        "/completion",
        &auth,
        json!({"model": "broken", "prompt": "x"})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 500);
    let full = request(a, "GET", "/v1/models", &auth, b"").json();
    let text = full.to_string();
    assert!(text.contains(&dir.display().to_string()), "{text}");
    let public = get(a, "/v1/models").json();
    let text = public.to_string();
    assert!(!text.contains(&dir.display().to_string()), "{text}");
    assert!(
        !text.contains("message") && !text.contains("meta"),
        "{text}"
    );
    for m in public["data"].as_array().unwrap() {
        let mut keys: Vec<&str> = m.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            ["aliases", "id", "object", "owned_by", "status"],
            "{m}"
        );
    }
    assert_eq!(status_of(&public, "alpha"), "unloaded");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A FIFO named `*.gguf` is no model: it is not listed, a request for it is a quick 400 (no
/// thread blocks opening it, nothing shows "loading"), and opening it as a model file fails at
/// once. A link to a model file is a model.
#[test]
fn a_fifo_in_the_models_dir_is_no_model() {
    let (dir, s) = two_model_router("router-fifo", 5);
    let fifo = dir.join("pipe.gguf");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|m| m.success()) {
        eprintln!("SKIPPED: mkfifo is not available");
        return;
    }
    std::os::unix::fs::symlink(dir.join("alpha.gguf"), dir.join("linked.gguf")).unwrap();
    let a = s.local_addr();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let r = post(
            a,
            "/completion",
            &json!({"model": "pipe", "prompt": "x", "n_predict": 2}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains("not found"), "{}", r.body);
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
    }
    let r = post(a, "/models/unload", &json!({"model": "pipe"}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("not found"), "{}", r.body);
    let models = get(a, "/v1/models").json();
    let ids: Vec<&str> = (models["data"].as_array().unwrap().iter())
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["alpha", "beta", "linked"], "{models}");
    let ok = json!({"model": "linked", "prompt": "x", "n_predict": 2});
    assert_eq!(post(a, "/completion", &ok).status, 200);
    // Opened directly (as -m would), the FIFO is refused without blocking.
    let config = ServerConfig::new(ModelSource::File(fifo.clone()));
    let Err(err) = hmoe_server::model_host::open_gguf(&fifo, &config) else {
        panic!("a FIFO opened as a model file");
    };
    assert!(err.to_string().contains("not a regular file"), "{err}");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
