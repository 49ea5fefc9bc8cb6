//! Tests of the CPU's expert sums (`experts.rs`): the single-token and batch paths, the
//! experts as pool tasks, and the errors.
#![allow(clippy::single_range_in_vec_init)] // slices of token ranges, one sequence each

use super::*;

/// The expert sum over the layer's tensors in the file mapping.
fn host_experts(
    layer: usize,
    k: &ExpertKernels,
    act: GatedAct,
    t: &ExpertTensors<'_>,
    batch: &ExpertBatch<'_>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<(), ExpertDeviceError> {
    let (d, ff) = t.validate()?;
    let shape = (d, ff, t.n_expert);
    expert_sum(layer, k, act, shape, batch, |e| t.view(e), scratch, out)
}

/// gpt-oss's activation.
const OAI: GatedAct = GatedAct::ClampedSwiglu {
    alpha: 1.702,
    limit: 7.0,
};

/// Two experts of `d = ff = 32` in Q8_0 with distinct weights.
fn q8_layer() -> (Vec<u8>, Vec<f32>) {
    let (d, n_expert) = (32usize, 2usize);
    let row = GgmlType::Q8_0.row_bytes(d as u64).unwrap() as usize;
    let mut data = vec![0u8; n_expert * d * row];
    for (i, r) in data.chunks_exact_mut(row).enumerate() {
        let vals: Vec<f32> = (0..d)
            .map(|j| ((i * 7 + j * 3) % 11) as f32 * 0.1 - 0.5)
            .collect();
        hmoe_quant::quantize_row(GgmlType::Q8_0, &vals, r).unwrap();
    }
    let bias: Vec<f32> = (0..n_expert * d).map(|i| i as f32 * 0.01).collect();
    (data, bias)
}

fn tensors<'a>(data: &'a [u8], bias: &'a [f32]) -> ExpertTensors<'a> {
    let m = ExpertMatrix {
        ty: GgmlType::Q8_0,
        n_in: 32,
        n_out: 32,
        data,
    };
    ExpertTensors {
        n_expert: 2,
        gate: m,
        up: m,
        down: m,
        gate_bias: bias,
        up_bias: bias,
        down_bias: bias,
    }
}

/// Random experts, gate, up and down of types `tys` (MXFP4 or types `quantize_row`
/// makes): `n_expert` experts of `d → ff → d`.
fn random_layer(tys: [GgmlType; 3], d: usize, ff: usize, n_expert: usize) -> Vec<Vec<u8>> {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ tys[0].id() as u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    [(d, ff), (d, ff), (ff, d)]
        .iter()
        .zip(tys)
        .map(|(&(n_in, n_out), ty)| {
            let rows = n_expert * n_out;
            let row = ty.row_bytes(n_in as u64).unwrap() as usize;
            let mut data = vec![0u8; rows * row];
            for r in data.chunks_exact_mut(row) {
                if ty == GgmlType::MXFP4 {
                    for b in r.chunks_exact_mut(17) {
                        b[0] = 120 + (next() % 12) as u8;
                        b[1..].iter_mut().for_each(|q| *q = next() as u8);
                    }
                } else if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K) {
                    // Random quants and scales, the f16 super-block scales small and
                    // finite (Q6_K's `d` at byte 208, Q4_K's and Q5_K's `d` and `dmin`
                    // first).
                    let at: &[usize] = match ty {
                        GgmlType::Q6_K => &[208],
                        _ => &[0, 2],
                    };
                    for b in r.chunks_exact_mut(ty.block_bytes()) {
                        b.iter_mut().for_each(|q| *q = next() as u8);
                        for &o in at {
                            let v = 0.001 + (next() % 100) as f32 * 1e-5;
                            b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                        }
                    }
                } else {
                    let vals: Vec<f32> = (0..n_in)
                        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                        .collect();
                    hmoe_quant::quantize_row(ty, &vals, r).unwrap();
                }
            }
            data
        })
        .collect()
}

