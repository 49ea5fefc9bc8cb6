//! GEMM kernel tests: seeded random property tests of every ISA against the scalar reference
//! (bit-exact, edge values included), the references against their definitions, errors.

use crate::scalar::gemm::{f32_lanes, mxfp4_blockwise};
use crate::scalar::shared::{e8m0_to_f32_half, f16_to_f32, MXFP4_BYTES, Q8_0_BYTES};
use crate::tests::{rand_f16, same, Rng};
use crate::*;

/// Every GEMM kernel this CPU can run for `ty`: each ISA, plus AVX-512 with AMX (where the
/// tiles run), and without VNNI and/or VBMI.
fn kernels(ty: GgmlType) -> Vec<GemmKernel> {
    let mut ks: Vec<GemmKernel> = Isa::available()
        .into_iter()
        .map(|isa| GemmKernel::new(ty, isa).unwrap())
        .collect();
    if Isa::Avx512.is_available() {
        for (vnni, vbmi, amx) in [
            (true, true, true),
            (true, true, false),
            (false, true, true),
            (true, false, true),
            (false, false, true),
        ] {
            ks.push(GemmKernel::resolve(ty, Isa::Avx512, vnni, vbmi, amx).unwrap());
        }
    }
    ks
}

/// Random MXFP4 rows: random nibbles, exponents mostly near 127 plus the edges.
fn mxfp4_rows(rows: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w = Vec::new();
    for _ in 0..rows * n / 32 {
        let e = match rng.below(16) {
            0 => 0,
            1 => 1,
            2 => 2,
            3 => 254,
            4 => rng.byte(),
            _ => 118 + rng.below(12) as u8,
        };
        w.push(e);
        for _ in 0..16 {
            w.push(rng.byte());
        }
    }
    w
}

/// Random Q8_0 blocks (weights or activations): scales over the f16 range including 0 and
/// subnormals, bytes uniform with extra -128, -127 and 127.
fn q8_0_rows(rows: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..rows * n / 32 {
        let d = match rng.below(12) {
            0 => 0,
            1 => rand_f16(rng, 0, 0),
            2 => rand_f16(rng, 25, 30),
            _ => rand_f16(rng, 5, 16),
        };
        out.extend_from_slice(&d.to_le_bytes());
        for _ in 0..32 {
            out.push(match rng.below(10) {
                0 => 0x80,
                1 => 0x81,
                2 => 0x7f,
                _ => rng.byte(),
            });
        }
    }
    out
}

