//! The IQ types' dot products: every ISA gives the scalar reference's bits, the multi-row entry
//! point equals the single-row one, and the result equals the exact sum of the dequantised
//! weights times the dequantised activations up to f32 accumulation error (which catches a wrong
//! scale, sign, grid index or constant in the product).

use hmoe_quant::{
    dequantize_row, quantize_row, set_iq_block_scale, vec_dot_type, BatchKind, DotKernel, GgmlType,
    Isa, IQ_TYPES,
};

mod common;
use common::Rng;

/// `rows` random weight rows of `n` elements: random codes, finite f16 scales from 2^-14 to 2^3
/// of either sign (IQ1_M keeps its scale in the top nibbles of its scale words).
fn weights(ty: GgmlType, n: usize, rows: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut raw: Vec<u8> = (0..rows * n / ty.block_elems() * bb)
        .map(|_| rng.next() as u8)
        .collect();
    for b in raw.chunks_exact_mut(bb) {
        let exp = 1 + rng.next() % 17;
        let d = (rng.next() as u16 & 0x83ff) | (exp as u16) << 10;
        assert!(set_iq_block_scale(ty, b, d));
    }
    raw
}

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.is_available())
        .collect()
}

#[test]
fn iq_dots_equal_the_dequantised_sum_on_every_isa() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for ty in IQ_TYPES {
        let act = vec_dot_type(ty);
        for n in [ty.block_elems(), 512, 2048, 32 * 7] {
            if n % ty.block_elems() != 0 {
                continue;
            }
            let rows = 5;
            let w = weights(ty, n, rows, &mut rng);
            // Activations spanning several binades within a block, as real ones do.
            let x: Vec<f32> = (0..n)
                .map(|i| rng.unit() * if i % 7 == 0 { 30.0 } else { 1.0 })
                .collect();
            let mut a = vec![0u8; act.row_bytes(n as u64).unwrap() as usize];
            quantize_row(act, &x, &mut a).unwrap();
            let mut av = vec![0.0f32; n];
            dequantize_row(act, &a, &mut av).unwrap();
            let rb = ty.row_bytes(n as u64).unwrap() as usize;
            let reference = DotKernel::new(ty, Isa::Scalar).unwrap();
            for r in 0..rows {
                let row = &w[r * rb..(r + 1) * rb];
                let mut wv = vec![0.0f32; n];
                dequantize_row(ty, row, &mut wv).unwrap();
                let exact: f64 = wv.iter().zip(&av).map(|(&p, &q)| p as f64 * q as f64).sum();
                let scale: f64 = wv
                    .iter()
                    .zip(&av)
                    .map(|(&p, &q)| (p as f64 * q as f64).abs())
                    .sum();
                let got = reference.dot(n, row, &a);
                let err = (got as f64 - exact).abs();
                assert!(
                    err <= 2e-6 * scale + 1e-30,
                    "{ty} n={n} row {r}: dot {got:e}, exact {exact:e}, err {err:e}, scale {scale:e}"
                );
            }
            let mut want = vec![0.0f32; rows];
            for (r, o) in want.iter_mut().enumerate() {
                *o = reference.dot(n, &w[r * rb..(r + 1) * rb], &a);
            }
            for isa in isas() {
                let k = DotKernel::new(ty, isa).unwrap();
                assert_eq!(k.act_type(), act);
                let mut out = vec![0.0f32; rows];
                k.dot_rows(n, &w, &a, &mut out);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&want), "{ty} n={n} on {isa:?}");
            }
        }
    }
}

/// An activation row of `act` (Q8_K or Q8_0) of `n` elements from raw random bytes: every code
/// from -128 to 127 (or all -128, or all 127 when `fill` says so), block sums that match the
/// codes, and the scale `d` (f32 for Q8_K, f16 bits of `d` for Q8_0).
fn raw_acts(act: GgmlType, n: usize, fill: Option<i8>, d: f32, rng: &mut Rng) -> Vec<u8> {
    let mut a = vec![0u8; act.row_bytes(n as u64).unwrap() as usize];
    for b in a.chunks_exact_mut(act.block_bytes()) {
        let (qs, len) = if act == GgmlType::Q8_K {
            b[..4].copy_from_slice(&d.to_le_bytes());
            (4, 256)
        } else {
            b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            (2, 32)
        };
        for q in &mut b[qs..qs + len] {
            *q = fill.unwrap_or(rng.next() as i8) as u8;
        }
        if act == GgmlType::Q8_K {
            for k in 0..16 {
                let sum: i16 = b[4 + 16 * k..20 + 16 * k]
                    .iter()
                    .map(|&q| q as i8 as i16)
                    .sum();
                b[260 + 2 * k..262 + 2 * k].copy_from_slice(&sum.to_le_bytes());
            }
        }
    }
    a
}

