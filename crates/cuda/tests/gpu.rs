//! The CUDA test suite: every kernel against a plain-Rust reference on random data: the
//! products, attention and the router against [`Ref0`] (the CPU device's numerics, which
//! the kernels reproduce: bit for bit where no libm `expf` or cuBLAS is involved), the rest
//! against formulas here. Each test returns early ("no CUDA device: skipped") on a machine
//! without a CUDA device, so these pass trivially here and check the kernels on a GPU machine
//! (scripts/gpu-check.sh).

use std::time::Instant;

use half::f16;
use hmoe_backend::{AttnParams, Backend, Ref0, RopeParams};
use hmoe_cuda::{CudaDevice, CudaSlice};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

#[allow(dead_code)]
mod common;
#[path = "support/gpu_device.rs"]
mod gpu_device;
use common::{
    act_quantizer_cases, attn_params, extreme_scales, kv_layouts, noise, quantizer_cases,
    random_weights, ref_attention, ref_ring, ATTN_CASES, KV_PAIRS, LOWBIT_MATMULS, LOWBIT_TOKENS,
    LOWBIT_TYPES, TYPES,
};
use gpu_device::{assert_close, device, weights};

#[test]
fn get_rows_dequantises_exactly() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(1);
    for ty in TYPES.into_iter().chain(LOWBIT_TYPES) {
        // Three K-quant super-blocks per row, three 32-blocks for the others.
        let (rows, cols) = (50, 3 * ty.block_elems().max(32));
        let (q, deq) = weights(&mut rng, ty, rows, cols);
        let table = dev.upload_matrix(ty, rows, cols, &q).unwrap();
        let ids = [3i32, 0, 49, 3, 17, -1, 50];
        let ids_d = dev.upload(&ids).unwrap();
        let mut out = dev.alloc_zeros::<f32>(ids.len() * cols).unwrap();
        dev.get_rows(&table, &ids_d, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let row = &got[t * cols..(t + 1) * cols];
            if (0..rows as i32).contains(&id) {
                let want = &deq[id as usize * cols..(id as usize + 1) * cols];
                assert_eq!(row, want, "{ty} row {id}");
            } else {
                assert!(row.iter().all(|&v| v == 0.0), "{ty}: id {id} gives zeros");
            }
        }
    }
}

#[test]
fn rms_norm_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(2);
    let (rows, n, eps) = (5, 2880, 1e-5f32);
    let x = noise(&mut rng, rows * n, 3.0);
    let w = noise(&mut rng, n, 1.0);
    let mut want = vec![0f32; rows * n];
    for r in 0..rows {
        let row = &x[r * n..(r + 1) * n];
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
        for i in 0..n {
            want[r * n + i] = row[i] * scale * w[i];
        }
    }
    let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let mut out = dev.alloc_zeros::<f32>(rows * n).unwrap();
    dev.rms_norm(&xd, &wd, eps, &mut out).unwrap();
    let got = dev.download(&out).unwrap();
    let scale: Vec<f32> = want.iter().map(|v| v.abs()).collect();
    assert_close("rms_norm", &got, &want, &scale, 1e-5);
}

/// `y = W·x` of `n` tokens on any backend.
fn matmul_on<B: Backend>(
    be: &B,
    (ty, rows, cols): (GgmlType, usize, usize),
    q: &[u8],
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let w = be.upload_matrix(ty, rows, cols, q).unwrap();
    let xd = be.upload(x).unwrap();
    let mut y = be.alloc::<f32>(n * rows).unwrap();
    be.matmul(&w, &xd, n, &mut y).unwrap();
    be.download(&y).unwrap()
}

/// The activation quantizers of the low-bit products (and Q8_0's through the same entry).
#[test]
fn quantize_acts_gives_the_cpus_bytes() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(10);
    for act in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
        let (x, want) = act_quantizer_cases(&mut rng, act);
        let xd = dev.upload(&x).unwrap();
        let got = dev
            .download(&dev.quantize_acts(act, &xd, x.len()).unwrap())
            .unwrap();
        assert_eq!(got, want, "{act}");
    }
}

#[test]
fn quantize_q8_0_gives_the_cpus_bytes() {
    let Some(dev) = device() else { return };
    let (x, want) = quantizer_cases(&mut StdRng::seed_from_u64(9));
    let xd = dev.upload(&x).unwrap();
    let got = dev
        .download(&dev.quantize_q8_0(&xd, x.len()).unwrap())
        .unwrap();
    assert_eq!(got, want);
}

