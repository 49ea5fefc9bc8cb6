//! End-to-end tests of the `hmoe` binary on fixture and generated models.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use hmoe_testdata::fixtures;

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
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-cli-test-{}", std::process::id()));
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

/// `-nr` (`--no-repack`) keeps the experts in the file's layout; by default MXFP4 experts are
/// interleaved for the AVX2/AVX-512 kernels where the CPU has them. Both give the same distributions,
/// to the bit.
#[test]
fn no_repack_gives_the_same_distributions() {
    let model = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            model.to_str().unwrap(),
            "--prompt-tokens",
            "1,2,3,4,5",
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
            "--top-k-probs",
            "5",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        let got: Value = serde_json::from_str(&ok_stdout(&args)).unwrap();
        (got["generated_tokens"].clone(), got["top_probs"].clone())
    };
    let (tokens, probs) = run(&[]);
    assert_eq!(tokens.as_array().unwrap().len(), 12);
    assert_eq!(run(&["-nr"]), (tokens.clone(), probs.clone()));
    assert_eq!(run(&["--no-repack"]), (tokens, probs));
}

/// Flags an architecture's writer would ignore are refused: gpt-oss's experts are MXFP4, so an
/// IQ type asked for there must not quietly give an MXFP4 file.
#[test]
fn make_test_model_refuses_flags_its_arch_ignores() {
    let out = hmoe(&[
        "make-test-model",
        "--expert-type",
        "iq2_xxs",
        "-o",
        scratch("ignored.gguf").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--expert-type does not apply to --arch gpt-oss"),
        "{err}"
    );
    assert!(!scratch("ignored.gguf").exists());
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

/// The first command the demo's "next:" line prints (between backticks).
fn next_command(out: &str) -> Vec<String> {
    let next = out
        .lines()
        .find(|l| l.starts_with("next: "))
        .unwrap_or_else(|| panic!("{out}"));
    let cmd = next.split('`').nth(1).unwrap();
    cmd.split(' ').map(String::from).collect()
}

/// The demo's "next:" line names a command that runs: the binary's own path when `hmoe` is
/// not on PATH (as after `cargo run`), `hmoe` when it is.
#[test]
fn demo_next_line_is_a_command_that_works() {
    let model = scratch("demo-next.gguf");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_hmoe"));
    let o = Command::new(&bin)
        .args(["demo", "-n", "2", "-o", model.to_str().unwrap()])
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let cmd = next_command(&out);
    assert_eq!(
        std::fs::canonicalize(&cmd[0]).unwrap(),
        std::fs::canonicalize(&bin).unwrap(),
        "{out}"
    );
    assert!(out.contains("cargo install --path crates/cli"), "{out}");
    assert_eq!(cmd[1..], ["chat", "-m", model.to_str().unwrap()], "{out}");
    // It runs: the chat answers one line from stdin and leaves at its end. The model is a
    // random-weight stand-in: without -n its reply stops at 64 tokens, a note says so and
    // where real small models come from, and the speed follows the reply.
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .args(["-t", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"hi\n").unwrap();
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("random-weight stand-in")
            && err.contains("cut at 64 tokens")
            && err.contains("scripts/fetch-real-models.sh"),
        "{err}"
    );
    // (stderr alone here: the reply and its newline went to stdout, after the "> " prompt.)
    let speed = err
        .lines()
        .find_map(|l| {
            l.find("[")
                .filter(|_| l.contains(" t/s; prompt "))
                .map(|i| &l[i..])
        })
        .unwrap_or_else(|| panic!("no speed line: {err}"));
    let n: usize = speed[1..].split(' ').next().unwrap().parse().unwrap();
    assert!((1..=64).contains(&n), "{speed}");
    // With `hmoe` on PATH (a link to this binary), the line says `hmoe`.
    let dir = scratch("demo-path");
    std::fs::create_dir_all(&dir).unwrap();
    let _ = std::fs::remove_file(dir.join("hmoe"));
    std::os::unix::fs::symlink(&bin, dir.join("hmoe")).unwrap();
    let o = Command::new(&bin)
        .args(["demo", "-n", "2", "-o", model.to_str().unwrap()])
        .env("PATH", format!("{}:/usr/bin:/bin", dir.display()))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(next_command(&out)[0], "hmoe", "{out}");
    assert!(!out.contains("is not on PATH"), "{out}");
}

/// `hmoe run`'s text ends with its newline before the reports (memory, speed) on stderr, so
/// on a terminal, where both streams meet, the reports start on a line of their own.
#[test]
fn run_prints_its_stats_after_the_texts_newline() {
    let both = scratch("run-both.txt");
    let file = std::fs::File::create(&both).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args([
            "run",
            "-m",
            &tiny(),
            "-p",
            "Hello",
            "-n",
            "6",
            "--temp",
            "0",
        ])
        .args(["-t", "2", "--memory-report"])
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .status()
        .unwrap();
    assert!(o.success());
    let text = String::from_utf8_lossy(&std::fs::read(&both).unwrap()).to_string();
    let memory = text
        .find("memory: baseline")
        .unwrap_or_else(|| panic!("{text}"));
    let speed = text.find("prompt: ").unwrap_or_else(|| panic!("{text}"));
    let first = memory.min(speed);
    assert!(text[..first].ends_with('\n'), "{text}");
}

/// On a terminal, loading shows one line updated in place (and erased before the text); with
/// stderr not a terminal, nothing.
#[test]
fn loading_shows_progress_on_a_terminal_only() {
    let Ok(probe) = Command::new("script").arg("--version").output() else {
        eprintln!("SKIPPED: no `script` (util-linux) for a terminal");
        return;
    };
    assert!(probe.status.success());
    let bin = env!("CARGO_BIN_EXE_hmoe");
    let run = format!(
        "{bin} run -m {} --no-mmap -p Hello -n 2 -t 2 --temp 0",
        tiny()
    );
    let log = scratch("progress-typescript");
    let o = Command::new("script")
        .args(["-qfec", &run])
        .arg(&log)
        .env("HMOE_PROGRESS_MS", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tty = String::from_utf8_lossy(&std::fs::read(&log).unwrap()).to_string();
    let shown = tty
        .find("\r\x1b[2Kloading ")
        .unwrap_or_else(|| panic!("{tty:?}"));
    assert!(tty[shown..].contains("% of "), "{tty:?}");
    // The last update is erased before the text and the stats.
    let speed = tty.find("prompt: ").unwrap();
    let last = tty[..speed].rfind("\r\x1b[2K").unwrap();
    assert!(!tty[last..speed].contains("loading "), "{tty:?}");
    let piped = Command::new(bin)
        .args([
            "run",
            "-m",
            &tiny(),
            "--no-mmap",
            "-p",
            "Hello",
            "-n",
            "2",
            "-t",
            "2",
        ])
        .env("HMOE_PROGRESS_MS", "1")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&piped.stderr).contains("loading "));
}

/// `hmoe inspect` takes `-m FILE` as every other command does, and the positional form still.
#[test]
fn inspect_takes_dash_m() {
    let m = tiny();
    let a = ok_stdout(&["inspect", "-m", &m, "--no-tensors"]);
    let b = ok_stdout(&["inspect", &m, "--no-tensors"]);
    assert!(a.contains("metadata keys"), "{a}");
    assert_eq!(a, b);
    assert_eq!(hmoe(&["inspect"]).status.code(), Some(2));
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

/// The full gpt-oss-120b layout as a sparse file, planned by `hmoe fit` (the layout's checks).
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
fn gpu_flags_without_a_gpu_run_on_the_cpu_unchanged() {
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

// Command lines that must fail fast with one clear error naming the flag (and never listen,
// spawn thousands of threads or panic), and llama-server flags that must be accepted.

fn tiny() -> String {
    fixtures()
        .join("gpt-oss/gptoss-tiny.gguf")
        .display()
        .to_string()
}

/// Runs `hmoe ARGS` with a deadline: a command that would listen (serve) is killed after
/// `limit`, and that counts as a failure of the test.
fn hmoe_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(args)
        .env_remove("LLAMA_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hmoe starts");
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "hmoe {args:?} still running after {limit:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Expects a quick failure whose stderr names `needle`, in one `error:` line, never a panic
/// and never "listening".
fn fails_naming(args: &[&str], needle: &str) {
    let out = hmoe_within(args, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: stderr lacks {needle:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(!err.contains("listening"), "{args:?}: {err}");
    assert!(
        err.matches("error").count() <= 2,
        "{args:?}: the error is repeated: {err}"
    );
}

#[test]
fn thread_counts_past_the_bound_are_refused() {
    let m = tiny();
    for cmd in ["serve", "run"] {
        let mut args = vec![cmd, "-m", &m, "-t", "100000", "--port", "0", "-p", "x"];
        if cmd == "serve" {
            args.truncate(7);
        } else {
            args.remove(5);
            args.remove(5);
        }
        fails_naming(&args, "--threads");
        let out = hmoe_within(&args, Duration::from_secs(20));
        assert!(String::from_utf8_lossy(&out.stderr).contains("512"));
    }
}

#[test]
fn serve_flag_values_out_of_range_are_errors_naming_the_flag() {
    let m = tiny();
    let cases: &[(&[&str], &str)] = &[
        (&["--temp", "nan"], "--temp"),
        (&["--top-p", "nan"], "--top-p"),
        (&["--top-p", "2"], "--top-p"),
        (&["--min-p", "nan"], "--min-p"),
        (&["-ot", "(=CPU"], "--override-tensor"),
        (&["-np", "0"], "--parallel"),
        (&["-np", "-2"], "--parallel"),
        (&["-c", "-1"], "--ctx-size"),
        (&["--port", "-1"], "--port"),
        (&["--device", "CUDA7"], "--device"),
        (&["--api-key", ""], "--api-key"),
        (&["--reasoning-budget", "-5"], "--reasoning-budget"),
        (
            &["--slot-prompt-similarity", "2"],
            "--slot-prompt-similarity",
        ),
        (&["--timeout", "0"], "--timeout"),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["serve", "-m", &m, "--port", "0"];
        args.extend_from_slice(extra);
        fails_naming(&args, needle);
    }
    // The range message, as `-c=-1` gets it, not "unexpected argument '-1'".
    let out = hmoe_within(&["serve", "-m", &m, "-c", "-1"], Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("unexpected argument"), "{err}");
    assert!(err.contains("-1 is not in"), "{err}");
}

#[test]
fn an_api_key_file_without_keys_is_an_error() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("keys.txt");
    // Blank lines and `#` comments (as llama-server reads the file) are no keys.
    std::fs::write(&f, "\n   \n# the keys\n\n").unwrap();
    let fs = f.display().to_string();
    fails_naming(
        &["serve", "-m", &tiny(), "--port", "0", "--api-key-file", &fs],
        "holds no key",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_model_paths_fail_once_before_listening() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-badm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("readme.txt");
    std::fs::write(&text, "hello\n").unwrap();
    for path in [
        "/nonexistent/model.gguf".to_string(),
        "/dev/zero".to_string(),
        dir.display().to_string(),
        text.display().to_string(),
    ] {
        let out = hmoe_within(
            &["serve", "-m", &path, "--port", "0"],
            Duration::from_secs(20),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{path}: {err}");
        assert!(!err.contains("listening"), "{path}: {err}");
        assert_eq!(
            err.lines().filter(|l| l.contains(path.as_str())).count(),
            1,
            "{path}: one error line naming the file: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inspect_into_a_closed_pipe_exits_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(["inspect", &tiny()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read a little, as `head -1` would, then close the pipe.
    let mut first = [0u8; 16];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.is_empty(), "{err}");
    assert!(out.status.success(), "{:?}", out.status);
}

#[test]
fn llama_server_flags_are_accepted() {
    // `--help` parses nothing; run the real parser through `serve` with a bad model path so
    // the command stops right after the flags are accepted (the error is about the file).
    let args = [
        "serve",
        "-m",
        "/nonexistent/m.gguf",
        "--port",
        "0",
        "-fit",
        "on",
        "-nkvo",
        "--swa-full",
        "--no-warmup",
        "-v",
        "--log-disable",
        "-sm",
        "none",
        "--reasoning",
        "off",
        "--reasoning-budget",
        "0",
        "--cors-origins",
        "http://a.example,http://b.example",
        "--cache-reuse",
        "256",
        "--ctx-checkpoints",
        "8",
        "--slot-prompt-similarity",
        "0.5",
        "--chat-template-kwargs",
        "{\"reasoning_effort\": \"low\"}",
        "-fa",
        "on",
        "-fa",
        "on",
        "--timeout",
        "30",
        "--max-connections",
        "64",
        "--header-timeout",
        "5",
        "--parse-budget",
        "128",
    ];
    let out = hmoe_within(&args, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("/nonexistent/m.gguf"), "{err}");
    assert!(
        !err.contains("unexpected argument") && !err.contains("cannot be used multiple"),
        "{err}"
    );
    // Flags that do not apply say so once.
    assert_eq!(err.matches("--swa-full does not apply").count(), 1, "{err}");
    assert_eq!(
        err.matches("--split-mode (-sm) does not apply").count(),
        1,
        "{err}"
    );
    // --log-disable silences the log (the notes and the error are not log lines).
    assert!(!err.contains(" WARN ") && !err.contains(" DEBUG "), "{err}");
}

#[test]
fn copied_llama_server_command_lines_run() {
    // Flags of the walk-through that died with exit 2, llama.cpp's multi-letter short flags
    // among them: each is accepted, those that do not apply with one note each, and the
    // command stops at the (missing) model file with exit 1.
    let line = "serve -m /nonexistent/m.gguf --port 0 -ts 3,1 --numa distribute -to 600 \
                -cram 0 -md d.gguf -ngl 99 -fa --jinja -np -1 --lora a.gguf";
    let out = hmoe_within(
        &line.split_whitespace().collect::<Vec<_>>(),
        Duration::from_secs(20),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let notes: Vec<&str> = err.lines().filter(|l| l.starts_with("note: ")).collect();
    let noted = [
        "--tensor-split (-ts)",
        "--numa",
        "--cache-ram (-cram)",
        "--spec-draft-model (-md)",
        "--lora",
    ];
    assert_eq!(notes.len(), noted.len(), "{err}");
    for (note, flag) in notes.iter().zip(noted) {
        assert!(
            note.starts_with(&format!("note: {flag} does not apply")),
            "{flag}: {err}"
        );
    }
    // From the environment, as Docker users configure llama-server.
    let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(["serve", "--port", "0"])
        .env("LLAMA_ARG_MODEL", "/nonexistent/env.gguf")
        .env("LLAMA_ARG_NUMA", "distribute")
        .env_remove("LLAMA_API_KEY")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/env.gguf"), "{err}");
    assert!(
        err.contains("note: --numa (from LLAMA_ARG_NUMA) does not apply"),
        "{err}"
    );
}

#[test]
fn help_documents_the_bounds() {
    let out = hmoe_within(&["serve", "--help"], Duration::from_secs(20));
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--max-connections",
        "--header-timeout",
        "--timeout",
        "--max-queue",
        "at most 512",
        "64 MiB",
        "--parse-budget",
        "SIGTERM",
        "32768 rules",
        "20000 terminals",
    ] {
        assert!(help.contains(needle), "`hmoe serve --help` lacks {needle}");
    }
}
