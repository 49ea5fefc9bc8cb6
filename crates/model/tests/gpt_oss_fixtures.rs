//! Teacher-forced comparison with llama.cpp's goldens and OpenAI's reference logits
//! (../shared/fixtures/gpt-oss; tolerances from its README).

mod common;

use common::{ids, load_gpt_oss as load_model, softmax64};
use hmoe_model::{KvType, LanguageModel, LogitsWanted};
use serde_json::Value;

fn load_json(name: &str) -> Value {
    common::load_json("gpt-oss", name)
}

/// Per-case result of a teacher-forced run.
struct CaseReport {
    /// Largest |Δp| over the golden top-10 of each step.
    step_max_dp: Vec<f64>,
    /// Steps whose golden top-1 margin exceeds 0.01 but whose argmax differs.
    top1_mismatches: Vec<usize>,
    /// Largest |Δlogit| of the last prompt position.
    prompt_logit_max_diff: f32,
}

fn teacher_forced(model: &dyn LanguageModel, golden: &Value, kv: KvType) -> Vec<CaseReport> {
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let prompt = ids(&case["prompt_tokens"]);
            let greedy = ids(&case["greedy_tokens"]);
            let mut cache = model.new_cache(kv, 512, 512);
            let mut logits = model
                .forward(&mut cache, &prompt, LogitsWanted::Last)
                .unwrap();
            let want_last: Vec<f32> = case["prompt_logits_last"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            let prompt_logit_max_diff = logits
                .iter()
                .zip(&want_last)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let mut report = CaseReport {
                step_max_dp: Vec::new(),
                top1_mismatches: Vec::new(),
                prompt_logit_max_diff,
            };
            for (step, top) in case["top_probs"].as_array().unwrap().iter().enumerate() {
                let probs = softmax64(&logits);
                let top = top.as_array().unwrap();
                let mut max_dp = 0f64;
                for pair in top {
                    let id = pair[0].as_u64().unwrap() as usize;
                    let p = pair[1].as_f64().unwrap();
                    max_dp = max_dp.max((probs[id] - p).abs());
                }
                report.step_max_dp.push(max_dp);
                let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
                let ours = (0..probs.len())
                    .fold(0, |best, i| if probs[i] > probs[best] { i } else { best });
                if margin > 0.01 && ours as u64 != top[0][0].as_u64().unwrap() {
                    report.top1_mismatches.push(step);
                }
                if step + 1 < greedy.len() {
                    logits = model
                        .forward(&mut cache, &[greedy[step]], LogitsWanted::Last)
                        .unwrap();
                }
            }
            report
        })
        .collect()
}

/// Golden check: top-10 probabilities within `tol` at every step but at most one step per case
/// (an expert-routing near-tie), and top-1 identical wherever the golden margin exceeds 0.01.
fn check_golden(model_file: &str, golden_file: &str, kv: KvType, tol: f64) {
    let model = load_model(model_file);
    let golden = load_json(golden_file);
    let mut failures = Vec::new();
    for (i, r) in teacher_forced(model.as_ref(), &golden, kv)
        .iter()
        .enumerate()
    {
        let bad: Vec<(usize, f64)> = r
            .step_max_dp
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, d)| d > tol)
            .collect();
        let worst = r.step_max_dp.iter().copied().fold(0.0, f64::max);
        eprintln!(
            "{golden_file} case {i}: max |Δp| {worst:.2e}, steps over {tol:.0e}: {bad:?}, top-1 mismatches {:?}, prompt logits max |Δ| {:.2e}",
            r.top1_mismatches, r.prompt_logit_max_diff
        );
        if bad.len() > 1 || !r.top1_mismatches.is_empty() {
            failures.push(i);
        }
    }
    assert!(
        failures.is_empty(),
        "{golden_file}: cases {failures:?} out of tolerance"
    );
}

#[test]
fn tiny_matches_llama_cpp_f32_kv() {
    check_golden(
        "gptoss-tiny.gguf",
        "gptoss-tiny.golden.json",
        KvType::F32,
        2e-3,
    );
}

#[test]
fn tiny_split_matches_llama_cpp_f32_kv() {
    check_golden(
        "gptoss-tiny-split-00001-of-00003.gguf",
        "gptoss-tiny-split.golden.json",
        KvType::F32,
        2e-3,
    );
}

#[test]
fn small_matches_llama_cpp_f32_kv() {
    check_golden(
        "gptoss-small.gguf",
        "gptoss-small.golden.json",
        KvType::F32,
        2e-3,
    );
}

