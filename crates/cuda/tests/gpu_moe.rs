//! The CUDA router and MoE kernels against the reference backend: top-k and normalisation,
//! the logits' top-k,
//! every expert type and activation, tiled products against one token at a time, and staged
//! expert uploads. Like `gpu.rs`, each test returns early ("no CUDA device: skipped") on a
//! machine without a CUDA device.

#[allow(dead_code)]
mod common;
#[path = "support/gpu_device.rs"]
mod gpu_device;

use std::time::Instant;

use hmoe_backend::{Backend, ExpertMatrix, ExpertTensors, Ref0};
use hmoe_cuda::{CudaDevice, DeviceExperts, ExpertAct, MoeWeights};
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::SeedableRng;

use common::{lowbit_expert_sets, noise, ref_moe, KERNEL_ACT, LOWBIT_MOE, LOWBIT_SEL, TYPES};
use gpu_device::{assert_close, device, weights};

#[test]
fn router_picks_top_k_and_normalises_them() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let (n, ne, k) = (9, 128, 4);
    let mut logits = noise(&mut rng, n * ne, 4.0);
    // Ties: the lower index wins.
    logits[5] = 10.0;
    logits[9] = 10.0;
    logits[ne + 100] = 7.0;
    logits[ne + 3] = 7.0;
    let ld = dev.upload(&logits).unwrap();
    let mut sel = dev.alloc_zeros::<i32>(n * k).unwrap();
    let mut w = dev.alloc_zeros::<f32>(n * k).unwrap();
    dev.router_top_k(&ld, ne, k, &mut sel, &mut w).unwrap();
    let (sel, w) = (dev.download(&sel).unwrap(), dev.download(&w).unwrap());
    for t in 0..n {
        let row = &logits[t * ne..(t + 1) * ne];
        let mut idx: Vec<usize> = (0..ne).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let top: Vec<i32> = idx[..k].iter().map(|&i| i as i32).collect();
        assert_eq!(&sel[t * k..(t + 1) * k], &top[..], "token {t}");
        // The CPU device's softmax: exps summed in f64, times the f32 of 1 / sum.
        let m = row[idx[0]];
        let e: Vec<f32> = idx[..k].iter().map(|&i| (row[i] - m).exp()).collect();
        let inv = (1.0 / e.iter().map(|&v| v as f64).sum::<f64>()) as f32;
        for j in 0..k {
            assert!(
                (w[t * k + j] - e[j] * inv).abs() < 1e-6,
                "token {t} slot {j}"
            );
        }
    }
    assert_eq!(&sel[..2], &[5, 9]);
    assert_eq!(&sel[k..k + 2], &[3, 100]);
}

