//! Command lines that must fail fast with one clear error naming the flag (and never listen,
//! spawn thousands of threads or panic), and llama-server flags that must be accepted.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

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

fn tiny() -> String {
    fixtures()
        .join("gpt-oss/gptoss-tiny.gguf")
        .display()
        .to_string()
}

/// Runs `hmoe ARGS` with a deadline: a command that would listen (serve) is killed after
/// `limit`, and that counts as a failure of the test.
fn hmoe(args: &[&str], limit: Duration) -> Output {
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
    let out = hmoe(args, Duration::from_secs(20));
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
        let out = hmoe(&args, Duration::from_secs(20));
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
        (&["-np", "-1"], "--parallel"),
        (&["-c", "-1"], "--ctx-size"),
        (&["--port", "-1"], "--port"),
        (&["--device", "CUDA7"], "--device"),
        (&["--api-key", ""], "--api-key"),
        (&["--reasoning-budget", "100"], "--reasoning-budget"),
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
    let out = hmoe(&["serve", "-m", &m, "-c", "-1"], Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("unexpected argument"), "{err}");
    assert!(err.contains("-1 is not in"), "{err}");
}

#[test]
fn an_api_key_file_without_keys_is_an_error() {
    let dir = std::env::temp_dir().join(format!("hmoe-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("keys.txt");
    std::fs::write(&f, "\n   \n\n").unwrap();
    let fs = f.display().to_string();
    fails_naming(
        &["serve", "-m", &tiny(), "--port", "0", "--api-key-file", &fs],
        "holds no key",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_model_paths_fail_once_before_listening() {
    let dir = std::env::temp_dir().join(format!("hmoe-badm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("readme.txt");
    std::fs::write(&text, "hello\n").unwrap();
    for path in [
        "/nonexistent/model.gguf".to_string(),
        "/dev/zero".to_string(),
        dir.display().to_string(),
        text.display().to_string(),
    ] {
        let out = hmoe(
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
    ];
    let out = hmoe(&args, Duration::from_secs(20));
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
        err.matches("--split-mode does not apply").count(),
        1,
        "{err}"
    );
    // --log-disable silences the log (the notes and the error are not log lines).
    assert!(!err.contains(" WARN ") && !err.contains(" DEBUG "), "{err}");
}

#[test]
fn help_documents_the_bounds() {
    let out = hmoe(&["serve", "--help"], Duration::from_secs(20));
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--max-connections",
        "--header-timeout",
        "--timeout",
        "--max-queue",
        "at most 512",
        "64 MiB",
    ] {
        assert!(help.contains(needle), "`hmoe serve --help` lacks {needle}");
    }
}
