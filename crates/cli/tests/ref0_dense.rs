//! The dense Llama-family files (`llama`, `qwen2`) on the reference device from the command
//! line: on the real SmolLM2-135M-Instruct Q4_1 and Qwen2.5-Coder-0.5B-Instruct
//! Q4_K_M files, the teacher-forced top-10 probabilities of `hmoe run -dev REF0 -ngl all` are
//! the CPU's (`-dev none`) bit for bit over the first golden case with f16, q8_0 and
//! f32 K/V caches; nothing crosses the bus but the ids, positions and logits of each
//! micro-batch; and `-ngl` short of every layer keeps the executor on the CPU and says why.
//!
//! The GGUFs are not committed (`scripts/fetch-real-models.sh` puts them in `$HMOE_MODELS`,
//! default `~/.cache/hmoe-models`); without them each test prints `SKIPPED: <why>` and passes.

mod common;

use std::path::PathBuf;

use common::{assert_ref0_is_the_cpu_device, fixtures, hmoe, ids, join, run, Fixture};
use serde_json::Value;

/// The file in the model cache and the stem of its goldens in `fixtures/real`.
const SMOLLM2: (&str, &str) = (
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "smollm2-135m-instruct-q4_1",
);
const QWEN25: (&str, &str) = (
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m",
);

/// The real model `file` with the first golden case of `stem` (6 steps), or `None` after
/// printing why the test is skipped.
fn real_fixture((file, stem): (&str, &str)) -> Option<Fixture> {
    let dir = std::env::var_os("HMOE_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/hmoe-models")));
    let path = match dir.map(|d| d.join(file)) {
        Some(p) if p.is_file() => p,
        _ => {
            eprintln!(
                "SKIPPED: {file} not in the model cache ($HMOE_MODELS or ~/.cache/hmoe-models); \
                 run scripts/fetch-real-models.sh to download it"
            );
            return None;
        }
    };
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(
            fixtures()
                .join("real")
                .join(format!("{stem}.golden-f16kv.json")),
        )
        .unwrap(),
    )
    .unwrap();
    let case = &golden["cases"][0];
    let teacher: Vec<u64> = ids(&case["greedy_tokens"]).into_iter().take(6).collect();
    let model = path.to_str().unwrap().to_string();
    let out = hmoe(&["inspect", &model, "--no-tensors"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let n_layer = text
        .lines()
        .find(|l| l.contains(".block_count"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no block_count in `hmoe inspect` of {model}:\n{text}"));
    Some(Fixture {
        model,
        prompt: join(&ids(&case["prompt_tokens"])),
        ubatches: teacher.len() as u64,
        teacher: join(&teacher),
        n_layer,
    })
}

fn check(model: (&str, &str), arch: &str) {
    let Some(f) = real_fixture(model) else {
        return;
    };
    for kv in ["f16", "q8_0", "f32"] {
        let kv_flags = ["-ctk", kv, "-ctv", kv];
        assert_ref0_is_the_cpu_device(&f, arch, &kv_flags, &[(&["-ngl", "all"], 0)]);
    }
    // Some layers on the CPU: the executor runs every layer on the device or none, so the
    // executor on the CPU runs it, and says why.
    let partial = (f.n_layer - 1).to_string();
    let (got, err) = run(&f, &["-dev", "REF0", "-ngl", &partial]);
    assert_eq!(got["engine"], "CPU", "-ngl {partial}: {err}");
    assert!(
        err.contains(&format!("of {} layers on the GPU", f.n_layer)),
        "-ngl {partial}: {err}"
    );
}

#[test]
fn ref0_smollm2_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    check(SMOLLM2, "llama");
}

#[test]
fn ref0_qwen25_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    check(QWEN25, "qwen2");
}
