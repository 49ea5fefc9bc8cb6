//! Shared helpers of the fixture tests: locating ../shared/fixtures, reading goldens, and the
//! teacher-forced comparison with llama.cpp's goldens and the reference implementations.
#![allow(dead_code)] // each test binary uses part of it

use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_model::{KvType, LanguageModel, LogitsWanted};
use serde_json::Value;

pub use hmoe_testdata::fixtures;

pub fn load_json(dir: &str, name: &str) -> Value {
    let path = fixtures().join(dir).join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn load_model(dir: &str, model: &str) -> Box<dyn LanguageModel> {
    let path = fixtures().join(dir).join(format!("{model}.gguf"));
    let gguf = GgufModel::open(&path, LoadOptions::default()).unwrap();
    hmoe_model::load(gguf).unwrap()
}

/// A gpt-oss fixture (`file` in fixtures/gpt-oss) on the CPU.
pub fn load_gpt_oss(file: &str) -> Box<dyn LanguageModel> {
    let path = fixtures().join("gpt-oss").join(file);
    hmoe_model::load(GgufModel::open(&path, LoadOptions::default()).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn softmax64(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Teacher-forced run of every golden case: the prompt in one batch, then the golden greedy
/// tokens one at a time. Asserts top-10 probabilities within `p_tol` at every step, top-1
/// identical wherever the golden margin exceeds 1e-4, and the last prompt position's logits
/// within `logit_tol`. Returns (max |Δp|, max |Δlogit|) for the report.
pub fn check_golden(
    dir: &str,
    model: &str,
    golden_file: &str,
    kv: KvType,
    p_tol: f64,
    logit_tol: f32,
) -> (f64, f32) {
    let golden = load_json(dir, golden_file);
    let model = load_model(dir, model);
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

/// Every prompt position's logits within 1e-3 (+1e-4 relative) of transformers' float32 logits.
pub fn check_reference(dir: &str, model_name: &str) {
    let model = load_model(dir, model_name);
    let reference = load_json(dir, &format!("{model_name}.reference.json"));
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
        eprintln!("{model_name} reference case {i}: max |Δlogit| {worst:.2e}");
    }
}

/// The fixture `file` (a path below the fixtures folder), opened.
pub fn open_fixture(file: &str) -> GgufModel {
    GgufModel::open(fixtures().join(file), LoadOptions::default()).unwrap()
}

/// The bits of `v`, for bit-for-bit comparisons.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The greedy choice of `logits` (the first of equal maxima).
pub fn argmax(logits: &[f32]) -> u32 {
    (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b }) as u32
}
