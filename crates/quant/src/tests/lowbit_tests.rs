//! Tests of the low-bit formats (Q4_0, Q4_1, Q5_0, Q5_1, K-quants, Q8_1, Q8_K): outputs recorded
//! from ggml itself, hand-computed blocks, every ISA against the scalar reference, and accuracy
//! against exact arithmetic.

use crate::scalar::shared::{f16_to_f32, f32_to_f16};
use crate::tests::{assert_rows_equal_dots, rand_f16, same, Rng};
use crate::*;
use GgmlType::*;

/// FNV-1a over bytes.
fn fnv(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// FNV-1a over f32 bits, every NaN as 0x7fc00000.
fn fnv_f32(x: &[f32]) -> u64 {
    fnv(x.iter().flat_map(|v| {
        let b = if v.is_nan() { 0x7fc0_0000 } else { v.to_bits() };
        b.to_le_bytes()
    }))
}

/// Byte offsets of the f16 scale fields of a weight block.
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// ggml's outputs for the deterministic inputs of [`golden_case`]: `(type, case, dot bits,
/// FNV of the activation bytes, FNV of the dequantised weights, FNV of the activation values
/// quantised to the weight type by ggml's reference quantiser)`. Recorded from llama.cpp
/// build 10587 (commit 3f545bec, the fixtures' build; x86-64 with AVX2/FMA/F16C/AVX-512/VNNI)
/// by a small C program calling `ggml_get_type_traits_cpu(t)->vec_dot`, the `from_float` of
/// its `vec_dot_type`, `ggml_get_type_traits(t)->to_float` and `->from_float_ref` on the same
/// inputs (`tools/record_ggml_goldens.c`).
#[rustfmt::skip]
const GGML_GOLDENS: [(GgmlType, u64, u32, u64, u64, u64); 44] = [
    (Q4_0, 0, 0x45099911, 0x44b75fa0f8c9f3ec, 0x29642ae9a334aaff, 0x85e5db343385e729),
    (Q4_0, 1, 0x451e60ff, 0xc28b23e54ab5fa78, 0x5ed5c91d03ffb6e0, 0xf5f9d3f0ab1cbeed),
    (Q4_0, 2, 0xc5bd4316, 0x4025bd383db317e7, 0xc3cf15c486c66d2b, 0x0000000000000000),
    (Q4_0, 3, 0x00000000, 0x0000000000000000, 0x0997d6aa90b64598, 0x0000000000000000),
    (Q4_1, 0, 0xc5817400, 0x50b4322ac4f38f7f, 0x8c67e87735332d8c, 0xc5ee6e16a51bfc48),
    (Q4_1, 1, 0x44b63650, 0xd1fa8e8c00b78760, 0x88a504960ba81347, 0xacbe53ecd3094d34),
    (Q4_1, 2, 0x441f465a, 0x4975c7ad75134b09, 0xa73fc873b8b4f987, 0x0000000000000000),
    (Q4_1, 3, 0x00000000, 0x0000000000000000, 0x4c129aad29450fe1, 0x0000000000000000),
    (Q5_0, 0, 0x4594a9c4, 0x07a6aa038abeeaf4, 0xd9fbc855ab5db925, 0xd56cb23e9657a137),
    (Q5_0, 1, 0xc61b7bc9, 0x98e7a57c7e1a7eb4, 0x41c524cc7d6ed41d, 0x55d7471fe5a1850e),
    (Q5_0, 2, 0xc5eed228, 0x9fd1837efd26cda1, 0xcd5088d76afe482d, 0x0000000000000000),
    (Q5_0, 3, 0x00000000, 0x0000000000000000, 0xae919fcca21010d4, 0x0000000000000000),
    (Q5_1, 0, 0xc651030d, 0x2f7b1d5a7aed7042, 0x7972c26a899a2bbd, 0x93f4d0d51a9c5a26),
    (Q5_1, 1, 0xc4d78c7c, 0xee374ca0fd49b2ab, 0xf6e2107adb24010e, 0x7a24b3460dd9f575),
    (Q5_1, 2, 0x45d36395, 0x3e6c503f822892c3, 0x703d4143001983cf, 0x0000000000000000),
    (Q5_1, 3, 0x00000000, 0x0000000000000000, 0x9ccdcc1c761190d2, 0x0000000000000000),
    (Q8_0, 0, 0xc6c89cdf, 0x72596d5ef42ccdf8, 0x3ab0808b1279e84b, 0x72596d5ef42ccdf8),
    (Q8_0, 1, 0xc7974697, 0x370d24a27b980c3f, 0x76b015cc670fb827, 0x370d24a27b980c3f),
    (Q8_0, 2, 0xc7271374, 0xea49e254590262f8, 0xdfcc06736f5f7464, 0x0000000000000000),
    (Q8_0, 3, 0x00000000, 0x0000000000000000, 0xc86da68ba4f8b2bb, 0x0000000000000000),
    (Q2_K, 0, 0x465f69bc, 0x096670d102f99839, 0x0533f6fcb7f11f3b, 0x6dc87212000f28ca),
    (Q2_K, 1, 0xc59b4f3d, 0x03de1f8accdefc18, 0x98ab260c39d8e3bb, 0x2e651e67f74f8702),
    (Q2_K, 2, 0x449c3bbb, 0x1abfc0756dc159d8, 0x9972284474aa0d20, 0x0000000000000000),
    (Q2_K, 3, 0x00000000, 0x0000000000000000, 0x8c68a541569839e4, 0x0000000000000000),
    (Q3_K, 0, 0x470f21a2, 0x979244686455aa02, 0x85ac04eb8dd0bf3f, 0x3e9dad0dff7fb685),
    (Q3_K, 1, 0xc675bfad, 0x5b53f7d27e1422ba, 0x1a296665d7cfc11c, 0x355ea89fcbf9de6e),
    (Q3_K, 2, 0x44f5b05c, 0xf62eddf0c8d4bb33, 0x8fc1faf65977d448, 0x0000000000000000),
    (Q3_K, 3, 0x00000000, 0x0000000000000000, 0x82b42a88b41f5556, 0x0000000000000000),
    (Q4_K, 0, 0x470e02e4, 0xb4e0b5dd5976895f, 0x43ea62e7cd645fe6, 0x9c1e7f10136eb550),
    (Q4_K, 1, 0x48069213, 0x07a47df3d2583f76, 0x6617d6916436b97a, 0x234cbb86ab878b26),
    (Q4_K, 2, 0xc89eb03d, 0x0c94d4c3da0068fa, 0x45ed563290eaf771, 0x0000000000000000),
    (Q4_K, 3, 0x00000000, 0x0000000000000000, 0xac4414c4746883fb, 0x0000000000000000),
    (Q5_K, 0, 0x48cca9bc, 0x2ef19f3c79a679d0, 0xbb91b6efdd31e3f0, 0x594777977212751f),
    (Q5_K, 1, 0x44c3983c, 0x9f7af02b05aa2575, 0xe2fbf3811486c6aa, 0x75d23aaaf7510cea),
    (Q5_K, 2, 0x4a95bf7f, 0x0b87d10a53d21ac9, 0x56999e33c06905a5, 0x0000000000000000),
    (Q5_K, 3, 0x00000000, 0x0000000000000000, 0x7c3a87767d431034, 0x0000000000000000),
    (Q6_K, 0, 0x4873a096, 0x84f4976f351dcc0e, 0xa1d2af080b5cc90b, 0x2fbba14e9c4a6532),
    (Q6_K, 1, 0xc748a2f0, 0x6e2880e9c08f150f, 0xbafcaf097ec4428f, 0xc05e9b5596a9e5e7),
    (Q6_K, 2, 0x46c90194, 0xdb95e7bf0abbb216, 0xfddf59c8e896c761, 0x0000000000000000),
    (Q6_K, 3, 0x00000000, 0x0000000000000000, 0x8f776e2d28f15fa4, 0x0000000000000000),
    (MXFP4, 0, 0x48333ff4, 0x8a75e7e48391b2ab, 0x909b78e638c37dde, 0x53663fd5829641f3),
    (MXFP4, 1, 0x47184dd2, 0x7dc84bcefbcb2d67, 0x6d6c625aab54376d, 0x6593dde578cbca00),
    (MXFP4, 2, 0xc6be069f, 0xdcaab2ec2237a688, 0xb7301e88efc225c8, 0x0000000000000000),
    (MXFP4, 3, 0x00000000, 0x0000000000000000, 0xd762b6624af2bd27, 0x0000000000000000),
];

/// Inputs of one golden case: row length, weight bytes, and (cases 0-2) the activation values
/// (cases 0, 1) or raw activation blocks (case 2).
struct GoldenCase {
    n: usize,
    w: Vec<u8>,
    x: Option<Vec<f32>>,
    a: Option<Vec<u8>>,
}

/// The inputs of one golden case, generated exactly as the C recorder did: a weight row of
/// random bytes with sane f16 scales (cases 0-2) or fully random (case 3: dequantisation only,
/// NaN/inf scales included); activations quantised from spread values (case 0), from values
/// with zero and tiny blocks and a zero first super-block (case 1), or random activation blocks
/// (case 2: every int8 including -128, Q8_K sums that do not match the quants).
fn golden_case(ty: GgmlType, case: u64) -> GoldenCase {
    let mut rng = Rng(ty.id() as u64 * 1000 + case);
    let n = if ty.block_elems() == 256 { 1280 } else { 1440 };
    let bb = ty.block_bytes();
    let mut w: Vec<u8> = (0..n / ty.block_elems() * bb).map(|_| rng.byte()).collect();
    if case == 3 {
        return GoldenCase {
            n,
            w,
            x: None,
            a: None,
        };
    }
    for blk in w.chunks_mut(bb) {
        for &off in scale_fields(ty) {
            blk[off..off + 2].copy_from_slice(&rand_f16(&mut rng, 8, 15).to_le_bytes());
        }
        if ty == MXFP4 {
            blk[0] = 118 + rng.below(16) as u8;
        }
    }
    let mut x: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    if case == 1 {
        for (i, v) in x.iter_mut().enumerate() {
            if (i / 32) % 7 == 3 || i < 256 {
                *v = 0.0;
            }
            if (i / 32) % 11 == 5 {
                *v *= 1e-30;
            }
        }
    }
    if case < 2 {
        return GoldenCase {
            n,
            w,
            x: Some(x),
            a: None,
        };
    }
    let at = vec_dot_type(ty);
    let mut a: Vec<u8> = (0..at.row_bytes(n as u64).unwrap())
        .map(|_| rng.byte())
        .collect();
    for blk in a.chunks_mut(at.block_bytes()) {
        if at == Q8_K {
            blk[..4].copy_from_slice(&(rng.spread() * 0.015625).to_le_bytes());
        } else {
            blk[..2].copy_from_slice(&rand_f16(&mut rng, 8, 15).to_le_bytes());
            if at == Q8_1 {
                blk[2..4].copy_from_slice(&rand_f16(&mut rng, 8, 15).to_le_bytes());
            }
        }
    }
    GoldenCase {
        n,
        w,
        x: None,
        a: Some(a),
    }
}

/// Every ISA reproduces ggml's dequantisation, activation quantisation and dot product bit for
/// bit (Q8_0 and MXFP4 included, as a check of the older kernels).
#[test]
fn matches_outputs_recorded_from_ggml() {
    for (ty, case, dot_bits, act_hash, deq_hash, quant_hash) in GGML_GOLDENS {
        let GoldenCase { n, w, x, a } = golden_case(ty, case);
        let at = vec_dot_type(ty);
        for isa in Isa::available() {
            let mut y = vec![0.0f32; n];
            dequantize_row_with(isa, ty, &w, &mut y).unwrap();
            assert_eq!(
                fnv_f32(&y),
                deq_hash,
                "{ty} case {case}: dequantise on {isa}"
            );
            let a = match (&x, &a) {
                (Some(x), _) => {
                    // The reference weight quantisers. (Not Q8_0: ggml's Q8_0 reference rounds
                    // half away from zero, our Q8_0 quantiser is the x86 activation one, checked
                    // below; K-quant weights have no quantiser here.)
                    if matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | MXFP4) {
                        let mut q = vec![0u8; w.len()];
                        quantize_row_with(isa, ty, x, &mut q).unwrap();
                        assert_eq!(
                            fnv(q.iter().copied()),
                            quant_hash,
                            "{ty} case {case}: quantise on {isa}"
                        );
                    }
                    let mut q = vec![0u8; at.row_bytes(n as u64).unwrap() as usize];
                    quantize_row_with(isa, at, x, &mut q).unwrap();
                    assert_eq!(
                        fnv(q.iter().copied()),
                        act_hash,
                        "{ty} case {case}: {at} on {isa}"
                    );
                    q
                }
                (None, Some(a)) => a.clone(),
                (None, None) => continue,
            };
            let k = DotKernel::new(ty, isa).unwrap();
            let got = k.dot(n, &w, &a);
            assert_eq!(
                got.to_bits(),
                dot_bits,
                "{} case {case}: {got} vs ggml {}",
                k.name(),
                f32::from_bits(dot_bits)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// generators

/// The weight types added for K-quant and legacy GGUFs.
const LOWBIT: [GgmlType; 9] = [Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K];

/// Row lengths: 1-3 blocks (odd counts exercise the AVX-512 tails), and the row lengths of the
/// real models' tensors (SmolLM2-135M: 576, 1536; Qwen2.5-0.5B: 896, 4864).
fn lens(ty: GgmlType) -> &'static [usize] {
    if ty.block_elems() == 256 {
        &[256, 512, 768, 1536, 4864]
    } else {
        &[32, 64, 96, 576, 896, 1536, 2880]
    }
}

/// A weight row of random blocks with edge cases: block `b % 8` = 4 has zero scales, 5 all
/// quant bits set (largest quants and 6-bit scales), 6 all quant bytes equal, 7 subnormal or
/// largest-finite scales; the rest random quants with random finite scales of either sign.
pub(super) fn weight_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut w: Vec<u8> = (0..n / ty.block_elems() * bb).map(|_| rng.byte()).collect();
    for (b, blk) in w.chunks_mut(bb).enumerate() {
        let fields = scale_fields(ty);
        let is_scale = |i: usize| fields.iter().any(|&f| i == f || i == f + 1);
        let fill = rng.byte();
        for (i, byte) in blk.iter_mut().enumerate() {
            if !is_scale(i) {
                match b % 8 {
                    5 => *byte = 0xff,
                    6 => *byte = fill,
                    _ => {}
                }
            }
        }
        for &off in fields {
            let h = match b % 8 {
                4 => 0,
                7 if rng.below(2) == 0 => rand_f16(rng, 0, 0),
                7 => 0x7bff | ((rng.byte() as u16 & 1) << 15),
                _ => rand_f16(rng, 1, 0x1e),
            };
            blk[off..off + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    w
}

/// Activation values: spread magnitudes with all-zero, tiny, huge and all-equal 32-blocks, one
/// all-zero and one all-equal 256-block, and a single dominant value.
pub(super) fn act_values(n: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    for (b, blk) in x.chunks_mut(32).enumerate() {
        match b % 7 {
            1 => blk.fill(0.0),
            3 => blk.iter_mut().for_each(|v| *v *= 1e-30),
            4 => blk.iter_mut().for_each(|v| *v *= 1e4),
            5 => blk.fill(-0.75),
            _ => {}
        }
    }
    for (b, blk) in x.chunks_mut(256).enumerate() {
        match b % 4 {
            1 => blk.fill(0.0),
            2 => blk.fill(3.0),
            3 => blk[17] = 1e6,
            _ => {}
        }
    }
    x
}

/// Activation bytes for weights of `ty`, quantised by the scalar reference.
pub(super) fn act_row(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let at = vec_dot_type(ty);
    let mut a = vec![0u8; at.row_bytes(x.len() as u64).unwrap() as usize];
    quantize_row_with(Isa::Scalar, at, x, &mut a).unwrap();
    a
}

/// Random activation blocks for weights of `ty`: every int8 value including -128 (which no
/// quantiser emits for finite input) and Q8_K sums unrelated to the quants.
pub(super) fn raw_act_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let at = vec_dot_type(ty);
    let mut a: Vec<u8> = (0..at.row_bytes(n as u64).unwrap())
        .map(|_| rng.byte())
        .collect();
    for blk in a.chunks_mut(at.block_bytes()) {
        if at == Q8_K {
            blk[..4].copy_from_slice(&(rng.spread() * 1e-2).to_le_bytes());
        } else {
            blk[..2].copy_from_slice(&rand_f16(rng, 1, 0x1e).to_le_bytes());
            if at == Q8_1 {
                blk[2..4].copy_from_slice(&rand_f16(rng, 1, 0x1e).to_le_bytes());
            }
        }
    }
    a
}

fn dequant(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; n];
    dequantize_row_with(Isa::Scalar, ty, src, &mut y).unwrap();
    y
}

/// Every kernel of `ty` on this CPU: one per ISA, plus AVX-512 without VNNI.
pub(super) fn kernels(ty: GgmlType) -> Vec<DotKernel> {
    let mut ks: Vec<DotKernel> = Isa::available()
        .into_iter()
        .map(|isa| DotKernel::new(ty, isa).unwrap())
        .collect();
    if Isa::Avx512.is_available() {
        ks.push(DotKernel::resolve(ty, Isa::Avx512, false).unwrap());
    }
    ks
}

// ---------------------------------------------------------------------------------------------
// every ISA against the scalar reference, bit for bit

#[test]
fn lowbit_dot_all_isas_bit_exact_with_scalar() {
    let mut rng = Rng(11);
    for ty in LOWBIT {
        let ks = kernels(ty);
        for &n in lens(ty) {
            let w = weight_row(ty, n, &mut rng);
            let acts = [
                act_row(ty, &act_values(n, &mut rng)),
                act_row(ty, &vec![1.0; n]),
                raw_act_row(ty, n, &mut rng),
            ];
            for (case, a) in acts.iter().enumerate() {
                let want = ks[0].dot(n, &w, a);
                for k in &ks[1..] {
                    let got = k.dot(n, &w, a);
                    assert!(
                        same(got, want),
                        "{} n={n} case {case}: {got} vs {want}",
                        k.name()
                    );
                }
            }
        }
    }
}

#[test]
fn lowbit_dot_rows_equals_dot_per_row() {
    let mut rng = Rng(12);
    for ty in LOWBIT {
        for k in kernels(ty) {
            for &n in &lens(ty)[..3] {
                for nrows in [0, 1, 2, 3, 5, 9] {
                    let rows: Vec<u8> = (0..nrows)
                        .flat_map(|_| weight_row(ty, n, &mut rng))
                        .collect();
                    let a = raw_act_row(ty, n, &mut rng);
                    assert_rows_equal_dots(&k, n, &rows, &a, nrows);
                }
            }
        }
    }
}

/// The activation quantisers and the reference weight quantisers give the same bytes on every
/// ISA, for special values (infinities, NaNs, subnormals) and ordinary rows.
#[test]
fn lowbit_quantize_all_isas_bit_exact_with_scalar() {
    let mut rng = Rng(13);
    let mut specials = vec![
        0.0,
        -0.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        65504.0,
        -65520.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0xffc1_2345),
    ];
    specials.resize(512, 0.5);
    let bits: Vec<f32> = (0..1 << 14)
        .map(|_| f32::from_bits(rng.u64() as u32))
        .collect();
    let rows = act_values(2560, &mut rng);
    for ty in [Q8_1, Q8_K, Q4_0, Q4_1, Q5_0, Q5_1] {
        for x in [&specials, &bits, &rows] {
            let mut want = vec![0u8; ty.row_bytes(x.len() as u64).unwrap() as usize];
            quantize_row_with(Isa::Scalar, ty, x, &mut want).unwrap();
            for isa in Isa::available() {
                let mut got = vec![0u8; want.len()];
                quantize_row_with(isa, ty, x, &mut got).unwrap();
                assert!(got == want, "{ty} on {isa}");
            }
        }
    }
}

#[test]
fn lowbit_dequantize_all_isas_bit_exact_with_scalar() {
    let mut rng = Rng(14);
    for ty in LOWBIT.into_iter().chain([Q8_1, Q8_K]) {
        let n = 1536;
        let src: Vec<u8> = (0..ty.row_bytes(n).unwrap()).map(|_| rng.byte()).collect();
        let want = dequant(ty, &src, n as usize);
        for isa in Isa::available() {
            let mut got = vec![0.0f32; n as usize];
            dequantize_row_with(isa, ty, &src, &mut got).unwrap();
            assert!(
                got.iter().zip(&want).all(|(g, w)| same(*g, *w)),
                "{ty} on {isa}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// hand-built blocks (the GGUF layouts of ggml-common.h, filled field by field)

fn h(v: f32) -> [u8; 2] {
    f32_to_f16(v).to_le_bytes()
}

/// 16 nibble bytes: low nibble `j`, high nibble `15 - j`.
fn ramp_nibbles() -> Vec<u8> {
    (0..16u8).map(|j| j | ((15 - j) << 4)).collect()
}

/// Packs 8 six-bit scales and mins as Q4_K/Q5_K store them (the inverse of
/// `get_scale_min_k4`).
fn pack_k4(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0f) | ((mn[j + 4] & 0x0f) << 4);
    }
    q
}

/// Packs 16 six-bit Q3_K scales (stored values, 32 + scale).
fn pack_q3k(v: [u8; 16]) -> [u8; 12] {
    let mut r = [0u8; 12];
    for (i, &v) in v.iter().enumerate() {
        if i < 8 {
            r[i] |= v & 0x0f;
        } else {
            r[i - 8] |= (v & 0x0f) << 4;
        }
        r[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
    }
    r
}

/// A hand-built block: its type, bytes, and (index, value) pairs worked out by hand.
type HandBlock = (GgmlType, Vec<u8>, Vec<(usize, f32)>);

/// One hand-built block of each type, with values worked out by hand from the format
/// definitions.
fn hand_blocks() -> Vec<HandBlock> {
    let mut out = Vec::new();
    let qh = 0xaaaa_5555u32.to_le_bytes(); // fifth bits: even j < 16, odd j >= 16
                                           // Q4_0: d 0.5, q = nibble - 8.
    let b = [&h(0.5)[..], &ramp_nibbles()].concat();
    out.push((Q4_0, b, vec![(0, -4.0), (15, 3.5), (16, 3.5), (31, -4.0)]));
    // Q4_1: d 0.25, m -1, value q/4 - 1.
    let b = [&h(0.25)[..], &h(-1.0), &ramp_nibbles()].concat();
    out.push((Q4_1, b, vec![(0, -1.0), (15, 2.75), (16, 2.75), (31, -1.0)]));
    // Q5_0: d 2; element 1: nibble 1, bit clear -> (1 - 16)·2; element 17: nibble 14, bit set.
    let b = [&h(2.0)[..], &qh, &ramp_nibbles()].concat();
    out.push((
        Q5_0,
        b,
        vec![
            (0, 0.0),
            (1, -30.0),
            (15, -2.0),
            (16, -2.0),
            (17, 28.0),
            (31, 0.0),
        ],
    ));
    // Q5_1: d 0.5, m 1.
    let b = [&h(0.5)[..], &h(1.0), &qh, &ramp_nibbles()].concat();
    out.push((
        Q5_1,
        b,
        vec![
            (0, 9.0),
            (1, 1.5),
            (15, 8.5),
            (16, 8.5),
            (17, 16.0),
            (31, 9.0),
        ],
    ));
    // Q2_K: sub-block i has scale i and min 15 - i; every quant byte 0xe4, so the quant of
    // 32-element group g (within its 128-element half) is g; d 1, dmin 0.5.
    let scales: Vec<u8> = (0..16u8).map(|i| i | ((15 - i) << 4)).collect();
    let b = [&scales[..], &[0xe4; 64], &h(1.0), &h(0.5)].concat();
    out.push((
        Q2_K,
        b,
        vec![(0, -7.5), (40, -4.5), (127, 17.0), (200, 22.5), (255, 45.0)],
    ));
    // Q3_K: hmask 0x0f (high bit set in the first half only, so q = g there and g - 4 in the
    // second), low bits g as above, scales i - 8, d 0.5.
    let v: Vec<u8> = (0..16).map(|i| 24 + i).collect();
    let b = [
        &[0x0f; 32][..],
        &[0xe4; 64],
        &pack_q3k(v.try_into().unwrap()),
        &h(0.5),
    ]
    .concat();
    out.push((
        Q3_K,
        b,
        vec![(0, 0.0), (40, -3.0), (130, 0.0), (200, -4.0), (255, -3.5)],
    ));
    // Q4_K: group g has scale 8g + 1 and min 63 - 8g; run bytes as ramp (low nibble t % 16 for
    // the even group, 15 - t % 16 for the odd one); d 0.25, dmin 0.5.
    let sc = [1, 9, 17, 25, 33, 41, 49, 57];
    let mn = [63, 55, 47, 39, 31, 23, 15, 7];
    let run: Vec<u8> = [ramp_nibbles(), ramp_nibbles()].concat();
    let qs: Vec<u8> = (0..4).flat_map(|_| run.iter().copied()).collect();
    let b = [&h(0.25)[..], &h(0.5), &pack_k4(sc, mn), &qs].concat();
    let spots = vec![(0, -31.5), (5, -30.25), (33, 4.0), (200, 90.5), (255, -3.5)];
    out.push((Q4_K, b, spots));
    // Q5_K: as Q4_K with fifth bits 0xa5 (groups 0, 2, 5, 7 get +16).
    let b = [&h(0.25)[..], &h(0.5), &pack_k4(sc, mn), &[0xa5; 32], &qs].concat();
    let spots = vec![
        (0, -27.5),
        (33, 4.0),
        (170, 203.75),
        (200, 90.5),
        (255, 224.5),
    ];
    out.push((Q5_K, b, spots));
    // Q6_K: ql ramps, qh 0xe4 (high bits of group g are g), scales i - 8, d 0.125.
    let ql: Vec<u8> = (0..8).flat_map(|_| ramp_nibbles()).collect();
    let sc6: Vec<u8> = (0..16).map(|i| (i as i8 - 8) as u8).collect();
    let b = [&ql[..], &[0xe4; 64], &sc6, &h(0.125)].concat();
    out.push((
        Q6_K,
        b,
        vec![(0, 32.0), (40, 6.0), (100, -6.75), (130, 0.0), (255, 14.0)],
    ));
    // Q8_1: d 0.25, q = j - 16 (s is not part of the value).
    let b = [
        &h(0.25)[..],
        &h(-4.0),
        &(0..32).map(|j| (j as i8 - 16) as u8).collect::<Vec<_>>(),
    ]
    .concat();
    out.push((Q8_1, b, vec![(0, -4.0), (16, 0.0), (31, 3.75)]));
    // Q8_K: d -0.5 (f32), q = e as int8.
    let b = [
        &(-0.5f32).to_le_bytes()[..],
        &(0..=255u8).collect::<Vec<_>>(),
        &[0; 32],
    ]
    .concat();
    out.push((
        Q8_K,
        b,
        vec![(1, -0.5), (127, -63.5), (128, 64.0), (255, 0.5)],
    ));
    out
}

#[test]
fn dequantize_hand_built_blocks() {
    for (ty, b, spots) in hand_blocks() {
        assert_eq!(b.len(), ty.block_bytes(), "{ty}");
        for isa in Isa::available() {
            let mut y = vec![0.0f32; ty.block_elems()];
            dequantize_row_with(isa, ty, &b, &mut y).unwrap();
            for &(i, v) in &spots {
                assert_eq!(y[i], v, "{ty} element {i} on {isa}");
            }
        }
    }
}

/// With all-ones activations (d = 1) every product and partial sum of a hand-built block is
/// exact, so the dot equals the sum of the dequantised block exactly.
#[test]
fn dot_of_hand_built_blocks_is_exact() {
    for (ty, w, _) in hand_blocks() {
        if !LOWBIT.contains(&ty) {
            continue;
        }
        let n = ty.block_elems();
        let want: f64 = dequant(ty, &w, n).iter().map(|&v| v as f64).sum();
        let a = match vec_dot_type(ty) {
            Q8_0 => [&h(1.0)[..], &[1; 32]].concat(),
            Q8_1 => [&h(1.0)[..], &h(32.0), &[1; 32]].concat(),
            _ => {
                let bsums: Vec<u8> = (0..16).flat_map(|_| 16i16.to_le_bytes()).collect();
                [&1.0f32.to_le_bytes()[..], &[1; 256], &bsums].concat()
            }
        };
        for k in kernels(ty) {
            assert_eq!(k.dot(n, &w, &a) as f64, want, "{}", k.name());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// activation quantisers by hand

#[test]
fn q8_k_quantiser_by_hand() {
    // The first value of largest magnitude sets iscale = -127/max: here max = -127, iscale = 1,
    // d = 1, and q = round-half-even(x).
    let mut x = [0.0f32; 256];
    x[0] = -127.0;
    x[1] = 127.0; // same magnitude, not first
    x[2] = 2.5;
    x[3] = 3.5;
    x[4] = -0.5;
    x[5] = 1.4999999;
    x[16] = 100.0;
    let mut q = [0xaau8; 292];
    quantize_row(Q8_K, &x, &mut q).unwrap();
    assert_eq!(f32::from_le_bytes(q[..4].try_into().unwrap()), 1.0);
    let qs: Vec<i8> = q[4..10].iter().map(|&b| b as i8).collect();
    assert_eq!(qs, [-127, 127, 2, 4, 0, 1]);
    let bsum = |q: &[u8], i: usize| i16::from_le_bytes([q[260 + 2 * i], q[261 + 2 * i]]);
    assert_eq!((bsum(&q, 0), bsum(&q, 1), bsum(&q, 2)), (7, 100, 0));
    // A positive maximum gives a negative scale and negated quants.
    let mut x = [0.0f32; 256];
    x[0] = 2.0;
    x[1] = -1.0;
    quantize_row(Q8_K, &x, &mut q).unwrap();
    assert_eq!(
        f32::from_le_bytes(q[..4].try_into().unwrap()),
        1.0 / (-127.0f32 / 2.0)
    );
    assert_eq!((q[4] as i8, q[5] as i8), (-127, 64)); // 63.5 rounds to even
    assert_eq!(bsum(&q, 0), -63);
    // All zeros: d = 0, zero quants and sums.
    quantize_row(Q8_K, &[0.0; 256], &mut q).unwrap();
    assert!(q.iter().all(|&b| b == 0));
}

#[test]
fn q8_1_quantiser_by_hand() {
    // amax 127: d = 1, q = round-half-even(x), s = d·Σq.
    let mut x = [0.0f32; 32];
    x[..6].copy_from_slice(&[127.0, 2.5, -2.5, 3.5, -126.5, 0.5]);
    for isa in Isa::available() {
        let mut q = [0u8; 36];
        quantize_row_with(isa, Q8_1, &x, &mut q).unwrap();
        assert_eq!(f16_to_f32(u16::from_le_bytes([q[0], q[1]])), 1.0);
        let qs: Vec<i8> = q[4..10].iter().map(|&b| b as i8).collect();
        assert_eq!(qs, [127, 2, -2, 4, -126, 0]);
        assert_eq!(f16_to_f32(u16::from_le_bytes([q[2], q[3]])), 5.0);
    }
    // s uses the unrounded d = amax/127 and is rounded to f16 once: amax 1 -> d = 1/127,
    // q = 127 for all 32 -> s = f16(32·127·(1/127)).
    let mut q = [0u8; 36];
    quantize_row(Q8_1, &[1.0; 32], &mut q).unwrap();
    assert_eq!(
        u16::from_le_bytes([q[2], q[3]]),
        f32_to_f16(4064.0 * (1.0 / 127.0))
    );
    assert_eq!(u16::from_le_bytes([q[0], q[1]]), f32_to_f16(1.0 / 127.0));
}

#[test]
fn legacy_reference_quantisers_by_hand() {
    // Q4_0: max -8 (first of largest magnitude) -> d = 1, q = trunc(x + 8.5) clipped to 15.
    let mut x = [0.0f32; 32];
    for (j, v) in x.iter_mut().enumerate().take(16) {
        *v = j as f32 - 8.0;
    }
    x[16] = 7.6; // rounds to 8, clipped to 7
    x[17] = -0.5; // trunc(8.0) = 8 -> 0
    x[18] = 0.5; // trunc(9.0) = 9 -> 1
    let mut q = [0u8; 18];
    quantize_row(Q4_0, &x, &mut q).unwrap();
    assert_eq!(f16_to_f32(u16::from_le_bytes([q[0], q[1]])), 1.0);
    let y = dequant(Q4_0, &q, 32);
    assert_eq!(&y[..16], &x[..16]);
    assert_eq!(&y[16..19], &[7.0, 0.0, 1.0]);
    // Q4_1: min -1, max 14 -> d = 1, m = -1, q = trunc(x + 1.5).
    let mut x = [0.0f32; 32];
    for (j, v) in x.iter_mut().enumerate() {
        *v = (j % 16) as f32 - 1.0;
    }
    let mut q = [0u8; 20];
    quantize_row(Q4_1, &x, &mut q).unwrap();
    assert_eq!(dequant(Q4_1, &q, 32), x);
    // Q5_0 / Q5_1 reproduce 5-bit grids exactly.
    let x: Vec<f32> = (0..32).map(|j| j as f32 - 16.0).collect();
    let mut q = [0u8; 22];
    quantize_row(Q5_0, &x, &mut q).unwrap();
    assert_eq!(dequant(Q5_0, &q, 32), x);
    let x: Vec<f32> = (0..32).map(|j| 0.5 * j as f32 + 3.0).collect();
    let mut q = [0u8; 24];
    quantize_row(Q5_1, &x, &mut q).unwrap();
    assert_eq!(dequant(Q5_1, &q, 32), x);
}

// ---------------------------------------------------------------------------------------------
// accuracy against exact arithmetic

/// |x - dequantize(quantize(x))| bound of one activation element: half a step of the exact
/// scale plus the f16/f32 rounding of the stored scale times the largest quant.
fn act_err(at: GgmlType, blk: &[u8], amax: f32) -> f64 {
    match at {
        Q8_K => {
            let d = f32::from_le_bytes(blk[..4].try_into().unwrap()).abs() as f64;
            d * (0.5 + 1e-5)
        }
        _ => {
            let d = amax as f64 / 127.0;
            let d16 = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64;
            d * 0.5 * 1.0001 + 127.0 * (d - d16).abs()
        }
    }
}

/// dot(w, quantize(x)) against Σ dequantize(w)·x in f64, for realistic weights (random quants,
/// positive scales of moderate range) and spread activations: within the activation
/// quantisation error (Σ|w|·err(x), plus for Q4_1/Q5_1 the f16 rounding of `s`) and f32
/// rounding of the block sums. Also records the worst error relative to Σ|w·x| (see crate docs).
#[test]
fn lowbit_dot_matches_f64_reference_within_quantisation_error() {
    let mut rng = Rng(15);
    for ty in LOWBIT {
        let k = DotKernel::best(ty).unwrap();
        let at = vec_dot_type(ty);
        let ab = at.block_bytes();
        let ae = at.block_elems();
        let mut worst = 0.0f64;
        for &n in lens(ty) {
            for _ in 0..4 {
                let mut w: Vec<u8> = (0..ty.row_bytes(n as u64).unwrap())
                    .map(|_| rng.byte())
                    .collect();
                for blk in w.chunks_mut(ty.block_bytes()) {
                    for &off in scale_fields(ty) {
                        let v = f32_to_f16(rng.unit().abs() * 2f32.powi(-(rng.below(6) as i32)));
                        blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
                let x: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
                let a = act_row(ty, &x);
                let wd = dequant(ty, &w, n);
                // The block's offset part (quants zeroed): m, -dmin·m, -4·d·sc, -32·d·sc.
                let mut w0 = w.clone();
                zero_quants(ty, &mut w0);
                let off = dequant(ty, &w0, n);
                let exact: f64 = wd.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
                let abs: f64 = wd
                    .iter()
                    .zip(&x)
                    .map(|(&w, &x)| (w as f64 * x as f64).abs())
                    .sum();
                let (mut qerr, mut scale) = (0.0f64, 0.0f64);
                for (b, blk) in a.chunks(ab).enumerate() {
                    let xs = &x[b * ae..(b + 1) * ae];
                    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let e = act_err(at, blk, amax);
                    for i in b * ae..(b + 1) * ae {
                        qerr += wd[i].abs() as f64 * e;
                        scale += (wd[i].abs() + 2.0 * off[i].abs()) as f64 * x[i].abs() as f64;
                    }
                    if at == Q8_1 {
                        // m·(d·Σq - s): s is d·Σq rounded to f16.
                        let d = amax as f64 / 127.0;
                        let sum_q: f64 = blk[4..].iter().map(|&q| (q as i8) as f64).sum();
                        qerr += off[b * ae].abs() as f64
                            * ((d * sum_q).abs() * 2f64.powi(-11) + 2f64.powi(-25));
                    }
                }
                let bound = qerr * 1.001 + scale * 2f64.powi(-20) + 1e-30;
                let got = k.dot(n, &w, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "{} n={n}: {got} vs {exact} (bound {bound})",
                    k.name()
                );
                worst = worst.max((got - exact).abs() / abs);
            }
        }
        eprintln!("{ty}: worst |dot - exact| / Σ|w·x| = {worst:.2e}");
    }
}

/// Zeroes the quant bits of every block (scales and mins kept).
fn zero_quants(ty: GgmlType, w: &mut [u8]) {
    let ranges: &[(usize, usize)] = match ty {
        Q4_0 => &[(2, 18)],
        Q4_1 => &[(4, 20)],
        Q5_0 => &[(2, 22)],
        Q5_1 => &[(4, 24)],
        Q2_K => &[(16, 80)],
        Q3_K => &[(0, 96)],
        Q4_K => &[(16, 144)],
        Q5_K => &[(16, 176)],
        Q6_K => &[(0, 192)],
        _ => unreachable!(),
    };
    for blk in w.chunks_mut(ty.block_bytes()) {
        for &(a, b) in ranges {
            blk[a..b].fill(0);
        }
    }
}

#[test]
fn lowbit_kernel_dispatch() {
    for ty in LOWBIT {
        let at = vec_dot_type(ty);
        for k in kernels(ty) {
            assert_eq!((k.weight_type(), k.act_type()), (ty, at));
            let prefix = format!("{}*{}/", ty.name(), at.name()).to_lowercase();
            assert!(k.name().starts_with(&prefix), "{}", k.name());
            let n = 4 * ty.block_elems();
            assert_eq!(k.weight_row_bytes(n), 4 * ty.block_bytes());
            assert_eq!(k.act_row_bytes(n), at.row_bytes(n as u64).unwrap() as usize);
        }
        // On AVX-512 the measured-faster kernel is picked (see x86/avx512/lowbit.rs).
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.is_available() {
            let k = DotKernel::new(ty, Isa::Avx512).unwrap();
            assert_eq!(k.isa(), Isa::Avx512);
            let vnni = is_x86_feature_detected!("avx512vnni");
            let want = match ty {
                Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q6_K if vnni => "/avx512vnni",
                Q3_K | Q6_K => "/avx512",
                _ => "/avx2",
            };
            assert!(k.name().ends_with(want), "{}", k.name());
        }
    }
}