/// The single-token path (two fused jobs) gives the bits of the batch path, which runs
/// the experts as separate matmuls: a token alone equals the same token in a batch of two.
#[test]
fn single_token_path_matches_batch_path() {
    let (d, ff, n_expert) = (160usize, 96usize, 4usize);
    for ty in [GgmlType::MXFP4, GgmlType::Q8_0] {
        let mats = random_layer([ty; 3], d, ff, n_expert);
        let m = |i: usize, n_in, n_out| ExpertMatrix {
            ty,
            n_in,
            n_out,
            data: &mats[i],
        };
        let gb: Vec<f32> = (0..n_expert * ff).map(|i| (i as f32 * 0.7).sin()).collect();
        let ub: Vec<f32> = (0..n_expert * ff).map(|i| (i as f32 * 0.3).cos()).collect();
        let db: Vec<f32> = (0..n_expert * d).map(|i| (i as f32 * 0.1).sin()).collect();
        let t = ExpertTensors {
            n_expert,
            gate: m(0, d, ff),
            up: m(1, d, ff),
            down: m(2, ff, d),
            gate_bias: &gb,
            up_bias: &ub,
            down_bias: &db,
        };
        let k = ExpertKernels::for_tensors(&t).unwrap();
        let h: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        // Three slots, so that the order of the weighted sum shows in the bits.
        let (selected, weights) = ([2u32, 0, 3], [0.5f32, 0.3, 0.2]);
        let one = ExpertBatch {
            h: &h,
            selected: &selected,
            weights: &weights,
            n_used: 3,
            groups: &[0..1],
        };
        let mut got = vec![f32::NAN; d];
        host_experts(
            0,
            &k,
            OAI,
            &t,
            &one,
            &mut ExpertScratch::default(),
            &mut got,
        )
        .unwrap();
        let h2 = [h.clone(), h.clone()].concat();
        let (sel2, w2) = ([selected, selected].concat(), [weights, weights].concat());
        let two = ExpertBatch {
            h: &h2,
            selected: &sel2,
            weights: &w2,
            n_used: 3,
            groups: &[0..2],
        };
        let mut want = vec![f32::NAN; 2 * d];
        host_experts(
            0,
            &k,
            OAI,
            &t,
            &two,
            &mut ExpertScratch::default(),
            &mut want,
        )
        .unwrap();
        assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{ty}");
        for (i, (a, b)) in got.iter().zip(&want[..d]).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{ty} output {i}: {a} vs {b}");
        }
    }
}

/// SiLU experts of one token (decode) take the fused path, whose bits are those of the
/// grouped path (three matmuls per expert): K-quants with Q8_K activations shared by gate
/// and up (repacked-order Q4_K gate/up, Q6_K down as in Q4_K_M files), Q5_K, and Q8_0; a
/// slot naming an expert outside the layer gives nothing on both paths.
#[test]
fn fused_silu_token_matches_grouped_path() {
    use GgmlType::*;
    let (d, ff, n_expert) = (512usize, 768usize, 4usize);
    for tys in [[Q4_K, Q4_K, Q6_K], [Q5_K, Q5_K, Q5_K], [Q8_0, Q8_0, Q8_0]] {
        let mats = random_layer(tys, d, ff, n_expert);
        let m = |i: usize, n_in, n_out| ExpertMatrix {
            ty: tys[i],
            n_in,
            n_out,
            data: &mats[i],
        };
        let t = ExpertTensors {
            n_expert,
            gate: m(0, d, ff),
            up: m(1, d, ff),
            down: m(2, ff, d),
            gate_bias: &[],
            up_bias: &[],
            down_bias: &[],
        };
        let k = ExpertKernels::for_tensors(&t).unwrap();
        assert!(one_token_rows(&k, ff).is_some(), "{tys:?} fuses");
        let h: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        // Four slots, one outside the layer, so that the order of the sum shows in the bits.
        let (selected, weights) = ([2usize, 0, 9, 3], [0.4f32, 0.3, 0.2, 0.1]);
        let shape = (d, ff, n_expert);
        let mut acts = QuantizedActs::default();
        let view = |e| t.view(e);
        let got = moe_swiglu(&k, shape, view, &h, &selected, &weights, 4, &mut acts);
        let want = moe_swiglu_grouped(&k, shape, view, &h, &selected, &weights, 4, &mut acts);
        assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{tys:?}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{tys:?} output {i}: {a} vs {b}");
        }
    }
}

