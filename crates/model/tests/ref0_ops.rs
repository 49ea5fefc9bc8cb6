//! The reference device's products against the CPU's (`hmoe_cpu::ops::matmul`), bit
//! for bit, for the types whose order it follows (Q8_0, MXFP4, F32 one token and batches),
//! including F32 rows with a tail after the last 64 elements. (Here, above both: the contract
//! crate cannot see the CPU.)

mod common;

use hmoe_backend::{Backend, Ref0};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `rows × cols` weights of `ty` quantized from noise.
fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut q = vec![0u8; rows * rb];
    for row in q.chunks_exact_mut(rb) {
        let src: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        hmoe_quant::quantize_row(ty, &src, row).unwrap();
    }
    q
}

#[test]
fn ref0_matmul_is_the_cpu_devices_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(11);
    let dev = Ref0::new();
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::F32] {
        for (rows, cols) in [(37, 256), (9, 160), (5, 2880)] {
            let q = weights(&mut rng, ty, rows, cols);
            let m = dev.upload_matrix(ty, rows, cols, &q).unwrap();
            for n in [1usize, 3, 9] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-3.0f32..3.0))
                    .collect();
                let xd = dev.upload(&x).unwrap();
                let mut yd = dev.alloc::<f32>(n * rows).unwrap();
                dev.matmul(&m, &xd, n, &mut yd).unwrap();
                let got = dev.download(&yd).unwrap();
                let kernel = hmoe_quant::DotKernel::best(ty).unwrap();
                let mut qa = hmoe_cpu::ops::QuantizedActs::default();
                qa.quantize(kernel.act_type(), &x, cols);
                let mut want = vec![0f32; n * rows];
                hmoe_cpu::ops::matmul(kernel, &q, cols, rows, &qa, &mut want);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{ty} {rows}x{cols} n={n} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// `rows × cols` weights of `ty` from random bytes, each block's f16 scales (and mins) set to
/// small finite values (ggml's block layouts: where `d`/`dmin` sit in each block).
fn random_blocks(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut q: Vec<u8> = (0..rows * rb).map(|_| rng.random()).collect();
    let scales: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        other if hmoe_quant::IQ_TYPES.contains(&other) => &[],
        other => panic!("no block layout for {other}"),
    };
    for block in q.chunks_exact_mut(ty.block_bytes()) {
        for &at in scales {
            let v = half::f16::from_f32(rng.random_range(0.001f32..0.05));
            block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
        let v = half::f16::from_f32(rng.random_range(0.001f32..0.05));
        hmoe_quant::set_iq_block_scale(ty, block, v.to_bits());
    }
    q
}

/// The types REF0 multiplies with hmoe-quant's kernels (Q4_0 … Q6_K): its `matmul` is the CPU's
/// `matmul` with the kernel the CPU picks for the matrix (repacked Q4_0/Q4_K
/// for rows in multiples of 8), one token and batches below, at and above the 4-token groups
/// of the repacked kernels and the 8 tokens from which K-quants are tiled.
#[test]
fn ref0_quant_kernel_matmul_is_the_cpu_devices_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(16);
    let dev = Ref0::new();
    for ty in hmoe_backend::QUANT_KERNEL_TYPES {
        let cols = 2 * ty.block_elems().max(32).max(256);
        for rows in [16, 12] {
            let q = random_blocks(&mut rng, ty, rows, cols);
            let m = dev.upload_matrix(ty, rows, cols, &q).unwrap();
            let kernel = hmoe_quant::DotKernel::for_matrix(ty, rows).unwrap();
            for n in [1usize, 3, 4, 6, 8, 13] {
                let x = noise(&mut rng, n * cols, 3.0);
                let xd = dev.upload(&x).unwrap();
                let mut yd = dev.alloc::<f32>(n * rows).unwrap();
                dev.matmul(&m, &xd, n, &mut yd).unwrap();
                let mut qa = hmoe_cpu::ops::QuantizedActs::default();
                qa.quantize(kernel.act_type(), &x, cols);
                let mut want = vec![0f32; n * rows];
                hmoe_cpu::ops::matmul(kernel, &q, cols, rows, &qa, &mut want);
                assert!(want.iter().all(|v| v.is_finite()), "{ty}: finite products");
                let what = format!("{ty} {rows}x{cols} n={n}");
                assert_bits(&dev.download(&yd).unwrap(), &want, &what);
            }
        }
    }
}

