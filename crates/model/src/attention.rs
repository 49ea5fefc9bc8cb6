//! Causal multi-head attention over the KV cache with grouped KV heads, an optional sliding
//! window and optional per-head sink logits (gpt-oss).
//!
//! Summation orders follow ggml's CPU backend so that results match llama.cpp bit for bit
//! where it matters (a last-bit change can flip a Q8_0 rounding downstream): scores as
//! 16-lane FMA chains (tinyBLAS) — except for f32 keys in multi-token batches, where ggml's
//! `vec_dot_f32` runs —, exponentials with ggml's vectorised `expf`, the softmax sum in chunks
//! of 16 positions, and the value sum as 16-lane FMA chains over positions.

use half::f16;
use rayon::prelude::*;

use crate::kv_cache::{Cells, LayerCache};
use crate::ops::{expf_ggml, reduce16};

/// Shape of one attention call.
pub(crate) struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
}

const LANES: usize = 16;

/// `out[t][h] = Σ_j softmax_j(q[t][h]·k_j · scale ⊕ sink[h]) v_j` over the keys visible from
/// position `pos0 + t`. The cache must already hold the batch's own keys and values.
pub(crate) fn attention(
    cache: &LayerCache,
    shape: &AttnShape,
    q: &[f32],
    pos0: usize,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let group = shape.n_head / shape.n_head_kv;
    let width = shape.n_head_kv * hd;
    let single_token = q.len() == shape.n_head * hd;
    out.par_chunks_mut(hd).enumerate().for_each(|(task, dst)| {
        let t = task / shape.n_head;
        let h = task % shape.n_head;
        let pos = pos0 + t;
        let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qh = &q[task * hd..(task + 1) * hd];
        let q16: Vec<f32> = match (&cache.k, single_token) {
            (Cells::F16(_), true) => qh.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
            _ => Vec::new(),
        };
        let kv_off = (h / group) * hd;
        let cell = |p: usize| (p % cache.cells) * width + kv_off;
        // Probabilities for positions chunk_start..=pos, zero outside the window.
        let chunk_start = first / LANES * LANES;
        let mut probs = vec![0f32; pos + 1 - chunk_start];
        let mut max = f32::NEG_INFINITY;
        for p in first..=pos {
            let s = match &cache.k {
                Cells::F32(k) => dot_vec_f32(qh, &k[cell(p)..cell(p) + hd]),
                // ggml rounds the query to f16 first; one token goes through `vec_dot_f16`,
                // a batch through tinyBLAS.
                Cells::F16(k) if single_token => dot_vec(&q16, &k[cell(p)..cell(p) + hd], f16::to_f32, true),
                Cells::F16(k) => dot_lanes_f16(qh, &k[cell(p)..cell(p) + hd]),
            } * shape.scale;
            probs[p - chunk_start] = s;
            max = max.max(s);
        }
        let sink = sinks.map(|s| s[h]);
        if let Some(s) = sink {
            max = max.max(s);
        }
        let mut sum = 0f64;
        for chunk in probs.chunks_mut(LANES) {
            let mut lanes = [0f32; LANES];
            for (i, v) in chunk.iter_mut().enumerate() {
                // Positions before the window hold 0 and must stay 0.
                *v = if *v == 0.0 && i + chunk_start < first { 0.0 } else { expf_ggml(*v - max) };
                lanes[i] = *v;
            }
            sum += reduce16(&lanes) as f64;
        }
        // Zero the positions before the window (their slots were never written above).
        for v in probs.iter_mut().take(first - chunk_start) {
            *v = 0.0;
        }
        if let Some(s) = sink {
            sum += (s - max).exp() as f64;
        }
        let inv = (1.0 / sum) as f32;
        for v in probs.iter_mut() {
            *v *= inv;
        }
        let mut acc = vec![[0f32; LANES]; hd];
        for (c, chunk) in probs.chunks(LANES).enumerate() {
            for (i, &w) in chunk.iter().enumerate() {
                let p = chunk_start + c * LANES + i;
                if p < first {
                    continue;
                }
                match &cache.v {
                    Cells::F32(v) => {
                        for (a, &x) in acc.iter_mut().zip(&v[cell(p)..cell(p) + hd]) {
                            a[i] = x.mul_add(w, a[i]);
                        }
                    }
                    Cells::F16(v) => {
                        let w = f16::from_f32(w).to_f32();
                        for (a, &x) in acc.iter_mut().zip(&v[cell(p)..cell(p) + hd]) {
                            a[i] = x.to_f32().mul_add(w, a[i]);
                        }
                    }
                }
            }
        }
        for (d, a) in dst.iter_mut().zip(&acc) {
            *d = reduce16(a);
        }
    });
}

/// Scores against f16 keys: the query is rounded to f16 first, as ggml converts it.
fn dot_lanes_f16(q: &[f32], k: &[f16]) -> f32 {
    let mut lanes = [0f32; LANES];
    for (cq, ck) in q.chunks(LANES).zip(k.chunks(LANES)) {
        for i in 0..cq.len() {
            let qv = f16::from_f32(cq[i]).to_f32();
            lanes[i] = qv.mul_add(ck[i].to_f32(), lanes[i]);
        }
    }
    reduce16(&lanes)
}

