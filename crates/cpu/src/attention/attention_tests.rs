//! Tests of attention: every cache type against f64, the kernels against the element loops.

use super::attn_shape::*;
use super::kv_reads::*;
use super::row_kernel::*;
use super::*;

use hmoe_backend::numerics::{fwht, hsum16, FLASH_CHUNK};

use crate::kv_storage::LayerCache;
use hmoe_backend::{CacheType, FlashAttn, KvType};

/// Deterministic values in [-1, 1).
pub(crate) fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

const N_HEAD: usize = 4;
const N_KV: usize = 2;
const HD: usize = 64;

fn shape() -> AttnShape {
    AttnShape {
        n_head: N_HEAD,
        n_head_kv: N_KV,
        head_dim: HD,
        scale: 1.0 / (HD as f32).sqrt(),
    }
}

/// Keys and values for `n` positions (keys scaled up so the softmax is far from uniform).
fn kv_rows(n: usize) -> (Vec<f32>, Vec<f32>) {
    let k: Vec<f32> = noise(1, n * N_KV * HD).iter().map(|x| 3.0 * x).collect();
    (k, noise(2, n * N_KV * HD))
}

/// f64 attention over exact keys and values: the reference.
fn reference(
    k: &[f32],
    v: &[f32],
    q: &[f32],
    pos0: usize,
    window: Option<usize>,
    sinks: &[f32],
) -> Vec<f32> {
    let w = N_KV * HD;
    let n_tok = q.len() / (N_HEAD * HD);
    let mut out = vec![0f32; q.len()];
    for t in 0..n_tok {
        let pos = pos0 + t;
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..N_HEAD {
            let kvh = h / (N_HEAD / N_KV);
            let qh = &q[(t * N_HEAD + h) * HD..][..HD];
            let scores: Vec<f64> = (first..=pos)
                .map(|p| {
                    let kh = &k[p * w + kvh * HD..][..HD];
                    qh.iter()
                        .zip(kh)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        / (HD as f64).sqrt()
                })
                .collect();
            let m = scores.iter().copied().fold(sinks[h] as f64, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + (sinks[h] as f64 - m).exp();
            for d in 0..HD {
                let acc: f64 = (first..=pos)
                    .zip(&e)
                    .map(|(p, &e)| e * v[p * w + kvh * HD + d] as f64)
                    .sum();
                out[(t * N_HEAD + h) * HD + d] = (acc / sum) as f32;
            }
        }
    }
    out
}

/// Fills a one-layer cache with `n` positions (in micro-batches of `ub`) and runs attention
/// for the last `n_q` of them in one call.
fn run(ty: KvType, window: Option<usize>, n: usize, ub: usize, n_q: usize) -> (Vec<f32>, Vec<f32>) {
    let (k, v) = kv_rows(n);
    let w = N_KV * HD;
    let mut cache = LayerCache::for_context(ty, n, ub, w, window).with_head_dims(HD, HD);
    let layer = &mut cache;
    for start in (0..n).step_by(ub) {
        let end = (start + ub).min(n);
        layer.store(
            start,
            &k[start * w..end * w],
            &v[start * w..end * w],
            end - start,
        );
    }
    let q = noise(3, n_q * N_HEAD * HD);
    let sinks = [0.5, -1.0, 2.0, 0.0];
    let mut out = vec![0f32; q.len()];
    attention(layer, &shape(), &q, n - n_q, Some(&sinks), &mut out);
    (out, reference(&k, &v, &q, n - n_q, window, &sinks))
}

/// Largest |a − b| relative to the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn flash_attention_matches_f64_for_every_cache_type() {
    // Bounds: 1.5-2× the measured conversion error of each type (max |error| over the
    // largest |output|); a wrong head or position gives errors of order 1.
    let cases = [
        (CacheType::F32, 1e-6),
        (CacheType::F16, 4e-3),
        (CacheType::BF16, 6e-3),
        (CacheType::Q8_0, 2.5e-2),
        (CacheType::Q5_0, 1.2e-1),
        (CacheType::Q5_1, 1.2e-1),
        (CacheType::Q4_0, 2.5e-1),
        (CacheType::Q4_1, 2.5e-1),
    ];
    for (t, tol) in cases {
        let ty = KvType::new(t, t, FlashAttn::On).unwrap();
        // A prefill of several query tiles, then one decode token; full and sliding layers;
        // several flash chunks.
        for (window, n, n_q) in [
            (None, 70, 40),
            (Some(8), 70, 40),
            (None, 70, 1),
            (Some(8), 70, 1),
            (None, 2 * FLASH_CHUNK + 30, 1),
            (None, 2 * FLASH_CHUNK + 30, 20),
        ] {
            let (out, want) = run(ty, window, n, 40, n_q);
            let err = rel_err(&out, &want);
            assert!(
                err < tol,
                "{t} window {window:?} queries {n_q}: relative error {err:.2e}"
            );
        }
    }
}

