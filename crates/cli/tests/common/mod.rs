//! What the REF0 command-line tests (ref0.rs, ref0_kv.rs, ref0_arch.rs, ref0_deepseek2.rs)
//! share: the fixtures with their first golden case, `hmoe run --json` teacher-forced with the
//! top-10 probabilities over them, and the placements.
#![allow(dead_code)] // each test binary uses part of it

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// The fixtures folder (`HMOE_FIXTURES`, or `shared/fixtures` beside the repository).
pub fn fixtures() -> PathBuf {
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

/// The `hmoe` binary's output for `args`.
pub fn hmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(args)
        .output()
        .expect("hmoe runs")
}

pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

pub fn join(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// A fixture with the first golden case's prompt and greedy continuation (6 steps).
pub struct Fixture {
    pub model: String,
    pub prompt: String,
    pub teacher: String,
    /// Micro-batches: the prompt, then every teacher token but the last (each step gives the
    /// next distribution).
    pub ubatches: u64,
    pub n_layer: u64,
}

pub fn fixture(dir: &str, stem: &str, model_file: &str) -> Fixture {
    let dir = fixtures().join(dir);
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("{stem}.golden-f16kv.json"))).unwrap(),
    )
    .unwrap();
    let case = &golden["cases"][0];
    let teacher: Vec<u64> = ids(&case["greedy_tokens"]).into_iter().take(6).collect();
    let model = dir.join(model_file).to_str().unwrap().to_string();
    let out = hmoe(&["inspect", &model, "--no-tensors"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let n_layer = text
        .lines()
        .find(|l| l.contains(".block_count"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no block_count in `hmoe inspect` of {model}:\n{text}"));
    Fixture {
        model,
        prompt: join(&ids(&case["prompt_tokens"])),
        ubatches: teacher.len() as u64,
        teacher: join(&teacher),
        n_layer,
    }
}

/// `hmoe run --json` teacher-forced with `extra` flags; the parsed output and stderr.
pub fn run(f: &Fixture, extra: &[&str]) -> (Value, String) {
    let mut args = vec![
        "run",
        "-m",
        &f.model,
        "--prompt-tokens",
        &f.prompt,
        "--teacher-tokens",
        &f.teacher,
        "--top-k-probs",
        "10",
        "--json",
        "-c",
        "256",
        "-t",
        "2",
    ];
    args.extend_from_slice(extra);
    let out = hmoe(&args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "hmoe {args:?} failed: {err}");
    (serde_json::from_slice(&out.stdout).unwrap(), err)
}

/// The gpt-oss fixtures: golden stem and model file.
pub const FIXTURES: [(&str, &str); 5] = [
    ("gptoss-tiny", "gptoss-tiny.gguf"),
    ("gptoss-tiny-split", "gptoss-tiny-split-00001-of-00003.gguf"),
    ("gptoss-small", "gptoss-small.gguf"),
    ("gptoss-openai", "gptoss-openai.gguf"),
    ("gptoss-openai-f32experts", "gptoss-openai-f32experts.gguf"),
];

/// The layers whose experts each placement keeps on the CPU (`None`: every layer).
pub fn placements() -> Vec<(Vec<&'static str>, Option<u64>)> {
    vec![
        (vec!["-ngl", "all"], Some(0)),
        (vec!["-ngl", "all", "--cpu-moe"], None),
        (vec!["-ngl", "all", "--n-cpu-moe", "1"], Some(1)),
        (
            vec!["-ngl", "all", "-ot", r"blk\.1\.ffn_(gate|up|down)_exps=CPU"],
            Some(1),
        ),
    ]
}