/// The GEMV kernel (the tiled kernel from 32 tokens for Q8_0/MXFP4) reproduces the reference
/// backend (the CPU device's bits) exactly for Q8_0, MXFP4 and F32 weights at every batch size; F16/BF16 sum in another order, and cuBLAS
/// (batches of 16+ with F16/BF16 weights) in its own.
#[test]
fn matmul_every_type_and_batch_size() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let cpu = Ref0::new();
    // 160 columns: F32 rows have a tail after the last 64 elements; 2880 as gpt-oss.
    for (rows, cols) in [(70, 160), (20, 2880)] {
        for ty in TYPES {
            let (q, deq) = weights(&mut rng, ty, rows, cols);
            for n in [1usize, 3, 9, 20, 40, 100] {
                let x = noise(&mut rng, n * cols, 1.0);
                let cublas = n >= hmoe_cuda::CUBLAS_MIN_TOKENS
                    && dev.has_cublas()
                    && matches!(ty, GgmlType::F16 | GgmlType::BF16);
                let exact =
                    !cublas && matches!(ty, GgmlType::F32 | GgmlType::Q8_0 | GgmlType::MXFP4);
                let shape = (ty, rows, cols);
                let got = matmul_on(dev, shape, &q, &x, n);
                let want = matmul_on(&cpu, shape, &q, &x, n);
                let what = format!("matmul {ty} {rows}x{cols} n={n}");
                if exact {
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{i}]: {g} vs {w}");
                    }
                    continue;
                }
                // Error scale: Σ|w·x| per output.
                let mut scale = vec![0f32; n * rows];
                for t in 0..n {
                    for r in 0..rows {
                        scale[t * rows + r] = (0..cols)
                            .map(|c| (deq[r * cols + c] * x[t * cols + c]).abs())
                            .sum();
                    }
                }
                assert_close(&what, &got, &want, &scale, 1e-4);
            }
        }
    }
}

/// Q8_0/MXFP4 batches (the tiled kernels: int8 tensor cores from sm_80, `__dp4a` before) with
/// weights of extreme scales ([`extreme_scales`]) and tokens of magnitudes 1e-30 … 1e4 give
/// REF0's bits (NaN where REF0 has NaN: the GPU's NaN bits are its own).
#[test]
fn tiled_products_of_extreme_scales_give_the_cpus_bits() {
    let Some(dev) = device() else { return };
    eprintln!("compute capability {:?}", dev.info().compute_capability);
    let mut rng = StdRng::seed_from_u64(45);
    let cpu = Ref0::new();
    let (rows, cols) = (70, 160);
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        let mut q = random_weights(&mut rng, ty, rows, cols);
        extreme_scales(&mut rng, ty, &mut q, cols, true);
        for n in [33usize, 130, 600] {
            let mut x = noise(&mut rng, n * cols, 1.0);
            let magnitudes = [1.0, 1e-30, 1e4, 1e-3];
            x.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v *= magnitudes[i / cols % 4]);
            let shape = (ty, rows, cols);
            let got = matmul_on(dev, shape, &q, &x, n);
            let want = matmul_on(&cpu, shape, &q, &x, n);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.to_bits() == w.to_bits() || g.is_nan() && w.is_nan();
                assert!(same, "matmul {ty} {rows}x{cols} n={n} [{i}]: {g} vs {w}");
            }
        }
    }
}

/// `matmul_shared` (one quantized activation for Q, K and V; one dp4a launch with the biases
/// for a decode batch of one type) gives REF0's `matmul` then `add_bias` bits for each matrix:
/// Q8_0 and MXFP4 of one width (quantized once; the dp4a GEMV kernels, the tiled kernel for 40
/// tokens), three Q8_0 matrices with biases on two, and a set with an F32 matrix (each
/// `matmul` on its own, the F32 GEMV adding its bias itself).
#[test]
fn matmul_shared_gives_each_matmuls_bits() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(31);
    let cpu = Ref0::new();
    let cols = 2880;
    let sets = [
        [
            (GgmlType::Q8_0, 64),
            (GgmlType::MXFP4, 8),
            (GgmlType::Q8_0, 8),
        ],
        [
            (GgmlType::Q8_0, 64),
            (GgmlType::Q8_0, 9),
            (GgmlType::Q8_0, 8),
        ],
        [
            (GgmlType::Q8_0, 64),
            (GgmlType::F32, 8),
            (GgmlType::MXFP4, 8),
        ],
    ];
    for (si, set) in sets.into_iter().enumerate() {
        let qs = set.map(|(ty, rows)| weights(&mut rng, ty, rows, cols).0);
        let ws: Vec<_> = set
            .iter()
            .zip(&qs)
            .map(|(&(ty, rows), q)| dev.upload_matrix(ty, rows, cols, q).unwrap())
            .collect();
        // Biases on the first and last matrices, and on the F32 one (the GEMV kernel's).
        let bs: Vec<Option<Vec<f32>>> = set
            .iter()
            .enumerate()
            .map(|(i, &(_, rows))| (i != 1 || si == 2).then(|| noise(&mut rng, rows, 1.0)))
            .collect();
        let bds: Vec<_> = bs
            .iter()
            .map(|b| b.as_ref().map(|b| dev.upload(b).unwrap()))
            .collect();
        for n in [1usize, 5, 40] {
            let x = noise(&mut rng, n * cols, 1.0);
            let xd = dev.upload(&x).unwrap();
            let mut ys: Vec<_> = set
                .iter()
                .map(|&(_, rows)| dev.alloc::<f32>(n * rows).unwrap())
                .collect();
            let mut outs: Vec<_> = ys.iter_mut().collect();
            let refs: Vec<_> = ws.iter().collect();
            let biases: Vec<_> = bds.iter().map(Option::as_ref).collect();
            dev.matmul_shared(&refs, &biases, &xd, n, &mut outs)
                .unwrap();
            for (((&(ty, rows), q), y), b) in set.iter().zip(&qs).zip(&ys).zip(&bs) {
                let mut want = matmul_on(&cpu, (ty, rows, cols), q, &x, n);
                if let Some(b) = b {
                    let mut wd = cpu.upload(&want).unwrap();
                    cpu.add_bias(&mut wd, &cpu.upload(b).unwrap()).unwrap();
                    want = cpu.download(&wd).unwrap();
                }
                let got = dev.download(y).unwrap();
                let what = format!("matmul_shared {ty} {rows}x{cols} n={n}");
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{what}"
                );
            }
        }
    }
}

