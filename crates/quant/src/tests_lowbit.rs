//! Tests of the low-bit formats (Q4_0, Q4_1, Q5_0, Q5_1, K-quants, Q8_1, Q8_K): outputs recorded
//! from ggml itself, hand-computed blocks, every ISA against the scalar reference, and accuracy
//! against exact arithmetic.

use crate::tests::{rand_f16, Rng};
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
/// FNV of the activation bytes, FNV of the dequantised weights)`. Recorded from llama.cpp
/// build 10587 (commit 3f545bec, the fixtures' build; x86-64 with AVX2/FMA/F16C/AVX-512/VNNI)
/// by a small C program calling `ggml_get_type_traits_cpu(t)->vec_dot`, the `from_float` of
/// its `vec_dot_type` and `ggml_get_type_traits(t)->to_float` on the same inputs.
#[rustfmt::skip]
const GGML_GOLDENS: [(GgmlType, u64, u32, u64, u64); 44] = [
    (Q4_0, 0, 0x45099911, 0x44b75fa0f8c9f3ec, 0x29642ae9a334aaff),
    (Q4_0, 1, 0x451e60ff, 0xc28b23e54ab5fa78, 0x5ed5c91d03ffb6e0),
    (Q4_0, 2, 0xc5bd4316, 0x4025bd383db317e7, 0xc3cf15c486c66d2b),
    (Q4_0, 3, 0x00000000, 0x0000000000000000, 0x0997d6aa90b64598),
    (Q4_1, 0, 0xc5817400, 0x50b4322ac4f38f7f, 0x8c67e87735332d8c),
    (Q4_1, 1, 0x44b63650, 0xd1fa8e8c00b78760, 0x88a504960ba81347),
    (Q4_1, 2, 0x441f465a, 0x4975c7ad75134b09, 0xa73fc873b8b4f987),
    (Q4_1, 3, 0x00000000, 0x0000000000000000, 0x4c129aad29450fe1),
    (Q5_0, 0, 0x4594a9c4, 0x07a6aa038abeeaf4, 0xd9fbc855ab5db925),
    (Q5_0, 1, 0xc61b7bc9, 0x98e7a57c7e1a7eb4, 0x41c524cc7d6ed41d),
    (Q5_0, 2, 0xc5eed228, 0x9fd1837efd26cda1, 0xcd5088d76afe482d),
    (Q5_0, 3, 0x00000000, 0x0000000000000000, 0xae919fcca21010d4),
    (Q5_1, 0, 0xc651030d, 0x2f7b1d5a7aed7042, 0x7972c26a899a2bbd),
    (Q5_1, 1, 0xc4d78c7c, 0xee374ca0fd49b2ab, 0xf6e2107adb24010e),
    (Q5_1, 2, 0x45d36395, 0x3e6c503f822892c3, 0x703d4143001983cf),
    (Q5_1, 3, 0x00000000, 0x0000000000000000, 0x9ccdcc1c761190d2),
    (Q8_0, 0, 0xc6c89cdf, 0x72596d5ef42ccdf8, 0x3ab0808b1279e84b),
    (Q8_0, 1, 0xc7974697, 0x370d24a27b980c3f, 0x76b015cc670fb827),
    (Q8_0, 2, 0xc7271374, 0xea49e254590262f8, 0xdfcc06736f5f7464),
    (Q8_0, 3, 0x00000000, 0x0000000000000000, 0xc86da68ba4f8b2bb),
    (Q2_K, 0, 0x465f69bc, 0x096670d102f99839, 0x0533f6fcb7f11f3b),
    (Q2_K, 1, 0xc59b4f3d, 0x03de1f8accdefc18, 0x98ab260c39d8e3bb),
    (Q2_K, 2, 0x449c3bbb, 0x1abfc0756dc159d8, 0x9972284474aa0d20),
    (Q2_K, 3, 0x00000000, 0x0000000000000000, 0x8c68a541569839e4),
    (Q3_K, 0, 0x470f21a2, 0x979244686455aa02, 0x85ac04eb8dd0bf3f),
    (Q3_K, 1, 0xc675bfad, 0x5b53f7d27e1422ba, 0x1a296665d7cfc11c),
    (Q3_K, 2, 0x44f5b05c, 0xf62eddf0c8d4bb33, 0x8fc1faf65977d448),
    (Q3_K, 3, 0x00000000, 0x0000000000000000, 0x82b42a88b41f5556),
    (Q4_K, 0, 0x470e02e4, 0xb4e0b5dd5976895f, 0x43ea62e7cd645fe6),
    (Q4_K, 1, 0x48069213, 0x07a47df3d2583f76, 0x6617d6916436b97a),
    (Q4_K, 2, 0xc89eb03d, 0x0c94d4c3da0068fa, 0x45ed563290eaf771),
    (Q4_K, 3, 0x00000000, 0x0000000000000000, 0xac4414c4746883fb),
    (Q5_K, 0, 0x48cca9bc, 0x2ef19f3c79a679d0, 0xbb91b6efdd31e3f0),
    (Q5_K, 1, 0x44c3983c, 0x9f7af02b05aa2575, 0xe2fbf3811486c6aa),
    (Q5_K, 2, 0x4a95bf7f, 0x0b87d10a53d21ac9, 0x56999e33c06905a5),
    (Q5_K, 3, 0x00000000, 0x0000000000000000, 0x7c3a87767d431034),
    (Q6_K, 0, 0x4873a096, 0x84f4976f351dcc0e, 0xa1d2af080b5cc90b),
    (Q6_K, 1, 0xc748a2f0, 0x6e2880e9c08f150f, 0xbafcaf097ec4428f),
    (Q6_K, 2, 0x46c90194, 0xdb95e7bf0abbb216, 0xfddf59c8e896c761),
    (Q6_K, 3, 0x00000000, 0x0000000000000000, 0x8f776e2d28f15fa4),
    (MXFP4, 0, 0x48333ff4, 0x8a75e7e48391b2ab, 0x909b78e638c37dde),
    (MXFP4, 1, 0x47184dd2, 0x7dc84bcefbcb2d67, 0x6d6c625aab54376d),
    (MXFP4, 2, 0xc6be069f, 0xdcaab2ec2237a688, 0xb7301e88efc225c8),
    (MXFP4, 3, 0x00000000, 0x0000000000000000, 0xd762b6624af2bd27),
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
    for (ty, case, dot_bits, act_hash, deq_hash) in GGML_GOLDENS {
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