/// The router's product and its top-k in one launch (`router_top_k_logits`, kernels/router.cu)
/// against REF0's `matmul_shared` then `router_top_k`, bit for bit: F32 routers of 128, 32 and
/// 8 experts over gpt-oss's 2,880, with a bias and without, 1 … 8 tokens (one launch) and 9
/// (two), one after the other and twice each, so that every launch finds the device's counter
/// as the last one left it.
#[test]
fn router_logits_and_top_k_in_one_launch_give_the_reference_backends_bits() {
    let Some(dev) = device() else { return };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(8);
    let d = 2880;
    let mut cases = 0;
    for (ne, k) in [(128, 4), (32, 4), (8, 2)] {
        let (q, _) = weights(&mut rng, GgmlType::F32, ne, d);
        let bias = noise(&mut rng, ne, 0.5);
        let (m, mc) = (
            dev.upload_matrix(GgmlType::F32, ne, d, &q).unwrap(),
            cpu.upload_matrix(GgmlType::F32, ne, d, &q).unwrap(),
        );
        let (bd, bc) = (dev.upload(&bias).unwrap(), cpu.upload(&bias).unwrap());
        for n in (1..=hmoe_cuda::ROUTER_FUSED_MAX_TOKENS + 1).chain([1]) {
            let x = noise(&mut rng, n * d, 1.0);
            for with_bias in [false, true] {
                let mut want = (
                    cpu.alloc::<f32>(n * ne).unwrap(),
                    cpu.alloc::<i32>(n * k).unwrap(),
                    cpu.alloc::<f32>(n * k).unwrap(),
                );
                let xc = cpu.upload(&x).unwrap();
                let b = [with_bias.then_some(&bc)];
                cpu.matmul_shared(&[&mc], &b, &xc, n, &mut [&mut want.0])
                    .unwrap();
                cpu.router_top_k(&want.0, ne, k, &mut want.1, &mut want.2)
                    .unwrap();
                let xd = dev.upload(&x).unwrap();
                for rep in 0..2 {
                    let mut logits = dev.alloc_zeros::<f32>(n * ne).unwrap();
                    let mut sel = dev.alloc_zeros::<i32>(n * k).unwrap();
                    let mut w = dev.alloc_zeros::<f32>(n * k).unwrap();
                    let bias = with_bias.then_some(&bd);
                    let (logits_, sel_, w_) = (&mut logits, &mut sel, &mut w);
                    Backend::router_top_k_logits(dev, &m, bias, &xd, n, (ne, k), logits_, sel_, w_)
                        .unwrap();
                    let what = format!("{ne} experts k {k}, {n} tokens, bias {with_bias}, #{rep}");
                    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let got_logits = bits(dev.download(&logits).unwrap());
                    assert_eq!(got_logits, bits(cpu.download(&want.0).unwrap()), "{what}");
                    assert_eq!(
                        dev.download(&sel).unwrap(),
                        cpu.download(&want.1).unwrap(),
                        "{what}"
                    );
                    let got_w = bits(dev.download(&w).unwrap());
                    assert_eq!(got_w, bits(cpu.download(&want.2).unwrap()), "{what}");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 3 * 10 * 2 * 2);
}

/// The logits' top-k (kernels/top_k.cu) at gpt-oss's vocabulary against REF0's bits, for
/// one and several rows, k = 1 (greedy), 40 (llama-server's default) and the bound, with
/// ties and specials; reports the kernels' time against bringing the whole row down.
#[test]
fn top_k_of_the_logits_gives_the_reference_backends_bits() {
    let Some(dev) = device() else { return };
    let cpu = Ref0::new();
    let mut rng = StdRng::seed_from_u64(47);
    let n_vocab = 201_088;
    for n in [1, 4] {
        let mut logits = noise(&mut rng, n * n_vocab, 8.0);
        // Ties at the top, ±0, ±inf and a NaN in the last row.
        for (i, v) in [
            (7, 30.0),
            (n_vocab - 1, 30.0),
            (11, f32::INFINITY),
            (12, -0.0),
        ] {
            logits[i] = v;
        }
        logits[(n - 1) * n_vocab + 5] = f32::NAN;
        let ld = dev.upload(&logits).unwrap();
        let ref_logits = cpu.upload(&logits).unwrap();
        for k in [1, 40, hmoe_backend::TOP_K_MAX] {
            let mut scratch = dev
                .alloc_scratch::<i32>(hmoe_backend::top_k_chunked_scratch(n, n_vocab, k))
                .unwrap();
            let mut v = dev.alloc_zeros::<f32>(n * k).unwrap();
            let mut ids = dev.alloc_zeros::<i32>(n * k).unwrap();
            dev.top_k(&ld, n_vocab, k, &mut scratch, &mut v, &mut ids)
                .unwrap();
            dev.synchronize().unwrap();
            let t0 = Instant::now();
            for _ in 0..20 {
                dev.top_k(&ld, n_vocab, k, &mut scratch, &mut v, &mut ids)
                    .unwrap();
            }
            dev.synchronize().unwrap();
            let kernels = t0.elapsed().as_secs_f64() * 1e6 / 20.0;
            let t0 = Instant::now();
            let _ = dev.download(&ld).unwrap();
            let whole = t0.elapsed().as_secs_f64() * 1e6;
            let mut rs = cpu
                .alloc_scratch::<i32>(cpu.top_k_scratch(n, n_vocab, k))
                .unwrap();
            let mut rv = cpu.alloc::<f32>(n * k).unwrap();
            let mut ri = cpu.alloc::<i32>(n * k).unwrap();
            cpu.top_k(&ref_logits, n_vocab, k, &mut rs, &mut rv, &mut ri)
                .unwrap();
            assert_eq!(
                dev.download(&ids).unwrap(),
                cpu.download(&ri).unwrap(),
                "{n}×k={k}"
            );
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(
                bits(dev.download(&v).unwrap()),
                bits(cpu.download(&rv).unwrap()),
                "{n}×k={k}"
            );
            eprintln!(
                "top_k {n}×{n_vocab} k={k}: {kernels:.1} µs on the GPU; the whole logits \
                 down: {whole:.1} µs"
            );
        }
    }
}

/// The MoE block on the device against the reference backend with the same experts. The
/// products are the CPU device's bits on both, but the SwiGLU's exponential is glibc's `expf`
/// on the host and the f64 `exp` rounded on the GPU, which differ in the last bit now and then
/// (glibc's is not always correctly rounded); such a hidden value can then round to another
/// Q8_0/f16/bf16 value for the down projection. F16/BF16 products also sum in another order.
/// So: within 1e-2 of one unit of the hidden state (one such rounding step), and the number of
/// bit-identical values is printed.
#[test]
fn moe_experts_match_the_reference_backend() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(8);
    // Expert 3 twice (F32: 16-lane order), the others once or not at all.
    let sel: Vec<i32> = vec![3, 0, 5, 3, 7, 1, 2, 6, 4, 9];
    for ty in TYPES {
        for with_bias in [true, false] {
            let act = (ExpertAct::ClampedSwiglu, with_bias);
            moe_case(dev, &mut rng, [ty; 3], (8, 64, 96, 5, 2), &sel, act);
        }
    }
}

/// [`moe_experts_match_the_reference_backend`] for low-bit expert sets, each type alone and the
/// Q4_K_M mixes, with SiLU (Qwen3-MoE) and an expert 8 slots route to (the tiled K-quant order).
#[test]
fn lowbit_moe_experts_match_the_reference_backend() {
    let Some(dev) = device() else { return };
    let mut rng = StdRng::seed_from_u64(12);
    for types in lowbit_expert_sets() {
        let act = (ExpertAct::Silu, false);
        moe_case(dev, &mut rng, types, LOWBIT_MOE, &LOWBIT_SEL, act);
    }
}

/// One MoE case of [`moe_experts_match_the_reference_backend`]: gate, up and down experts of
/// `types`, `(ne, d, ff, n, k)`, expert ids `sel`, the activation and whether biases are given.
fn moe_case(
    dev: &CudaDevice,
    rng: &mut StdRng,
    [gt, ut, dt]: [GgmlType; 3],
    (ne, d, ff, n, k): (usize, usize, usize, usize, usize),
    sel: &[i32],
    (act, with_bias): (ExpertAct, bool),
) {
    let cpu = Ref0::new();
    let (gq, _) = weights(rng, gt, ne * ff, d);
    let (uq, _) = weights(rng, ut, ne * ff, d);
    let (dq, ddq) = weights(rng, dt, ne * d, ff);
    let (bg, bu, bd) = (
        noise(rng, ne * ff, 0.5),
        noise(rng, ne * ff, 0.5),
        noise(rng, ne * d, 0.5),
    );
    let x = noise(rng, n * d, 1.0);
    let wts = noise(rng, n * k, 1.0);
    let zeros = (vec![0f32; ne * ff], vec![0f32; ne * d]);
    let (bg_h, bu_h, bd_h) = if with_bias {
        (&bg[..], &bu[..], &bd[..])
    } else {
        (&zeros.0[..], &zeros.0[..], &zeros.1[..])
    };
    let matrix = |ty, n_in, n_out, data| ExpertMatrix {
        ty,
        n_in,
        n_out,
        data,
    };
    let tensors = ExpertTensors {
        n_expert: ne,
        gate: matrix(gt, d, ff, &gq),
        up: matrix(ut, d, ff, &uq),
        down: matrix(dt, ff, d, &dq),
        gate_bias: bg_h,
        up_bias: bu_h,
        down_bias: bd_h,
    };
    let rm = cpu.upload_moe(&tensors, None).unwrap();
    let ref_act = match act {
        ExpertAct::ClampedSwiglu => KERNEL_ACT,
        ExpertAct::Silu => hmoe_backend::GatedAct::Silu,
    };
    let want = ref_moe(&cpu, &rm, ref_act, &x, sel, &wts, k);
    // The device without biases takes the kernels' has_bias = 0 path.
    let mw = MoeWeights {
        gate: dev.upload_experts(gt, ne, ff, d, &gq).unwrap(),
        up: dev.upload_experts(ut, ne, ff, d, &uq).unwrap(),
        down: dev.upload_experts(dt, ne, d, ff, &dq).unwrap(),
        gate_bias: with_bias.then(|| dev.upload(&bg).unwrap()),
        up_bias: with_bias.then(|| dev.upload(&bu).unwrap()),
        down_bias: with_bias.then(|| dev.upload(&bd).unwrap()),
    };
    let xd = dev.upload(&x).unwrap();
    let sd = dev.upload(sel).unwrap();
    let wd = dev.upload(&wts).unwrap();
    let mut out = dev.alloc_zeros::<f32>(n * d).unwrap();
    dev.moe(&mw, act, &xd, &sd, &wd, k, &mut out).unwrap();
    let got = dev.download(&out).unwrap();
    // Error scale: Σ_j |w_j| (Σ_c |W_down[r][c]| + 1), the size of one unit of h.
    let mut scale = vec![0f32; n * d];
    for t in 0..n {
        for j in 0..k {
            let e = sel[t * k + j];
            if !(0..ne as i32).contains(&e) {
                continue;
            }
            for r in 0..d {
                let row = (e as usize * d + r) * ff;
                let a: f32 = ddq[row..row + ff].iter().map(|v| v.abs()).sum();
                scale[t * d + r] += wts[t * k + j].abs() * (a + 1.0);
            }
        }
    }
    let same = got
        .iter()
        .zip(&want)
        .filter(|(g, w)| g.to_bits() == w.to_bits())
        .count();
    let what = format!("moe {:?} {act:?} bias {with_bias}", [gt, ut, dt]);
    eprintln!("{what}: {same} of {} values identical", got.len());
    assert_close(&what, &got, &want, &scale, 1e-2);
}

#[test]
fn pinned_async_round_trip() {
    let Some(dev) = device() else { return };
    let n = 1 << 16;
    let mut host = dev.alloc_pinned::<f32>(n).unwrap();
    for (i, v) in host.as_mut_slice().unwrap().iter_mut().enumerate() {
        *v = i as f32 * 0.5;
    }
    let mut d = dev.alloc_zeros::<f32>(n).unwrap();
    dev.upload_async(&host, &mut d).unwrap();
    let mut back = dev.alloc_pinned::<f32>(n).unwrap();
    dev.download_async(&d, &mut back).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(back.as_slice().unwrap(), host.as_slice().unwrap());
}

#[test]
fn tiled_moe_matches_one_token_at_a_time() {
    let Some(dev) = device() else { return };
    // 96 tokens × 4 = 384 slots take the tiled kernels; one token (4 slots) the two dp4a
    // kernels (moe_dp4a.cu). Every output must agree bit for bit: both sum each product block by block in
    // order. d = 2880 (90 blocks: 12 shared-memory chunks, the last partial), ff = 224
    // (a partial row tile), expert 5 with 200 slots (7 tiles of slots), ids out of range.
    let (ne, d, ff, n, k) = (16, 2880, 224, 96, 4);
    let mut rng = StdRng::seed_from_u64(21);
    let sel: Vec<i32> = (0..n * k)
        .map(|i| match i % 8 {
            0 | 2 | 4 => 5,
            7 if i % 16 == 7 => -1,
            7 => 99,
            j => ((i / 8 + j) % ne) as i32,
        })
        .collect();
    let x = noise(&mut rng, n * d, 1.0);
    let wts = noise(&mut rng, n * k, 1.0);
    for ty in [GgmlType::Q8_0, GgmlType::MXFP4] {
        let (gq, _) = weights(&mut rng, ty, ne * ff, d);
        let (uq, _) = weights(&mut rng, ty, ne * ff, d);
        let (dq, _) = weights(&mut rng, ty, ne * d, ff);
        let mw = MoeWeights {
            gate: dev.upload_experts(ty, ne, ff, d, &gq).unwrap(),
            up: dev.upload_experts(ty, ne, ff, d, &uq).unwrap(),
            down: dev.upload_experts(ty, ne, d, ff, &dq).unwrap(),
            gate_bias: Some(dev.upload(&noise(&mut rng, ne * ff, 0.5)).unwrap()),
            up_bias: Some(dev.upload(&noise(&mut rng, ne * ff, 0.5)).unwrap()),
            down_bias: Some(dev.upload(&noise(&mut rng, ne * d, 0.5)).unwrap()),
        };
        let run = |range: std::ops::Range<usize>| {
            let m = range.len();
            let xd = dev.upload(&x[range.start * d..range.end * d]).unwrap();
            let sd = dev.upload(&sel[range.start * k..range.end * k]).unwrap();
            let wd = dev.upload(&wts[range.start * k..range.end * k]).unwrap();
            let mut out = dev.alloc_zeros::<f32>(m * d).unwrap();
            dev.moe(&mw, ExpertAct::ClampedSwiglu, &xd, &sd, &wd, k, &mut out)
                .unwrap();
            dev.download(&out).unwrap()
        };
        let t = Instant::now();
        let batched = run(0..n);
        let batched_s = t.elapsed().as_secs_f64();
        for token in 0..n {
            let one = run(token..token + 1);
            let same = one
                .iter()
                .zip(&batched[token * d..(token + 1) * d])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{ty} token {token}: tiled and two-launch results differ"
            );
        }
        eprintln!(
            "tiled {ty} MoE of {n} tokens: {:.2} ms with uploads",
            batched_s * 1e3
        );
    }
}

#[test]
fn staged_expert_uploads_keep_every_byte() {
    let Some(dev) = device() else { return };
    // 120 Q8_0 experts of 2880 × 2880 (8.8 MB each, about 1 GB): 32 slots of the pinned
    // ring, the last one partial, taken in a scrambled order as op offload picks experts.
    let (ty, rows, cols, n) = (GgmlType::Q8_0, 2880, 2880, 120);
    let eb = rows * cols / 32 * 34;
    let mut bytes = vec![0u8; n * eb];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let order: Vec<usize> = (0..n).map(|i| i * 7 % n).collect();
    let parts: Vec<&[u8]> = order
        .iter()
        .map(|&e| &bytes[e * eb..(e + 1) * eb])
        .collect();
    let timed = |f: &dyn Fn() -> DeviceExperts| {
        let t = Instant::now();
        let experts = f();
        dev.synchronize().unwrap();
        (experts, t.elapsed().as_secs_f64())
    };
    let staged = || dev.upload_experts_from(ty, rows, cols, &parts).unwrap();
    let (first, _) = timed(&staged);
    let back = dev.download(first.data()).unwrap();
    for (i, &e) in order.iter().enumerate() {
        assert!(
            back[i * eb..(i + 1) * eb] == bytes[e * eb..(e + 1) * eb],
            "expert {i} (source {e}) differs"
        );
    }
    drop(first);
    let (_, staged_s) = timed(&staged);
    let (_, pageable_s) = timed(&|| dev.upload_experts(ty, n, rows, cols, &bytes).unwrap());
    let gb = (n * eb) as f64 / 1e9;
    eprintln!(
        "{gb:.2} GB of experts: staged {:.1} GB/s, pageable {:.1} GB/s",
        gb / staged_s,
        gb / pageable_s
    );
}