/// The CPU's routed SwiGLU experts (its host path, `moe_swiglu`) from its public
/// pieces: each expert's routed rows together (quantized for the matrix's kernel, the one the
/// CPU picks for it), `matmul_vec_dot` (the expert matmul's order), `swiglu`, then each
/// token's slot outputs weighted and added in slot order from zero.
#[allow(clippy::too_many_arguments)]
fn cpu_moe_swiglu(
    [gate, up, down]: [(GgmlType, &[u8]); 3],
    (d, ff): (usize, usize),
    x: &[f32],
    sel: &[i32],
    wts: &[f32],
    k: usize,
) -> Vec<f32> {
    use hmoe_cpu::ops::{matmul_vec_dot, swiglu, QuantizedActs};
    let n = x.len() / d;
    let product = |(ty, data): (GgmlType, &[u8]), e: usize, rows: usize, cols, acts: &[f32]| {
        let kernel = hmoe_quant::DotKernel::for_matrix(ty, rows).unwrap();
        let size = rows * ty.row_bytes(cols as u64).unwrap() as usize;
        let mut qa = QuantizedActs::default();
        qa.quantize(kernel.act_type(), acts, cols);
        let mut y = vec![0f32; acts.len() / cols * rows];
        matmul_vec_dot(
            kernel,
            &data[e * size..(e + 1) * size],
            cols,
            rows,
            &qa,
            &mut y,
        );
        y
    };
    let mut per_slot = vec![0f32; n * k * d];
    for e in 0..=sel.iter().copied().max().unwrap_or(0) as usize {
        let slots: Vec<usize> = (0..n * k).filter(|&s| sel[s] == e as i32).collect();
        if slots.is_empty() {
            continue;
        }
        let rows: Vec<f32> = slots
            .iter()
            .flat_map(|&s| x[(s / k) * d..][..d].iter().copied())
            .collect();
        let mut g = product(gate, e, ff, d, &rows);
        let u = product(up, e, ff, d, &rows);
        swiglu(&mut g, &u, ff);
        let y = product(down, e, d, ff, &g);
        for (row, &s) in y.chunks_exact(d).zip(&slots) {
            per_slot[s * d..(s + 1) * d].copy_from_slice(row);
        }
    }
    let mut out = vec![0f32; n * d];
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        for s in 0..k {
            let w = wts[t * k + s];
            for (ov, &v) in o.iter_mut().zip(&per_slot[(t * k + s) * d..][..d]) {
                *ov += v * w;
            }
        }
    }
    out
}

/// REF0's `moe` with SiLU experts of the quantized types of real files (Q4_K gate/up with
/// Q6_K or Q8_0 down as in Q4_K_M, and the other K-quant and Q4/Q5 types) is the CPU's
/// host expert path bit for bit: 12 tokens put every row on expert 0 (the tiled K-quant order
/// of an expert matmul of 8 or more rows) and 6 on each of experts 1 and 2; one token alone.
#[test]
fn ref0_quant_silu_experts_are_the_cpu_devices_bit_for_bit() {
    use hmoe_backend::{ExpertMatrix, ExpertTensors, GatedAct};
    use GgmlType::*;
    let mut rng = StdRng::seed_from_u64(21);
    let dev = Ref0::new();
    let (d, ff, ne, k) = (512, 256, 3, 2);
    for [g_ty, u_ty, d_ty] in [
        [Q4_K, Q4_K, Q6_K],
        [Q4_K, Q4_K, Q8_0],
        [Q5_K, Q5_K, Q5_K],
        [Q2_K, Q3_K, Q4_K],
        [Q4_0, Q4_1, Q5_0],
        [Q5_1, Q8_0, Q4_0],
    ] {
        let stack = |rng: &mut StdRng, ty, rows, cols| -> Vec<u8> {
            match ty {
                Q8_0 => weights(rng, ty, ne * rows, cols),
                _ => random_blocks(rng, ty, ne * rows, cols),
            }
        };
        let (gw, uw, dw) = (
            stack(&mut rng, g_ty, ff, d),
            stack(&mut rng, u_ty, ff, d),
            stack(&mut rng, d_ty, d, ff),
        );
        let m = |ty, n_in, n_out, data| ExpertMatrix {
            ty,
            n_in,
            n_out,
            data,
        };
        let t = ExpertTensors {
            n_expert: ne,
            gate: m(g_ty, d, ff, &gw),
            up: m(u_ty, d, ff, &uw),
            down: m(d_ty, ff, d, &dw),
            gate_bias: &[],
            up_bias: &[],
            down_bias: &[],
        };
        let experts = dev.upload_moe(&t, None).unwrap();
        for n in [12usize, 1] {
            let x = noise(&mut rng, n * d, 2.0);
            let sel: Vec<i32> = (0..n).flat_map(|t| [0, 1 + (t % 2) as i32]).collect();
            let wts = noise(&mut rng, n * k, 1.0);
            let (xd, sd, wd) = (
                dev.upload(&x).unwrap(),
                dev.upload(&sel).unwrap(),
                dev.upload(&wts).unwrap(),
            );
            let mut out = dev.alloc::<f32>(n * d).unwrap();
            dev.moe(&experts, GatedAct::Silu, &xd, &sd, &wd, k, &mut out)
                .unwrap();
            let want = cpu_moe_swiglu(
                [(g_ty, &gw), (u_ty, &uw), (d_ty, &dw)],
                (d, ff),
                &x,
                &sel,
                &wts,
                k,
            );
            assert!(want.iter().all(|v| v.is_finite()), "finite outputs");
            let what = format!("{g_ty}/{u_ty}/{d_ty} experts, {n} tokens");
            assert_bits(&dev.download(&out).unwrap(), &want, &what);
        }
    }
}