/// A matrix of a product test: type, rows, bytes and bias.
type TestMatrix = (GgmlType, usize, Vec<u8>, Option<Vec<f32>>);

/// The outputs of [`Backend::norm_matmul_shared`] on `be`: the normed rows, `x` (with the
/// residual `y` added where given) and each product, for `n` tokens of `x` (rows of `w`'s
/// length) and the matrices `ms` (type, rows, bytes) with their biases.
fn norm_matmul_on<B: Backend>(
    be: &B,
    (x, y, w): (&[f32], Option<&[f32]>, &[f32]),
    ms: &[TestMatrix],
    n: usize,
) -> Vec<Vec<f32>> {
    let d = w.len();
    let mut xd = be.upload(x).unwrap();
    let yd = y.map(|y| be.upload(y).unwrap());
    let wd = be.upload(w).unwrap();
    let mut hd = be.alloc::<f32>(n * d).unwrap();
    let mats: Vec<_> = (ms.iter())
        .map(|(ty, rows, q, _)| be.upload_matrix(*ty, *rows, d, q).unwrap())
        .collect();
    let bs: Vec<_> = (ms.iter())
        .map(|(.., b)| b.as_ref().map(|b| be.upload(b).unwrap()))
        .collect();
    let mut ys: Vec<_> = (ms.iter())
        .map(|(_, rows, ..)| be.alloc::<f32>(n * rows).unwrap())
        .collect();
    be.norm_matmul_shared(
        &mut xd,
        yd.as_ref(),
        (&wd, 1e-5),
        &mut hd,
        &mats.iter().collect::<Vec<_>>(),
        &bs.iter().map(Option::as_ref).collect::<Vec<_>>(),
        n,
        &mut ys.iter_mut().collect::<Vec<_>>(),
    )
    .unwrap();
    [&hd, &xd]
        .into_iter()
        .chain(&ys)
        .map(|b| be.download(b).unwrap())
        .collect()
}

/// `norm_matmul_shared` (the norm writing the Q8_0 activations of Q8_0/MXFP4 products of its
/// width; else the norm and `matmul_shared`) gives REF0's bits (its default: the two ops):
/// gpt-oss's Q, K and V shapes with biases of Q8_0 and of MXFP4 (the dp4a group; the tiled
/// kernel for 40 tokens), a set with an F32 matrix and rows of 1,000 values (not whole Q8_0
/// blocks) with an F32 matrix (the two ops), each with and without the residual.
#[test]
fn norm_matmul_shared_gives_the_norm_then_matmul_shared_bits() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(37);
    let cpu = Ref0::new();
    let (q8, mx, f32) = (GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::F32);
    let sets: [(usize, &[(GgmlType, usize)]); 4] = [
        (2880, &[(q8, 4096), (q8, 512), (q8, 512)]),
        (2880, &[(mx, 4096), (mx, 512), (mx, 512)]),
        (2880, &[(q8, 64), (f32, 8)]),
        (1000, &[(f32, 16)]),
    ];
    for (d, set) in sets {
        let ms: Vec<_> = (set.iter())
            .map(|&(ty, rows)| {
                let q = weights(&mut rng, ty, rows, d).0;
                (ty, rows, q, Some(noise(&mut rng, rows, 1.0)))
            })
            .collect();
        let w = noise(&mut rng, d, 2.0);
        for n in [1usize, 4, 40] {
            let x = noise(&mut rng, n * d, 30.0);
            let y = noise(&mut rng, n * d, 0.5);
            for pending in [None, Some(&y[..])] {
                let got = norm_matmul_on(dev, (&x, pending, &w), &ms, n);
                let want = norm_matmul_on(&cpu, (&x, pending, &w), &ms, n);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("norm_matmul_shared d {d} {set:?} n={n} output {i}");
                    assert!(
                        g.len() == w.len()
                            && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what} (residual {})",
                        pending.is_some()
                    );
                }
            }
        }
    }
}

