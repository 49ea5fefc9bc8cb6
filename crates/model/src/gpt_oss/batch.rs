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

use std::ops::Range;

use hmoe_quant::GgmlType;

use super::GptOss;
use crate::ops::{rms_norm, QuantizedActs};
use crate::ubatch::Ubatches;
use crate::weights::{project, Mat};
use crate::{LogitsWanted, ModelError, SeqBatch};

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
        self.forward_step(seqs)
    }

    /// One pass over several sequences; `groups[i]` are the rows of sequence `i`. The experts
    /// of each layer see the whole step at once: one round trip per device layer per step.
    fn forward_step(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let p = &self.params;
        let g = &self.gguf;
        let d = p.n_embd;
        let mut groups = Vec::with_capacity(seqs.len());
        let mut n = 0;
        for s in seqs.iter() {
            groups.push(n..n + s.tokens.len());
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
                let rows = groups[i].start * d..groups[i].end * d;
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
            let moe = self.moe_block(l, b, &h, &groups, &mut acts)?;
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
            let r = groups[i].end - 1;
            last.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &self.output_norm, p.rms_eps, &mut normed);
        let singles: Vec<Range<usize>> = (0..wanted.len()).map(|i| i..i + 1).collect();
        let logits = project_grouped(g, &self.output, &normed, &singles, &mut acts);
        let mut out = vec![Vec::new(); seqs.len()];
        for (k, &i) in wanted.iter().enumerate() {
            out[i] = logits[k * p.n_vocab..(k + 1) * p.n_vocab].to_vec();
        }
        Ok(out)
    }
}
/// `W · x` for every row of `x`: one matmul over all rows, or, for F32 weights, one per group
/// (the rows a sequence alone would have had).
pub(super) fn project_grouped(
    g: &hmoe_gguf::GgufModel,
    w: &Mat,
    x: &[f32],
    groups: &[Range<usize>],
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
            &x[grp.start * w.n_in..grp.end * w.n_in],
            acts,
        ));
    }
    out
}