#[test]
fn non_flash_attention_reads_block_keys_and_bf16_values() {
    for (k, v, tol) in [
        (CacheType::Q8_0, CacheType::F16, 2e-2),
        (CacheType::Q4_0, CacheType::F32, 2e-1),
        (CacheType::BF16, CacheType::BF16, 6e-3),
    ] {
        let ty = KvType::new(k, v, FlashAttn::Off).unwrap();
        assert!(!ty.flash_attn());
        for n_q in [1, 40] {
            let (out, want) = run(ty, Some(8), 70, 40, n_q);
            let err = rel_err(&out, &want);
            assert!(err < tol, "{k}/{v} queries {n_q}: relative error {err:.2e}");
        }
    }
}

#[test]
fn flash_attention_rows_do_not_depend_on_the_batch() {
    // The same queries, all at once and one at a time, give identical bits: the chunked
    // kernel (one token splits its chunks over tasks, a batch folds them in one task) over
    // quantized and float values, full and sliding.
    for (t, n, window) in [
        (CacheType::Q8_0, 50, Some(8)),
        (CacheType::Q4_0, 3 * FLASH_CHUNK + 50, None),
        (CacheType::Q8_0, 3 * FLASH_CHUNK + 50, Some(FLASH_CHUNK + 7)),
        (CacheType::F16, 50, Some(8)),
        (CacheType::F16, 3 * FLASH_CHUNK + 50, None),
        (CacheType::F32, 3 * FLASH_CHUNK + 50, Some(FLASH_CHUNK + 7)),
    ] {
        batch_invariance(t, n, window);
    }
}

fn batch_invariance(t: CacheType, n: usize, window: Option<usize>) {
    let ty = KvType::new(t, t, FlashAttn::On).unwrap();
    let n_q = 20;
    let (k, v) = kv_rows(n);
    let w = N_KV * HD;
    let mut cache = LayerCache::for_context(ty, n, n, w, window).with_head_dims(HD, HD);
    cache.store(0, &k, &v, n);
    let q = noise(3, n_q * N_HEAD * HD);
    let sinks = [0.5, -1.0, 2.0, 0.0];
    let mut all = vec![0f32; q.len()];
    attention(&cache, &shape(), &q, n - n_q, Some(&sinks), &mut all);
    for t in 0..n_q {
        let row = N_HEAD * HD;
        let mut one = vec![0f32; row];
        attention(
            &cache,
            &shape(),
            &q[t * row..(t + 1) * row],
            n - n_q + t,
            Some(&sinks),
            &mut one,
        );
        assert_eq!(
            one,
            all[t * row..(t + 1) * row],
            "{ty:?} {window:?} query {t}"
        );
    }
}