/// A batch over many experts (each expert one pool task, or one after another with the
/// threads sharing its matmuls) gives the bits of the experts computed from the public
/// pieces one by one (`matmul_vec_dot`, `swiglu`, the slot-order weighted sum): K-quant
/// experts of every batched order (repacked-order Q4_K, tiled Q5_K and Q6_K from 8 tokens,
/// `vec_dot` below), 1 to 30 tokens an expert, a slot outside the layer.
#[test]
fn experts_as_pool_tasks_match_the_experts_one_by_one() {
    use crate::ops::matmul_vec_dot;
    use GgmlType::*;
    let (d, ff, n_expert, k_used, n) = (256usize, 512usize, 12usize, 4usize, 37usize);
    for tys in [[Q4_K, Q4_K, Q6_K], [Q5_K, Q5_K, Q6_K]] {
        let mats = random_layer(tys, d, ff, n_expert);
        let m = |i: usize, n_in, n_out| ExpertMatrix {
            ty: tys[i],
            n_in,
            n_out,
            data: &mats[i],
        };
        let t = ExpertTensors {
            n_expert,
            gate: m(0, d, ff),
            up: m(1, d, ff),
            down: m(2, ff, d),
            gate_bias: &[],
            up_bias: &[],
            down_bias: &[],
        };
        let k = ExpertKernels::for_tensors(&t).unwrap();
        let h: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        // Expert 0 takes every token's first slot (37 tokens), the others a few each;
        // token 5's last slot names an expert outside the layer.
        let selected: Vec<usize> = (0..n * k_used)
            .map(|i| match (i / k_used, i % k_used) {
                (5, 3) => n_expert + 2,
                (_, 0) => 0,
                (t, s) => 1 + (t * 7 + s * 3) % (n_expert - 1),
            })
            .collect();
        let weights: Vec<f32> = (0..n * k_used)
            .map(|i| 0.1 + (i % 7) as f32 * 0.05)
            .collect();
        let shape = (d, ff, n_expert);
        let mut acts = QuantizedActs::default();
        let got = moe_swiglu(
            &k,
            shape,
            |e| t.view(e),
            &h,
            &selected,
            &weights,
            k_used,
            &mut acts,
        );
        // The experts one by one from the public pieces.
        let product = |kernel: DotKernel, w: &[u8], (n_in, n_out), x: &[f32]| {
            let mut qa = QuantizedActs::default();
            qa.quantize(kernel.act_type(), x, n_in);
            let mut y = vec![0f32; x.len() / n_in * n_out];
            matmul_vec_dot(kernel, w, n_in, n_out, &qa, &mut y);
            y
        };
        let mut want = vec![0f32; n * d];
        let mut per_slot = vec![None; n * k_used];
        for e in 0..n_expert {
            let slots: Vec<usize> = (0..n * k_used).filter(|&i| selected[i] == e).collect();
            let rows: Vec<f32> = slots
                .iter()
                .flat_map(|&i| h[i / k_used * d..][..d].iter().copied())
                .collect();
            let v = t.view(e).unwrap();
            let mut g = product(k.gate, v.gate, (d, ff), &rows);
            let u = product(k.up, v.up, (d, ff), &rows);
            swiglu(&mut g, &u, ff);
            let y = product(k.down, v.down, (ff, d), &g);
            for (row, &i) in y.chunks_exact(d).zip(&slots) {
                per_slot[i] = Some(row.to_vec());
            }
        }
        for (tok, dst) in want.chunks_exact_mut(d).enumerate() {
            for s in 0..k_used {
                if let Some(row) = &per_slot[tok * k_used + s] {
                    let w = weights[tok * k_used + s];
                    for (o, &v) in dst.iter_mut().zip(row) {
                        *o += v * w;
                    }
                }
            }
        }
        assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{tys:?}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{tys:?} output {i}: {a} vs {b}");
        }
        // Both ways of running the experts, whatever the pool's size.
        let routed: Vec<(ExpertView<'_>, Vec<usize>)> = (0..n_expert)
            .map(|e| {
                let slots = (0..n * k_used).filter(|&i| selected[i] == e).collect();
                (t.view(e).unwrap(), slots)
            })
            .collect();
        acts.quantize(k.gate.act_type(), &h, d);
        let tasks = expert_outputs(&k, (d, ff), &routed, &h, k_used, &acts, true);
        let serial = expert_outputs(&k, (d, ff), &routed, &h, k_used, &acts, false);
        for (a, b) in tasks.iter().zip(&serial) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}

/// SiLU experts of the IQ types (random codes, small scales): a token alone (the fused
/// single-token path, the single-row kernels) gives the bits of the same token in a batch
/// of two (the grouped path, the batched IQ kernels).
#[test]
fn iq_silu_token_alone_equals_token_in_batch() {
    let (d, ff, n_expert) = (512usize, 256usize, 4usize);
    for ty in hmoe_quant::IQ_TYPES {
        let mut seed = 0x2545_f491_4f6c_dd1du64 ^ ty.id() as u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut mat = |n_in: usize, n_out: usize| {
            let row = ty.row_bytes(n_in as u64).unwrap() as usize;
            let mut data: Vec<u8> = (0..n_expert * n_out * row).map(|_| next() as u8).collect();
            for b in data.chunks_exact_mut(ty.block_bytes()) {
                let v = 0.001 + (next() % 100) as f32 * 1e-5;
                let bits = half::f16::from_f32(v).to_bits();
                assert!(hmoe_quant::set_iq_block_scale(ty, b, bits));
            }
            data
        };
        let mats = [mat(d, ff), mat(d, ff), mat(ff, d)];
        let m = |i: usize, n_in, n_out| ExpertMatrix {
            ty,
            n_in,
            n_out,
            data: &mats[i],
        };
        let t = ExpertTensors {
            n_expert,
            gate: m(0, d, ff),
            up: m(1, d, ff),
            down: m(2, ff, d),
            gate_bias: &[],
            up_bias: &[],
            down_bias: &[],
        };
        let k = ExpertKernels::for_tensors(&t).unwrap();
        let h: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        let (selected, weights) = ([2usize, 0, 3], [0.5f32, 0.3, 0.2]);
        let shape = (d, ff, n_expert);
        let mut acts = QuantizedActs::default();
        let view = |e| t.view(e);
        let alone = moe_swiglu(&k, shape, view, &h, &selected, &weights, 3, &mut acts);
        let h2 = [h.clone(), h.clone()].concat();
        let (sel2, w2) = ([selected, selected].concat(), [weights, weights].concat());
        let two = moe_swiglu(&k, shape, view, &h2, &sel2, &w2, 3, &mut acts);
        assert!(alone.iter().all(|v| v.is_finite()), "{ty}");
        for (i, (a, b)) in alone.iter().zip(&two[..d]).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{ty} output {i}: {a} vs {b}");
        }
    }
}

