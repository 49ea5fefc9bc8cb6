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
    let dir = scratch("router-busy");
    let gpt = fixtures().join("gpt-oss");
    std::fs::copy(gpt.join("gptoss-tiny.gguf"), dir.join("alpha.gguf")).unwrap();
    std::fs::copy(gpt.join("gptoss-tiny.gguf"), dir.join("beta.gguf")).unwrap();
    let mut c = ServerConfig::new(ModelSource::Dir(dir.clone()));
    c.port = 0;
    c.engine.n_ctx = 8192;
    c.models_max = 1;
    let s = start(c);
    let a = s.local_addr();
    let mut busy = Sse::open(
        a,
        "/v1/completions",
        &json!({"model": "alpha", "prompt": "Tell me", "max_tokens": 8000, "stream": true, "ignore_eos": true}),
    );
    assert_eq!(busy.status, 200);
    assert!(busy.next_data().is_some());
    let r = post(
        a,
        "/completion",
        &json!({"model": "beta", "prompt": "x", "n_predict": 2}),
    );
    assert_eq!(r.status, 503, "{}", r.body);
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
