//! Property tests: every SIMD path this CPU can run gives the scalar reference's bits, for
//! random rows of random lengths and value ranges (proptest shrinks a failure to the smallest
//! row that shows it).
//!
//! Covered per weight type: `quantize_row`, `dequantize_row`, `DotKernel::dot` and `dot_rows`,
//! and for the GEMM types `GemmKernel::gemm`. K-quant weights cannot be quantised by this
//! crate, so their blocks are random bytes (a NaN from a random scale must then be NaN on
//! every path).

use hmoe_quant::{
    dequantize_row_with, quantize_row_with, vec_dot_type, DotKernel, GemmKernel, GgmlType, Isa,
};
use proptest::prelude::*;

/// Weight types with a dot kernel.
const WEIGHTS: [GgmlType; 14] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::MXFP4,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

fn is_k_quant(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
    )
}

/// The SIMD ISAs of this CPU (the scalar reference excluded).
fn simd_isas() -> Vec<Isa> {
    Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .collect()
}

/// Same bits, or both NaN.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Deterministic floats from a seed, scaled by `scale`; a few exact zeros and large outliers
/// so rounding ties and saturation are exercised.
fn floats(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            match i % 37 {
                0 => 0.0,
                1 => u * scale * 50.0,
                _ => u * scale,
            }
        })
        .collect()
}

/// A weight row of `n` elements of `ty`: quantised floats, or random bytes for K-quants.
fn weight_row(ty: GgmlType, n: usize, seed: u64, scale: f32) -> Vec<u8> {
    let bytes = ty.row_bytes(n as u64).unwrap() as usize;
    if is_k_quant(ty) {
        let mut s = seed | 1;
        return (0..bytes)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 56) as u8
            })
            .collect();
    }
    let mut out = vec![0u8; bytes];
    quantize_row_with(Isa::Scalar, ty, &floats(seed, n, scale), &mut out).unwrap();
    out
}

/// Row lengths: whole blocks of every type (K-quants need 256).
fn lengths() -> impl Strategy<Value = usize> {
    (1usize..=6).prop_map(|blocks| blocks * 256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn quantize_and_dequantize_match_the_scalar_reference(
        n in lengths(), seed in any::<u64>(), scale in 1e-3f32..1e3,
    ) {
        let x = floats(seed, n, scale);
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K, GgmlType::F16, GgmlType::BF16] {
            let bytes = ty.row_bytes(n as u64).unwrap() as usize;
            let mut want = vec![0u8; bytes];
            quantize_row_with(Isa::Scalar, ty, &x, &mut want).unwrap();
            for isa in simd_isas() {
                let mut got = vec![0u8; bytes];
                quantize_row_with(isa, ty, &x, &mut got).unwrap();
                prop_assert_eq!(&got, &want, "quantize {:?} on {:?}", ty, isa);
            }
        }
        for ty in WEIGHTS {
            let w = weight_row(ty, n, seed, scale);
            let mut want = vec![0f32; n];
            dequantize_row_with(Isa::Scalar, ty, &w, &mut want).unwrap();
            for isa in simd_isas() {
                let mut got = vec![0f32; n];
                dequantize_row_with(isa, ty, &w, &mut got).unwrap();
                let bad = got.iter().zip(&want).position(|(&g, &e)| !same(g, e));
                prop_assert!(bad.is_none(), "dequantize {:?} on {:?} at {:?}", ty, isa, bad);
            }
        }
    }

    #[test]
    fn dot_kernels_match_the_scalar_reference(
        n in lengths(), seed in any::<u64>(), scale in 1e-3f32..1e2, rows in 1usize..=9,
    ) {
        for ty in WEIGHTS {
            let act_ty = vec_dot_type(ty);
            let mut acts = vec![0u8; act_ty.row_bytes(n as u64).unwrap() as usize];
            quantize_row_with(Isa::Scalar, act_ty, &floats(seed ^ 0x5555, n, scale), &mut acts)
                .unwrap();
            let w: Vec<u8> = (0..rows)
                .flat_map(|r| weight_row(ty, n, seed.wrapping_add(r as u64), scale))
                .collect();
            let reference = DotKernel::new(ty, Isa::Scalar).unwrap();
            let rb = reference.weight_row_bytes(n);
            let want: Vec<f32> = w
                .chunks_exact(rb)
                .map(|row| reference.dot(n, row, &acts))
                .collect();
            for isa in simd_isas() {
                let kernel = DotKernel::new(ty, isa).unwrap();
                let mut got = vec![0f32; rows];
                kernel.dot_rows(n, &w, &acts, &mut got);
                for (r, row) in w.chunks_exact(rb).enumerate() {
                    let one = kernel.dot(n, row, &acts);
                    prop_assert!(same(one, want[r]), "{}: dot row {} {} vs {}", kernel.name(), r, one, want[r]);
                    prop_assert!(same(got[r], want[r]), "{}: dot_rows row {} {} vs {}", kernel.name(), r, got[r], want[r]);
                }
            }
        }
    }

    #[test]
    fn gemm_kernels_match_the_scalar_reference(
        blocks in 1usize..=4, seed in any::<u64>(), rows in 1usize..=20, tokens in 1usize..=9,
    ) {
        let n = blocks * 32;
        for ty in [
            GgmlType::Q8_0,
            GgmlType::MXFP4,
            GgmlType::F32,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
        ] {
            let act_ty = GemmKernel::new(ty, Isa::Scalar).unwrap().act_type();
            let ab = act_ty.row_bytes(n as u64).unwrap() as usize;
            let mut acts = vec![0u8; ab * tokens];
            for (t, a) in acts.chunks_exact_mut(ab).enumerate() {
                quantize_row_with(Isa::Scalar, act_ty, &floats(seed ^ t as u64, n, 3.0), a)
                    .unwrap();
            }
            let w: Vec<u8> = (0..rows)
                .flat_map(|r| weight_row(ty, n, seed.wrapping_add(r as u64 * 7), 1.0))
                .collect();
            let reference = GemmKernel::new(ty, Isa::Scalar).unwrap();
            let mut want = vec![0f32; rows * tokens];
            reference
                .gemm(&w, &reference.prepare(n, &acts, tokens).unwrap(), &mut want)
                .unwrap();
            for isa in simd_isas() {
                let kernel = GemmKernel::new(ty, isa).unwrap();
                let mut got = vec![0f32; rows * tokens];
                kernel
                    .gemm(&w, &kernel.prepare(n, &acts, tokens).unwrap(), &mut got)
                    .unwrap();
                let bad = got.iter().zip(&want).position(|(&g, &e)| !same(g, e));
                prop_assert!(bad.is_none(), "{}: gemm element {:?}", kernel.name(), bad);
            }
        }
    }
}