fn noise(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{i}]: {g} vs {w}");
    }
}

/// Normal-style RoPE over a sub-range of each head (MLA's rope dims after the latent), plain
/// and with YaRN: the rotation of adjacent pairs by the CPU's `(cos, sin)` table
/// (`Rope::caches`) with ggml's FMA contraction, on those dims, bit for bit.
#[test]
fn ref0_rope_norm_is_the_cpu_devices_bit_for_bit() {
    use hmoe_model::archs::rope::{Rope, RopeScaling};
    let mut rng = StdRng::seed_from_u64(12);
    let dev = Ref0::new();
    let yarn = RopeScaling::Yarn {
        factor: 40.0,
        n_ctx_orig: 4096,
        attn_factor: 0.7,
        beta_fast: 32.0,
        beta_slow: 1.0,
    };
    for (scaling, rd, first, hd) in [
        (RopeScaling::None, 8, 16, 24),
        (yarn, 64, 512, 576),
        (RopeScaling::Linear { factor: 4.0 }, 16, 0, 16),
    ] {
        let rope = Rope::scaled(rd, 10000.0, scaling);
        let (n, nh, pos0) = (5, 3, 1000);
        let x = noise(&mut rng, n * nh * hd, 2.0);
        let positions: Vec<i32> = (pos0..pos0 + n as i32).collect();
        let mut xd = dev.upload(&x).unwrap();
        let pd = dev.upload(&positions).unwrap();
        let p = rope.device_params().unwrap();
        dev.rope_norm(&mut xd, &pd, nh, hd, first, &p).unwrap();
        let mut want = x.clone();
        let cs = rope.caches(pos0 as usize, n);
        for (t, cs) in cs.iter().enumerate() {
            for h in 0..nh {
                let head = &mut want[(t * nh + h) * hd..][..hd];
                for (pair, &(c, s)) in head[first..first + rd].chunks_exact_mut(2).zip(cs) {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0.mul_add(c, -(x1 * s));
                    pair[1] = x0.mul_add(s, x1 * c);
                }
            }
        }
        assert_bits(&dev.download(&xd).unwrap(), &want, &format!("{scaling:?}"));
    }
    // Rotated dims past the head are refused.
    let mut xd = dev.upload(&[0f32; 24]).unwrap();
    let pd = dev.upload(&[0i32]).unwrap();
    let p = Rope::scaled(8, 1e4, RopeScaling::None)
        .device_params()
        .unwrap();
    assert!(dev.rope_norm(&mut xd, &pd, 1, 24, 20, &p).is_err());
}