#[test]
fn quantized_heads_are_rotated_like_llama_cpp() {
    let ty = KvType::new(CacheType::Q8_0, CacheType::Q4_0, FlashAttn::On).unwrap();
    let cache = LayerCache::for_context(ty, 8, 8, 2 * 128, None).with_head_dims(128, 128);
    // K: the largest power of two dividing the head; V: always 64.
    assert_eq!((cache.k.rotation(), cache.v.rotation()), (128, 64));
    let plain = LayerCache::for_context(KvType::F16, 8, 8, 128, None).with_head_dims(64, 64);
    assert_eq!(plain.k.rotation(), 0);
    // The transform is orthonormal and its own inverse.
    let x = noise(5, 64);
    let mut y = x.clone();
    fwht(&mut y);
    let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
    assert!((norm(&y) - norm(&x)).abs() < 1e-4 * norm(&x));
    fwht(&mut y);
    assert!(rel_err(&y, &x) < 1e-6);
    // Head 0 of a rotated row is H·x: its first value is the scaled sum.
    let mut first = x.clone();
    fwht(&mut first);
    assert!((first[0] - x.iter().sum::<f32>() / 8.0).abs() < 1e-5);
}

/// `vec_dot_f32`'s order written out index by index: four 16-lane accumulators per
/// 64 elements, folded (0+2)+(1+3), reduced, then the tail.
fn dot_by_index(a: &[f32], b: &[f32]) -> f32 {
    let np = a.len() / 64 * 64;
    let mut acc = [[0f32; LANES]; 4];
    for i in (0..np).step_by(64) {
        for j in 0..4 {
            for l in 0..LANES {
                acc[j][l] = a[i + j * LANES + l].mul_add(b[i + j * LANES + l], acc[j][l]);
            }
        }
    }
    let folded: [f32; LANES] =
        std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let mut sum = hsum16(&folded);
    for k in np..a.len() {
        sum += a[k] * b[k];
    }
    sum
}

#[test]
fn dot_vec_keeps_ggml_order() {
    for n in [16, 64, 80, 128, 200, 576] {
        let (a, b) = (noise(7, n), noise(8, n));
        assert_eq!(
            dot_vec_f32(&a, &b).to_bits(),
            dot_by_index(&a, &b).to_bits(),
            "n {n}"
        );
    }
}

/// The row kernel's tasks run one at a time with `kv_per_task` KV heads each, through the
/// vector kernels or (`kernels` false) the element-by-element loops.
fn row_kernel_with(
    cache: &LayerCache,
    shape: &AttnShape,
    q: &[f32],
    pos0: usize,
    sinks: Option<&[f32]>,
    kv_per_task: usize,
    kernels: bool,
) -> Vec<f32> {
    let ctx = RowTask {
        cache,
        k_kernel: block_kernel(&cache.k),
        group: shape.n_head / shape.n_head_kv,
        n_head_kv: shape.n_head_kv,
        kv_per_task,
        hd: shape.head_dim,
        scale: shape.scale,
        single_token: q.len() == shape.n_head * shape.head_dim,
        q,
        pos0,
        sinks,
    };
    let mut out = vec![0f32; q.len()];
    let mut sc = RowScratch::default();
    let chunk = kv_per_task * ctx.group * shape.head_dim;
    for (task, dst) in out.chunks_exact_mut(chunk).enumerate() {
        ctx.run(task, &mut sc, dst, kernels);
    }
    out
}

