//! Causal multi-head attention over the KV cache with grouped KV heads, an optional sliding
//! window and optional per-head sink logits (gpt-oss), computed like ggml's non-flash path.

use half::f16;
use rayon::prelude::*;

use crate::kv_cache::{Cells, LayerCache};

/// Shape of one attention call.
pub(crate) struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
}

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
    out.par_chunks_mut(hd).enumerate().for_each(|(task, dst)| {
        let t = task / shape.n_head;
        let h = task % shape.n_head;
        let pos = pos0 + t;
        let first = cache.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qh = &q[task * hd..(task + 1) * hd];
        let kv_off = (h / group) * hd;
        let cell = |p: usize| (p % cache.cells) * width + kv_off;
        let mut scores: Vec<f32> = Vec::with_capacity(pos + 1 - first);
        match &cache.k {
            Cells::F32(k) => {
                for p in first..=pos {
                    let kr = &k[cell(p)..cell(p) + hd];
                    scores.push(dot_f32(qh, kr) * shape.scale);
                }
            }
            Cells::F16(k) => {
                let qr: Vec<f32> = qh.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
                for p in first..=pos {
                    let kr = &k[cell(p)..cell(p) + hd];
                    let s: f32 = qr.iter().zip(kr).map(|(&a, &b)| a * b.to_f32()).sum();
                    scores.push(s * shape.scale);
                }
            }
        }
        let sink = sinks.map(|s| s[h]);
        let mut max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if let Some(s) = sink {
            max = max.max(s);
        }
        let mut sum = 0f64;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s as f64;
        }
        if let Some(s) = sink {
            sum += ((s - max).exp()) as f64;
        }
        let inv = (1.0 / sum) as f32;
        dst.fill(0.0);
        match &cache.v {
            Cells::F32(v) => {
                for (i, p) in (first..=pos).enumerate() {
                    let w = scores[i] * inv;
                    axpy(dst, w, &v[cell(p)..cell(p) + hd]);
                }
            }
            Cells::F16(v) => {
                for (i, p) in (first..=pos).enumerate() {
                    let w = f16::from_f32(scores[i] * inv).to_f32();
                    for (d, &x) in dst.iter_mut().zip(&v[cell(p)..cell(p) + hd]) {
                        *d += w * x.to_f32();
                    }
                }
            }
        }
    });
}

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn axpy(dst: &mut [f32], w: f32, x: &[f32]) {
    for (d, &v) in dst.iter_mut().zip(x) {
        *d += w * v;
    }
}
