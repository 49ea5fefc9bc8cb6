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
//! The layers run over the device contract ([`GptOss`], run by [`crate::DeviceModel`] on the
//! CPU, a GPU or REF0, the experts wherever the placement puts them).

use hmoe_backend::{Backend, GatedAct};
use hmoe_gguf::{GgufModel, Metadata};

use hmoe_backend::ExpertTensors;
use hmoe_cpu::kv_cache::KvType;

use super::rope::Rope;
use crate::error::ModelError;
use crate::executor::device_kv::KvWidths;
use crate::executor::layer_blocks::{AttnMoeLayers, AttnMoeSpec, AttnSpec, MoeSpec};
use crate::executor::routing::{ExpertSplit, Gating, Router};
use crate::executor::step::{AttnShape, DeviceLayers, ModelDims, Step};
use crate::sequence::KvCache;
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
        let int = |k: &str| -> Result<usize, ModelError> {
            let key = format!("gpt-oss.{k}");
            meta.get_u64(&key)
                .map(|v| v as usize)
                .ok_or(ModelError::MissingKey(key))
        };
        let float = |k: &str| -> Result<f32, ModelError> {
            let key = format!("gpt-oss.{k}");
            meta.get_f32(&key).ok_or(ModelError::MissingKey(key))
        };
        let n_head = int("attention.head_count")?;
        let n_embd = int("embedding_length")?;
        let head_dim = match meta.get_u64("gpt-oss.attention.key_length") {
            Some(v) => v as usize,
            None => n_embd / n_head.max(1),
        };
        let yarn = match meta.get_str("gpt-oss.rope.scaling.type") {
            Some("yarn") => Some((
                float("rope.scaling.factor")?,
                int("rope.scaling.original_context_length")? as u32,
            )),
            Some("none") | None => None,
            Some(other) => {
                return Err(ModelError::BadParam {
                    key: "gpt-oss.rope.scaling.type".into(),
                    value: other.into(),
                    why: "only yarn or none are supported",
                })
            }
        };
        let p = GptOssParams {
            n_layer: int("block_count")?,
            n_embd,
            n_head,
            n_head_kv: int("attention.head_count_kv")?,
            head_dim,
            n_vocab,
            n_expert: int("expert_count")?,
            n_expert_used: int("expert_used_count")?,
            n_ff_exp: int("expert_feed_forward_length")?,
            sliding_window: int("attention.sliding_window")?,
            rms_eps: float("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: float("rope.freq_base").unwrap_or(150000.0),
            yarn,
            n_ctx_train: int("context_length")?,
        };
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |key: &str, value: usize, why: &'static str| {
            Err(ModelError::BadParam {
                key: format!("gpt-oss.{key}"),
                value: value.to_string(),
                why,
            })
        };
        if self.n_layer == 0 || self.n_layer > 4096 {
            return bad("block_count", self.n_layer, "must be 1..=4096");
        }
        if self.n_head == 0 || self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(
                "attention.head_count_kv",
                self.n_head_kv,
                "must divide head_count",
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(
                "attention.key_length",
                self.head_dim,
                "must be even and nonzero",
            );
        }
        if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
            return bad(
                "expert_used_count",
                self.n_expert_used,
                "must be 1..=expert_count",
            );
        }
        if self.sliding_window == 0 {
            return bad("attention.sliding_window", 0, "must be nonzero");
        }
        Ok(())
    }

    /// The sliding window of layer `l`: even layers slide, odd layers see the whole context.
    pub fn window(&self, layer: usize) -> Option<usize> {
        layer.is_multiple_of(2).then_some(self.sliding_window)
    }
}

/// gpt-oss's expert activation as the contract's `moe` op takes it: the SwiGLU constants are
/// fixed by the architecture, not stored in GGUF.
const EXPERT_ACT: GatedAct = GatedAct::ClampedSwiglu {
    alpha: 1.702,
    limit: 7.0,
};

/// gpt-oss's layers on a device ([`crate::DeviceModel`]): each layer is the attention block
/// (q/k/v/o biases, NeoX RoPE with YaRN, sinks, the sliding window on even layers) and the
/// routed-MoE block (router bias, top-k then softmax, the clamped SwiGLU experts with biases,
/// a sequence's rows multiplied together by F32 experts as the host experts do).
pub(crate) struct GptOss<B: Backend> {
    params: GptOssParams,
    gguf: GgufModel,
    layers: AttnMoeLayers<B>,
}

impl<B: Backend> GptOss<B> {
    /// Checks every tensor of `gguf` against the hyperparameters and uploads every layer's
    /// dense weights to `dev` (the routed experts are the executor's).
    pub(crate) fn load(gguf: GgufModel, dev: &B) -> Result<GptOss<B>, ModelError> {
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
        Ok(GptOss {
            params: p,
            gguf,
            layers,
        })
    }
}

impl<B: Backend> DeviceLayers<B> for GptOss<B> {
    fn dims(&self) -> ModelDims {
        let p = &self.params;
        ModelDims {
            n_layer: p.n_layer,
            n_embd: p.n_embd,
            n_vocab: p.n_vocab,
            n_ctx_train: p.n_ctx_train,
            rms_eps: p.rms_eps,
            scratch_per_token: self.layers.scratch_per_token(p.n_embd),
            kv_head_dim: p.head_dim,
        }
    }
    fn gguf(&self) -> &GgufModel {
        &self.gguf
    }
    /// Positions and the ring geometry: windowed layers keep `window + n_ubatch` cells.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        let windows: Vec<_> = (0..self.params.n_layer)
            .map(|l| self.params.window(l))
            .collect();
        KvCache::new(ty, n_ctx, n_ubatch, &windows)
    }
    fn kv_widths(&self, layer: usize) -> KvWidths {
        self.layers.kv_widths(layer)
    }
    fn layer(&self, cx: &mut Step<'_, B>, l: usize, x: &mut B::Buf<f32>) -> Result<(), ModelError> {
        self.layers.forward(cx, l, x)
    }
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>> {
        self.layers.experts(&self.gguf, layer)
    }
    fn weight_bytes(&self) -> u64 {
        self.layers.bytes()
    }
}
