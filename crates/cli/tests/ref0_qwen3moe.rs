//! Qwen3-MoE (`qwen3moe`) on the reference device from the command line:
//! the teacher-forced top-10 probabilities of `hmoe run -dev REF0` are the CPU's
//! (`-dev none`) bit for bit with `-ngl all`, `-ngl all --cpu-moe`, `--n-cpu-moe 1` and an
//! `-ot` rule for one layer, on the qwen3moe fixture (F32, heads of 16) with f16, f32 and bf16
//! K/V, and on a `make-test-model --arch qwen3moe` file (Q8_0, heads of 32) with f16 and q8_0
//! K/V, and on such files with K-quant experts (Q4_K, Q4_K with Q6_K or Q8_0 down); the
//! transfer counts in `--json` show one round trip per CPU-expert layer per micro-batch and
//! none with everything on REF0.

mod common;

use common::{assert_ref0_is_the_cpu_device, fixture, make_test_model, Fixture, Placement};

/// The placements and the layers whose experts each keeps on the CPU.
const PLACEMENTS: [Placement<'static>; 4] = [
    (&["-ngl", "all"], 0),
    (&["-ngl", "all", "--cpu-moe"], 2),
    (&["-ngl", "all", "--n-cpu-moe", "1"], 1),
    (
        &["-ngl", "all", "-ot", r"blk\.1\.ffn_(gate|up|down)_exps=CPU"],
        1,
    ),
];

/// `f` on REF0 with every placement and each of `kvs` (extra K/V flags) against the CPU with
/// the same K/V flags.
fn check(f: &Fixture, kvs: &[&[&str]]) {
    assert_eq!(f.n_layer, 2);
    for &kv in kvs {
        assert_ref0_is_the_cpu_device(f, "qwen3moe", kv, &PLACEMENTS);
    }
}

#[test]
fn ref0_qwen3moe_fixture_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
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

/// A `make-test-model --arch qwen3moe` file of 2 layers with the `shape` flags (width,
/// experts, types) and a vocabulary of 300, with the prompt `prompt` and 6 teacher-forced
/// steps.
fn stand_in(tag: &str, shape: &[&str], prompt: &str) -> (std::path::PathBuf, Fixture) {
    let args = [
        &["--arch", "qwen3moe", "--layers", "2", "--vocab", "300"][..],
        shape,
    ]
    .concat();
    let (dir, model) = make_test_model(tag, &args);
    let f = Fixture {
        model,
        prompt: prompt.into(),
        teacher: "11,12,13,14,15,16".into(),
        ubatches: 6,
        n_layer: 2,
    };
    (dir, f)
}

#[test]
fn ref0_qwen3moe_stand_in_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    let shape = [
        "--embd",
        "128",
        "--experts",
        "8",
        "--experts-used",
        "2",
        "--ff",
        "64",
    ];
    let (dir, f) = stand_in("ref0-qwen3moe", &shape, "1,17,250,3,99,42,7,200,5");
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

/// K-quant experts: Q4_K gate/up with Q6_K down (as in Q4_K_M files), all Q4_K,
/// and Q4_K gate/up with Q8_0 down (the CPU's kernels beside REF0's own products).
/// 4 experts, 2 used, over a prompt of 24 tokens route 8 or more rows to some expert, where
/// the CPU's expert matmul takes the tiled K-quant order; the decode steps route one.
#[test]
fn ref0_qwen3moe_k_quant_experts_top10_probabilities_are_the_cpu_devices_bit_for_bit() {
    let prompt: Vec<String> = (0..24).map(|i| ((i * 37 + 1) % 300).to_string()).collect();
    let dims = [
        "--embd",
        "512",
        "--experts",
        "4",
        "--experts-used",
        "2",
        "--ff",
        "512",
    ];
    for (tag, types) in [
        (
            "q4k-q6k",
            &["--expert-type", "q4_k", "--down-expert-type", "q6_k"][..],
        ),
        ("q4k", &["--expert-type", "q4_k"][..]),
        (
            "q4k-q8",
            &["--expert-type", "q4_k", "--down-expert-type", "q8_0"][..],
        ),
    ] {
        let shape = [&dims[..], types].concat();
        let (dir, f) = stand_in(&format!("ref0-qwen3moe-{tag}"), &shape, &prompt.join(","));
        check(&f, &[&[], &["-ctk", "q8_0", "-ctv", "q8_0"]]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
