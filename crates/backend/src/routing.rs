//! Expert routing as the CPU device computes it (llama.cpp's `build_moe_ffn`): gate scores from
//! router logits (softmax or sigmoid), a selection-only score bias, group-limited top-k, and
//! renormalised, scaled weights. Pure functions, shared by the CPU device and the reference
//! device so that both choose the same experts with the same weights, bit for bit.

use crate::numerics::{expf_ggml, hsum16};

/// How expert weights are derived from router logits (GGUF `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts (Qwen3-MoE, Mixtral, DeepSeek-V2).
    Softmax,
    /// Independent sigmoids (DeepSeek-V3).
    Sigmoid,
}

/// Routing rules of one MoE block, as llama.cpp's `build_moe_ffn` applies them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub k: usize,
    /// `Some((groups, used))`: experts fall into `groups` equal groups, a group scores the sum of
    /// its two best selection scores, and only the `used` best groups are eligible.
    pub groups: Option<(usize, usize)>,
    /// Divide the chosen weights by their sum (clamped to ≥ 2^−14).
    pub norm: bool,
    /// Multiply the chosen weights by this (0 or 1: no scaling).
    pub scale: f32,
}

impl Routing {
    /// Picks the experts of one token from its gate probabilities `probs`; `bias` (DeepSeek-V3's
    /// `exp_probs_b`) is added for the choice only. Writes the chosen experts (best first) and
    /// their weights, taken from the unbiased `probs`.
    pub fn select(
        &self,
        probs: &[f32],
        bias: Option<&[f32]>,
        experts: &mut Vec<usize>,
        weights: &mut Vec<f32>,
    ) {
        let mut scores: Vec<f32> = match bias {
            Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
            None => probs.to_vec(),
        };
        if let Some((n_groups, n_used)) = self.groups.filter(|&(g, _)| g > 1) {
            let per_group = scores.len() / n_groups;
            let mut top = Vec::new();
            let group_scores: Vec<f32> = scores
                .chunks(per_group)
                .map(|grp| {
                    top_k(grp, 2.min(per_group), &mut top);
                    top.iter().map(|&i| grp[i] as f64).sum::<f64>() as f32
                })
                .collect();
            top_k(&group_scores, n_used, &mut top);
            for (gi, grp) in scores.chunks_mut(per_group).enumerate() {
                if !top.contains(&gi) {
                    grp.fill(f32::NEG_INFINITY);
                }
            }
        }
        top_k(&scores, self.k, experts);
        weights.clear();
        weights.extend(experts.iter().map(|&e| probs[e]));
        if self.norm {
            let sum = (weights.iter().map(|&w| w as f64).sum::<f64>() as f32).max(6.103_515_6e-5);
            for w in weights.iter_mut() {
                *w /= sum;
            }
        }
        if self.scale != 0.0 && self.scale != 1.0 {
            for w in weights.iter_mut() {
                *w *= self.scale;
            }
        }
    }
}

/// Gate probabilities of one token from its router logits, in place.
pub fn gate_probs(gating: Gating, logits: &mut [f32]) {
    match gating {
        Gating::Softmax => softmax_ggml(logits),
        Gating::Sigmoid => logits.iter_mut().for_each(|v| *v = sigmoid(*v)),
    }
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k(x: &[f32], k: usize, out: &mut Vec<usize>) {
    out.clear();
    out.extend(0..x.len());
    out.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    out.truncate(k);
}

/// The logistic function as ggml's `ggml_vec_sigmoid_f32`: `1 / (1 + expf(−x))`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// In-place softmax of one row as ggml's AVX-512 `ggml_vec_soft_max_f32` computes it: blocks
/// of 16 with the vectorised exponential (each block's sum added in f64), the remainder with
/// libm's `expf`, then one multiplication by the f32 reciprocal of the f64 sum.
pub fn softmax_ggml(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    let blocks = x.len() / 16 * 16;
    for chunk in x[..blocks].chunks_exact_mut(16) {
        let mut lanes = [0f32; 16];
        for (v, l) in chunk.iter_mut().zip(lanes.iter_mut()) {
            *v = expf_ggml(*v - max);
            *l = *v;
        }
        sum += hsum16(&lanes) as f64;
    }
    for v in x[blocks..].iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_and_breaks_ties_by_index() {
        let mut idx = Vec::new();
        top_k(&[1.0, 3.0, 3.0, -1.0, 2.0], 3, &mut idx);
        assert_eq!(idx, vec![1, 2, 4]);
    }

    #[test]
    fn group_limited_routing() {
        // Two groups of four; group 1 holds the two best biased scores, so only it is eligible
        // even though expert 0 alone has the highest probability.
        let routing = Routing {
            k: 2,
            groups: Some((2, 1)),
            norm: true,
            scale: 2.5,
        };
        let probs = [0.9, 0.1, 0.1, 0.1, 0.6, 0.7, 0.5, 0.2];
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0];
        let (mut top, mut w) = (Vec::new(), Vec::new());
        routing.select(&probs, Some(&bias), &mut top, &mut w);
        assert_eq!(top, vec![6, 5]);
        // Weights come from the unbiased probabilities, normalised then scaled.
        assert!((w[0] - 0.5 / 1.2 * 2.5).abs() < 1e-6 && (w[1] - 0.7 / 1.2 * 2.5).abs() < 1e-6);
    }
}