/// Per-head products (MLA's absorbed key and value up-projections): with a strided input
/// (`q_nope` inside the query rows) in `vec_dot` order, as the CPU's
/// `matmul_vec_dot`; with contiguous rows as its `matmul` of each head's batch.
#[test]
fn ref0_matmul_heads_is_the_cpu_devices_bit_for_bit() {
    use hmoe_cpu::ops::{matmul, matmul_vec_dot, QuantizedActs};
    let mut rng = StdRng::seed_from_u64(13);
    let dev = Ref0::new();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let (nh, out, cols) = (3, 48, 64);
        let q = weights(&mut rng, ty, nh * out, cols);
        let m = dev.upload_matrix(ty, nh * out, cols, &q).unwrap();
        let kernel = hmoe_quant::DotKernel::best(ty).unwrap();
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        for (stride, n) in [(cols, 1), (cols, 7), (cols + 32, 1), (cols + 32, 7)] {
            let x = noise(&mut rng, n * nh * stride, 3.0);
            let xd = dev.upload(&x).unwrap();
            let mut yd = dev.alloc::<f32>(n * nh * out).unwrap();
            dev.matmul_heads(&m, &xd, n, nh, stride, &mut yd).unwrap();
            let mut want = vec![0f32; n * nh * out];
            for h in 0..nh {
                let rows: Vec<f32> = (0..n)
                    .flat_map(|t| x[(t * nh + h) * stride..][..cols].to_vec())
                    .collect();
                let mut qa = QuantizedActs::default();
                qa.quantize(kernel.act_type(), &rows, cols);
                let w = &q[h * out * rb..(h + 1) * out * rb];
                let mut y = vec![0f32; n * out];
                if stride == cols {
                    matmul(kernel, w, cols, out, &qa, &mut y);
                } else {
                    matmul_vec_dot(kernel, w, cols, out, &qa, &mut y);
                }
                for t in 0..n {
                    want[(t * nh + h) * out..][..out].copy_from_slice(&y[t * out..][..out]);
                }
            }
            let what = format!("{ty} stride {stride} n {n}");
            assert_bits(&dev.download(&yd).unwrap(), &want, &what);
        }
    }
}

/// `silu(g)·u` with whole 16-blocks (ggml's vectorised `exp`) and a tail (libm's), as the CPU's
/// `swiglu`.
#[test]
fn ref0_swiglu_is_the_cpu_devices_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(14);
    let dev = Ref0::new();
    for n in [32, 40, 7] {
        let g = noise(&mut rng, 3 * n, 8.0);
        let u = noise(&mut rng, 3 * n, 2.0);
        let mut gd = dev.upload(&g).unwrap();
        let ud = dev.upload(&u).unwrap();
        dev.swiglu(&mut gd, &ud, n).unwrap();
        let mut want = g.clone();
        hmoe_cpu::ops::swiglu(&mut want, &u, n);
        assert_bits(&dev.download(&gd).unwrap(), &want, &format!("n {n}"));
    }
}

