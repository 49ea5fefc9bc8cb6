//! `hmoe fit` on small GPUs: the full layouts of gpt-oss-120b, Qwen3-235B-A22B and
//! DeepSeek-V3 (sparse `make-test-model` files: the real tensor table, no weights written)
//! fit cards that llama.cpp fits them in, with the experts on the CPU. The op-offload ring
//! shrinks to what the card leaves; the plan never exceeds the card; `hmoe fit` prints the
//! ring.

mod common;

use std::path::PathBuf;

use common::hmoe;
use serde_json::Value;

fn scratch(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-fit-small-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn ok_stdout(args: &[&str]) -> String {
    let out = hmoe(args);
    assert!(
        out.status.success(),
        "hmoe {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A sparse model file of `make` (make-test-model arguments), made once.
fn sparse(name: &str, make: &[&str]) -> String {
    let path = scratch(name);
    let p = path.to_str().unwrap().to_string();
    let mut args = vec!["make-test-model", "--sparse", "-o", &p];
    args.extend_from_slice(make);
    ok_stdout(&args);
    p
}

/// `hmoe fit --json` of `model` on a GPU of `gpu_mem` with `-ngl 99 --cpu-moe -c ctx`,
/// checked to fit within the card with the default margin.
fn fit(model: &str, gpu_mem: &str, ctx: &str) -> Value {
    let args = [
        "fit",
        "-m",
        model,
        "--gpu-mem",
        gpu_mem,
        "-c",
        ctx,
        "-ngl",
        "99",
        "--cpu-moe",
        "--json",
    ];
    let v: Value = serde_json::from_str(&ok_stdout(&args)).unwrap();
    let gpu = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == "CUDA0")
        .unwrap()
        .clone();
    let n = |k: &str| gpu[k].as_u64().unwrap();
    assert_eq!(v["fits"], true, "{model} on {gpu_mem}: {v}");
    assert!(n("total") + n("margin") <= n("free"), "{v}");
    assert_eq!(n("margin"), 1 << 30, "the default --fit-target");
    assert!(n("ring") > 0, "{v}");
    assert!(n("compute") >= n("ring"));
    assert!(v["ring_slice_experts"].as_u64().unwrap() >= 1);
    eprintln!(
        "{model} --gpu-mem {gpu_mem} -c {ctx}: total {} MiB, ring {} MiB ({} experts a slice), \
         notes {}",
        n("total") >> 20,
        n("ring") >> 20,
        v["ring_slice_experts"],
        v["notes"]
    );
    v
}

#[test]
fn gpt_oss_120b_fits_8_6_and_4_gib() {
    let m = sparse("g120.gguf", &["--preset", "gpt-oss-120b"]);
    // -c 0: the trained 131072, pinned.
    let v = fit(&m, "8GiB", "0");
    assert_eq!(v["n_ctx"], 131072);
    fit(&m, "6GiB", "32768");
    fit(&m, "4GiB", "4096");
    // The text report prints the ring.
    let text = ok_stdout(&[
        "fit",
        "-m",
        &m,
        "--gpu-mem",
        "8GiB",
        "-c",
        "0",
        "-ngl",
        "99",
        "--cpu-moe",
    ]);
    eprintln!("{text}");
    assert!(
        text.contains("op-offload ring on CUDA0: 2 slices of"),
        "{text}"
    );
    assert!(
        text.contains("fit: op-offload ring shrunk from 32 to"),
        "{text}"
    );
}

#[test]
fn qwen3_235b_fits_16_gib_at_32k() {
    let m = sparse(
        "q235.gguf",
        &[
            "--arch",
            "qwen3moe",
            "--preset",
            "qwen3-235b-a22b",
            "--expert-type",
            "q4_k",
        ],
    );
    let v = fit(&m, "16GiB", "32768");
    assert_eq!(v["n_ctx"], 32768);
}

#[test]
fn deepseek_v3_fits_24_gib_at_32k() {
    let m = sparse(
        "dsv3.gguf",
        &[
            "--arch",
            "deepseek2",
            "--preset",
            "deepseek-v3",
            "--expert-type",
            "q4_k",
        ],
    );
    let v = fit(&m, "24GiB", "32768");
    assert_eq!(v["n_ctx"], 32768);
}
