//! DeepSeek-V3 (`deepseek2`) on the reference device from the command line: the
//! teacher-forced top-10 probabilities of `hmoe run -dev REF0` are the CPU's
//! (`-dev none`) bit for bit on the deepseek2 fixture with `-ngl all`, `-ngl all --cpu-moe`
//! and `--n-cpu-moe 1`, and the transfer counts in `--json` show one round trip per
//! CPU-expert layer per micro-batch and none with everything on REF0. The fixture's first
//! layer is dense (no experts), so `--cpu-moe` keeps two layers' experts on the CPU and
//! `--n-cpu-moe 1` none (its first layer has no experts to keep). The same on a file with
//! Q4_K experts and Q6_K down matrices, and with the latent cache in q8_0, q4_0, f32, bf16
//! and q5_1.

mod common;

use common::{assert_ref0_is_the_cpu_device, fixture, make_test_model, Fixture, Placement};

/// The placements and the layers whose experts each keeps on the CPU.
const PLACEMENTS: [Placement<'static>; 3] = [
    (&["-ngl", "all"], 0),
    (&["-ngl", "all", "--cpu-moe"], 2),
    (&["-ngl", "all", "--n-cpu-moe", "2"], 1),
];

#[test]
fn ref0_deepseek2_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    let f = fixture("deepseek2", "deepseek2-tiny", "deepseek2-tiny.gguf");
    assert_eq!(f.n_layer, 3);
    assert_ref0_is_the_cpu_device(&f, "deepseek2", &[], &PLACEMENTS);
}

/// K-quant experts: a `make-test-model --arch deepseek2` file with Q4_K routed and
/// shared experts and Q6_K down matrices (as in Q4_K_M files), 4 experts of which 2 are used,
/// over a prompt of 24 tokens (some expert gets 8 rows or more: the CPU's tiled
/// K-quant order).
#[test]
fn ref0_deepseek2_k_quant_experts_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    let (dir, model) = make_test_model(
        "ref0-deepseek2-q4k",
        &[
            "--arch",
            "deepseek2",
            "--layers",
            "3",
            "--embd",
            "256",
            "--ff",
            "256",
            "--experts",
            "4",
            "--experts-used",
            "2",
            "--vocab",
            "300",
            "--expert-type",
            "q4_k",
            "--down-expert-type",
            "q6_k",
        ],
    );
    let prompt: Vec<String> = (0..24).map(|i| ((i * 37 + 1) % 300).to_string()).collect();
    let f = Fixture {
        model,
        prompt: prompt.join(","),
        teacher: "11,12,13,14,15,16".into(),
        ubatches: 6,
        n_layer: 3,
    };
    assert_ref0_is_the_cpu_device(&f, "deepseek2", &[], &PLACEMENTS);
    let _ = std::fs::remove_dir_all(&dir);
}

/// DeepSeek's latent (K-only) cache on REF0 in every `-ctk` type the CPU device keeps it in
/// (`-ctv` unused), bit for bit, on a `make-test-model --arch deepseek2 --rope-dim 64` file
/// (latent rows of 64 + 64 values: whole blocks of every type, and a multiple of 64 that the
/// CPU device's latent cache does not rotate).
#[test]
fn ref0_deepseek2_latent_cache_types_are_the_cpu_devices_bit_for_bit() {
    let (dir, model) = make_test_model(
        "ref0-deepseek2-latent",
        &[
            "--arch",
            "deepseek2",
            "--layers",
            "3",
            "--rope-dim",
            "64",
            "--vocab",
            "300",
        ],
    );
    let f = Fixture {
        model,
        prompt: "1,17,250,3,99,42,7,200,5".into(),
        teacher: "11,12,13,14,15,16".into(),
        ubatches: 6,
        n_layer: 3,
    };
    for kv in [
        &["-ctk", "q8_0"][..],
        &["-ctk", "q8_0", "-ctv", "q8_0"],
        &["-ctk", "q4_0", "-ctv", "q4_0"],
        &["-ctk", "f32", "-ctv", "f32"],
        &["-ctk", "bf16"],
        &["-ctk", "q5_1"],
    ] {
        assert_ref0_is_the_cpu_device(&f, "deepseek2", kv, &PLACEMENTS);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
