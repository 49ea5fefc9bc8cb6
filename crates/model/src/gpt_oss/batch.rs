//! Several sequences in one forward pass (continuous batching in a server): the expert, router
//! and output matmuls read their weights once for every sequence of the step, while each
//! sequence's attention runs over its own cache.
//!
//! The result for every sequence is bit-identical to [`GptOss::forward`] on that sequence
//! alone. Row-wise steps (embedding, norms, RoPE, biases, SwiGLU, activation quantisation) do
//! not depend on the other rows, and the quantized dot kernels give the same value for a row
//! whether it is computed alone or in a batch. F32 weights are the exception: ggml (and so
//! [`crate::ops::matmul`]) sums a single token in `vec_dot` order and a batch in tinyBLAS order,
//! so products with F32 weights are computed per sequence, with exactly the rows the sequence
//! alone would have.

use hmoe_quant::GgmlType;
use rayon::prelude::*;

use super::{swiglu_oai, Block, GptOss};
use crate::ops::{add_bias, matmul, rms_norm, softmax, top_k, QuantizedActs};
use crate::weights::{project, Mat};
use crate::{LogitsWanted, ModelError, SeqBatch};

/// Rows `start..start + len` of the step's token matrix belong to one sequence.
#[derive(Clone, Copy, Debug)]
struct Group {
    start: usize,
    len: usize,
}

impl GptOss {
    /// Runs every sequence's tokens at the next positions of its cache in one pass; returns the
    /// last token's logits of the sequences that want them (empty vectors for the others).
    /// Each result equals [`GptOss::forward`] with [`LogitsWanted::Last`] on that sequence alone.
    pub fn forward_multi(
        &self,
        seqs: &mut [SeqBatch<'_, '_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let n_vocab = self.params.n_vocab;
        for s in seqs.iter() {
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(ModelError::BadToken { id, n_vocab });
            }
            s.cache
                .check_heads(self.params.head_dim, self.params.head_dim)?;
            if s.cache.n_past() + s.tokens.len() > s.cache.n_ctx() {
                return Err(ModelError::ContextFull {
                    pos: s.cache.n_past(),
                    n_tokens: s.tokens.len(),
                    n_ctx: s.cache.n_ctx(),
                });
            }
        }
        // One micro-batch per sequence at most (longer prompts are split by `forward`), and
        // nothing to share with a single sequence.
        let simple = seqs.len() == 1
            || seqs
                .iter()
                .any(|s| s.tokens.is_empty() || s.tokens.len() > s.cache.n_ubatch());
        if simple {
            return seqs
                .iter_mut()
                .map(|s| {
                    let logits = self.forward(s.cache, s.tokens, LogitsWanted::Last)?;
                    Ok(if s.logits { logits } else { Vec::new() })
                })
                .collect();
        }
        Ok(self.forward_step(seqs))
    }

