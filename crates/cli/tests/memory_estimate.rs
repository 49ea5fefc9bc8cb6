//! The placement crate's CPU estimate (weights + KV cache + compute) against the measured
//! peak resident-memory growth of `hmoe run --memory-report`, on models of three sizes: within
//! 5% + 1 MiB.
//!
//! Conditions that make the comparison meaningful and stable:
//! * one thread (`-t 1`): every thread the pool starts adds a stack and an allocator arena;
//! * a prompt of every 4th or 8th token id, so that every page of the embedding table is read
//!   (a run maps only the rows of the tokens it sees; with the rows spaced less than a page
//!   apart, every page is touched and the page cache's fault-around cannot add or hide any),
//!   and long enough that every expert of every layer is routed to at least once, so the
//!   whole file is resident as the estimate assumes;
//! * `--ignore-eos`, so the run processes exactly the tokens it was asked for.
//!
//! The measured growth includes fixed costs that are not the model's: 2.3 to 3.3 MiB (by
//! build) of the program's own code pages faulted in as the engine runs for the first time,
//! and a few hundred KiB of parsed metadata and tokenizer. The report separates the code pages
//! (file-backed pages of the executable and shared libraries); every model is compared with
//! the growth less those pages, and the generated 130 MB model with the raw peak growth as
//! well (at 58 MB the code pages alone are 4 to 5% of it).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use hmoe_testdata::fixtures;

fn hmoe(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(args)
        .output()
        .expect("hmoe runs");
    assert!(
        out.status.success(),
        "hmoe {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `model` with `--memory-report --json` and returns the `memory` object.
fn report(model: &Path, vocab: u32, step: usize) -> Value {
    let prompt: Vec<String> = (0..vocab).step_by(step).map(|i| i.to_string()).collect();
    let out = hmoe(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &prompt.join(","),
        "-n",
        "64",
        "-c",
        "4096",
        "-t",
        "1",
        "--temp",
        "0",
        "--ignore-eos",
        "--memory-report",
        "--json",
    ]);
    let v: Value = serde_json::from_str(out.trim()).expect("one JSON object");
    v["memory"].clone()
}

fn mib(v: &Value) -> f64 {
    v.as_u64().expect("a byte count") as f64 / (1 << 20) as f64
}

/// Checks the estimate is within 5% + 1 MiB of the model's growth (and of the raw peak growth
/// when `raw` is set), printing every figure. The 1 MiB is what the estimate does not model and
/// is the same at every size: allocator slack, thread-local kernel scratch, page-granular
/// faults; repeated runs of one binary on the 9 MB fixture spread over 0.3 MiB, and changes
/// to kernels that leave the estimate's buffers alone moved its growth by 0.4 MiB (-4.9% to
/// -7.2% of it, 2026-12-07), so 5% alone made the smallest model's check a coin toss.
fn check(name: &str, m: &Value, raw: bool) {
    let est = &m["estimate"];
    let total = mib(&est["total"]);
    let growth = mib(&m["peak_growth"]);
    let model = mib(&m["model_growth"]);
    let err = |measured: f64| (total - measured) / measured * 100.0;
    println!(
        "{name}: peak growth {growth:.2} MiB (program pages {:.2}, model {model:.2}); \
         estimate {total:.2} MiB = weights {:.2} + kv {:.2} + compute {:.2}; \
         error {:+.2}% of the model's growth, {:+.2}% of the peak growth",
        mib(&m["program_growth"]),
        mib(&est["weights"]),
        mib(&est["kv"]),
        mib(&est["compute"]),
        err(model),
        err(growth),
    );
    let part = |k: &str| est[k].as_u64().expect("a byte count");
    assert_eq!(
        part("weights") + part("kv") + part("compute"),
        part("total")
    );
    let within = |measured: f64| (total - measured).abs() <= 0.05 * measured + 1.0;
    assert!(within(model), "{name}: {m}");
    if raw {
        assert!(within(growth), "{name}: {m}");
    }
}

#[test]
fn cpu_estimate_matches_peak_rss_growth() {
    if !Path::new("/proc/self/smaps").exists() {
        eprintln!("skipped: needs Linux /proc");
        return;
    }
    // 9 MB shared fixture: 1024 tokens, 272-byte embedding rows, every 8th read.
    let small = fixtures().join("gpt-oss/gptoss-small.gguf");
    check("gptoss-small (9 MB)", &report(&small, 1024, 8), false);

    // Generated models: 512 tokens, embedding rows of 544 and 816 bytes, every 4th read.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memory-estimate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, embd, heads, kv_heads) in [("58 MB", "512", "8", "2"), ("130 MB", "768", "12", "4")]
    {
        let path = dir.join(format!("gpt-oss-{embd}.gguf"));
        hmoe(&[
            "make-test-model",
            "--embd",
            embd,
            "--ff",
            embd,
            "--experts",
            "32",
            "--experts-used",
            "4",
            "--layers",
            "4",
            "--heads",
            heads,
            "--kv-heads",
            kv_heads,
            "--head-dim",
            "64",
            "-o",
            path.to_str().unwrap(),
        ]);
        let m = report(&path, 512, 4);
        let _ = std::fs::remove_file(&path);
        // The raw peak also holds the program's code pages, which the estimate leaves out.
        check(&format!("generated gpt-oss ({name})"), &m, name == "130 MB");
    }
    let _ = std::fs::remove_dir(&dir);
}
