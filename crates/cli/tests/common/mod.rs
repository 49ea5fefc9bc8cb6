//! What the REF0 command-line tests (ref0*.rs, moe_cache.rs) share: the fixtures with their
//! first golden case, `hmoe run --json` teacher-forced with the top-10 probabilities over them,
//! the placements, the comparison of REF0 with the executor on the CPU
//! ([`assert_ref0_is_the_cpu_device`]) and `make-test-model` files.
#![allow(dead_code)] // each test binary uses part of it

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

pub use hmoe_testdata::fixtures;

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

/// A `-dev REF0` placement (its flags) and the layers whose experts it keeps on the CPU.
pub type Placement<'a> = (&'a [&'a str], u64);

/// The teacher-forced top-10 probabilities of `f` with `-dev REF0` and each placement of
/// `cases` (and the extra flags `kv`, the same on both sides) are the CPU's
/// (`-dev none`) bit for bit: the run says it is `arch` on REF0, makes one round trip per
/// CPU-expert layer per micro-batch, offloads nothing (prompts below 32 tokens), and brings
/// down nothing but each micro-batch's logits and one staged copy per round trip. Returns the
/// output on the CPU.
pub fn assert_ref0_is_the_cpu_device(
    f: &Fixture,
    arch: &str,
    kv: &[&str],
    cases: &[Placement<'_>],
) -> Value {
    let (cpu, _) = run(f, &[&["-dev", "none"][..], kv].concat());
    assert_eq!(cpu["engine"], "CPU", "{} {kv:?}", f.model);
    let steps = cpu["top_probs"].as_array().unwrap().len() as u64;
    assert_eq!(steps, f.ubatches, "{} {kv:?}", f.model);
    for &(flags, host) in cases {
        let extra = [&["-dev", "REF0"][..], flags, kv].concat();
        let (got, err) = run(f, &extra);
        let what = format!("{} {extra:?}", f.model);
        assert_eq!(got["engine"], "REF0", "{what}: {err}");
        assert!(err.contains(&format!("{arch} on REF0")), "{what}: {err}");
        assert_eq!(got["top_probs"], cpu["top_probs"], "{what}");
        assert_eq!(got["generated_tokens"], cpu["generated_tokens"], "{what}");
        let s = &got["device_stats"];
        assert_eq!(s["ubatches"], f.ubatches, "{what}: {s}");
        assert_eq!(s["host_round_trips"], host * f.ubatches, "{what}: {s}");
        assert_eq!(s["offloaded_layers"], 0, "{what}: prompts below 32 tokens");
        // Device → host: the logits of each micro-batch and one staged copy per round trip;
        // nothing else leaves the device.
        assert_eq!(
            s["transfers"]["downloads"].as_u64(),
            Some(f.ubatches + host * f.ubatches),
            "{what}: {s}"
        );
    }
    cpu
}

/// A `make-test-model` file written by `args` (without `-o`) into a fresh temporary folder
/// named after `tag`: the folder (remove it when done) and the file's path.
pub fn make_test_model(tag: &str, args: &[&str]) -> (PathBuf, String) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf").to_str().unwrap().to_string();
    let out = hmoe(&[&["make-test-model"][..], args, &["-o", &path]].concat());
    assert!(
        out.status.success(),
        "make-test-model {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, path)
}
