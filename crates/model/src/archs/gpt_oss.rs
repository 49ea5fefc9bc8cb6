//! gpt-oss (OpenAI's open-weight MoE, "gpt-oss-120b & gpt-oss-20b Model Card", 2025), as in
//! OpenAI's reference `torch/model.py` with the
//! numerics of llama.cpp's CPU backend:
//!
//! ```text
//! x = embed(tokens)
//! for each block l:
//!     h = rmsnorm(x) · attn_norm
//!     q, k, v = Wq·h + bq, Wk·h + bk, Wv·h + bv          (GQA: n_head q heads, n_head_kv kv heads)
//!     q, k = rope_neox_yarn(q, k, pos)
//!     x += Wo · attention(q, k, v; sinks, window if l is even) + bo
//!     h = rmsnorm(x) · post_attention_norm
//!     s = Wr·h + br;  top = top_k(s);  w = softmax(s[top])
//!     x += Σ_k w_k · expert_{top_k}(h)
//! logits = Wout · (rmsnorm(x) · output_norm)
//! expert(h) = Wd · (min(g,7) · σ(1.702·min(g,7)) · (clamp(u,−7,7) + 1)) + bd,  g = Wg·h + bg,  u = Wu·h + bu
//! ```
//!
//! The layers run over the device contract (`load`, run by [`crate::DeviceModel`] on the
//! CPU, a GPU or REF0, the experts wherever the placement puts them).

use hmoe_backend::{Backend, GatedAct};
use hmoe_gguf::{GgufModel, Metadata};
use hmoe_placement::ModelShape;

use super::hparams::{check_heads, saturating_u32, ArchMeta, WholeHeads};
use super::rope::Rope;
use crate::error::ModelError;
use crate::executor::layer_blocks::{AttnMoeLayers, AttnMoeModel, AttnMoeSpec, AttnSpec, MoeSpec};
use crate::executor::routing::{ExpertSplit, Gating, Router};
use crate::executor::step::{AttnShape, ModelDims};
use crate::weights::n_vocab;

/// Hyperparameters of a gpt-oss model, read from GGUF metadata (`gpt-oss.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct GptOssParams {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub n_vocab: usize,
    /// Experts per block.
    pub n_expert: usize,
    /// Experts used per token.
    pub n_expert_used: usize,
    /// Hidden size of each expert.
    pub n_ff_exp: usize,
    /// Sliding window of the even layers.
    pub sliding_window: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// YaRN `(factor, original context)`, if the model scales RoPE.
    pub yarn: Option<(f32, u32)>,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
}

impl GptOssParams {
    /// Reads the hyperparameters; `n_vocab` comes from the embedding tensor.
    pub fn from_metadata(meta: &Metadata, n_vocab: usize) -> Result<GptOssParams, ModelError> {
        let arch = meta.architecture().unwrap_or("");
        if arch != "gpt-oss" {
            return Err(ModelError::UnsupportedArch(arch.to_string()));
        }
        let m = ArchMeta {
            meta,
            arch: "gpt-oss",
        };
        let n_head = m.usize("attention.head_count")?;
        let n_embd = m.usize("embedding_length")?;
        let yarn = match meta.get_str("gpt-oss.rope.scaling.type") {
            Some("yarn") => Some((
                m.f32("rope.scaling.factor")?,
                m.usize("rope.scaling.original_context_length")? as u32,
            )),
            Some("none") | None => None,
            Some(other) => {
                return Err(m.bad(
                    "rope.scaling.type",
                    other,
                    "only yarn or none are supported",
                ))
            }
        };
        let p = GptOssParams {
            n_layer: m.usize("block_count")?,
            n_embd,
            n_head,
            n_head_kv: m.usize("attention.head_count_kv")?,
            head_dim: m.usize_or("attention.key_length", n_embd / n_head.max(1)),
            n_vocab,
            n_expert: m.usize("expert_count")?,
            n_expert_used: m.usize("expert_used_count")?,
            n_ff_exp: m.usize("expert_feed_forward_length")?,
            sliding_window: m.usize("attention.sliding_window")?,
            rms_eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: m.f32_or("rope.freq_base", 150000.0),
            yarn,
            n_ctx_train: m.usize("context_length")?,
        };
        check_heads(&m, p.n_layer, p.n_head, p.n_head_kv, p.head_dim)?;
        if p.n_expert_used == 0 || p.n_expert_used > p.n_expert {
            return Err(m.bad(
                "expert_used_count",
                p.n_expert_used,
                "must be 1..=expert_count",
            ));
        }
        if p.sliding_window == 0 {
            return Err(m.bad("attention.sliding_window", 0, "must be nonzero"));
        }
        Ok(p)
    }

