//! A prompt's result does not depend on how it is split into micro-batches where llama.cpp's
//! does not: llama.cpp runs its last layer's feed-forward block over the rows that give
//! outputs alone (`inp_out_ids`), so the prompt's last token goes through the F32 router of
//! the last layer as one row (`vec_dot`), whatever `-ub` is. hmoe used to multiply it there
//! together with the rest of its micro-batch (tinyBLAS's 16-lane order), and on the Qwen3-MoE
//! IQ1_M stand-in of seed 1 that last-bit change flipped a Q8_0 code of the output head's
//! input: the top probability after the prompt `77,88,99,111` was 0.2316811 with `-ub 2` or
//! `-ub 512` and 0.2306458 (llama-server's, with any `-ub`) with `-ub 1` or `-ub 3`.

mod common;

use common::{hmoe, make_test_model};
use serde_json::Value;

/// The generated tokens and top-10 probabilities of `hmoe run --json` on `model` with
/// `-ub ub` and the extra flags `extra`.
fn run(model: &str, ub: &str, extra: &[&str]) -> (Value, Value) {
    let args = [
        &[
            "run",
            "-m",
            model,
            "--prompt-tokens",
            "77,88,99,111",
            "-n",
            "3",
        ][..],
        &[
            "--temp",
            "0",
            "--json",
            "--top-k-probs",
            "10",
            "-t",
            "2",
            "-c",
            "512",
        ],
        &["-fa", "off", "-ctk", "f32", "-ctv", "f32", "-ub", ub],
        extra,
    ]
    .concat();
    let out = hmoe(&args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    (v["generated_tokens"].clone(), v["top_probs"].clone())
}

#[test]
fn iq1_m_stand_in_gives_the_same_bits_for_every_micro_batch_size() {
    let (dir, model) = make_test_model(
        "last-layer-rows",
        &[
            "--arch",
            "qwen3moe",
            "--embd",
            "256",
            "--ff",
            "256",
            "--expert-type",
            "iq1_m",
            "--seed",
            "1",
        ],
    );
    for dev in [&["-dev", "none"][..], &["-dev", "REF0"]] {
        let want = run(&model, "1", dev);
        let top = want.1[0][0][1].as_f64().unwrap();
        assert!(
            (top - 0.2306458).abs() < 1e-7,
            "{dev:?}: top probability {top}, llama-server's is 0.2306458 (7 digits)"
        );
        for ub in ["2", "3", "4", "512"] {
            assert_eq!(run(&model, ub, dev), want, "{dev:?} -ub {ub} against -ub 1");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