/// The dp4a GEMV kernels on gpt-oss's decode shapes (q, k/v and o projections of Q8_0, an
/// MXFP4 matrix of 2880²) for 1 and 4 tokens: REF0's bits, then the time of 100 products
/// (activation quantization included) reported as weight bytes per second.
#[test]
fn dp4a_gemv_on_gpt_oss_shapes() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(43);
    let cpu = Ref0::new();
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 4096, 2880),
        (GgmlType::Q8_0, 512, 2880),
        (GgmlType::Q8_0, 2880, 4096),
        (GgmlType::MXFP4, 2880, 2880),
    ] {
        let (q, _) = weights(&mut rng, ty, rows, cols);
        let w = dev.upload_matrix(ty, rows, cols, &q).unwrap();
        for n in [1usize, 4] {
            let x = noise(&mut rng, n * cols, 1.0);
            let xd = dev.upload(&x).unwrap();
            let mut y = dev.alloc_zeros::<f32>(n * rows).unwrap();
            dev.matmul(&w, &xd, n, &mut y).unwrap();
            let got = dev.download(&y).unwrap();
            let want = matmul_on(&cpu, (ty, rows, cols), &q, &x, n);
            let what = format!("{ty} {rows}x{cols} n={n}");
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "{what}"
            );
            let reps = 100;
            dev.synchronize().unwrap();
            let t = Instant::now();
            for _ in 0..reps {
                dev.matmul(&w, &xd, n, &mut y).unwrap();
            }
            dev.synchronize().unwrap();
            let us = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
            let gbs = q.len() as f64 / (us * 1e3);
            eprintln!("dp4a GEMV {what}: {us:.1} µs per product, {gbs:.0} GB/s of weights");
        }
    }
}

/// The low-bit types' products are the CPU device's bits at every batch size: the kernels
/// replay the order of the CPU kernel for the matrix and batch (`vec_dot`, tiled K-quants from
/// 8 tokens, repacked Q4_0/Q4_K for row counts that are multiples of 8).
#[test]
fn matmul_lowbit_types_give_the_cpus_bits() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    let cpu = Ref0::new();
    for (rows, cols) in LOWBIT_MATMULS.into_iter().chain([(64, 2048)]) {
        for ty in LOWBIT_TYPES {
            let (q, _) = weights(&mut rng, ty, rows, cols);
            for n in LOWBIT_TOKENS.into_iter().chain([20, 40, 100]) {
                let x = noise(&mut rng, n * cols, 1.0);
                let shape = (ty, rows, cols);
                let got = matmul_on(dev, shape, &q, &x, n);
                let want = matmul_on(&cpu, shape, &q, &x, n);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("matmul {ty} {rows}x{cols} n={n} [{i}]");
                    assert_eq!(g.to_bits(), w.to_bits(), "{what}: {g} vs {w}");
                }
            }
        }
    }
}

/// Per-head products (`matmul_heads`) of `n` tokens by `nh` heads of `out` rows of `cols` of
/// `ty`, the head rows `stride` values apart, on any backend.
fn matmul_heads_on<B: Backend>(
    be: &B,
    (ty, nh, out, cols): (GgmlType, usize, usize, usize),
    q: &[u8],
    x: &[f32],
    (n, stride): (usize, usize),
) -> Vec<f32> {
    let w = be.upload_matrix(ty, nh * out, cols, q).unwrap();
    let xd = be.upload(x).unwrap();
    let mut y = be.alloc::<f32>(n * nh * out).unwrap();
    be.matmul_heads(&w, &xd, n, nh, stride, &mut y).unwrap();
    be.download(&y).unwrap()
}