#[test]
fn bad_batches_and_tensors_are_errors() {
    let (data, bias) = q8_layer();
    let t = tensors(&data, &bias);
    let k = ExpertKernels::for_tensors(&t).unwrap();
    let h = vec![0.5f32; 64];
    let mut out = vec![0f32; 64];
    let ok_groups = [0..2];
    let bad_groups = [0..1];
    let mut run = |batch: &ExpertBatch<'_>, t: &ExpertTensors<'_>, out_len: usize| {
        let mut scratch = ExpertScratch::default();
        host_experts(0, &k, OAI, t, batch, &mut scratch, &mut out[..out_len])
    };
    for (sel, w, groups, out_len) in [
        (&[0u32, 1][..], &[1.0f32][..], &ok_groups, 64),
        (&[0, 1], &[1.0, 1.0], &bad_groups, 64),
        (&[0, 1], &[1.0, 1.0], &ok_groups, 63),
        (&[0, 7], &[1.0, 1.0], &ok_groups, 64),
    ] {
        let batch = ExpertBatch {
            h: &h,
            selected: sel,
            weights: w,
            n_used: 1,
            groups,
        };
        assert!(run(&batch, &t, out_len).is_err(), "{sel:?} {w:?} {out_len}");
    }
    let good = ExpertBatch {
        h: &h,
        selected: &[0, 1],
        weights: &[1.0, 1.0],
        n_used: 1,
        groups: &ok_groups,
    };
    assert!(run(&good, &t, 64).is_ok());
    let short = tensors(&data[1..], &bias);
    assert!(matches!(
        run(&good, &short, 64),
        Err(ExpertDeviceError::Shape { .. })
    ));
}
