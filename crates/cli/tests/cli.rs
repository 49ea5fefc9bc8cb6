//! End-to-end tests of the `hmoe` binary on fixture and generated models.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

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

fn hmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(args)
        .output()
        .expect("hmoe runs")
}

fn ok_stdout(args: &[&str]) -> String {
    let out = hmoe(args);
    assert!(
        out.status.success(),
        "hmoe {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hmoe-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn join_ids(v: &Value) -> String {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// `hmoe run --json --teacher-tokens` reproduces llama.cpp's teacher-forced distributions.
#[test]
fn run_json_teacher_forced_matches_golden() {
    let dir = fixtures().join("gpt-oss");
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("gptoss-tiny.golden.json")).unwrap(),
    )
    .unwrap();
    let case = &golden["cases"][1];
    let model = dir.join("gptoss-tiny.gguf");
    let prompt = join_ids(&case["prompt_tokens"]);
    let teacher = join_ids(&case["greedy_tokens"]);
    let out = ok_stdout(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &prompt,
        "--teacher-tokens",
        &teacher,
        "--json",
        "--top-k-probs",
        "10",
        "-ctk",
        "f32",
        "-ctv",
        "f32",
        "-t",
        "2",
    ]);
    let got: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(got["generated_tokens"], case["greedy_tokens"]);
    let steps = got["top_probs"].as_array().unwrap();
    assert_eq!(steps.len(), 32);
    let mut over = 0;
    for (ours, gold) in steps.iter().zip(case["top_probs"].as_array().unwrap()) {
        let p0 = ours[0][1].as_f64().unwrap();
        let g0 = gold[0][1].as_f64().unwrap();
        if (p0 - g0).abs() > 2e-3 || ours[0][0] != gold[0][0] {
            over += 1;
        }
    }
    assert!(over <= 1, "{over} steps differ from the golden");
    assert!(got["timings"]["prompt_per_second"].as_f64().unwrap() > 0.0);
}

/// A generated model, written whole and split, runs the same through `hmoe run`.
#[test]
fn make_test_model_split_and_run_greedy() {
    let whole = scratch("whole.gguf");
    let prefix = scratch("split");
    ok_stdout(&[
        "make-test-model",
        "--layers",
        "2",
        "--seed",
        "3",
        "-o",
        whole.to_str().unwrap(),
    ]);
    let shards = ok_stdout(&[
        "make-test-model",
        "--layers",
        "2",
        "--seed",
        "3",
        "-o",
        prefix.to_str().unwrap(),
        "--split-max-tensors",
        "10",
    ]);
    let first = shards.lines().next().unwrap().to_string();
    assert!(first.ends_with("-00001-of-00005.gguf"), "{shards}");
    let run = |m: &str| {
        let out = ok_stdout(&[
            "run",
            "-m",
            m,
            "--prompt-tokens",
            "1,2,3",
            "-n",
            "8",
            "--temp",
            "0",
            "--json",
            "-t",
            "2",
        ]);
        let v: Value = serde_json::from_str(&out).unwrap();
        v["generated_tokens"].clone()
    };
    let a = run(whole.to_str().unwrap());
    assert_eq!(a.as_array().unwrap().len(), 8);
    assert_eq!(a, run(&first));
    let text = ok_stdout(&[
        "run",
        "-m",
        whole.to_str().unwrap(),
        "-p",
        "Hello",
        "-n",
        "4",
        "--seed",
        "1",
    ]);
    assert!(!text.is_empty());
    let inspect = ok_stdout(&["inspect", whole.to_str().unwrap()]);
    assert!(
        inspect.contains("MXFP4") && inspect.contains("blk.1.ffn_down_exps.weight"),
        "{inspect}"
    );
}

