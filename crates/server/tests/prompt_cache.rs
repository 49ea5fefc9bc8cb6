//! The prompt cache: requests served from a slot's cached prefix give exactly the tokens and
//! log-probabilities of a cold run, multi-turn chats compute only the new turn, and every
//! completion route reports `timings` and `tokens_cached` as llama-server does.

mod common;

use common::*;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_server::scheduler::{measure_reuse, Reuse};
use serde_json::{json, Value};

/// Every model fixture of a different architecture.
fn models() -> Vec<std::path::PathBuf> {
    let f = fixtures();
    vec![
        f.join("gpt-oss/gptoss-tiny.gguf"),
        f.join("qwen3moe/qwen3moe-tiny.gguf"),
        f.join("deepseek2/deepseek2-tiny.gguf"),
    ]
}

fn config_for(model: &std::path::Path, n_ubatch: usize) -> hmoe_server::ServerConfig {
    let mut c = tiny_config();
    c.models = hmoe_server::ModelSource::File(model.to_path_buf());
    c.engine.n_parallel = 1;
    c.engine.n_ubatch = n_ubatch;
    c
}

fn complete(addr: std::net::SocketAddr, prompt: &str, n: usize) -> Value {
    let r = post(
        addr,
        "/completion",
        &json!({"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 3,
                "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

#[test]
fn gpt_oss_kernels_are_measured_free_of_batch_splits() {
    let g = GgufModel::open(tiny_model(), LoadOptions::default()).unwrap();
    let m = hmoe_model::load(g).unwrap();
    // gpt-oss's MXFP4 / Q8_0 / f32 kernels sum a token the same way whatever shares its pass.
    for ub in [4, 512] {
        assert_eq!(
            measure_reuse(m.as_ref(), hmoe_model::KvType::F16, 512, ub),
            Reuse::All
        );
    }
    // Too small a context to measure: the safe answer.
    assert_eq!(
        measure_reuse(m.as_ref(), hmoe_model::KvType::F16, 8, 4),
        Reuse::Aligned
    );
}

#[test]
fn cached_prefixes_give_the_tokens_of_cold_runs() {
    // A prompt, then longer ones that share its prefix and its generated text: each answer
    // from the warm server must equal the answer of a fresh server, bit for bit.
    let base = "The quick brown fox jumps over the lazy dog and then";
    for model in models() {
        for ub in [4, 7, 64] {
            let c = config_for(&model, ub);
            let warm = start(c.clone());
            let first = complete(warm.local_addr(), base, 6);
            let continued = format!("{base}{} and", first["content"].as_str().unwrap());
            let prompts = [
                continued.clone(),
                format!("{continued} more"),
                base.to_string(),
            ];
            for p in &prompts {
                let got = complete(warm.local_addr(), p, 6);
                let cold = complete(start(c.clone()).local_addr(), p, 6);
                let what = format!("{} ub {ub}: {p:?}", model.display());
                assert_eq!(cold["tokens_cached"], 0, "{what}");
                assert_eq!(got["content"], cold["content"], "{what}");
                assert_eq!(
                    got["completion_probabilities"], cold["completion_probabilities"],
                    "{what}"
                );
                let t = &got["timings"];
                assert_eq!(t["cache_n"], got["tokens_cached"], "{what}");
                assert_eq!(
                    t["cache_n"].as_u64().unwrap() + t["prompt_n"].as_u64().unwrap(),
                    got["tokens_evaluated"].as_u64().unwrap(),
                    "{what}"
                );
            }
            // gpt-oss reuses everything it shares: the base prompt is served from the cache
            // but for its last token (with micro-batches of 64 the sliding-window rings can go
            // back over the 6 generated tokens; with 4 or 7 they cannot and recompute).
            if model.ends_with("gptoss-tiny.gguf") && ub == 64 {
                let again = complete(warm.local_addr(), base, 6);
                let n = again["tokens_evaluated"].as_u64().unwrap();
                assert_eq!(again["timings"]["cache_n"].as_u64().unwrap(), n - 1);
            }
        }
    }
}

fn chat(addr: std::net::SocketAddr, messages: &Value) -> Value {
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

#[test]
fn a_second_chat_turn_computes_only_the_new_turn() {
    let c = tiny_config();
    let s = start(c.clone());
    let a = s.local_addr();
    let mut messages = json!([{"role": "user", "content": "Tell me about the sea."}]);
    let one = chat(a, &messages);
    let reply = one["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": reply}),
        json!({"role": "user", "content": "And the mountains?"}),
    ]);
    let two = chat(a, &messages);
    let first_prompt = one["usage"]["prompt_tokens"].as_u64().unwrap();
    let t = &two["timings"];
    assert!(
        t["cache_n"].as_u64().unwrap() >= first_prompt,
        "turn 2 reused {} of turn 1's {first_prompt} prompt tokens",
        t["cache_n"]
    );
    assert_eq!(
        two["usage"]["prompt_tokens_details"]["cached_tokens"],
        t["cache_n"]
    );
    for key in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_token_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_token_ms",
        "predicted_per_second",
    ] {
        assert!(t[key].is_number(), "timings.{key} missing: {t}");
    }
    assert_eq!(
        t["cache_n"].as_u64().unwrap() + t["prompt_n"].as_u64().unwrap(),
        two["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    // Same answer as a server that never saw turn 1.
    let cold = chat(start(c.clone()).local_addr(), &messages);
    assert_eq!(cold["timings"]["cache_n"], 0);
    assert_eq!(two["choices"][0]["message"], cold["choices"][0]["message"]);

    // Streaming: the last chunk carries the timings.
    let mut sse = Sse::open(
        a,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 4, "temperature": 0, "stream": true}),
    );
    assert_eq!(sse.status, 200, "{}", sse.error_body);
    let chunks: Vec<Value> = sse
        .all()
        .into_iter()
        .filter(|d| d != "[DONE]")
        .map(|d| serde_json::from_str(&d).unwrap())
        .collect();
    let last = chunks.last().expect("chunks");
    assert!(
        last["timings"]["cache_n"].as_u64().unwrap() > first_prompt,
        "{last}"
    );
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c.get("timings").is_none()));
}

#[test]
fn slot_prompt_similarity_picks_the_slot_holding_the_prefix() {
    let mut c = tiny_config();
    c.engine.n_parallel = 2;
    let s = start(c.clone());
    let a = s.local_addr();
    let p1 = "Alpha beta gamma delta epsilon zeta eta theta iota kappa";
    let p2 = "One two three four five six seven eight nine ten eleven";
    complete(a, p1, 2);
    complete(a, p2, 2); // the least recently used slot: the other one
    let again = complete(a, &format!("{p1} lambda"), 2);
    assert!(again["tokens_cached"].as_u64().unwrap() > 5, "{again}");
    assert_eq!(again["id_slot"], 0, "{again}");

    // With the similarity check off, requests go to the least recently used slot.
    c.engine.slot_prompt_similarity = 0.0;
    let s = start(c);
    let a = s.local_addr();
    complete(a, p1, 2);
    complete(a, p2, 2); // slot 1: slot 0 is now the least recently used one
    let lru = complete(a, &format!("{p2} twelve"), 2);
    assert_eq!(lru["id_slot"], 0, "{lru}");
    assert!(lru["tokens_cached"].as_u64().unwrap() < 3, "{lru}");

    // cache_prompt: false computes the whole prompt.
    let r = post(
        a,
        "/completion",
        &json!({"prompt": p2, "n_predict": 1, "cache_prompt": false}),
    );
    assert_eq!(r.json()["timings"]["cache_n"], 0);
}
