//! Qwen3-MoE (`qwen3moe`) on the reference device from the command line (issues #15 and #16):
//! the teacher-forced top-10 probabilities of `hmoe run -dev REF0` are the CPU engine's
//! (`-dev none`) bit for bit with `-ngl all`, `-ngl all --cpu-moe`, `--n-cpu-moe 1` and an
//! `-ot` rule for one layer, on the qwen3moe fixture (F32, heads of 16) with f16, f32 and bf16
//! K/V, and on a `make-test-model --arch qwen3moe` file (Q8_0, heads of 32) with f16 and q8_0
//! K/V; the transfer counts in `--json` show one round trip per CPU-expert layer per
//! micro-batch and none with everything on REF0.

mod common;

use common::{fixture, hmoe, run, Fixture};

/// The placements and the layers whose experts each keeps on the CPU.
fn placements() -> [(Vec<&'static str>, u64); 4] {
    [
        (vec!["-ngl", "all"], 0),
        (vec!["-ngl", "all", "--cpu-moe"], 2),
        (vec!["-ngl", "all", "--n-cpu-moe", "1"], 1),
        (
            vec!["-ngl", "all", "-ot", r"blk\.1\.ffn_(gate|up|down)_exps=CPU"],
            1,
        ),
    ]
}

/// `f` on REF0 with every placement and each of `kvs` (extra K/V flags) against the CPU engine
/// with the same K/V flags.
fn check(f: &Fixture, kvs: &[&[&str]]) {
    assert_eq!(f.n_layer, 2);
    for &kv in kvs {
        let cpu_flags = [&["-dev", "none"][..], kv].concat();
        let (cpu, _) = run(f, &cpu_flags);
        assert_eq!(cpu["engine"], "CPU");
        let steps = cpu["top_probs"].as_array().unwrap().len() as u64;
        assert_eq!(steps, f.ubatches);
        for (flags, host) in placements() {
            let extra = [&["-dev", "REF0"][..], &flags, kv].concat();
            let (got, err) = run(f, &extra);
            let what = format!("{} {extra:?}", f.model);
            assert_eq!(got["engine"], "REF0", "{what}: {err}");
            assert!(err.contains("qwen3moe on REF0"), "{what}: {err}");
            assert_eq!(got["top_probs"], cpu["top_probs"], "{what}");
            assert_eq!(got["generated_tokens"], cpu["generated_tokens"], "{what}");
            let s = &got["device_stats"];
            assert_eq!(s["ubatches"], f.ubatches, "{what}: {s}");
            assert_eq!(s["host_round_trips"], host * f.ubatches, "{what}: {s}");
            assert_eq!(s["offloaded_layers"], 0, "{what}: prompts below 32 tokens");
            // Device → host: the logits of each micro-batch and one staged copy per round
            // trip; nothing else leaves the device.
            let t = &s["transfers"];
            assert_eq!(
                t["downloads"].as_u64(),
                Some(f.ubatches + host * f.ubatches),
                "{what}: {s}"
            );
        }
    }
}

#[test]
fn ref0_qwen3moe_fixture_top10_probabilities_are_the_cpu_engines_bit_for_bit() {
    let f = fixture("qwen3moe", "qwen3moe-tiny", "qwen3moe-tiny.gguf");
    check(
        &f,
        &[
            &[],
            &["-ctk", "f32", "-ctv", "f32"],
            &["-ctk", "bf16", "-ctv", "bf16"],
        ],
    );
}

#[test]
fn ref0_qwen3moe_stand_in_top10_probabilities_are_the_cpu_engines_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("hmoe-ref0-qwen3moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("qwen3moe.gguf");
    let path = model.to_str().unwrap();
    let out = hmoe(&[
        "make-test-model",
        "--arch",
        "qwen3moe",
        "--layers",
        "2",
        "--embd",
        "128",
        "--experts",
        "8",
        "--experts-used",
        "2",
        "--ff",
        "64",
        "--vocab",
        "300",
        "-o",
        path,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f = Fixture {
        model: path.to_string(),
        prompt: "1,17,250,3,99,42,7,200,5".into(),
        teacher: "11,12,13,14,15,16".into(),
        ubatches: 6,
        n_layer: 2,
    };
    check(
        &f,
        &[
            &[],
            &["-ctk", "q8_0", "-ctv", "q8_0"],
            &["-ctk", "f32", "-ctv", "q8_0"],
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}
