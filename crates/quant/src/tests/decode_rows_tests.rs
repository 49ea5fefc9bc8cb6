//! The single-token row kernels (`dot_rows`, decode's mat-vec) on every path they take, held
//! to the scalar reference's `dot` bit for bit: the AVX-512 VNNI Q5_0 kernel that prepares the
//! activation row (every row count around its groups of four, rows of 1–257 blocks, tails of
//! the 8-block steps) and its fallbacks (activations holding -128, rows longer than it
//! prepares).

use super::lowbit_tests::{act_row, act_values, kernels, raw_act_row, weight_row};
use crate::tests::{same, Rng};
use crate::*;
use GgmlType::*;

/// Every kernel of `ty` here against the scalar `dot` of each row, for `nrows` rows of `n`.
fn check_rows(ty: GgmlType, n: usize, nrows: usize, a: &[u8], rng: &mut Rng, what: &str) {
    let scalar = DotKernel::new(ty, Isa::Scalar).unwrap();
    let rows: Vec<u8> = (0..nrows).flat_map(|_| weight_row(ty, n, rng)).collect();
    let rb = scalar.weight_row_bytes(n);
    let want: Vec<f32> = (0..nrows)
        .map(|r| scalar.dot(n, &rows[r * rb..(r + 1) * rb], a))
        .collect();
    for k in kernels(ty) {
        let mut out = vec![f32::NAN; nrows];
        k.dot_rows(n, &rows, a, &mut out);
        for (r, (o, w)) in out.iter().zip(&want).enumerate() {
            assert!(
                same(*o, *w),
                "{} n={n} {what} row {r}/{nrows}: {o} vs {w}",
                k.name()
            );
        }
    }
}

/// Whether a Q8_0 activation row holds the quant -128.
fn has_min_quant(a: &[u8]) -> bool {
    a.chunks(34).any(|b| b[2..].contains(&0x80))
}

#[test]
fn q5_0_rows_every_path_bit_exact_with_scalar() {
    let mut rng = Rng(46);
    let mut prepared = 0;
    // 1, 7, 8, 9 and 28 blocks (steps of 8 and their tails), 152 (Qwen2.5's 4864), 256 (the
    // most prepared), 257 (too long: the sign-trick kernel).
    for n in [32, 224, 256, 288, 896, 4864, 8192, 8224] {
        let spread: Vec<f32> = (0..n).map(|_| rng.spread()).collect();
        let mut raw = raw_act_row(Q5_0, n, &mut rng);
        let at = 34 * rng.below((n / 32) as u64) as usize + 2 + rng.below(32) as usize;
        raw[at] = 0x80;
        let acts = [
            ("spread", act_row(Q5_0, &spread)),
            ("edge values", act_row(Q5_0, &act_values(n, &mut rng))),
            ("raw bytes with -128", raw),
        ];
        for (what, a) in &acts {
            prepared += usize::from(!has_min_quant(a) && n <= 8192);
            for nrows in [1, 3, 4, 5, 8, 13] {
                check_rows(Q5_0, n, nrows, a, &mut rng, what);
            }
        }
    }
    assert!(prepared >= 7, "the prepared path ran ({prepared} rows)");
}
