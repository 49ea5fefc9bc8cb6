//! Teacher-forced comparison of the DeepSeek-V3 (MLA) forward pass with llama.cpp's goldens and
//! transformers' logits (../shared/fixtures/deepseek2; tolerances from its README). The model
//! runs with its K-only latent cache, as llama.cpp does.

use std::path::PathBuf;

use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{KvType, LanguageModel, LogitsWanted};
use serde_json::Value;

const DIR: &str = "deepseek2";
const MODEL: &str = "deepseek2-tiny";

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

fn load_json(name: &str) -> Value {
    let path = fixtures().join(DIR).join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn load_model() -> Box<dyn LanguageModel> {
    let path = fixtures().join(DIR).join(format!("{MODEL}.gguf"));
    let gguf = GgufModel::open(&path, LoadOptions::default()).unwrap();
    hmoe_model::load(gguf).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn softmax64(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Teacher-forced run of every golden case: the prompt in one batch, then the golden greedy
/// tokens one at a time. Asserts top-10 probabilities within `p_tol` at every step, top-1
/// identical wherever the golden margin exceeds 1e-4, and the last prompt position's logits
/// within `logit_tol`. Returns (max |Δp|, max |Δlogit|) for the report.
fn check_golden(golden_file: &str, kv: KvType, p_tol: f64, logit_tol: f32) -> (f64, f32) {
    let model = load_model();
    let golden = load_json(golden_file);
    let (mut worst_p, mut worst_logit) = (0f64, 0f32);
    for (i, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&case["prompt_tokens"]);
        let greedy = ids(&case["greedy_tokens"]);
        let mut cache = model.new_cache(kv, 512, 512);
        let mut logits = model
            .forward(&mut cache, &prompt, LogitsWanted::Last)
            .unwrap();
        let d_logit = max_abs_diff(&logits, &floats(&case["prompt_logits_last"]));
        let mut case_p = 0f64;
        for (step, top) in case["top_probs"].as_array().unwrap().iter().enumerate() {
            let probs = softmax64(&logits);
            let top = top.as_array().unwrap();
            for pair in top {
                let id = pair[0].as_u64().unwrap() as usize;
                let dp = (probs[id] - pair[1].as_f64().unwrap()).abs();
                assert!(
                    dp <= p_tol,
                    "{golden_file} case {i} step {step} token {id}: |Δp| {dp:.3e}"
                );
                case_p = case_p.max(dp);
            }
            let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            let ours =
                (0..probs.len()).fold(0, |best, j| if probs[j] > probs[best] { j } else { best });
            if margin > 1e-4 {
                assert_eq!(
                    ours as u64,
                    top[0][0].as_u64().unwrap(),
                    "{golden_file} case {i} step {step}: top-1"
                );
            }
            if step + 1 < greedy.len() {
                logits = model
                    .forward(&mut cache, &[greedy[step]], LogitsWanted::Last)
                    .unwrap();
            }
        }
        eprintln!("{golden_file} case {i}: max |Δp| {case_p:.2e}, last prompt logits max |Δ| {d_logit:.2e}");
        assert!(
            d_logit <= logit_tol,
            "{golden_file} case {i}: prompt logits |Δ| {d_logit}"
        );
        worst_p = worst_p.max(case_p);
        worst_logit = worst_logit.max(d_logit);
    }
    (worst_p, worst_logit)
}

#[test]
fn tiny_uses_k_only_latent_cache() {
    let model = load_model();
    let cache = model.new_cache(KvType::F16, 512, 512);
    assert!(cache.is_k_only());
    // 3 layers × 512 positions × (kv_lora 16 + rope 8) f16 values.
    assert_eq!(cache.bytes(), 3 * 512 * 24 * 2);
}

#[test]
fn tiny_matches_llama_cpp_f32_kv() {
    check_golden(&format!("{MODEL}.golden.json"), KvType::F32, 2e-3, 1e-3);
}

#[test]
fn tiny_matches_llama_cpp_f16_kv() {
    check_golden(
        &format!("{MODEL}.golden-f16kv.json"),
        KvType::F16,
        2e-3,
        0.005,
    );
}

/// Every prompt position's logits within 1e-3 (+1e-4 relative) of transformers' float32 logits.
#[test]
fn tiny_logits_match_transformers() {
    let model = load_model();
    let reference = load_json(&format!("{MODEL}.reference.json"));
    let n_vocab = model.n_vocab();
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&case["prompt_tokens"]);
        let mut cache = model.new_cache(KvType::F32, 512, 512);
        let logits = model
            .forward(&mut cache, &prompt, LogitsWanted::All)
            .unwrap();
        let mut worst = 0f32;
        for (pos, want) in case["logits"].as_array().unwrap().iter().enumerate() {
            for (j, &w) in floats(want).iter().enumerate() {
                let got = logits[pos * n_vocab + j];
                let d = (got - w).abs();
                worst = worst.max(d);
                assert!(
                    d <= 1e-3 + 1e-4 * w.abs(),
                    "case {i} position {pos} token {j}: {got} vs {w}"
                );
            }
        }
        eprintln!("{MODEL} reference case {i}: max |Δlogit| {worst:.2e}");
    }
}