/// ggml's `vec_dot_f32` / `vec_dot_f16` on an AVX-512 build: four 16-lane FMA accumulators
/// per 64 elements, folded pairwise, then the tail added one product at a time (in f32 for
/// f32 data, in f64 for f16 data, as ggml does).
fn dot_vec<T: Copy>(a: &[f32], b: &[T], to_f32: impl Fn(T) -> f32, f64_tail: bool) -> f32 {
    let np = a.len() / 64 * 64;
    let mut acc = [[0f32; LANES]; 4];
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let k = i + j * LANES + l;
                *lane = a[k].mul_add(to_f32(b[k]), *lane);
            }
        }
    }
    let mut folded = [0f32; LANES];
    for l in 0..LANES {
        folded[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let head = reduce16(&folded);
    if f64_tail {
        let mut sum = head as f64;
        for k in np..a.len() {
            sum += (a[k] * to_f32(b[k])) as f64;
        }
        sum as f32
    } else {
        let mut sum = head;
        for k in np..a.len() {
            sum += a[k] * to_f32(b[k]);
        }
        sum
    }
}

fn dot_vec_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_vec(a, b, |v| v, false)
}

/// Shape of an attention call whose key and value heads may differ in size.
pub(crate) struct AttnLayout {
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Elements of each query/key head.
    pub k_dim: usize,
    /// Elements of each value head.
    pub v_dim: usize,
    /// Values are the first `v_dim` elements of each key head (multi-head latent attention's
    /// K-only cache) instead of a separate V store.
    pub v_in_k: bool,
    pub scale: f32,
}

/// `out[t][h] = Σ_j softmax_j(q[t][h]·k_j · scale) v_j` over the keys visible from position
/// `pos0 + t`, for heads of `k_dim` (query, key) and `v_dim` (value) elements; `out` holds
/// `v_dim` values per head. The cache must already hold the batch's own keys and values.
///
/// Numerics as [`attention`], plus what ggml does when an f16 key head is not a multiple of 16
/// long (tinyBLAS declines it): the scores of a batch then come from `vec_dot_f16` too.
pub(crate) fn attention_ext(cache: &LayerCache, shape: &AttnLayout, q: &[f32], pos0: usize, out: &mut [f32]) {
    let (kd, vd) = (shape.k_dim, shape.v_dim);
    let group = shape.n_head / shape.n_head_kv;
    let k_width = shape.n_head_kv * kd;
    let v_width = if shape.v_in_k { k_width } else { shape.n_head_kv * vd };
    let lanes_ok = kd.is_multiple_of(LANES);
    let single_token = q.len() == shape.n_head * kd;
    out.par_chunks_mut(vd).enumerate().for_each(|(task, dst)| {
        let t = task / shape.n_head;
        let h = task % shape.n_head;
        let pos = pos0 + t;
        let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qh = &q[task * kd..(task + 1) * kd];
        // ggml rounds the query to f16 before dotting it with f16 keys.
        let q16: Vec<f32> = match &cache.k {
            Cells::F16(_) => qh.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
            Cells::F32(_) => Vec::new(),
        };
        let kv_head = h / group;
        let k_at = |p: usize| (p % cache.cells) * k_width + kv_head * kd;
        let v_at = |p: usize| {
            if shape.v_in_k {
                k_at(p)
            } else {
                (p % cache.cells) * v_width + kv_head * vd
            }
        };
        let v_cells = if shape.v_in_k { &cache.k } else { &cache.v };
        let chunk_start = first / LANES * LANES;
        let mut probs = vec![0f32; pos + 1 - chunk_start];
        let mut max = f32::NEG_INFINITY;
        for p in first..=pos {
            let at = k_at(p);
            let s = match &cache.k {
                Cells::F32(k) => dot_vec_f32(qh, &k[at..at + kd]),
                // A batch goes through tinyBLAS when the head is a multiple of 16 long; one
                // token, or a head tinyBLAS declines, through `vec_dot_f16`.
                Cells::F16(k) if lanes_ok && !single_token => dot_lanes_f16(qh, &k[at..at + kd]),
                Cells::F16(k) => dot_vec(&q16, &k[at..at + kd], f16::to_f32, true),
            } * shape.scale;
            probs[p - chunk_start] = s;
            max = max.max(s);
        }
        let mut sum = 0f64;
        for (c, chunk) in probs.chunks_mut(LANES).enumerate() {
            let mut lanes = [0f32; LANES];
            for (i, v) in chunk.iter_mut().enumerate() {
                // Positions before the window contribute exactly 0.
                *v = if chunk_start + c * LANES + i < first { 0.0 } else { expf_ggml(*v - max) };
                lanes[i] = *v;
            }
            sum += reduce16(&lanes) as f64;
        }
        let inv = (1.0 / sum) as f32;
        for v in probs.iter_mut() {
            *v *= inv;
        }
        let mut acc = vec![[0f32; LANES]; vd];
        for (c, chunk) in probs.chunks(LANES).enumerate() {
            for (i, &w) in chunk.iter().enumerate() {
                let p = chunk_start + c * LANES + i;
                if p < first {
                    continue;
                }
                let at = v_at(p);
                match v_cells {
                    Cells::F32(v) => {
                        for (a, &x) in acc.iter_mut().zip(&v[at..at + vd]) {
                            a[i] = x.mul_add(w, a[i]);
                        }
                    }
                    Cells::F16(v) => {
                        let w = f16::from_f32(w).to_f32();
                        for (a, &x) in acc.iter_mut().zip(&v[at..at + vd]) {
                            a[i] = x.to_f32().mul_add(w, a[i]);
                        }
                    }
                }
            }
        }
        for (d, a) in dst.iter_mut().zip(&acc) {
            *d = reduce16(a);
        }
    });
}
