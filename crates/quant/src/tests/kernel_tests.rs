//! Kernel tests: hand-computed values, every ISA against the scalar reference (bit-exact), round
//! trips and dot products against an f64 reference within the quantisation error.

use crate::scalar::shared::{e8m0_to_f32_half, f16_to_f32, f32_to_f16};
use crate::tests::{assert_rows_equal_dots, rand_f16, same, Rng};
use crate::*;

/// The types with kernels.
const TYPES: [GgmlType; 5] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::MXFP4,
];

/// Row lengths for the block types (3 and 91 blocks exercise the odd-block tails).
const BLOCK_LENS: [usize; 5] = [32, 64, 96, 2880, 2912];
/// Row lengths for the float types (partial SIMD steps and leftovers).
const FLOAT_LENS: [usize; 12] = [1, 7, 31, 32, 33, 63, 64, 65, 100, 127, 2880, 2881];

fn lens(ty: GgmlType) -> &'static [usize] {
    if ty.block_elems() == 1 {
        &FLOAT_LENS
    } else {
        &BLOCK_LENS
    }
}

/// A random weight row of `n` elements of `ty`, including the type's edge values.
fn weight_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.row_bytes(n as u64).unwrap() as usize);
    match ty {
        GgmlType::F32 => {
            for i in 0..n {
                let v = match i % 97 {
                    5 => f32::from_bits(rng.below(0x7f_ffff) as u32 + 1), // subnormal
                    11 => 0.0,
                    _ => rng.spread(),
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for i in 0..n {
                let h = match i % 89 {
                    3 => 0x7bff,                 // 65504
                    4 => 0xfbff,                 // -65504
                    7 => rand_f16(rng, 0, 0),    // subnormal
                    _ => rand_f16(rng, 1, 0x1e), // any finite
                };
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for i in 0..n {
                let h = match i % 83 {
                    2 => 0x0001 + rng.below(0x7f) as u16, // subnormal
                    9 => 0x8000,                          // -0
                    _ => crate::scalar::shared::f32_to_bf16(rng.spread()),
                };
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            for b in 0..n / 32 {
                let d = match b % 7 {
                    3 => 0,                   // zero scale
                    5 => rand_f16(rng, 0, 0), // subnormal scale
                    _ => rand_f16(rng, 5, 16),
                };
                out.extend_from_slice(&d.to_le_bytes());
                // Every byte value, including -128 (never produced by ggml's quantisers).
                out.extend((0..32).map(|_| rng.byte()));
            }
        }
        GgmlType::MXFP4 => {
            const EDGE: [u8; 6] = [0, 1, 2, 127, 254, 255];
            for b in 0..n / 32 {
                let e = if b % 5 == 4 {
                    EDGE[(b / 5) % EDGE.len()]
                } else {
                    110 + rng.below(30) as u8
                };
                out.push(e);
                out.extend((0..16).map(|_| rng.byte()));
            }
        }
        _ => unreachable!(),
    }
    out
}

/// Random activations: mostly spread values, with all-zero, tiny, subnormal and large blocks.
fn act_values(n: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
    for (b, blk) in x.chunks_mut(32).enumerate() {
        match b % 6 {
            1 => blk.fill(0.0),
            3 => blk.iter_mut().for_each(|v| *v *= 1e-30),
            4 => blk.iter_mut().for_each(|v| *v *= 100.0),
            _ => {}
        }
    }
    if n > 40 {
        x[40] = f32::from_bits(3); // a subnormal
    }
    x
}

/// Activation bytes for `ty` from `x`, quantised by the scalar reference.
fn act_row(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let act = vec_dot_type(ty);
    let mut out = vec![0u8; act.row_bytes(x.len() as u64).unwrap() as usize];
    quantize_row_with(Isa::Scalar, act, x, &mut out).unwrap();
    out
}

fn dequant(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    dequantize_row_with(Isa::Scalar, ty, src, &mut out).unwrap();
    out
}

// ---------------------------------------------------------------------------------------------
// hand-computed values

#[test]
fn e8m0_half_scale_matches_ggml() {
    assert_eq!(e8m0_to_f32_half(0).to_bits(), 0x0020_0000); // 2^-128, subnormal
    assert_eq!(e8m0_to_f32_half(1).to_bits(), 0x0040_0000); // 2^-127, subnormal
    assert_eq!(e8m0_to_f32_half(2), 2f32.powi(-126));
    assert_eq!(e8m0_to_f32_half(127), 0.5);
    assert_eq!(e8m0_to_f32_half(128), 1.0);
    assert_eq!(e8m0_to_f32_half(254), 2f32.powi(126));
    assert_eq!(e8m0_to_f32_half(255), 2f32.powi(127));
}

#[test]
fn mxfp4_known_block() {
    // e = 130: scale 4. Byte j = 0x21: element j is table[1] = 1, element j+16 is table[2] = 2.
    let mut w = vec![130u8];
    w.extend([0x21u8; 16]);
    let y = dequant(GgmlType::MXFP4, &w, 32);
    assert!(y[..16].iter().all(|&v| v == 4.0));
    assert!(y[16..].iter().all(|&v| v == 8.0));

    // Activation block: d = 0.25, q[j] = j - 16. Σ q·kv = Σ(-16..0)·1 + Σ(0..16)·2 = -136 + 240.
    let mut a = f32_to_f16(0.25).to_le_bytes().to_vec();
    a.extend((0..32).map(|j| (j as i8 - 16) as u8));
    for isa in Isa::available() {
        let k = DotKernel::new(GgmlType::MXFP4, isa).unwrap();
        assert_eq!(k.act_type(), GgmlType::Q8_0);
        assert_eq!(k.dot(32, &w, &a), 0.25 * 4.0 * 104.0, "{isa}");
    }

    // Every nibble: low nibble j = index j, high nibble = 15 - j, scale 2^-1.
    let mut w = vec![127u8];
    w.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequant(GgmlType::MXFP4, &w, 32);
    let kv = [
        0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.,
    ];
    for j in 0..16 {
        assert_eq!(y[j], kv[j] * 0.5);
        assert_eq!(y[j + 16], kv[15 - j] * 0.5);
    }
    // Smallest scale: table value 1 at e = 0 is 2^-128 exactly.
    let mut w = vec![0u8];
    w.extend([0x01u8; 16]);
    assert_eq!(dequant(GgmlType::MXFP4, &w, 32)[0].to_bits(), 0x0020_0000);
}

#[test]
fn mxfp4_reference_quantiser() {
    // amax 13: floor(log2 13) = 3, e = 3 - 2 + 127 = 128, scale 1: values map onto the table.
    let mut x = [0.0f32; 32];
    let vals = [
        0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -1.0, -6.0, -12.0, 13.0,
    ];
    x[..vals.len()].copy_from_slice(&vals);
    x[16] = 5.0; // tie between 4 (index 4) and 6: the first index wins
    x[17] = -5.0; // tie between -4 (index 12) and -6
    x[18] = 10.0; // tie between 8 and 12
    x[19] = 0.5; // tie between 0 and 1
    x[20] = -0.0;
    x[21] = 0.74; // nearest 1
    let mut q = [0u8; 17];
    quantize_row(GgmlType::MXFP4, &x, &mut q).unwrap();
    assert_eq!(q[0], 128);
    let lo: Vec<u8> = q[1..].iter().map(|b| b & 15).collect();
    let hi: Vec<u8> = q[1..].iter().map(|b| b >> 4).collect();
    assert_eq!(&lo[..12], &[0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 15, 7]);
    assert_eq!(&hi[..6], &[4, 12, 6, 0, 0, 1]);
    // All zeros: e = 0 and index 0.
    let mut q = [0xffu8; 17];
    quantize_row(GgmlType::MXFP4, &[0.0; 32], &mut q).unwrap();
    assert_eq!(q, [0u8; 17]);
    // Exponent range: amax 2^-125 gives e = 0. For f32::MAX, log2f returns 128.0 (the exact
    // 127.9999999 rounds up in f32), so e = 128 - 2 + 127 = 253, as in ggml.
    let mut x = [0.0f32; 32];
    x[0] = 2f32.powi(-125);
    quantize_row(GgmlType::MXFP4, &x, &mut q).unwrap();
    assert_eq!(q[0], 0);
    x[0] = f32::MAX;
    quantize_row(GgmlType::MXFP4, &x, &mut q).unwrap();
    assert_eq!(q[0], 253);
}

#[test]
fn q8_0_known_block_rounds_half_to_even() {
    // amax 127: d = 1 (f16 0x3c00) and multiplier exactly 1, so q = round_half_even(x).
    let mut x = [0.0f32; 32];
    let vals = [127.0, 2.5, -2.5, 0.5, 1.5, -0.5, 3.5, -126.5, 0.49999997];
    x[..vals.len()].copy_from_slice(&vals);
    for isa in Isa::available() {
        let mut q = [0u8; 34];
        quantize_row_with(isa, GgmlType::Q8_0, &x, &mut q).unwrap();
        assert_eq!(&q[..2], &0x3c00u16.to_le_bytes(), "{isa}");
        let qs: Vec<i8> = q[2..11].iter().map(|&b| b as i8).collect();
        assert_eq!(qs, [127, 2, -2, 0, 2, 0, 4, -126, 0], "{isa}");
        assert!(q[11..].iter().all(|&b| b == 0));
    }
    // amax 0: d = 0, all q = 0.
    let mut q = [0xffu8; 34];
    quantize_row(GgmlType::Q8_0, &[0.0; 32], &mut q).unwrap();
    assert_eq!(q, [0u8; 34]);
    // d = 8/127 in f16, multiplier 127/8 = 15.875: x = 0.5 gives 7.9375 -> 8.
    let mut x = [0.5f32; 32];
    x[0] = -8.0;
    quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
    assert_eq!(u16::from_le_bytes([q[0], q[1]]), f32_to_f16(8.0 / 127.0));
    assert_eq!(q[2] as i8, -127);
    assert!(q[3..].iter().all(|&b| b == 8));

    // Dot by hand: weights d = 0.5, q = 2; activations d = 1, q = 0..32: 0.5·2·Σj = 496.
    let mut w = f32_to_f16(0.5).to_le_bytes().to_vec();
    w.extend([2u8; 32]);
    let mut a = f32_to_f16(1.0).to_le_bytes().to_vec();
    a.extend(0..32u8);
    for isa in Isa::available() {
        assert_eq!(
            DotKernel::new(GgmlType::Q8_0, isa).unwrap().dot(32, &w, &a),
            496.0
        );
    }
}

#[test]
fn half_and_bf16_conversions_round_to_nearest_even() {
    assert_eq!(f32_to_f16(65504.0), 0x7bff);
    assert_eq!(f32_to_f16(-65504.0), 0xfbff);
    assert_eq!(f32_to_f16(65519.0), 0x7bff);
    assert_eq!(f32_to_f16(65520.0), 0x7c00); // halfway to 65536: ties to even = inf
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00); // tie, even stays
    assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02); // tie, odd rounds up
    assert_eq!(f32_to_f16(2f32.powi(-25)), 0); // tie between 0 and the smallest subnormal
    assert_eq!(f32_to_f16(2f32.powi(-24)), 1);
    assert_eq!(f16_to_f32(1), 2f32.powi(-24));
    use crate::scalar::shared::{bf16_to_f32, f32_to_bf16};
    assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
    assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up to inf
    assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0); // NaN made quiet
    assert_eq!(bf16_to_f32(0x3f80), 1.0);
    // Through the public API on every ISA.
    for isa in Isa::available() {
        let mut b = [0u8; 4];
        quantize_row_with(isa, GgmlType::F16, &[65504.0, -65520.0], &mut b).unwrap();
        assert_eq!(b, [0xff, 0x7b, 0x00, 0xfc], "{isa}");
        let mut y = [0.0f32; 2];
        dequantize_row_with(isa, GgmlType::F16, &b, &mut y).unwrap();
        assert_eq!(y, [65504.0, f32::NEG_INFINITY]);
    }
}