#[test]
fn row_kernel_f16_kernels_equal_the_element_loops() {
    // gpt-oss's group of 8 with heads of 64, other groups and head sizes (one the vector
    // kernels decline), full layers and windows whose positions wrap around the ring,
    // one token and a batch, with and without sinks.
    for (n_head, n_kv, hd, window, n, n_q) in [
        (32, 4, 64, None, 300, 1),
        (16, 2, 64, None, 300, 1),
        (16, 2, 64, Some(40), 300, 1),
        (16, 2, 64, Some(40), 300, 7),
        (8, 1, 128, None, 77, 1),
        (6, 3, 32, Some(17), 90, 1),
        (4, 2, 80, None, 50, 3),
    ] {
        let w = n_kv * hd;
        let ub = 8;
        let mut cache =
            LayerCache::for_context(KvType::F16, n, ub, w, window).with_head_dims(hd, hd);
        let (k, v) = (noise(1, n * w), noise(2, n * w));
        let k: Vec<f32> = k.iter().map(|x| 4.0 * x).collect();
        for start in (0..n).step_by(ub) {
            let end = (start + ub).min(n);
            cache.store(
                start,
                &k[start * w..end * w],
                &v[start * w..end * w],
                end - start,
            );
        }
        let shape = AttnShape {
            n_head,
            n_head_kv: n_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let sinks: Vec<f32> = noise(4, n_head);
        for sinks in [None, Some(&sinks[..])] {
            let q = noise(3, n_q * n_head * hd);
            let mut out = vec![0f32; q.len()];
            let layer = &cache;
            attention(layer, &shape, &q, n - n_q, sinks, &mut out);
            let want = row_kernel_with(layer, &shape, &q, n - n_q, sinks, 1, false);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&out),
                bits(&want),
                "heads {n_head}/{n_kv} of {hd}, window {window:?}, {n_q} queries, sinks {}",
                sinks.is_some()
            );
            // Any run of KV heads per task, either way.
            for kv in (1..=n_kv).filter(|k| n_kv.is_multiple_of(*k)) {
                for kernels in [false, true] {
                    let got = row_kernel_with(layer, &shape, &q, n - n_q, sinks, kv, kernels);
                    assert_eq!(bits(&got), bits(&want), "{kv} KV heads per task");
                }
            }
        }
    }
}

/// The softmax as it was written element by element (ggml's order, scalar `expf_ggml`).
fn softmax_by_element(probs: &mut [f32], skip: usize, sink: Option<f32>) {
    let mut max = probs[skip..]
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if let Some(s) = sink {
        max = max.max(s);
    }
    let mut sum = 0f64;
    for (c, chunk) in probs.chunks_mut(LANES).enumerate() {
        let mut lanes = [0f32; LANES];
        for (i, v) in chunk.iter_mut().enumerate() {
            *v = if c * LANES + i < skip {
                0.0
            } else {
                hmoe_backend::numerics::expf_ggml(*v - max)
            };
            lanes[i] = *v;
        }
        sum += hsum16(&lanes) as f64;
    }
    if let Some(s) = sink {
        sum += (s - max).exp() as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in probs.iter_mut() {
        *v *= inv;
    }
}

#[test]
fn softmax_window_keeps_the_element_order_bits() {
    for (n, skip, sink) in [
        (1, 0, None),
        (16, 3, Some(0.5)),
        (37, 16, None),
        (300, 5, Some(9.0)),
        (4097, 0, Some(-3.0)),
    ] {
        // Scores over a wide range, a repeated maximum and a zero among them.
        let mut scores: Vec<f32> = noise(9, n).iter().map(|x| 30.0 * x).collect();
        scores[n / 2] = 0.0;
        let top = scores.iter().copied().fold(f32::MIN, f32::max);
        scores[n - 1] = top;
        let mut want = scores.clone();
        softmax_by_element(&mut want, skip, sink);
        softmax_window(&mut scores, skip, sink);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scores), bits(&want), "{n} scores, skip {skip}");
    }
}

#[test]
fn heads_that_straddle_blocks_are_refused() {
    let ty = KvType::new(CacheType::Q8_0, CacheType::Q8_0, FlashAttn::On).unwrap();
    let cache = LayerCache::for_context(ty, 8, 8, 2 * 16, None);
    let shape = AttnShape {
        n_head: 2,
        n_head_kv: 2,
        head_dim: 16,
        scale: 0.25,
    };
    let mut out = vec![1f32; 32];
    attention(&cache, &shape, &[0.0; 32], 0, None, &mut out);
    assert!(cache.refused.load(std::sync::atomic::Ordering::Relaxed));
    assert!(out.iter().all(|&x| x == 0.0));
}