/// Per-head products of the low-bit types (DeepSeek's `attn_k_b` over `q_nope` inside query
/// rows of 64 more values, `attn_v_b` over contiguous rows): REF0's bits (the CPU device's
/// orders for each head's batch) for one token and batches under and over the tiled
/// K-quant threshold, with matrices the CPU device repacks (Q4_0/Q4_K, 16 × 64 rows) and
/// one it does not (4 × 13).
#[test]
fn matmul_heads_lowbit_types_give_the_cpus_bits() {
    let Some(dev) = device() else { return };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(21);
    for ty in LOWBIT_TYPES {
        let cols = ty.block_elems().max(128);
        for (nh, out) in [(16, 64), (4, 13)] {
            let (q, _) = weights(&mut rng, ty, nh * out, cols);
            for (stride, n) in [
                (cols, 1),
                (cols, 6),
                (cols, 9),
                (cols, 40),
                (cols + 64, 1),
                (cols + 64, 9),
                (cols + 64, 40),
            ] {
                let x = noise(&mut rng, n * nh * stride, 2.0);
                let shape = (ty, nh, out, cols);
                let got = matmul_heads_on(dev, shape, &q, &x, (n, stride));
                let want = matmul_heads_on(&cpu, shape, &q, &x, (n, stride));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what =
                        format!("matmul_heads {ty} {nh}x{out}x{cols} stride {stride} n={n} [{i}]");
                    assert_eq!(g.to_bits(), w.to_bits(), "{what}: {g} vs {w}");
                }
            }
        }
    }
}

/// Attention over a K-only ring of `layout` holding `keys` (stored by the backend itself) for
/// `n` tokens from `pos0`, on any backend.
fn k_only_on<B: Backend>(
    be: &B,
    p: &hmoe_backend::KOnlyAttnParams,
    layout: hmoe_backend::KvLayout,
    keys: &[f32],
    q: &[f32],
    (pos0, n): (usize, usize),
) -> Vec<f32> {
    let mut ring = be.kv_alloc(layout).unwrap();
    let kd = be.upload(keys).unwrap();
    be.kv_store(&kd, &mut ring, layout.cells, 0).unwrap();
    let qd = be.upload(q).unwrap();
    let mut out = be.alloc::<f32>(n * p.n_head * p.v_dim).unwrap();
    be.attention_k_only(p, &qd, &ring, n, pos0, &mut out)
        .unwrap();
    be.download(&out).unwrap()
}

/// Attention over K-only (latent) rings of every K/V type, stored on the device: REF0's bits
/// with DeepSeek's latent widths (keys of 576 = 512 + 64, values the first 512), 16 heads,
/// one query token and batches, contexts of one and of several tiles of positions (the split
/// path); and with 128 heads over a ring of 131,073 cells: one token still split, two tokens
/// more scores than the split path takes for a batch (the one-block-per-(head, token)
/// kernel).
#[test]
fn attention_k_only_of_every_ring_type_gives_the_cpus_bits() {
    let Some(dev) = device() else { return };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(22);
    for ty in hmoe_cuda::K_ONLY_TYPES {
        for (kd, vd, n_head, cells) in [
            (576, 512, 16, 700),
            (96, 64, 16, 700),
            (96, 64, 128, 131_073),
        ] {
            let p = hmoe_backend::KOnlyAttnParams {
                n_head,
                k_dim: kd,
                v_dim: vd,
                cells,
                scale: 1.0 / (kd as f32).sqrt(),
            };
            let layout = hmoe_backend::KvLayout::new(ty, kd, cells, 0).unwrap();
            let keys = noise(&mut rng, cells * kd, 2.0);
            let cases: &[(usize, usize)] = match cells {
                700 => &[(0, 1), (600, 1), (0, 7), (500, 40)],
                _ => &[(0, 1), (600, 1), (500, 2)],
            };
            for &(pos0, n) in cases {
                let q = noise(&mut rng, n * p.n_head * kd, 2.0);
                let got = k_only_on(dev, &p, layout, &keys, &q, (pos0, n));
                let want = k_only_on(&cpu, &p, layout, &keys, &q, (pos0, n));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("attention_k_only {ty} kd {kd} pos0 {pos0} n={n} [{i}]");
                    assert_eq!(g.to_bits(), w.to_bits(), "{what}: {g} vs {w}");
                }
            }
        }
    }
}

#[test]
fn adds() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(4);
    let (a, b, bias) = (
        noise(&mut rng, 3 * 40, 1.0),
        noise(&mut rng, 3 * 40, 1.0),
        noise(&mut rng, 40, 1.0),
    );
    let mut ad = dev.upload(&a).unwrap();
    dev.add_assign(&mut ad, &dev.upload(&b).unwrap()).unwrap();
    dev.add_bias(&mut ad, &dev.upload(&bias).unwrap()).unwrap();
    let got = dev.download(&ad).unwrap();
    for i in 0..a.len() {
        assert_eq!(got[i], (a[i] + b[i]) + bias[i % 40], "[{i}]");
    }
}