    fn forward_step(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Vec<Vec<f32>> {
        let p = &self.params;
        let g = &self.gguf;
        let d = p.n_embd;
        let mut groups = Vec::with_capacity(seqs.len());
        let mut n = 0;
        for s in seqs.iter() {
            groups.push(Group {
                start: n,
                len: s.tokens.len(),
            });
            n += s.tokens.len();
        }
        let mut x = vec![0f32; n * d];
        for (s, grp) in seqs.iter().zip(&groups) {
            for (t, &id) in s.tokens.iter().enumerate() {
                let row = &self.tok_embd.bytes(g)[id as usize * self.tok_embd.row_bytes..]
                    [..self.tok_embd.row_bytes];
                let dst = &mut x[(grp.start + t) * d..(grp.start + t + 1) * d];
                hmoe_quant::dequantize_row(self.tok_embd.info.ty, row, dst)
                    .expect("embedding row size checked at load");
            }
        }
        let pos0: Vec<usize> = seqs.iter().map(|s| s.cache.n_past()).collect();
        let rope_cs: Vec<Vec<Vec<(f32, f32)>>> = seqs
            .iter()
            .zip(&pos0)
            .map(|(s, &p0)| self.rope.caches(p0, s.tokens.len()))
            .collect();
        let mut h = vec![0f32; n * d];
        let mut acts = QuantizedActs::default();
        for (l, b) in self.blocks.iter().enumerate() {
            rms_norm(&x, &b.attn_norm, p.rms_eps, &mut h);
            for (i, s) in seqs.iter_mut().enumerate() {
                let rows = groups[i].start * d..(groups[i].start + groups[i].len) * d;
                let attn = self.attention_block(
                    s.cache,
                    l,
                    b,
                    &h[rows.clone()],
                    pos0[i],
                    &rope_cs[i],
                    &mut acts,
                );
                for (xv, av) in x[rows].iter_mut().zip(&attn) {
                    *xv += av;
                }
            }
            rms_norm(&x, &b.ffn_norm, p.rms_eps, &mut h);
            let moe = self.moe_block_multi(b, &h, &groups, &mut acts);
            for (xv, mv) in x.iter_mut().zip(&moe) {
                *xv += mv;
            }
        }
        for s in seqs.iter_mut() {
            s.cache.advance(s.tokens.len());
        }
        // Output head on the last row of every sequence that wants logits.
        let wanted: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].logits).collect();
        let mut last = Vec::with_capacity(wanted.len() * d);
        for &i in &wanted {
            let r = groups[i].start + groups[i].len - 1;
            last.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &self.output_norm, p.rms_eps, &mut normed);
        let singles: Vec<Group> = (0..wanted.len())
            .map(|i| Group { start: i, len: 1 })
            .collect();
        let logits = project_grouped(g, &self.output, &normed, &singles, &mut acts);
        let mut out = vec![Vec::new(); seqs.len()];
        for (k, &i) in wanted.iter().enumerate() {
            out[i] = logits[k * p.n_vocab..(k + 1) * p.n_vocab].to_vec();
        }
        out
    }

    /// [`GptOss::moe_block`] over the rows of several sequences: router and (quantized) expert
    /// matmuls shared, F32 products per sequence.
    fn moe_block_multi(
        &self,
        b: &Block,
        h: &[f32],
        groups: &[Group],
        acts: &mut QuantizedActs,
    ) -> Vec<f32> {
        let p = &self.params;
        let g = &self.gguf;
        let (d, ff, k_used) = (p.n_embd, p.n_ff_exp, p.n_expert_used);
        let n = h.len() / d;
        let mut scores = project_grouped(g, &b.router, h, groups, acts);
        add_bias(&mut scores, &b.router_b);
        let mut selected = vec![0usize; n * k_used];
        let mut weights = vec![0f32; n * k_used];
        let mut top = Vec::new();
        for t in 0..n {
            let s = &scores[t * p.n_expert..(t + 1) * p.n_expert];
            top_k(s, k_used, &mut top);
            let w = &mut weights[t * k_used..(t + 1) * k_used];
            for (i, &e) in top.iter().enumerate() {
                selected[t * k_used + i] = e;
                w[i] = s[e];
            }
            softmax(w);
        }
        acts.quantize(b.gate_exps.kernel.act_type(), h, d);
        let mut per_slot = vec![0f32; n * k_used * d];
        let (mut routed, mut act_q) = (QuantizedActs::default(), QuantizedActs::default());
        let per_group = [&b.gate_exps, &b.up_exps, &b.down_exps]
            .iter()
            .any(|m| m.kernel.weight_type() == GgmlType::F32);
        let whole = [Group { start: 0, len: n }];
        let parts: &[Group] = if per_group { groups } else { &whole };
        for e in 0..p.n_expert {
            for grp in parts {
                let slots: Vec<usize> = (grp.start * k_used..(grp.start + grp.len) * k_used)
                    .filter(|&i| selected[i] == e)
                    .collect();
                if slots.is_empty() {
                    continue;
                }
                let m = slots.len();
                routed.gather(acts, slots.iter().map(|&i| i / k_used));
                let mut gate = vec![0f32; m * ff];
                let mut up = vec![0f32; m * ff];
                let (gm, um, dm) = (&b.gate_exps, &b.up_exps, &b.down_exps);
                matmul(gm.kernel, gm.slice(g, e), d, ff, &routed, &mut gate);
                matmul(um.kernel, um.slice(g, e), d, ff, &routed, &mut up);
                add_bias(&mut gate, &b.gate_b[e * ff..(e + 1) * ff]);
                add_bias(&mut up, &b.up_b[e * ff..(e + 1) * ff]);
                gate.par_iter_mut()
                    .zip(&up)
                    .for_each(|(gv, &uv)| *gv = swiglu_oai(*gv, uv));
                act_q.quantize(dm.kernel.act_type(), &gate, ff);
                let mut down = vec![0f32; m * d];
                matmul(dm.kernel, dm.slice(g, e), ff, d, &act_q, &mut down);
                add_bias(&mut down, &b.down_b[e * d..(e + 1) * d]);
                for (row, &slot) in down.chunks_exact(d).zip(&slots) {
                    per_slot[slot * d..(slot + 1) * d].copy_from_slice(row);
                }
            }
        }
        let mut out = vec![0f32; n * d];
        for t in 0..n {
            let dst = &mut out[t * d..(t + 1) * d];
            for s in 0..k_used {
                let w = weights[t * k_used + s];
                let src = &per_slot[(t * k_used + s) * d..(t * k_used + s + 1) * d];
                for (o, &v) in dst.iter_mut().zip(src) {
                    *o += v * w;
                }
            }
        }
        out
    }
}

/// `W · x` for every row of `x`: one matmul over all rows, or, for F32 weights, one per group
/// (the rows a sequence alone would have had).
fn project_grouped(
    g: &hmoe_gguf::GgufModel,
    w: &Mat,
    x: &[f32],
    groups: &[Group],
    acts: &mut QuantizedActs,
) -> Vec<f32> {
    if w.kernel.weight_type() != GgmlType::F32 {
        return project(g, w, x, acts);
    }
    let mut out = Vec::with_capacity(x.len() / w.n_in * w.n_out);
    for grp in groups {
        out.extend(project(
            g,
            w,
            &x[grp.start * w.n_in..(grp.start + grp.len) * w.n_in],
            acts,
        ));
    }
    out
}