    /// The sliding window of layer `l`: even layers slide, odd layers see the whole context.
    pub fn window(&self, layer: usize) -> Option<usize> {
        layer.is_multiple_of(2).then_some(self.sliding_window)
    }

    /// The placement planner's shape of the model: GQA heads of `head_dim` for keys and
    /// values, the sliding window on the layers [`GptOssParams::window`] gives it, routed
    /// experts and no dense FFN.
    pub fn shape(&self) -> ModelShape {
        let heads = WholeHeads {
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
        };
        ModelShape {
            sliding_window: saturating_u32(self.sliding_window),
            swa_layers: (0..self.n_layer)
                .map(|l| self.window(l).is_some())
                .collect(),
            n_expert: self.n_expert as u64,
            n_expert_used: self.n_expert_used as u64,
            n_ff_exp: self.n_ff_exp as u64,
            ..heads.shape("gpt-oss", self.n_layer, self.n_vocab, self.n_ctx_train)
        }
    }
}

/// gpt-oss's expert activation as the contract's `moe` op takes it: the SwiGLU constants are
/// fixed by the architecture, not stored in GGUF.
const EXPERT_ACT: GatedAct = GatedAct::ClampedSwiglu {
    alpha: 1.702,
    limit: 7.0,
};

/// gpt-oss's layers of `gguf` on `dev` (every tensor checked against the hyperparameters;
/// the routed experts are the executor's): each layer is the attention block (q/k/v/o
/// biases, NeoX RoPE with YaRN, sinks, the sliding window on even layers) and the routed-MoE
/// block (router bias, top-k then softmax, the clamped SwiGLU experts with biases, a
/// sequence's rows multiplied together by F32 experts as the host experts do).
pub(crate) fn load<B: Backend>(gguf: GgufModel, dev: &B) -> Result<AttnMoeModel<B>, ModelError> {
    let p = GptOssParams::from_metadata(gguf.metadata(), n_vocab(&gguf)?)?;
    let rope = (Rope::new(p.head_dim, p.rope_freq_base, p.yarn).device_params())
        .ok_or_else(|| ModelError::Placement("RoPE frequency factors".into()))?;
    let mut layers = AttnMoeLayers::with_capacity(p.n_layer);
    for l in 0..p.n_layer {
        let shape = AttnShape {
            n_head: p.n_head,
            n_head_kv: p.n_head_kv,
            head_dim: p.head_dim,
            window: p.window(l),
            scale: 1.0 / (p.head_dim as f32).sqrt(),
            // The CPU's row kernel sums one token's values in one chain here.
            value_chains: 1,
        };
        let attn = AttnSpec {
            n_embd: p.n_embd,
            shape,
            rope,
            rms_eps: p.rms_eps,
        };
        let moe = MoeSpec {
            n_embd: p.n_embd,
            router: Router {
                n_expert: p.n_expert,
                k: p.n_expert_used,
                gating: Gating::TopKSoftmax,
            },
            act: EXPERT_ACT,
            split: ExpertSplit::PerSequence,
            rms_eps: p.rms_eps,
        };
        let spec = AttnMoeSpec {
            attn,
            moe,
            moe_norm: "post_attention_norm.weight",
            n_ff: p.n_ff_exp,
            expert_biases: true,
        };
        layers.push(dev, &gguf, l, &spec)?;
    }
    let dims = ModelDims {
        n_layer: p.n_layer,
        n_embd: p.n_embd,
        n_vocab: p.n_vocab,
        n_ctx_train: p.n_ctx_train,
        rms_eps: p.rms_eps,
        scratch_per_token: layers.scratch_per_token(p.n_embd),
        kv_head_dim: p.head_dim,
    };
    Ok(AttnMoeModel::new(gguf, dims, layers))
}