#[test]
fn rope_neox_yarn_matches_the_host_formula() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (n_heads, hd) = (3, 64);
    let positions = [0i32, 1, 7, 130, 4095, 70000];
    let n = positions.len();
    for p in [
        RopeParams::yarn(hd, 150000.0, 32.0, 4096, 1.0, 32.0, 1.0),
        RopeParams::plain(hd, 10000.0),
    ] {
        let x = noise(&mut rng, n * n_heads * hd, 2.0);
        let mut want = x.clone();
        let half = hd / 2;
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..n_heads {
                let head = &mut want[(t * n_heads + h) * hd..(t * n_heads + h + 1) * hd];
                for i in 0..half {
                    let (c, s) = p.cos_sin(pos, i);
                    let (x0, x1) = (head[i], head[i + half]);
                    head[i] = x0.mul_add(c, -(x1 * s));
                    head[i + half] = x0.mul_add(s, x1 * c);
                }
            }
        }
        let mut xd = dev.upload(&x).unwrap();
        let pd = dev.upload(&positions).unwrap();
        dev.rope_neox(&mut xd, &pd, n_heads, hd, &p).unwrap();
        let got = dev.download(&xd).unwrap();
        // cosf/sinf on the GPU are within 2 ulp of the host's; large angles lose more.
        let scale = vec![4.0f32; got.len()];
        assert_close("rope", &got, &want, &scale, 1e-5);
    }
}

/// The K/V store and attention on the device against the reference backend, for every ring
/// type pair of [`KV_PAIRS`] (rotated as the executor rotates quantized heads): the rings the
/// device stores are REF0's bytes; attention over f16/f32 values is REF0's bit for bit without
/// sinks. With sinks, and over Q8_0 and Q4_0 values (the chunked flash kernel, libm's `expf`), the
/// kernels' glibc `expf` in f64 with FMA gives REF0's bits in the host emulation
/// (tests/emulated.rs); here they are held to 1e-3 until a GPU has shown the same.
#[test]
fn attention_with_sinks_window_gqa_and_a_ring_cache() {
    let Some(dev) = device() else { return };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(6);
    let (n_head, n_kv) = (8, 2);
    // The common shapes, and more positions than the kernel keeps scores of in shared memory
    // (8192: scores recomputed).
    let big = (64, None, 8300, 8250, 3);
    for (hd, window, cells, pos0, n_tokens) in ATTN_CASES.into_iter().chain([big]) {
        let kvw = n_kv * hd;
        for pair in KV_PAIRS {
            let Some((kl, vl)) = kv_layouts(pair, hd, n_kv, cells) else {
                continue;
            };
            let (kt, vt) = pair;
            // Sinks with one value chain (gpt-oss), four chains without (Qwen3-MoE).
            for (with_sinks, value_chains) in [(false, 1), (true, 1), (false, 4)] {
                let total = pos0 + n_tokens;
                let k_all = noise(&mut rng, total * kvw, 1.0);
                let v_all = noise(&mut rng, total * kvw, 1.0);
                let q = noise(&mut rng, n_tokens * n_head * hd, 1.0);
                let sinks = noise(&mut rng, n_head, 2.0);
                let p = attn_params(n_head, n_kv, hd, cells, window, value_chains);
                let (mut kc, mut vc) = (dev.kv_alloc(kl).unwrap(), dev.kv_alloc(vl).unwrap());
                let (mut kr, mut vr) = (cpu.kv_alloc(kl).unwrap(), cpu.kv_alloc(vl).unwrap());
                // Store the history one token at a time (as decode does), then the batch.
                let mut spans: Vec<(usize, usize)> = (0..pos0).map(|p| (p, 1)).collect();
                spans.push((pos0, n_tokens));
                for (at, n) in spans {
                    let (ks, vs) = (
                        &k_all[at * kvw..(at + n) * kvw],
                        &v_all[at * kvw..(at + n) * kvw],
                    );
                    let (kd, vd) = (dev.upload(ks).unwrap(), dev.upload(vs).unwrap());
                    Backend::kv_store(dev, &kd, &mut kc, n, at).unwrap();
                    Backend::kv_store(dev, &vd, &mut vc, n, at).unwrap();
                    let (kd, vd) = (cpu.upload(ks).unwrap(), cpu.upload(vs).unwrap());
                    cpu.kv_store(&kd, &mut kr, n, at).unwrap();
                    cpu.kv_store(&vd, &mut vr, n, at).unwrap();
                }
                let what = format!(
                    "attention K {kt} / V {vt} hd {hd} window {window:?} sinks {with_sinks} \
                     chains {value_chains}"
                );
                let (k_bytes, v_bytes) = (
                    dev.download(&kc.data).unwrap(),
                    dev.download(&vc.data).unwrap(),
                );
                assert!(k_bytes == cpu.download(&kr.data).unwrap(), "{what}: K ring");
                assert!(v_bytes == cpu.download(&vr.data).unwrap(), "{what}: V ring");
                if kt == GgmlType::F16 && window.is_none() && cells >= total {
                    // The cache holds f16 bits of the values, cell = position.
                    let bits = u16::from_le_bytes([k_bytes[10], k_bytes[11]]);
                    assert_eq!(bits, f16::from_f32(k_all[5]).to_bits());
                }
                let qd = dev.upload(&q).unwrap();
                let sd = dev.upload(&sinks).unwrap();
                let mut out = dev.alloc_zeros::<f32>(q.len()).unwrap();
                let s = with_sinks.then_some(&sd);
                Backend::attention(dev, &p, &qd, &kc, &vc, s, n_tokens, pos0, &mut out).unwrap();
                let got = dev.download(&out).unwrap();
                let s = with_sinks.then_some(&sinks[..]);
                let want = ref_attention(
                    &cpu,
                    &p,
                    &q,
                    (kl, &k_bytes),
                    (vl, &v_bytes),
                    s,
                    n_tokens,
                    pos0,
                );
                // Quantized values: bit for bit in `chunked_flash_attention_gives_the_cpus_bits`.
                let flash = !matches!(vt, GgmlType::F16 | GgmlType::F32);
                if with_sinks || flash {
                    let scale = vec![1.0f32; want.len()];
                    assert_close(&what, &got, &want, &scale, 1e-3);
                } else {
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{i}]: {g} vs {w}");
                    }
                }
            }
        }
    }
}

