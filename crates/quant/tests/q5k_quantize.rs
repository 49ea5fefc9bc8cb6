//! The Q5_K quantiser (for test files): ggml's layout, read back by the Q5_K dequantiser within
//! half a quant step of every value, on every ISA with the same bytes.

use hmoe_quant::{dequantize_row, quantize_row_with, GgmlType, Isa};

mod common;
use common::Rng;

#[test]
fn q5_k_round_trips_within_half_a_step() {
    let mut rng = Rng(0x05c0_ffee_1234_5678);
    let n = 256 * 4;
    let cases: Vec<Vec<f32>> = vec![
        (0..n).map(|_| rng.unit()).collect(),
        (0..n)
            .map(|i| rng.unit() * if i % 7 == 0 { 300.0 } else { 0.01 })
            .collect(),
        (0..n).map(|_| rng.unit().abs() + 2.0).collect(),
        (0..n).map(|_| -rng.unit().abs() - 1e-3).collect(),
        vec![0.0; n],
    ];
    for (c, x) in cases.iter().enumerate() {
        let mut q = vec![0u8; 176 * n / 256];
        quantize_row_with(Isa::Scalar, GgmlType::Q5_K, x, &mut q).unwrap();
        for isa in [Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.is_available())
        {
            let mut other = vec![0u8; q.len()];
            quantize_row_with(isa, GgmlType::Q5_K, x, &mut other).unwrap();
            assert_eq!(other, q, "case {c} on {isa:?}");
        }
        let mut back = vec![0f32; n];
        dequantize_row(GgmlType::Q5_K, &q, &mut back).unwrap();
        for (sb, (xs, ys)) in x.chunks(256).zip(back.chunks(256)).enumerate() {
            let b = &q[176 * sb..176 * (sb + 1)];
            let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            let dmin = half::f16::from_le_bytes([b[2], b[3]]).to_f32();
            for j in 0..8 {
                let g = &xs[32 * j..32 * j + 32];
                let range =
                    g.iter().fold(0f32, |m, &v| m.max(v)) - g.iter().fold(0f32, |m, &v| m.min(v));
                // Half a step d·sc, with sc ≤ ⌈(range + dmin)/(31·d)⌉, plus float rounding.
                let bound = 0.5 * ((range + dmin) / 31.0 + d) * 1.001 + 1e-6 * range + 1e-30;
                for (e, (&a, &b)) in g.iter().zip(&ys[32 * j..32 * j + 32]).enumerate() {
                    assert!(
                        (a - b).abs() <= bound,
                        "case {c} super-block {sb} element {}: {a} -> {b} (bound {bound})",
                        32 * j + e
                    );
                }
            }
        }
    }
}