/// Routing (softmax or sigmoid gate, selection bias, expert groups, renormalised and scaled
/// weights) on the DeepSeek-V3 fixture's router and score bias, and on random logits: the
/// CPU's `gate_probs` + `Routing::select`, row by row.
#[test]
fn ref0_route_is_the_cpu_devices() {
    use hmoe_backend::routing::{gate_probs, Gating, Routing};
    let path = common::fixtures().join("deepseek2/deepseek2-tiny.gguf");
    let g = hmoe_gguf::GgufModel::open(&path, hmoe_gguf::LoadOptions::default()).unwrap();
    let n_vocab = g.tensor_info("token_embd.weight").unwrap().dims[1] as usize;
    let p = hmoe_model::Deepseek2Params::from_metadata(g.metadata(), n_vocab).unwrap();
    let bias: Vec<f32> = g
        .tensor_data("blk.1.exp_probs_b.bias")
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(bias.len(), p.n_expert);
    let mut rng = StdRng::seed_from_u64(15);
    let dev = Ref0::new();
    let ne = p.n_expert;
    let cases = [
        (p.gating, p.routing, Some(&bias)),
        (
            Gating::Softmax,
            Routing {
                k: 3,
                groups: None,
                norm: false,
                scale: 1.0,
            },
            None,
        ),
        (
            Gating::Sigmoid,
            Routing {
                k: 4,
                groups: Some((4, 2)),
                norm: true,
                scale: 0.5,
            },
            None,
        ),
    ];
    for (gating, routing, bias) in cases {
        let n = 9;
        let logits = noise(&mut rng, n * ne, 4.0);
        let ld = dev.upload(&logits).unwrap();
        let bd = bias.map(|b| dev.upload(b).unwrap());
        let k = routing.k;
        let mut sel = dev.alloc::<i32>(n * k).unwrap();
        let mut w = dev.alloc::<f32>(n * k).unwrap();
        dev.route(&ld, bd.as_ref(), gating, &routing, ne, &mut sel, &mut w)
            .unwrap();
        let (sel, w) = (dev.download(&sel).unwrap(), dev.download(&w).unwrap());
        let (mut top, mut tw) = (Vec::new(), Vec::new());
        for t in 0..n {
            let mut row = logits[t * ne..(t + 1) * ne].to_vec();
            gate_probs(gating, &mut row);
            routing.select(&row, bias.map(|b| &b[..]), &mut top, &mut tw);
            let want_sel: Vec<i32> = top.iter().map(|&e| e as i32).collect();
            assert_eq!(
                &sel[t * k..(t + 1) * k],
                &want_sel[..],
                "{routing:?} row {t}"
            );
            assert_bits(&w[t * k..(t + 1) * k], &tw, &format!("{routing:?} row {t}"));
        }
    }
    // Groups that do not split the experts are refused.
    let ld = dev.upload(&vec![0f32; ne]).unwrap();
    let (mut sel, mut w) = (dev.alloc::<i32>(2).unwrap(), dev.alloc::<f32>(2).unwrap());
    let bad = Routing {
        k: 2,
        groups: Some((3, 1)),
        norm: true,
        scale: 1.0,
    };
    assert!(dev
        .route(&ld, None, Gating::Sigmoid, &bad, ne, &mut sel, &mut w)
        .is_err());
}

/// Strided row copies (heads split out of and gathered into wider rows), and their bounds.
#[test]
fn ref0_copy_rows_copies_strided_rows() {
    use hmoe_backend::RowCopy;
    let dev = Ref0::new();
    let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let sd = dev.upload(&src).unwrap();
    let mut dd = dev.alloc::<f32>(9).unwrap();
    let c = RowCopy {
        n_rows: 3,
        width: 2,
        src_stride: 4,
        src_offset: 1,
        dst_stride: 3,
        dst_offset: 1,
    };
    dev.copy_rows(&sd, &mut dd, &c).unwrap();
    assert_eq!(
        dev.download(&dd).unwrap(),
        [0.0, 1.0, 2.0, 0.0, 5.0, 6.0, 0.0, 9.0, 10.0]
    );
    let too_far = RowCopy { dst_offset: 2, ..c }; // row 2 would end at 10
    assert!(dev.copy_rows(&sd, &mut dd, &too_far).is_err());
    let huge = RowCopy {
        src_stride: usize::MAX,
        ..c
    };
    assert!(dev.copy_rows(&sd, &mut dd, &huge).is_err());
}

/// ggml's vectorised exponential (shared by the CPU and the reference device) is within two
/// ulp of `expf`.
#[test]
fn expf_ggml_is_within_two_ulp_of_expf() {
    use hmoe_backend::numerics::{expf_ggml, hsum16};
    for i in -2000..2000 {
        let x = i as f32 * 0.0437;
        let (a, b) = (expf_ggml(x), x.exp());
        let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(ulps <= 2, "x {x}: {a} vs {b}");
    }
    assert_eq!(expf_ggml(f32::NEG_INFINITY), 0.0);
    assert_eq!(expf_ggml(0.0), 1.0);
    assert_eq!(hsum16(&[1.0; 16]), 16.0);
}

/// The CPU's RMSNorm row kernel is `x / rms(x) · w`.
#[test]
fn rms_norm_matches_definition() {
    let x = [1.0f32, 2.0, 3.0, 4.0];
    let w = [1.0f32, 0.5, 2.0, 1.0];
    let mut out = [0f32; 4];
    hmoe_cpu::ops::rms_norm(&x, &w, 1e-5, &mut out);
    let rms = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0 + 1e-5f32).sqrt();
    for i in 0..4 {
        assert!((out[i] - x[i] / rms * w[i]).abs() < 1e-6);
    }
}