/// Chunked flash attention (`-fa on`, and Q8_0/Q4_0 values: `attn_chunked`, split over the
/// chunks for decode) against REF0 with `AttnParams::flash`, bit for bit as in the host
/// emulation (tests/emulated.rs): gpt-oss's shapes (64 heads over 8 KV heads of 64, sinks),
/// f32, f16, rotated Q8_0 and Q4_0 rings, decode deep in a full layer and in a sliding layer,
/// and a prefill batch; then the time of one decode call at the full layer's depth, chunked
/// against the row kernel (`-fa off`, float values) and for the quantized rings.
#[test]
fn chunked_flash_attention_gives_the_cpus_bits() {
    let Some(dev) = device() else { return };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(43);
    let (n_head, n_kv, hd) = (64, 8, 64);
    // (window, cells, pos0, n_tokens)
    let cases = [
        (None, 4352, 4100, 1),
        (Some(128), 4352, 4100, 1),
        (None, 4352, 300, 200),
        (Some(128), 4352, 300, 200),
    ];
    for (window, cells, pos0, n) in cases {
        let kvw = n_kv * hd;
        for pair in [
            (GgmlType::F16, GgmlType::F16),
            (GgmlType::F32, GgmlType::F32),
            (GgmlType::Q8_0, GgmlType::Q8_0),
            (GgmlType::Q4_0, GgmlType::Q4_0),
        ] {
            let (kl, vl) = kv_layouts(pair, hd, n_kv, cells).unwrap();
            let kb = ref_ring(&cpu, kl, &noise(&mut rng, cells * kvw, 1.0));
            let vb = ref_ring(&cpu, vl, &noise(&mut rng, cells * kvw, 1.0));
            let q = noise(&mut rng, n * n_head * hd, 2.0);
            let sinks = noise(&mut rng, n_head, 3.0);
            let mut p = attn_params(n_head, n_kv, hd, cells, window, 1);
            p.flash = true;
            let want = ref_attention(&cpu, &p, &q, (kl, &kb), (vl, &vb), Some(&sinks), n, pos0);
            let (kd, vd) = (dev.upload(&kb).unwrap(), dev.upload(&vb).unwrap());
            let (qd, sd) = (dev.upload(&q).unwrap(), dev.upload(&sinks).unwrap());
            let mut out = dev.alloc_zeros::<f32>(q.len()).unwrap();
            // The first position is read on the device.
            let pos = dev.upload(&[pos0 as i32]).unwrap();
            let call = |p: &AttnParams, out: &mut CudaSlice<f32>| {
                let at = pos.slice(0..1);
                dev.attention(p, &qd, (&kd, &kl), (&vd, &vl), Some(&sd), n, &at, out)
                    .unwrap()
            };
            call(&p, &mut out);
            let got = dev.download(&out).unwrap();
            let what = format!("chunked attention {pair:?} window {window:?} pos0 {pos0} n {n}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{what} [{i}]: {g} vs {w}");
            }
            if n == 1 && window.is_none() {
                let row = AttnParams { flash: false, ..p };
                let float = matches!(pair.1, GgmlType::F16 | GgmlType::F32);
                let runs: &[(&str, &AttnParams)] = match float {
                    true => &[("attn_chunked", &p), ("attn_row", &row)],
                    false => &[("attn_chunked", &p)],
                };
                for &(name, p) in runs {
                    call(p, &mut out);
                    dev.synchronize().unwrap();
                    let t = Instant::now();
                    for _ in 0..50 {
                        call(p, &mut out);
                    }
                    dev.synchronize().unwrap();
                    let us = t.elapsed().as_secs_f64() * 1e6 / 50.0;
                    eprintln!("{what}: {name} {us:.1} µs per call (with launch overhead)");
                }
            }
        }
    }
}

