//! The int8 tensor-core kernels (kernels/mma.cu, kernels/mma_kquants.cu: an sm_80+ device's)
//! in the emulator of tests/emulated.rs, against REF0: Q8_0 and MXFP4 products, the K-quants'
//! (tiled and repacked orders, dense and experts), with expert sets whose experts get 0 … N
//! routed slots (the tile list of `moe_tiles`).

use hmoe_backend::{GatedAct, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::KERNEL_ACT;
use super::emulator::Emulator;
use super::{matmul_case, moe_case, Arch, MoeShape};

/// `n × k` expert ids of `ne` experts, shuffled: expert e gets the e-th of `counts` (while
/// slots last), the rest go to expert `ne - 1` or nowhere (-1).
fn routed(rng: &mut StdRng, counts: &[usize], ne: usize, n: usize, k: usize) -> Vec<i32> {
    use rand::seq::SliceRandom;
    let mut sel: Vec<i32> = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e as i32, c))
        .chain((0..).map(|j| [ne as i32 - 1, -1][j % 2]))
        .take(n * k)
        .collect();
    sel.shuffle(rng);
    sel
}

/// The int8 tensor-core products (kernels/mma.cu, an sm_80+ device's) alone, for batches of
/// 1 … 600 tokens: dense Q8_0 and MXFP4 matmuls (a partial row tile, a partial chunk of
/// blocks, tokens of very different magnitudes), and MoE blocks whose experts get 0, 1, 7, 8,
/// 9, 33, … routed slots (out-of-range ids too), all with weights of extreme scales; REF0's bits.
#[test]
#[ignore = "slow (minutes): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_tensor_core_products_give_the_reference_backends_bits() {
    let Some(emu) = Emulator::build("mma") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(45);
    let acts = [(KERNEL_ACT, true), (GatedAct::Silu, false)];
    let (mut overflowed, mut subnormal) = (0, 0);
    for (i, n) in [1usize, 7, 16, 33, 130, 600].into_iter().enumerate() {
        for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
            let y = matmul_case(&emu, &cpu, &mut rng, (ty, Arch::Sm80), (70, 160), n);
            overflowed += y.iter().filter(|v| !v.is_finite()).count();
            // Products of E8M0 scales 2^-129 … 2^-127 with small tokens (f16 scales cannot
            // get there).
            if ty == GgmlType::MXFP4 {
                subnormal += y.iter().filter(|v| v.is_subnormal()).count();
            }
            let (ne, k) = (8, 2);
            let sel = routed(&mut rng, &[0, 1, 7, 8, 9, 33, 130], ne, n, k);
            let shape = MoeShape {
                ne,
                d: 64,
                ff: 96,
                n,
                k,
            };
            moe_case(
                &emu,
                &cpu,
                &mut rng,
                ([ty; 3], Arch::Sm80),
                shape,
                &sel,
                acts[i % 2],
            );
        }
    }
    eprintln!("dense outputs: {overflowed} overflowed, {subnormal} subnormal");
    assert!(
        overflowed > 0 && subnormal > 0,
        "the extreme scales were not reached"
    );
}

/// The K-quant tensor-core products (kernels/mma_kquants.cu) for every K-quant type: dense
/// matmuls of 1, 7 (decode sizes: the warp kernels), 8, 13, 33, 130 and 600 tokens on a matrix
/// the CPU device repacks (40 rows: Q4_K's pair and block orders, a group of four cut by the
/// end of the batch) and one it does not (37 rows: the tiled order), two super-blocks per row,
/// weights of extreme scales; and MoE blocks of each type alone and of the Q4_K_M mixes (Q4_K
/// gate/up with Q6_K down; Q5_0 with Q8_0 down, whose Q8_0 experts take the Q8_0 tensor-core
/// kernel), whose experts get 0, 1, 7, 8 (the tensor cores' threshold), 9, 33, … routed slots
/// (those under 8 on the warp kernels); REF0's bits.
#[test]
#[ignore = "slow (minutes): cargo test -p hmoe-cuda --test emulated -- --ignored"]
fn emulated_kquant_tensor_core_products_give_the_reference_backends_bits() {
    use GgmlType::*;
    let Some(emu) = Emulator::build("mma_kq") else {
        return;
    };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(46);
    let mut cases = 0;
    for ty in [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
        for shape in [(40, 512), (37, 512)] {
            for n in [1usize, 7, 8, 13, 33, 130, 600] {
                matmul_case(&emu, &cpu, &mut rng, (ty, Arch::Sm80), shape, n);
                cases += 1;
            }
        }
    }
    let sets = [
        [Q4_K, Q4_K, Q6_K],
        [Q5_0, Q5_0, Q8_0],
        [Q2_K; 3],
        [Q3_K; 3],
        [Q4_K; 3],
        [Q5_K; 3],
        [Q6_K; 3],
    ];
    let acts = [(KERNEL_ACT, true), (GatedAct::Silu, false)];
    for (i, types) in sets.into_iter().enumerate() {
        let tokens: &[usize] = if i == 0 {
            &[1, 7, 33, 130, 600]
        } else {
            &[7, 130]
        };
        for &n in tokens {
            let (ne, k) = (8, 2);
            let sel = routed(&mut rng, &[0, 1, 7, 8, 9, 33, 130], ne, n, k);
            let shape = MoeShape {
                ne,
                d: 256,
                ff: 256,
                n,
                k,
            };
            moe_case(
                &emu,
                &cpu,
                &mut rng,
                (types, Arch::Sm80),
                shape,
                &sel,
                acts[n % 2],
            );
            cases += 1;
        }
    }
    eprintln!("{cases} K-quant tensor-core cases");
}
