//! `scripts/iq_llama_compare.py --types iq2_xxs,iq4_nl --archs qwen3moe,deepseek2`: Qwen3-MoE
//! and DeepSeek2 stand-ins with IQ2_XXS and IQ4_NL experts (DeepSeek2's shared experts are dense
//! IQ4_NL matrices, which llama.cpp multiplies with its repacked kernels) made by
//! `hmoe make-test-model`, greedy on the CPU, against llama.cpp's CPU llama-server
//! (teacher-forced on hmoe's tokens: every token equal, the first step's top-10 probabilities
//! within 1e-4). Needs llama-server (`$HMOE_LLAMA_SERVER`, else the unpacked baseline
//! `../llama-cpu-unpacked/llama-cpu/bin/llama-server` beside the checkout) and Python 3
//! (`$HMOE_PYTHON` or `python3`); without them `SKIPPED:`.

#[allow(dead_code)]
#[path = "../../server/tests/common/python.rs"]
mod python;

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn iq2_xxs_and_iq4_nl_experts_generate_llama_cpps_tokens() {
    let server = std::env::var_os("HMOE_LLAMA_SERVER").map_or_else(
        || root().join("../llama-cpu-unpacked/llama-cpu/bin/llama-server"),
        PathBuf::from,
    );
    if !server.is_file() {
        eprintln!(
            "SKIPPED: no llama-server at {} (set HMOE_LLAMA_SERVER)",
            server.display()
        );
        return;
    }
    let Some(py) = python::python_with(&["json", "urllib.request"]) else {
        return;
    };
    let out = Command::new(&py)
        .arg(root().join("scripts/iq_llama_compare.py"))
        .args(["--hmoe", env!("CARGO_BIN_EXE_hmoe")])
        .arg("--llama-server")
        .arg(&server)
        .args(["--types", "iq2_xxs,iq4_nl", "--archs", "qwen3moe,deepseek2"])
        .args(["--port", "18391", "-n", "8"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("qwen3moe iq2_xxs: "), "{stdout}");
    assert!(stdout.contains("deepseek2 iq2_xxs: "), "{stdout}");
    assert!(stdout.contains("qwen3moe iq4_nl: "), "{stdout}");
    assert!(stdout.contains("deepseek2 iq4_nl: "), "{stdout}");
}
