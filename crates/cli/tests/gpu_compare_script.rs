//! `scripts/gpu_compare.py --device REF0`: the GPU check's fixture comparison, run on the
//! reference device so that CI exercises the script itself (its CPU reference, the start-up
//! line it looks for, every architecture's fixtures). REF0 equals the CPU bit for bit, so
//! every placement must show 0 against the CPU. On the first H200 run the script compared
//! against the CPU's default flash kernel, which the GPU does not follow: this catches that
//! kind of slip before a GPU lease is spent on it. Needs Python 3 (`$HMOE_PYTHON` or
//! `python3`); without it `SKIPPED:`.

#[allow(dead_code)]
#[path = "../../server/tests/common/python.rs"]
mod python;

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

use hmoe_testdata::fixtures;

#[test]
fn ref0_dry_run_equals_the_cpu_on_every_architecture() {
    let Some(py) = python::python_with(&["json"]) else {
        return;
    };
    let mut cmd = Command::new(&py);
    cmd.arg(root().join("scripts/gpu_compare.py"))
        .args(["--hmoe", env!("CARGO_BIN_EXE_hmoe")])
        .args([
            "--device",
            "REF0",
            "--only",
            "tiny$",
            "--jobs",
            "2",
            "--threads",
            "1",
        ]);
    for arch in ["gpt-oss", "qwen3moe", "deepseek2"] {
        cmd.arg("--fixtures").arg(fixtures().join(arch));
    }
    let out = cmd.output().expect("python runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpu_compare.py --device REF0 failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("gpu_compare: PASS"), "{text}");
    for fixture in ["gptoss-tiny", "qwen3moe-tiny", "deepseek2-tiny"] {
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with(&format!("{fixture} ")) && l.contains(" REF0 "))
            .collect();
        // Four placements, each equal to the CPU's probabilities.
        assert_eq!(rows.len(), 4, "{fixture}:\n{text}");
        for row in rows {
            let vs_cpu = row.split_whitespace().rev().nth(4).unwrap();
            assert_eq!(vs_cpu, "0.000e+00", "{row}");
        }
    }
}