#[test]
fn iq_simd_dots_equal_scalar_on_extreme_blocks() {
    let mut rng = Rng(0x0bad_cafe_f00d_1234);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for ty in IQ_TYPES {
        let act = vec_dot_type(ty);
        let reference = DotKernel::new(ty, Isa::Scalar).unwrap();
        // Weight scales: the largest finite f16 of both signs, the smallest subnormal, one.
        let scales: [u16; 5] = [0x7bff, 0xfbff, 0x0001, 0x3c00, 0x8400];
        let fills = [None, Some(-128), Some(127), Some(0)];
        for (case, (&wd, fill)) in scales.iter().zip(fills.iter().cycle()).enumerate() {
            for n in [ty.block_elems(), 3 * 256, 32 * 5] {
                if n % ty.block_elems() != 0 {
                    continue;
                }
                let rows = 3;
                let mut w = weights(ty, n, rows, &mut rng);
                for b in w.chunks_exact_mut(ty.block_bytes()) {
                    assert!(set_iq_block_scale(ty, b, wd));
                }
                let ad = [1e-30, 3.0e4, -1.0, 7.5e-3, 1.0][case];
                let a = raw_acts(act, n, *fill, ad, &mut rng);
                let rb = ty.row_bytes(n as u64).unwrap() as usize;
                let want: Vec<f32> = (0..rows)
                    .map(|r| reference.dot(n, &w[r * rb..(r + 1) * rb], &a))
                    .collect();
                for isa in isas() {
                    let k = DotKernel::new(ty, isa).unwrap();
                    let mut out = vec![0.0f32; rows];
                    k.dot_rows(n, &w, &a, &mut out);
                    let single: Vec<f32> = (0..rows)
                        .map(|r| k.dot(n, &w[r * rb..(r + 1) * rb], &a))
                        .collect();
                    let at = format!("{ty} n={n} case {case} on {isa:?} ({})", k.name());
                    assert_eq!(bits(&out), bits(&want), "{at}");
                    assert_eq!(bits(&single), bits(&want), "{at}");
                }
            }
        }
    }
}

/// The batched products (`dot_tokens_rows`: AVX2, and AVX-512 VNNI where the CPU has it) of
/// every IQ type give the scalar `dot` per token, bit for bit, also for activation bytes of
/// -128 (which the sign trick leaves negative).
#[test]
fn iq_batches_equal_the_scalar_dot_per_token() {
    let mut rng = Rng(0x5eed_0f1a_2b3c);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for ty in IQ_TYPES {
        let act = vec_dot_type(ty);
        let reference = DotKernel::new(ty, Isa::Scalar).unwrap();
        // Every token count from 1 to 19 (the VNNI and AVX2 batch kernels' loops), and other
        // row lengths.
        let counts = (1..=19).map(|t| (512, t));
        let other = [(ty.block_elems(), 1), (768, 9), (32 * 5, 4)];
        for (n, n_tokens) in counts.chain(other) {
            if n % ty.block_elems() != 0 {
                continue;
            }
            let rows = 5;
            let w = weights(ty, n, rows, &mut rng);
            let ab = act.row_bytes(n as u64).unwrap() as usize;
            let mut acts = Vec::new();
            for t in 0..n_tokens {
                let fill = [None, Some(-128), None][t % 3];
                acts.extend(raw_acts(act, n, fill, 0.5 + t as f32, &mut rng));
            }
            let rb = ty.row_bytes(n as u64).unwrap() as usize;
            let mut want = vec![0.0f32; rows * n_tokens];
            for (i, o) in want.iter_mut().enumerate() {
                let (r, t) = (i / n_tokens, i % n_tokens);
                *o = reference.dot(n, &w[r * rb..(r + 1) * rb], &acts[t * ab..(t + 1) * ab]);
            }
            for isa in isas() {
                let k = DotKernel::new(ty, isa).unwrap();
                for kind in [BatchKind::Dense, BatchKind::Expert] {
                    let mut out = vec![0.0f32; rows * n_tokens];
                    k.dot_tokens_rows(kind, n, &w, &acts, n_tokens, &mut out);
                    let at = format!("{ty} n={n} {n_tokens} tokens {kind:?} on {isa:?}");
                    assert_eq!(bits(&out), bits(&want), "{at}");
                }
            }
        }
    }
}

#[test]
fn iq_dots_run_simd_kernels_where_the_cpu_has_them() {
    for ty in IQ_TYPES {
        for isa in isas() {
            let name = DotKernel::new(ty, isa).unwrap().name();
            let want: &[&str] = match isa {
                Isa::Scalar => &["/scalar"],
                // IQ2_XXS rows have AVX-512 VBMI kernels where the CPU has VBMI and BITALG.
                Isa::Avx512 if ty == GgmlType::IQ2_XXS => &["/avx2", "/avx512vbmi"],
                _ => &["/avx2"],
            };
            assert!(
                want.iter().any(|w| name.ends_with(w)),
                "{ty} on {isa:?}: {name}"
            );
        }
    }
}

#[test]
fn iq_types_multiply_against_ggml_activation_types() {
    for ty in IQ_TYPES {
        let want = if ty == GgmlType::IQ4_NL {
            GgmlType::Q8_0
        } else {
            GgmlType::Q8_K
        };
        assert_eq!(vec_dot_type(ty), want, "{ty}");
    }
}