/// Bad input ends with an error message and exit status 1, never a panic.
#[test]
fn bad_input_is_an_error_not_a_panic() {
    let bytes = std::fs::read(fixtures().join("gpt-oss/gptoss-tiny.gguf")).unwrap();
    let truncated = scratch("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    for args in [
        vec![
            "run",
            "-m",
            truncated.to_str().unwrap(),
            "--prompt-tokens",
            "1",
        ],
        vec!["inspect", truncated.to_str().unwrap()],
        vec!["run", "-m", "/nonexistent.gguf", "--prompt-tokens", "1"],
    ] {
        let out = hmoe(&args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
    let model = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    let out = hmoe(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "5000",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary"));
    let out = hmoe(&["run", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn demo_generates() {
    let model = scratch("demo.gguf");
    let out = ok_stdout(&["demo", "-o", model.to_str().unwrap(), "-n", "8"]);
    assert!(out.contains("generated ids"), "{out}");
}

/// `hmoe chat` renders the model's template each turn and answers every line of stdin.
#[test]
fn chat_answers_each_line_from_stdin() {
    use std::io::Write;
    let model = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args([
            "chat",
            "-m",
            model.to_str().unwrap(),
            "-n",
            "8",
            "--temp",
            "0",
            "-t",
            "2",
            "--reasoning-format",
            "none",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello there\nWhat is two plus two?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let replies: Vec<&str> = stdout
        .split_terminator('\n')
        .filter(|l| !l.is_empty())
        .collect();
    assert!(replies.len() >= 2, "{stdout:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).matches("> ").count(),
        3
    );
}

/// The full gpt-oss-120b layout as a sparse file, planned by `hmoe fit` (issue 4's checks).
#[test]
fn fit_plans_the_sparse_gpt_oss_120b_layout() {
    let model = scratch("g120-sparse.gguf");
    ok_stdout(&[
        "make-test-model",
        "--preset",
        "gpt-oss-120b",
        "--sparse",
        "-o",
        model.to_str().unwrap(),
    ]);
    let m = model.to_str().unwrap();
    let inspect = ok_stdout(&["inspect", m, "--no-tensors"]);
    assert!(inspect.contains("687 tensors"), "{inspect}");
    let fit = |extra: &[&str]| -> Value {
        let mut args = vec!["fit", "-m", m, "-c", "4096", "-ngl", "all", "--json"];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok_stdout(&args)).unwrap()
    };
    let dev = |v: &Value, name: &str| -> Value {
        v["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["device"] == name)
            .unwrap()
            .clone()
    };
    let gib = |x: &Value| x.as_u64().unwrap() as f64 / (1u64 << 30) as f64;
    let cpu_moe = fit(&["--cpu-moe", "--gpu-mem", "8GiB"]);
    let gpu = dev(&cpu_moe, "CUDA0");
    let gpu_gb = gpu["total"].as_u64().unwrap() as f64 / 1e9;
    assert!((3.0..5.0).contains(&gpu_gb), "GPU total {gpu_gb} GB");
    assert_eq!(dev(&cpu_moe, "CPU")["expert_layers"], 36);
    for (mem, min_layers) in [("8GiB", 1), ("22GiB", 5)] {
        let p = fit(&["--gpu-mem", mem]);
        let gpu = dev(&p, "CUDA0");
        let free_left = gib(&gpu["free"]) - gib(&gpu["total"]);
        assert!(free_left >= 1.0, "{mem}: {free_left} GiB left");
        assert!(
            gpu["expert_layers"].as_u64().unwrap() >= min_layers,
            "{mem}: {gpu}"
        );
    }
}

/// On a machine without a GPU, asking for GPU offload (`-ngl all`, `--cpu-moe`) runs the CPU
/// engine exactly as a plain run (same top probabilities, bit for bit) and says why once; a
/// plain run says nothing. With a GPU (gpu-check.sh) this test is skipped: the GPU executor
/// then runs instead.
#[test]
fn gpu_flags_without_a_gpu_run_the_cpu_engine_unchanged() {
    if hmoe_cuda_present() {
        eprintln!("a CUDA device is present: skipped");
        return;
    }
    let model = fixtures().join("gpt-oss").join("gptoss-tiny.gguf");
    let model = model.to_str().unwrap();
    let base = [
        "run",
        "-m",
        model,
        "--prompt-tokens",
        "46,77,344,510,261",
        "--teacher-tokens",
        "648,428,336",
        "--top-k-probs",
        "10",
        "--json",
        "-c",
        "512",
        "-t",
        "1",
    ];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = hmoe(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["top_probs"].clone(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (plain, plain_err) = run(&[]);
    assert!(!plain_err.contains("running on the CPU"), "{plain_err}");
    for extra in [
        &["-ngl", "all"][..],
        &["-ngl", "all", "--cpu-moe"],
        &[
            "--n-gpu-layers",
            "all",
            "--n-cpu-moe",
            "1",
            "--op-offload-min-batch",
            "4",
        ],
        &["-ngl", "all", "--no-op-offload"],
    ] {
        let (probs, err) = run(extra);
        assert_eq!(probs, plain, "{extra:?}");
        assert_eq!(
            err.matches("running on the CPU: no GPU").count(),
            1,
            "{extra:?}: {err}"
        );
    }
}

/// Whether a CUDA device answers (then the GPU executor would run).
fn hmoe_cuda_present() -> bool {
    let out = hmoe(&["--list-devices"]);
    String::from_utf8_lossy(&out.stdout).contains("CUDA0")
}