// ---------------------------------------------------------------------------------------------
// every ISA against the scalar reference, bit for bit

#[test]
fn dot_all_isas_bit_exact_with_scalar() {
    let mut rng = Rng(1);
    for ty in TYPES {
        let kernels: Vec<DotKernel> = Isa::available()
            .into_iter()
            .map(|i| DotKernel::new(ty, i).unwrap())
            .collect();
        for &n in lens(ty) {
            for case in 0..3 {
                let w = weight_row(ty, n, &mut rng);
                let a = if case == 2 && ty.block_elems() == 32 {
                    // Raw random activation blocks: every int8 value, including -128.
                    weight_row(GgmlType::Q8_0, n, &mut rng)
                } else {
                    act_row(ty, &act_values(n, &mut rng))
                };
                let want = kernels[0].dot(n, &w, &a);
                for k in &kernels[1..] {
                    let got = k.dot(n, &w, &a);
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

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_without_vnni_bit_exact_with_scalar() {
    if !Isa::Avx512.is_available() {
        eprintln!("skipped: no AVX-512 on this CPU");
        return;
    }
    let mut rng = Rng(2);
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        let k = DotKernel::resolve(ty, Isa::Avx512, false).unwrap();
        assert!(!k.name().contains("vnni"));
        let s = DotKernel::new(ty, Isa::Scalar).unwrap();
        for &n in lens(ty) {
            let w = weight_row(ty, n, &mut rng);
            let a = weight_row(GgmlType::Q8_0, n, &mut rng);
            assert!(same(k.dot(n, &w, &a), s.dot(n, &w, &a)), "{ty} n={n}");
            let mut out = [0.0f32; 6];
            let rows: Vec<u8> = (0..6).flat_map(|_| weight_row(ty, n, &mut rng)).collect();
            k.dot_rows(n, &rows, &a, &mut out);
            let rb = k.weight_row_bytes(n);
            for (r, o) in out.iter().enumerate() {
                assert!(same(*o, s.dot(n, &rows[r * rb..(r + 1) * rb], &a)));
            }
        }
    }
}

/// The VNNI Q8_0 rows kernel biases the weights to unsigned bytes for rows it can prepare;
/// rows too long for its stack buffers and activations holding -128 (whose product ggml's
/// sign trick wraps) take the sign-trick kernel. All three against the scalar reference.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_vnni_q8_0_rows_every_path_bit_exact_with_scalar() {
    let k = DotKernel::new(GgmlType::Q8_0, Isa::Avx512).ok();
    let Some(k) = k.filter(|k| k.name().contains("vnni")) else {
        eprintln!("skipped: no AVX-512 VNNI on this CPU");
        return;
    };
    let s = DotKernel::new(GgmlType::Q8_0, Isa::Scalar).unwrap();
    let mut rng = Rng(4);
    for (n, raw) in [
        (96, false),
        (2880, false),
        (8192, false),
        (8224, false),
        (2880, true),
        (256, true),
    ] {
        // Spread values quantise to -127..=127 (`act_values`' subnormal in a zero block
        // makes a -128, 0 times an infinite inverse scale).
        let a = if raw {
            weight_row(GgmlType::Q8_0, n, &mut rng)
        } else {
            act_row(
                GgmlType::Q8_0,
                &(0..n).map(|_| rng.spread()).collect::<Vec<_>>(),
            )
        };
        assert_eq!(raw, a.chunks(34).any(|b| b[2..].contains(&0x80)), "n={n}");
        let rows: Vec<u8> = (0..7)
            .flat_map(|_| weight_row(GgmlType::Q8_0, n, &mut rng))
            .collect();
        let mut out = [f32::NAN; 7];
        k.dot_rows(n, &rows, &a, &mut out);
        let rb = k.weight_row_bytes(n);
        for (r, o) in out.iter().enumerate() {
            let want = s.dot(n, &rows[r * rb..(r + 1) * rb], &a);
            assert!(same(*o, want), "n={n} raw={raw} row {r}: {o} vs {want}");
        }
    }
}

#[test]
fn dot_rows_equals_dot_per_row() {
    let mut rng = Rng(3);
    for ty in TYPES {
        for isa in Isa::available() {
            let k = DotKernel::new(ty, isa).unwrap();
            for &n in &lens(ty)[..4] {
                for nrows in [0, 1, 3, 4, 7, 9] {
                    let rows: Vec<u8> = (0..nrows)
                        .flat_map(|_| weight_row(ty, n, &mut rng))
                        .collect();
                    let a = act_row(ty, &act_values(n, &mut rng));
                    assert_rows_equal_dots(&k, n, &rows, &a, nrows);
                }
            }
        }
    }
}

#[test]
fn quantize_all_isas_bit_exact_with_scalar() {
    let mut rng = Rng(4);
    let mut specials = vec![
        0.0,
        -0.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        65504.0,
        65520.0,
        -65519.99,
        2f32.powi(-25),
        2f32.powi(-24) * 1.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc1_2345),
    ];
    specials.resize(64, 1.0);
    // Random bit patterns cover every exponent, subnormals, infinities and NaNs.
    let bits: Vec<f32> = (0..1 << 16)
        .map(|_| f32::from_bits(rng.u64() as u32))
        .collect();
    let mut blocks = act_values(2880, &mut rng);
    // Blocks whose multiplied values land exactly on .5 ties.
    blocks.extend((0..64).map(|i| (i as f32 - 31.5) * 127.0 / 31.5));
    for ty in TYPES {
        for x in [&specials, &bits, &blocks] {
            let nb = ty.row_bytes(x.len() as u64).unwrap() as usize;
            let mut want = vec![0u8; nb];
            quantize_row_with(Isa::Scalar, ty, x, &mut want).unwrap();
            for isa in Isa::available() {
                let mut got = vec![0u8; nb];
                quantize_row_with(isa, ty, x, &mut got).unwrap();
                assert!(got == want, "{ty} on {isa}");
            }
        }
    }
}

#[test]
fn dequantize_all_isas_bit_exact_with_scalar() {
    let mut rng = Rng(5);
    for ty in TYPES {
        for n in [32, 64, 2880, 2912] {
            // Random bytes: every bit pattern of every format, NaNs included.
            let src: Vec<u8> = (0..ty.row_bytes(n).unwrap()).map(|_| rng.byte()).collect();
            let n = n as usize;
            let want = dequant(ty, &src, n);
            for isa in Isa::available() {
                let mut got = vec![0.0f32; n];
                dequantize_row_with(isa, ty, &src, &mut got).unwrap();
                for (g, w) in got.iter().zip(&want) {
                    assert!(same(*g, *w), "{ty} on {isa}: {g} vs {w}");
                }
            }
            let mut got = vec![0.0f32; n];
            Dequantizer::new(ty).unwrap().row(&src, &mut got);
            assert!(
                got.iter().zip(&want).all(|(g, w)| same(*g, *w)),
                "{ty}: Dequantizer"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// accuracy against exact arithmetic

/// Largest |x - q·d16| of a Q8_0 element: half a step of the exact d = amax/127 (the multiplier
/// 127/amax is rounded, hence the 1e-4 slack), plus |q| ≤ 127 times the f16 rounding of d.
fn q8_0_err_bound(amax: f32, d16: f32) -> f64 {
    let d = amax as f64 / 127.0;
    d * 0.5 * 1.0001 + 127.0 * (d - d16 as f64).abs()
}

/// |x - dequantize(quantize(x))| is within each format's rounding error.
#[test]
fn round_trip_error_is_bounded() {
    let mut rng = Rng(6);
    let x = act_values(2880, &mut rng);
    for ty in TYPES {
        let mut q = vec![0u8; ty.row_bytes(2880).unwrap() as usize];
        quantize_row(ty, &x, &mut q).unwrap();
        let y = dequant(ty, &q, x.len());
        for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (&x, &y) in xb.iter().zip(yb) {
                let err = (x - y).abs();
                let bound = match ty {
                    GgmlType::F32 => 0.0,
                    // Half an ulp, or half the smallest subnormal.
                    GgmlType::F16 => (x.abs() * 2f32.powi(-11)).max(2f32.powi(-25)),
                    GgmlType::BF16 => (x.abs() * 2f32.powi(-8)).max(2f32.powi(-134)),
                    GgmlType::Q8_0 => {
                        let d16 = f16_to_f32(u16::from_le_bytes([q[b * 34], q[b * 34 + 1]]));
                        q8_0_err_bound(amax, d16) as f32
                    }
                    // Scale s = 2^(floor(log2 amax) - 3): half the widest gap (8..12) is 2s,
                    // clipping above 12s loses < 4s.
                    _ => {
                        let e = q[b * 17];
                        4.0 * e8m0_to_f32_half(e)
                    }
                };
                assert!(
                    err <= bound,
                    "{ty} block {b}: {x} -> {y} (err {err}, bound {bound})"
                );
            }
        }
    }
}

/// dot(w, quantize(x)) against Σ dequantize(w)·x in f64: the difference is the activation
/// quantisation error plus f32 accumulation rounding.
#[test]
fn dot_matches_f64_reference_within_quantisation_error() {
    let mut rng = Rng(7);
    for ty in TYPES {
        let k = DotKernel::best(ty).unwrap();
        for &n in lens(ty) {
            let mut w = weight_row(ty, n, &mut rng);
            if ty == GgmlType::MXFP4 {
                // Keep scales moderate so that 2^-128 scales do not flush products to zero.
                w.chunks_mut(17).for_each(|b| b[0] = 120 + b[0] % 16);
            }
            let x: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
            let a = act_row(ty, &x);
            let wd = dequant(ty, &w, n);
            let exact: f64 = wd.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
            let abs: f64 = wd
                .iter()
                .zip(&x)
                .map(|(&w, &x)| (w as f64 * x as f64).abs())
                .sum();
            // Σ |w_i| · (max quantisation error of x_i).
            let mut qerr = 0.0f64;
            for (b, (wb, xb)) in wd.chunks(32).zip(x.chunks(32)).enumerate() {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (&w, &x) in wb.iter().zip(xb) {
                    let e = match vec_dot_type(ty) {
                        GgmlType::F32 => 0.0,
                        GgmlType::F16 => (x.abs() as f64) * 2f64.powi(-11) + 2f64.powi(-25),
                        GgmlType::BF16 => (x.abs() as f64) * 2f64.powi(-8),
                        _ => {
                            let d16 = f16_to_f32(u16::from_le_bytes([a[b * 34], a[b * 34 + 1]]));
                            q8_0_err_bound(amax, d16)
                        }
                    };
                    qerr += (w.abs() as f64) * e;
                }
            }
            // f32 accumulation: generous n·2^-24 relative to Σ|w·x| (observed far below).
            let bound = qerr * 1.001 + abs * (n as f64) * 2f64.powi(-24) + 1e-30;
            let got = k.dot(n, &w, &a) as f64;
            assert!(
                (got - exact).abs() <= bound,
                "{} n={n}: {got} vs {exact} (bound {bound})",
                k.name()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dispatch and errors

#[test]
fn isa_detection_and_avx512_path_runs_here() {
    let avail = Isa::available();
    assert_eq!(avail[0], Isa::Scalar);
    assert_eq!(*avail.last().unwrap(), Isa::best());
    #[cfg(target_arch = "x86_64")]
    {
        let has512 = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if !has512 {
            eprintln!("skipped: this CPU has no AVX-512 F/BW/VL");
            return;
        }
        assert_eq!(Isa::best(), Isa::Avx512);
        let vnni = is_x86_feature_detected!("avx512vnni");
        let mut rng = Rng(8);
        for ty in TYPES {
            let k = DotKernel::best(ty).unwrap();
            assert_eq!(k.isa(), Isa::Avx512);
            let quant = matches!(ty, GgmlType::Q8_0 | GgmlType::MXFP4);
            let suffix = if vnni && quant {
                "/avx512vnni"
            } else {
                "/avx512"
            };
            assert!(k.name().ends_with(suffix), "{}", k.name());
            let n = 2880;
            let w = weight_row(ty, n, &mut rng);
            let a = act_row(ty, &act_values(n, &mut rng));
            let s = DotKernel::new(ty, Isa::Scalar).unwrap();
            assert!(same(k.dot(n, &w, &a), s.dot(n, &w, &a)));
        }
    }
}

#[test]
fn errors_for_bad_input() {
    let mut buf = [0u8; 34];
    assert_eq!(
        quantize_row(GgmlType::Q4_K, &[0.0; 256], &mut [0u8; 144]),
        Err(QuantError::Unsupported {
            ty: GgmlType::Q4_K,
            op: "quantize"
        })
    );
    // Q8_1 and Q8_K are activation formats only.
    for ty in [GgmlType::Q8_1, GgmlType::Q8_K] {
        assert!(matches!(
            DotKernel::best(ty),
            Err(QuantError::Unsupported { op: "dot", .. })
        ));
    }
    assert_eq!(
        quantize_row(GgmlType::Q8_0, &[0.0; 33], &mut buf),
        Err(QuantError::NotBlockMultiple {
            ty: GgmlType::Q8_0,
            n: 33,
            block: 32
        })
    );
    assert_eq!(
        quantize_row(GgmlType::Q8_0, &[0.0; 32], &mut buf[..33]),
        Err(QuantError::LengthMismatch {
            ty: GgmlType::Q8_0,
            n: 32,
            expected: 34,
            got: 33
        })
    );
    assert!(matches!(
        dequantize_row(GgmlType::MXFP4, &[0u8; 18], &mut [0.0; 32]),
        Err(QuantError::LengthMismatch { expected: 17, .. })
    ));
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !isa.is_available() {
            assert_eq!(
                DotKernel::new(GgmlType::F32, isa).err(),
                Some(QuantError::IsaUnavailable(isa))
            );
        }
    }
    // Empty rows are fine.
    quantize_row(GgmlType::Q8_0, &[], &mut []).unwrap();
    assert_eq!(
        DotKernel::best(GgmlType::MXFP4).unwrap().dot(0, &[], &[]),
        0.0
    );
}

#[test]
fn vec_dot_types_follow_ggml() {
    assert_eq!(vec_dot_type(GgmlType::F32), GgmlType::F32);
    assert_eq!(vec_dot_type(GgmlType::F16), GgmlType::F16);
    assert_eq!(vec_dot_type(GgmlType::BF16), GgmlType::BF16);
    assert_eq!(vec_dot_type(GgmlType::Q8_0), GgmlType::Q8_0);
    assert_eq!(vec_dot_type(GgmlType::MXFP4), GgmlType::Q8_0);
    assert_eq!(vec_dot_type(GgmlType::Q4_1), GgmlType::Q8_1);
    assert_eq!(vec_dot_type(GgmlType::Q6_K), GgmlType::Q8_K);
    for ty in TYPES {
        let k = DotKernel::new(ty, Isa::Scalar).unwrap();
        assert_eq!((k.weight_type(), k.act_type()), (ty, vec_dot_type(ty)));
    }
}

#[test]
fn kernels_are_send_sync_copy() {
    fn check<T: Send + Sync + Copy + 'static>() {}
    check::<DotKernel>();
    check::<Isa>();
}

#[test]
#[should_panic(expected = "are not the")]
fn dequantizer_refuses_a_short_row() {
    Dequantizer::new(GgmlType::Q8_0)
        .unwrap()
        .row(&[0u8; 33], &mut [0.0; 32]);
}

#[test]
fn f16_bytes_are_the_little_endian_values() {
    let v = [
        half::f16::from_f32(1.5),
        half::f16::from_f32(-2.0),
        half::f16::NAN,
    ];
    let want: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(f16_bytes(&v), &want[..]);
    assert!(f16_bytes(&[]).is_empty());
}

#[test]
fn prefetch_is_only_a_hint() {
    let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
    for (a, b) in [(0, 0), (0, 1), (3, 70), (63, 1000), (999, 1000)] {
        prefetch(&data[a..b]);
    }
    assert!(data.iter().enumerate().all(|(i, &v)| v == i as u8));
}

/// `whole_pages` gives exactly the page-aligned addresses inside the bytes: none for an empty
/// slice or one inside a single page, and the inner pages of an unaligned slice.
#[cfg(unix)]
#[test]
fn whole_pages_are_the_aligned_pages_inside() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let data = vec![0u8; 4 * page];
    let base = data.as_ptr() as usize;
    let first = base.next_multiple_of(page);
    let at = first - base;
    assert_eq!(
        whole_pages(&data[at..at + 2 * page]),
        Some(first..first + 2 * page)
    );
    assert_eq!(
        whole_pages(&data[at + 1..at + 2 * page]),
        Some(first + page..first + 2 * page)
    );
    assert_eq!(whole_pages(&data[at + 1..at + 2 * page - 1]), None);
    assert_eq!(whole_pages(&data[at..at + page - 1]), None);
    assert_eq!(whole_pages(&[]), None);
}