/// The memory pool keeps what is freed (`HMOE_CUDA_POOL_KEEP`, on by default), and the
/// device's free memory counts it: after a 1 GiB buffer is freed and the stream has run, free
/// memory is back within 512 MiB of where it was (other tests allocate beside this one).
#[test]
fn freed_memory_stays_in_the_pool_and_counts_as_free() {
    let Some(dev) = device() else { return };
    dev.stream().synchronize().unwrap();
    let (before, _) = dev.mem_info().unwrap();
    let big = dev.alloc_scratch::<u8>(1 << 30).unwrap();
    dev.stream().synchronize().unwrap();
    drop(big);
    dev.stream().synchronize().unwrap();
    let (after, total) = dev.mem_info().unwrap();
    assert!(after <= total);
    assert!(
        after + (512 << 20) >= before,
        "free memory {before} before a 1 GiB buffer, {after} after it was freed"
    );
}

#[test]
fn probe_reports_memory_and_the_cache_is_used() {
    let Some(dev) = device() else { return };
    let info = dev.info();
    assert!(
        info.total_bytes > 0 && info.free_bytes <= info.total_bytes,
        "{info:?}"
    );
    assert!(info.compute_capability.0 >= 5, "{info:?}");
    let (free, total) = dev.mem_info().unwrap();
    assert_eq!(total, info.total_bytes);
    assert!(free <= total);
    let gpus = hmoe_cuda::probe().unwrap();
    assert_eq!(gpus[0].name, info.name);
    eprintln!("{info:?}, kernels from {:?}", dev.ptx_origin());
    if hmoe_cuda::cache::cache_dir().is_some() {
        // The first open compiled or read the cache; a second open must read it.
        let again = CudaDevice::new(0).unwrap();
        assert!(
            matches!(again.ptx_origin(), hmoe_cuda::kernels::PtxOrigin::Cache(_)),
            "{:?}",
            again.ptx_origin()
        );
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let Some(dev) = device() else { return };
    let x = dev.alloc_zeros::<f32>(10).unwrap();
    let w = dev.alloc_zeros::<f32>(4).unwrap();
    let mut out = dev.alloc_zeros::<f32>(10).unwrap();
    assert!(
        dev.rms_norm(&x, &w, 1e-5, &mut out).is_err(),
        "10 is not rows of 4"
    );
    assert!(dev
        .upload_matrix(GgmlType::Q8_0, 2, 31, &[0u8; 68])
        .is_err());
    assert!(
        dev.upload_matrix(GgmlType::Q4_K, 1, 128, &[0u8; 72])
            .is_err(),
        "half a super-block"
    );
    assert!(
        dev.upload_matrix(GgmlType::Q8_K, 1, 256, &[0u8; 292])
            .is_err(),
        "an activation type"
    );
    let mut sel = dev.alloc_zeros::<i32>(1).unwrap();
    let mut wt = dev.alloc_zeros::<f32>(1).unwrap();
    assert!(
        dev.router_top_k(&x, 5, 6, &mut sel, &mut wt).is_err(),
        "k > n_expert"
    );
}

/// A saved sequence's K/V rows ([`Backend::kv_read`], [`Backend::kv_write`]): read alone,
/// the bytes REF0 stores for the same rows; written into a fresh ring, the ring they came
/// from; rows outside the ring are a shape error.
#[test]
fn kv_rows_are_read_and_written_alone() {
    let Some(dev) = device() else { return };
    let r = Ref0::new();
    let mut rng = StdRng::seed_from_u64(7);
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        let layout = hmoe_backend::KvLayout::new(ty, 64, 10, 0).unwrap();
        let src = noise(&mut rng, 6 * 64, 2.0);
        let mut g = Backend::kv_alloc(dev, layout).unwrap();
        let mut c = r.kv_alloc(layout).unwrap();
        Backend::kv_store(dev, &dev.upload(&src).unwrap(), &mut g, 6, 2).unwrap();
        r.kv_store(&r.upload(&src).unwrap(), &mut c, 6, 2).unwrap();
        let rows = Backend::kv_read(dev, &g, 2..8).unwrap();
        assert_eq!(rows, r.kv_read(&c, 2..8).unwrap(), "{ty:?}");
        let mut fresh = Backend::kv_alloc(dev, layout).unwrap();
        Backend::kv_write(dev, &mut fresh, 2, &rows).unwrap();
        assert_eq!(
            dev.download(&fresh.data).unwrap(),
            dev.download(&g.data).unwrap(),
            "{ty:?}"
        );
        assert!(Backend::kv_read(dev, &g, 8..11).is_err());
        assert!(Backend::kv_write(dev, &mut fresh, 9, &rows).is_err());
        assert!(Backend::kv_write(dev, &mut fresh, 0, &rows[1..]).is_err());
    }
}
