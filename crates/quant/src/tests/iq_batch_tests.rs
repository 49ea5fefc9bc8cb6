//! The AVX-512 VNNI batches of the IQ types (`x86::avx2::iquants::tokens_vnni`), with and
//! without the VBMI decoding of IQ2_XXS, against the scalar dot per token: extreme weight
//! scales, activations of -128 (which the sign trick leaves negative), 127 and 0, 1 to 20
//! tokens; and activations without -128, as Q8_K quantization makes them, which take the
//! kernel's biased-activation path. (`tests/iq_dot.rs` checks the batches through `DotKernel`, which takes only the
//! best path of the machine.)

use crate::tests::{same, Rng};
use crate::*;

/// A Q8_K activation row of `n` elements: random codes (or all `fill`; -127 for a random -128
/// where `no_min`), the scale `d`, and the block sums of its codes.
fn q8_k_row(n: usize, fill: Option<i8>, d: f32, no_min: bool, rng: &mut Rng) -> Vec<u8> {
    let bb = GgmlType::Q8_K.block_bytes();
    let mut a = vec![0u8; n / 256 * bb];
    for b in a.chunks_exact_mut(bb) {
        b[..4].copy_from_slice(&d.to_le_bytes());
        for q in &mut b[4..260] {
            let v = fill.unwrap_or(rng.byte() as i8);
            *q = if no_min { v.max(-127) } else { v } as u8;
        }
        for k in 0..16 {
            let sum: i16 = b[4 + 16 * k..20 + 16 * k]
                .iter()
                .map(|&q| q as i8 as i16)
                .sum();
            b[260 + 2 * k..262 + 2 * k].copy_from_slice(&sum.to_le_bytes());
        }
    }
    a
}

#[test]
fn iq_vnni_batches_equal_the_scalar_dot_with_and_without_vbmi() {
    if !crate::x86::features::has_avx512_vnni() {
        eprintln!("no AVX-512 VNNI: nothing to check");
        return;
    }
    let vbmi = [false, true]
        .into_iter()
        .filter(|&v| !v || crate::x86::features::has_avx512_vbmi());
    let vbmi: Vec<bool> = vbmi.collect();
    let mut rng = Rng(0x1b2a_3c4d_5e6f_7081);
    // The largest finite f16 of both signs, the smallest subnormal, one, a negative normal.
    let scales: [u16; 5] = [0x7bff, 0xfbff, 0x0001, 0x3c00, 0x8400];
    let act_scales = [1e-30, 3.0e4, -1.0, 7.5e-3, 1.0];
    let fills = [None, Some(-128), Some(127), Some(0), None, Some(-128)];
    let types = IQ_TYPES.into_iter().filter(|&t| t != GgmlType::IQ4_NL);
    for (ty, no_min) in types.flat_map(|t| [(t, false), (t, true)]) {
        let reference = DotKernel::new(ty, Isa::Scalar).unwrap();
        for n_tokens in 1..=20 {
            let n = [256, 512, 768][n_tokens % 3];
            let rows = 3;
            let rb = ty.row_bytes(n as u64).unwrap() as usize;
            let mut w: Vec<u8> = (0..rows * rb).map(|_| rng.byte()).collect();
            for (i, b) in w.chunks_exact_mut(ty.block_bytes()).enumerate() {
                // Extreme scales in every other block, random normal ones in between.
                let d = if i % 2 == 0 {
                    scales[(i / 2 + n_tokens) % scales.len()]
                } else {
                    crate::tests::rand_f16(&mut rng, 1, 17)
                };
                assert!(set_iq_block_scale(ty, b, d));
            }
            let ab = GgmlType::Q8_K.row_bytes(n as u64).unwrap() as usize;
            let acts: Vec<u8> = (0..n_tokens)
                .flat_map(|t| {
                    let d = act_scales[(t + n_tokens) % act_scales.len()];
                    q8_k_row(n, fills[t % fills.len()], d, no_min, &mut rng)
                })
                .collect();
            let want: Vec<f32> = (0..rows * n_tokens)
                .map(|i| {
                    let (r, t) = (i / n_tokens, i % n_tokens);
                    let a = &acts[t * ab..(t + 1) * ab];
                    reference.dot(n, &w[r * rb..(r + 1) * rb], a)
                })
                .collect();
            for &v in &vbmi {
                let mut out = vec![f32::NAN; rows * n_tokens];
                // SAFETY: VNNI (and VBMI where asked) were checked above; `w` holds `rows` rows
                // and `acts` `n_tokens` rows of `n` elements.
                let done = unsafe {
                    crate::x86::avx2::iquants::tokens_vnni::tokens_rows(
                        ty, n, &w, &acts, n_tokens, &mut out, v,
                    )
                };
                assert!(done, "{ty}");
                for (i, (&o, &e)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        same(o, e),
                        "{ty} n={n} {n_tokens} tokens, vbmi {v}, no -128 {no_min}: output {i} is \
                         {o:e}, want {e:e}"
                    );
                }
            }
        }
    }
}
