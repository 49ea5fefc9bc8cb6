//! Quantized and f32 K/V caches on the reference device `REF0` from the command line: with
//! `-dev REF0` the executor keeps each layer's K/V rings on the device in the `-ctk`/`-ctv`
//! types (no fallback to the CPU), and the teacher-forced top-10 probabilities of `hmoe run`
//! are the CPU's (`-dev none`) bit for bit on every gpt-oss fixture for `-ctk q8_0 -ctv q8_0
//! -fa on`, `-ctk f32 -ctv f32` and `-ctk q4_0 -ctv q4_0`, with `-ngl all`, `--n-cpu-moe 1`
//! and `--cpu-moe` (one round trip per CPU-expert layer per micro-batch);
//! mixed types (block keys with f16 values, f16 keys with q4_0 values) too. A fixture whose
//! heads are not whole blocks of the type (gptoss-tiny's 16) is refused by both engines.

mod common;
use common::{fixture, run, FIXTURES};

use std::process::Command;

/// `hmoe run` with `extra` flags over the fixture's prompt: success and stderr.
fn try_run(model: &str, extra: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hmoe"))
        .args(["run", "-m", model, "--prompt-tokens", "1,2,3", "-n", "1"])
        .args(["-c", "256", "-t", "2"])
        .args(extra)
        .output()
        .expect("hmoe runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the matrix of `kvs` on `fixtures`: REF0 equals the CPU for both placements, or, where
/// the CPU refuses the type (heads not whole blocks), REF0 refuses it too.
fn check(fixtures: &[(&str, &str)], kvs: &[[&str; 6]]) {
    for &(stem, file) in fixtures {
        let f = fixture("gpt-oss", stem, file);
        for kv in kvs {
            let what = format!("{stem} {kv:?}");
            let (cpu_ok, cpu_err) = try_run(&f.model, &[&["-dev", "none"][..], kv].concat());
            if !cpu_ok {
                assert!(
                    cpu_err.contains("whole number of blocks"),
                    "{what}: {cpu_err}"
                );
                let (ok, err) = try_run(
                    &f.model,
                    &[&["-dev", "REF0", "-ngl", "all"][..], kv].concat(),
                );
                assert!(
                    !ok && err.contains("whole number of blocks"),
                    "{what}: {err}"
                );
                continue;
            }
            let (cpu, _) = run(&f, &[&["-dev", "none"][..], kv].concat());
            assert_eq!(cpu["engine"], "CPU", "{what}");
            for (flags, host_layers) in [
                (&["-ngl", "all"][..], 0),
                (&["-ngl", "all", "--n-cpu-moe", "1"][..], 1),
                (&["-ngl", "all", "--cpu-moe"][..], f.n_layer),
            ] {
                let extra = [&["-dev", "REF0"][..], flags, kv].concat();
                let (got, err) = run(&f, &extra);
                let what = format!("{stem} {extra:?}");
                assert_eq!(got["engine"], "REF0", "{what}: {err}");
                assert_eq!(got["top_probs"], cpu["top_probs"], "{what}");
                assert_eq!(got["generated_tokens"], cpu["generated_tokens"], "{what}");
                let s = &got["device_stats"];
                assert_eq!(s["ubatches"], f.ubatches, "{what}: {s}");
                assert_eq!(
                    s["host_round_trips"],
                    host_layers * f.ubatches,
                    "{what}: {s}"
                );
            }
        }
    }
}

#[test]
fn ref0_q8_0_f32_and_q4_0_kv_top10_are_the_cpu_devices_bit_for_bit() {
    check(
        &FIXTURES,
        &[
            ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
            ["-ctk", "f32", "-ctv", "f32", "-fa", "off"],
            ["-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on"],
        ],
    );
}

#[test]
fn ref0_mixed_kv_types_are_the_cpu_devices_bit_for_bit() {
    check(
        &FIXTURES[2..3],
        &[
            ["-ctk", "q8_0", "-ctv", "f16", "-fa", "off"],
            ["-ctk", "f16", "-ctv", "q4_0", "-fa", "on"],
        ],
    );
}
