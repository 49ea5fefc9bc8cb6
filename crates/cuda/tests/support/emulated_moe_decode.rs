//! The MoE block of a few tokens with Q8_0 or MXFP4 experts (kernels/moe_dp4a.cu: two
//! launches, x quantized inside the gate/up kernel, h handed over as Q8_0 blocks, the down
//! kernel summing each token's weighted slots) in the emulator of tests/emulated.rs, against
//! REF0.

use hmoe_backend::{GatedAct, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::common::KERNEL_ACT;
use super::emulator::Emulator;
use super::{moe_case, Arch, MoeShape};

/// `n × k` random ids of `ne` experts; with 2 slots or more the last slot repeats the first's
/// expert (several slots of one expert, within a token when n = 1), and with 3 or more slot 1
/// is out of range (`ne + 1` or -1).
fn decode_sel(rng: &mut StdRng, ne: usize, n: usize, k: usize) -> Vec<i32> {
    let mut sel: Vec<i32> = (0..n * k).map(|_| rng.random_range(0..ne as i32)).collect();
    if n * k >= 2 {
        sel[n * k - 1] = sel[0];
    }
    if n * k >= 3 {
        sel[1] = if rng.random_bool(0.5) {
            ne as i32 + 1
        } else {
            -1
        };
    }
    sel
}

/// The two-launch MoE block (below the tiled kernels' 64 slots) for Q8_0 and MXFP4 experts:
/// gpt-oss's width (2,880 columns, one staging round of x) with its clamped SwiGLU and biases,
/// SiLU experts without biases (Qwen3-MoE) for k = 1 … 5 and 8 slots (the down kernel's warps
/// take a token's slots in rounds of four) over 1 … 8 tokens, and rows wider than one staging
/// round (8,256 columns: 256 blocks, then 2); expert ids out of range and experts routed by
/// several slots. REF0's bits.
#[test]
#[ignore = "slow (minutes): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_two_launch_moe_gives_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("moe_dp4a") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(43);
    let (gpt, silu) = ((KERNEL_ACT, true), (GatedAct::Silu, false));
    let ne = 8;
    let mut cases = 0;
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        for (d, ff, n, k, act) in [
            (2880, 64, 1, 4, gpt),
            (2880, 96, 2, 4, gpt),
            (256, 64, 8, 4, gpt),
            (256, 96, 1, 1, silu),
            (256, 96, 3, 2, silu),
            (256, 96, 8, 3, silu),
            (256, 64, 5, 5, silu),
            (256, 64, 4, 8, silu),
            (8256, 32, 1, 3, silu),
            (8256, 32, 2, 2, gpt),
        ] {
            let sel = decode_sel(&mut rng, ne, n, k);
            let shape = MoeShape { ne, d, ff, n, k };
            moe_case(
                &emu,
                &cpu,
                &mut rng,
                ([ty; 3], Arch::Older),
                shape,
                &sel,
                act,
            );
            cases += 1;
        }
    }
    assert_eq!(cases, 20);
}