/// Random f32 rows with a spread of magnitudes, zeros and subnormals.
fn f32_rows(rows: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..rows * n {
        let v = match i % 37 {
            3 => f32::from_bits(rng.below(0x7f_ffff) as u32 + 1),
            7 => -0.0,
            _ => rng.spread(),
        };
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Runs every kernel for `ty` on random operands of every shape and compares each output with
/// `reference(n, weight_row, act_row)`.
fn check_all_isas(
    ty: GgmlType,
    lens: &[usize],
    weights: impl Fn(usize, usize, &mut Rng) -> Vec<u8>,
    acts: impl Fn(usize, usize, &mut Rng) -> Vec<u8>,
    reference: impl Fn(usize, &[u8], &[u8]) -> f32,
) {
    let mut rng = Rng(ty.id() as u64 + 0x5eed);
    let act_ty = vec_dot_type(ty);
    for &n in lens {
        let wb = ty.row_bytes(n as u64).unwrap() as usize;
        let ab = act_ty.row_bytes(n as u64).unwrap() as usize;
        for &(rows, toks) in &[
            (1, 1),
            (16, 1),
            (37, 1),
            (5, 2),
            (17, 3),
            (8, 5),
            (33, 9),
            (3, 13),
            (5, 70),
            // Three of the AVX-512 VNNI Q8_0 kernel's blocks of 64 rows, the last of two.
            (130, 9),
        ] {
            let w = weights(rows, n, &mut rng);
            let a = acts(toks, n, &mut rng);
            let expect: Vec<f32> = (0..rows * toks)
                .map(|i| {
                    let (r, t) = (i / toks, i % toks);
                    reference(n, &w[r * wb..(r + 1) * wb], &a[t * ab..(t + 1) * ab])
                })
                .collect();
            for k in kernels(ty) {
                let prep = k.prepare(n, &a, toks).unwrap();
                let mut out = vec![f32::NAN; rows * toks];
                k.gemm(&w, &prep, &mut out).unwrap();
                for (i, (&got, &want)) in out.iter().zip(&expect).enumerate() {
                    assert!(
                        same(got, want),
                        "{} n={n} rows={rows} tokens={toks} out[{}][{}]: {got:e} vs {want:e}",
                        k.name(),
                        i / toks,
                        i % toks
                    );
                }
            }
        }
    }
}

#[test]
fn mxfp4_gemm_all_isas_bit_exact_with_blockwise_reference() {
    check_all_isas(
        GgmlType::MXFP4,
        &[32, 64, 96, 2880],
        mxfp4_rows,
        q8_0_rows,
        |_, w, a| mxfp4_blockwise(w, a),
    );
}

/// The kernels over interleaved MXFP4 rows (AVX2, and every AVX-512 VNNI/VBMI variant this
/// CPU runs) give the block-wise reference's bits, for whole matrices and for slices of whole
/// groups (how the matmuls hand rows to threads), at token counts of both AVX2 paths;
/// interleaving checks its shapes and the kernel its rows.
#[test]
fn mxfp4_interleaved_gemm_bit_exact_with_blockwise_reference() {
    let Some(best) = GemmKernel::interleaved(Isa::best()) else {
        eprintln!("skipped: no interleaved MXFP4 kernel on this CPU (no AVX2)");
        return;
    };
    let ks: Vec<GemmKernel> = [
        (Isa::Avx512, true, true, true),
        (Isa::Avx512, true, true, false),
        (Isa::Avx512, true, false, false),
        (Isa::Avx512, false, true, false),
        (Isa::Avx512, false, false, false),
        (Isa::Avx2, false, false, false),
    ]
    .into_iter()
    .filter_map(|(isa, vnni, vbmi, amx)| GemmKernel::resolve_interleaved(isa, vnni, vbmi, amx))
    .collect();
    let mut rng = Rng(0x16);
    for n in [32, 64, 96, 2880] {
        let wb = GgmlType::MXFP4.row_bytes(n as u64).unwrap() as usize;
        let ab = GgmlType::Q8_0.row_bytes(n as u64).unwrap() as usize;
        for (rows, toks) in [
            (16, 1),
            (64, 1),
            (32, 2),
            (32, 4),
            (48, 5),
            (16, 9),
            (32, 13),
            (16, 70),
        ] {
            let w = mxfp4_rows(rows, n, &mut rng);
            let a = q8_0_rows(toks, n, &mut rng);
            let mut x = vec![0u8; w.len()];
            best.interleave_into(n, &w, &mut x).unwrap();
            for k in &ks {
                let prep = k.prepare(n, &a, toks).unwrap();
                // The whole matrix, then its groups from the second on.
                for from in [0, 16.min(rows - 16)] {
                    let mut out = vec![f32::NAN; (rows - from) * toks];
                    k.gemm(&x[from * wb..], &prep, &mut out).unwrap();
                    for (i, &got) in out.iter().enumerate() {
                        let (r, t) = (from + i / toks, i % toks);
                        let want = mxfp4_blockwise(&w[r * wb..(r + 1) * wb], &a[t * ab..][..ab]);
                        assert!(
                            same(got, want),
                            "{} n={n} rows={rows} tokens={toks} out[{r}][{t}]: {got:e} vs {want:e}",
                            k.name()
                        );
                    }
                }
            }
        }
    }
    // Shapes: rows in whole groups, as many bytes out as in, only for an interleaved kernel.
    let w = mxfp4_rows(17, 64, &mut rng);
    let mut x = vec![0u8; w.len()];
    assert!(best.interleave_into(64, &w, &mut x).is_err());
    assert!(best
        .interleave_into(64, &w[..16 * 34], &mut x[..15 * 34])
        .is_err());
    let plain = GemmKernel::new(GgmlType::MXFP4, best.isa()).unwrap();
    assert!(plain
        .interleave_into(64, &w[..16 * 34], &mut x[..16 * 34])
        .is_err());
    assert!(best.is_interleaved() && !plain.is_interleaved());
    let a = q8_0_rows(1, 64, &mut rng);
    let prep = best.prepare(64, &a, 1).unwrap();
    let mut out = vec![0f32; 17];
    assert!(best.gemm(&w, &prep, &mut out).is_err());
}

#[test]
fn q8_0_gemm_all_isas_equal_dot_kernel() {
    let dot = DotKernel::new(GgmlType::Q8_0, Isa::Scalar).unwrap();
    check_all_isas(
        GgmlType::Q8_0,
        &[32, 64, 96, 2880],
        q8_0_rows,
        q8_0_rows,
        |n, w, a| dot.dot(n, w, a),
    );
    // Activations as Q8_0 quantization makes them (no byte -128), which the AVX-512 VNNI
    // kernel runs on its unsigned-activation path (the bytes above send it to its fallback);
    // 4128 = 129 blocks, three of its passes of 64 blocks, the last of one block.
    check_all_isas(
        GgmlType::Q8_0,
        &[32, 64, 96, 2880, 4128],
        q8_0_rows,
        |rows, n, rng| {
            let mut a = q8_0_rows(rows, n, rng);
            for block in a.chunks_exact_mut(Q8_0_BYTES) {
                block[2..]
                    .iter_mut()
                    .filter(|q| **q == 0x80)
                    .for_each(|q| *q = 0x81);
            }
            a
        },
        |n, w, a| dot.dot(n, w, a),
    );
    // And the SIMD dot kernels agree with the scalar one on the same data (so the GEMM equals
    // whatever `DotKernel::dot` the model uses).
    let mut rng = Rng(99);
    let (w, a) = (q8_0_rows(1, 2880, &mut rng), q8_0_rows(1, 2880, &mut rng));
    for isa in Isa::available() {
        let k = DotKernel::new(GgmlType::Q8_0, isa).unwrap();
        assert!(same(k.dot(2880, &w, &a), dot.dot(2880, &w, &a)));
    }
}

#[test]
fn f32_gemm_all_isas_bit_exact_with_lanes_reference() {
    check_all_isas(
        GgmlType::F32,
        &[1, 7, 15, 16, 17, 33, 100, 2880, 2881],
        f32_rows,
        f32_rows,
        f32_lanes,
    );
}

/// The F32 reference is the 16-lane order written the way the model crate did: chunks of 16,
/// a partial last chunk, then pairwise halving sums.
#[test]
fn f32_lanes_reference_matches_chunked_definition() {
    let mut rng = Rng(7);
    for n in [1, 15, 16, 31, 100, 2881] {
        let (w, a) = (f32_rows(1, n, &mut rng), f32_rows(1, n, &mut rng));
        let rd = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let mut l = [0f32; 16];
        for (cw, ca) in w.chunks(64).zip(a.chunks(64)) {
            for (i, (x, y)) in cw.chunks_exact(4).zip(ca.chunks_exact(4)).enumerate() {
                l[i] = rd(x).mul_add(rd(y), l[i]);
            }
        }
        let t8: Vec<f32> = (0..8).map(|i| l[i] + l[i + 8]).collect();
        let t4 = [t8[0] + t8[4], t8[1] + t8[5], t8[2] + t8[6], t8[3] + t8[7]];
        let want = (t4[0] + t4[2]) + (t4[1] + t4[3]);
        assert!(same(f32_lanes(n, &w, &a), want), "n={n}");
    }
}

/// Hand-checked block: the integer sum is exact for activation -128 against negative values
/// (no sign-trick wrap), the scale is `2^(e-128) · d` rounded once, one FMA per block.
#[test]
fn mxfp4_blockwise_known_values() {
    // Block 0: every element the value -12 (nibble 15), activations all -128, e = 128 (×1), d = 1.
    let mut w = vec![128u8];
    w.extend([0xffu8; 16]);
    let mut a = f32_to_f16_bytes(1.0);
    a.extend([0x80u8; 32]);
    assert_eq!(mxfp4_blockwise(&w, &a), 32.0 * 12.0 * 128.0);
    // Two blocks: e = 0 (2^-128, subnormal scale product) then e = 254 with d = 0.5.
    let mut w2 = vec![0u8];
    w2.extend([0x11u8; 16]); // value 1 everywhere
    w2.push(254);
    w2.extend([0x00u8; 15]);
    w2.push(0x07); // element 15 = 12, element 31 = 0
    let mut a2 = f32_to_f16_bytes(1.0);
    a2.extend([1u8; 32]);
    a2.extend(f32_to_f16_bytes(0.5));
    a2.extend([3u8; 32]);
    let s0 = e8m0_to_f32_half(0) * 1.0;
    let s1 = e8m0_to_f32_half(254) * 0.5;
    let want = (36.0f32).mul_add(s1, (32.0f32).mul_add(s0, 0.0));
    assert_eq!(mxfp4_blockwise(&w2, &a2).to_bits(), want.to_bits());
    for k in kernels(GgmlType::MXFP4) {
        for (w, a, want) in [(&w, &a, 49152.0), (&w2, &a2, want)] {
            let n = w.len() / MXFP4_BYTES * 32;
            let prep = k.prepare(n, a, 1).unwrap();
            let mut out = [0f32];
            k.gemm(w, &prep, &mut out).unwrap();
            assert_eq!(out[0].to_bits(), want.to_bits(), "{}", k.name());
        }
    }
}

fn f32_to_f16_bytes(x: f32) -> Vec<u8> {
    let h = half::f16::from_f32(x);
    assert_eq!(f16_to_f32(h.to_bits()), x);
    h.to_bits().to_le_bytes().to_vec()
}

#[test]
fn gemm_errors_for_bad_input() {
    let k = GemmKernel::best(GgmlType::MXFP4).unwrap();
    assert!(matches!(
        GemmKernel::best(GgmlType::Q4_K),
        Err(QuantError::Unsupported { .. })
    ));
    assert!(GemmKernel::supports(GgmlType::F32) && !GemmKernel::supports(GgmlType::F16));
    let a = vec![0u8; 2 * Q8_0_BYTES];
    assert!(matches!(
        k.prepare(33, &a, 1),
        Err(QuantError::NotBlockMultiple { .. })
    ));
    assert!(matches!(
        k.prepare(32, &a, 1),
        Err(QuantError::ShapeMismatch { .. })
    ));
    let prep = k.prepare(32, &a, 2).unwrap();
    assert_eq!((prep.n(), prep.n_tokens()), (32, 2));
    let w = vec![127u8; 3 * MXFP4_BYTES];
    let mut out = vec![0f32; 5];
    assert!(matches!(
        k.gemm(&w, &prep, &mut out),
        Err(QuantError::ShapeMismatch { .. })
    ));
    let mut out = vec![0f32; 4];
    assert!(matches!(
        k.gemm(&w, &prep, &mut out),
        Err(QuantError::ShapeMismatch { .. })
    ));
    let mut out = vec![1f32; 6];
    k.gemm(&w, &prep, &mut out).unwrap();
    assert_eq!(out, vec![0f32; 6]);
    let q = GemmKernel::best(GgmlType::Q8_0).unwrap();
    assert!(q.gemm(&w, &prep, &mut out).is_err());
    // Activations prepared by another kernel of the type: its blocks may lack what this one
    // reads (the AVX2 and AMX kernels read fields the scalar one leaves empty).
    for other in Isa::available() {
        let o = GemmKernel::new(GgmlType::MXFP4, other).unwrap();
        let ok = o.gemm(&w, &prep, &mut out);
        assert_eq!(ok.is_ok(), o.name() == k.name(), "{}: {ok:?}", o.name());
    }
    let empty = k.prepare(32, &[], 0).unwrap();
    k.gemm(&[], &empty, &mut []).unwrap();
    assert!(k.gemm(&[], &empty, &mut [0.0]).is_err());
}

#[test]
fn gemm_kernels_are_send_sync_copy() {
    fn check<T: Send + Sync + Copy + 'static>() {}
    check::<GemmKernel>();
    fn sync<T: Send + Sync>() {}
    sync::<GemmActs<'static>>();
}

/// The AMX MXFP4 kernels (over the file's layout and over interleaved rows) equal the
/// AVX-512 VNNI + VBMI ones bit for bit, over token counts on both sides of the threshold, of a
/// 16-token group and of a 64-token pass, row counts that leave a partial group, and widths of
/// one block to gpt-oss's 2880 (runs only where the tile probe passed).
#[test]
fn amx_mxfp4_equals_vnni_bit_for_bit() {
    let status = amx_status();
    if *status != AmxStatus::Usable {
        eprintln!("SKIPPED: AMX MXFP4 kernel not tested: {status}");
        return;
    }
    let amx = GemmKernel::resolve(GgmlType::MXFP4, Isa::Avx512, true, true, true).unwrap();
    let vnni = GemmKernel::resolve(GgmlType::MXFP4, Isa::Avx512, true, true, false).unwrap();
    let amx_x16 = GemmKernel::resolve_interleaved(Isa::Avx512, true, true, true).unwrap();
    let vnni_x16 = GemmKernel::resolve_interleaved(Isa::Avx512, true, true, false).unwrap();
    for k in [&amx, &amx_x16] {
        assert!(k.name().contains("amx"), "{}", k.name());
    }
    for k in [&vnni, &vnni_x16] {
        assert!(!k.name().contains("amx"), "{}", k.name());
    }
    let mut rng = Rng(21);
    for (rows, n, n_tokens) in [
        (16, 32, 4),
        (16, 64, 16),
        (32, 96, 17),
        (48, 2880, 5),
        (70, 2880, 33),
        (64, 320, 3),
        (21, 128, 40),
        (32, 2880, 64),
        (16, 576, 70),
        (48, 1024, 130),
    ] {
        let w = mxfp4_rows(rows, n, &mut rng);
        let a = q8_0_rows(n_tokens, n, &mut rng);
        let run = |k: &GemmKernel, w: &[u8], rows: usize| {
            let acts = k.prepare(n, &a, n_tokens).unwrap();
            let mut out = vec![0f32; rows * n_tokens];
            k.gemm(w, &acts, &mut out).unwrap();
            out
        };
        let whole = rows / 16 * 16;
        let mut x16 = vec![0u8; whole * w.len() / rows];
        amx_x16
            .interleave_into(n, &w[..x16.len()], &mut x16)
            .unwrap();
        for (p, q, what) in [
            (run(&amx, &w, rows), run(&vnni, &w, rows), "rows"),
            (
                run(&amx_x16, &x16, whole),
                run(&vnni_x16, &x16, whole),
                "interleaved",
            ),
        ] {
            for (i, (p, q)) in p.iter().zip(&q).enumerate() {
                assert!(
                    same(*p, *q),
                    "{what}: rows {rows} n {n} tokens {n_tokens}: output {i}: amx {p} vnni {q}"
                );
            }
        }
    }
}

/// An f16 scale (or min) for the low-bit tests: zero of either sign, subnormals, the largest
/// finite exponents, tiny and ordinary ones.
fn extreme_f16(rng: &mut Rng) -> u16 {
    match rng.below(8) {
        0 => (rng.byte() as u16 & 1) << 15,
        1 => rand_f16(rng, 0, 0),
        2 => rand_f16(rng, 30, 30),
        3 => rand_f16(rng, 1, 3),
        _ => rand_f16(rng, 5, 16),
    }
}

/// Random blocks of `ty` (Q4_0/Q4_1/Q5_0/Q5_1 weights, or Q8_0/Q8_1 activations): random
/// quant bytes (and fifth bits), the leading f16 fields from [`extreme_f16`]; without `minus_128`
/// the activation byte -128 (which quantization never makes) becomes -127.
fn lowbit_blocks(ty: GgmlType, blocks: usize, minus_128: bool, rng: &mut Rng) -> Vec<u8> {
    let bytes = ty.block_bytes();
    let halves = match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => 2,
        _ => 1,
    };
    let act = matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1);
    let mut out = Vec::new();
    for _ in 0..blocks {
        let mut b: Vec<u8> = (0..bytes).map(|_| rng.byte()).collect();
        for h in 0..halves {
            b[2 * h..2 * h + 2].copy_from_slice(&extreme_f16(rng).to_le_bytes());
        }
        if act {
            for q in &mut b[bytes - 32..] {
                *q = match rng.below(10) {
                    0 if minus_128 => 0x80,
                    1 => 0x81,
                    2 => 0x7f,
                    _ if *q == 0x80 && !minus_128 => 0x81,
                    _ => *q,
                };
            }
        }
        out.extend(b);
    }
    out
}