#[test]
fn openai_matches_llama_cpp_f32_kv() {
    check_golden(
        "gptoss-openai.gguf",
        "gptoss-openai.golden.json",
        KvType::F32,
        2e-3,
    );
}

#[test]
fn openai_f32_experts_matches_llama_cpp_f32_kv() {
    check_golden(
        "gptoss-openai-f32experts.gguf",
        "gptoss-openai-f32experts.golden.json",
        KvType::F32,
        2e-3,
    );
}

/// Exact-math file: every prompt position's logits within 1e-3 of OpenAI's math with
/// llama.cpp's YaRN rounding, and the last position within 1e-3 of llama.cpp's golden.
#[test]
fn openai_f32_experts_logits_match_reference_and_golden() {
    let model = load_model("gptoss-openai-f32experts.gguf");
    let reference = load_json("gptoss-openai-f32experts.reference-yarn-rounded.json");
    let golden = load_json("gptoss-openai-f32experts.golden.json");
    let n_vocab = model.n_vocab();
    for (case, gold) in reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .zip(golden["cases"].as_array().unwrap())
    {
        let prompt = ids(&case["prompt_tokens"]);
        let mut cache = model.new_cache(KvType::F32, 512, 512);
        let logits = model
            .forward(&mut cache, &prompt, LogitsWanted::All)
            .unwrap();
        let mut worst = 0f32;
        for (pos, want) in case["logits"].as_array().unwrap().iter().enumerate() {
            for (j, w) in want.as_array().unwrap().iter().enumerate() {
                let w = w.as_f64().unwrap() as f32;
                let d = (logits[pos * n_vocab + j] - w).abs();
                worst = worst.max(d);
                assert!(
                    d <= 1e-3 + 1e-4 * w.abs(),
                    "position {pos} token {j}: {} vs {w}",
                    logits[pos * n_vocab + j]
                );
            }
        }
        let last = &logits[(prompt.len() - 1) * n_vocab..];
        let gold_worst = gold["prompt_logits_last"]
            .as_array()
            .unwrap()
            .iter()
            .zip(last)
            .map(|(w, &v)| (v - w.as_f64().unwrap() as f32).abs())
            .fold(0f32, f32::max);
        eprintln!("reference max |Δlogit| {worst:.2e}, golden last-position max |Δlogit| {gold_worst:.2e}");
        assert!(gold_worst <= 1e-3);
    }
}

#[test]
fn tiny_matches_llama_cpp_f16_kv() {
    check_golden(
        "gptoss-tiny.gguf",
        "gptoss-tiny.golden-f16kv.json",
        KvType::F16,
        2e-3,
    );
}

#[test]
fn small_matches_llama_cpp_f16_kv() {
    check_golden(
        "gptoss-small.gguf",
        "gptoss-small.golden-f16kv.json",
        KvType::F16,
        2e-3,
    );
}

#[test]
fn openai_matches_llama_cpp_f16_kv() {
    check_golden(
        "gptoss-openai.gguf",
        "gptoss-openai.golden-f16kv.json",
        KvType::F16,
        2e-3,
    );
}

#[test]
fn openai_f32_experts_matches_llama_cpp_f16_kv() {
    check_golden(
        "gptoss-openai-f32experts.gguf",
        "gptoss-openai-f32experts.golden-f16kv.json",
        KvType::F16,
        2e-3,
    );
}

/// Free-running greedy decoding (argmax, ties to the lower id) reproduces llama.cpp's greedy
/// tokens; with bit-identical logits there is no near-tie to stop at.
#[test]
fn free_running_greedy_matches_llama_cpp() {
    for (file, golden) in [
        ("gptoss-tiny.gguf", "gptoss-tiny.golden.json"),
        ("gptoss-small.gguf", "gptoss-small.golden.json"),
        ("gptoss-openai.gguf", "gptoss-openai.golden.json"),
    ] {
        let model = load_model(file);
        for case in load_json(golden)["cases"].as_array().unwrap() {
            let want = ids(&case["greedy_tokens"]);
            let mut cache = model.new_cache(KvType::F32, 512, 512);
            let mut logits = model
                .forward(&mut cache, &ids(&case["prompt_tokens"]), LogitsWanted::Last)
                .unwrap();
            let mut got = Vec::new();
            while got.len() < want.len() {
                let next =
                    (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
                got.push(next as u32);
                logits = model
                    .forward(&mut cache, &[next as u32], LogitsWanted::Last)
                    .unwrap();
            }
            assert_eq!(got, want, "{golden}");
        }
    }
}