/// Every Q4_0/Q4_1/Q5_0/Q5_1 GEMM kernel this CPU runs (scalar, AVX2, AVX-512 with and without
/// VNNI) gives the bits of the scalar `vec_dot` kernel for every output: 1 to 19 tokens (and
/// 33, 70: several tiles and chunks), odd row counts, scales and mins over the f16 range, and
/// activations with and without the byte -128 (Q4_0/Q5_0 on AVX-512 fall back to `vec_dot`
/// where it occurs, the others take it exactly).
#[test]
fn lowbit_gemm_all_isas_equal_dot_kernel() {
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
    ] {
        let dot = DotKernel::new(ty, Isa::Scalar).unwrap();
        let act_ty = vec_dot_type(ty);
        let mut rng = Rng(ty.id() as u64 + 0x10b1);
        let ks = kernels(ty);
        for n in [32, 96, 896] {
            let (wb, ab) = (dot.weight_row_bytes(n), dot.act_row_bytes(n));
            let tokens = (1..=19).chain(if n == 96 { vec![33, 70] } else { vec![] });
            for toks in tokens {
                for (rows, minus_128) in [(1, false), (3, true), (5, false), (17, toks % 2 == 0)] {
                    let w = lowbit_blocks(ty, rows * n / 32, false, &mut rng);
                    let a = lowbit_blocks(act_ty, toks * n / 32, minus_128, &mut rng);
                    for k in &ks {
                        let prep = k.prepare(n, &a, toks).unwrap();
                        let mut out = vec![f32::NAN; rows * toks];
                        k.gemm(&w, &prep, &mut out).unwrap();
                        for (i, &got) in out.iter().enumerate() {
                            let (r, t) = (i / toks, i % toks);
                            let want = dot.dot(n, &w[r * wb..][..wb], &a[t * ab..][..ab]);
                            assert!(
                                same(got, want),
                                "{} n={n} rows={rows} tokens={toks} -128: {minus_128} \
                                 out[{r}][{t}]: {got:e} vs {want:e}",
                                k.name()
                            );
                        }
                    }
                }
            }
        }
    }
}
