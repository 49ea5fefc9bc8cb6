//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder; "Qwen3 Technical Report", 2025),
//! as transformers'
//! `Qwen3MoeForCausalLM` with the numerics of llama.cpp's CPU backend:
//!
//! ```text
//! x = embed(tokens)
//! for each block l:
//!     h = rmsnorm(x) · attn_norm
//!     q, k, v = Wq·h, Wk·h, Wv·h                          (GQA, no biases)
//!     q, k = rmsnorm(q_head) · q_norm, rmsnorm(k_head) · k_norm   (per head)
//!     q, k = rope_neox(q, k, pos)
//!     x += Wo · attention(q, k, v)                        (scale 1/√head_dim)
//!     h = rmsnorm(x) · ffn_norm
//!     p = softmax(Wr·h)                                   (over all experts)
//!     top = top_k(p);  w = p[top] / Σ p[top]              (expert_weights_norm, on for qwen3moe)
//!     x += Σ_k w_k · Wd_k · (silu(Wg_k·h) ⊙ Wu_k·h)
//! logits = Wout · (rmsnorm(x) · output_norm)
//! ```
//!
//! Each layer is the executor's shared attention block (per-head q/k RMSNorm, NeoX RoPE, GQA
//! without sinks, the value sum of one token in `vec_dot`'s four chains) and its routed-MoE
//! block (softmax gate over every expert, top-k renormalised by the contract's `route` op,
//! bias-less SiLU experts), run by [`crate::DeviceModel`] on the CPU, a GPU or REF0.

use hmoe_backend::{Backend, GatedAct};
use hmoe_gguf::GgufModel;
use hmoe_placement::ModelShape;

use hmoe_backend::routing::{Gating, Routing};

use super::hparams::{check_heads, ArchMeta, WholeHeads};
use super::rope::{Rope, RopeScaling};
use crate::error::ModelError;
use crate::executor::layer_blocks::{AttnMoeLayers, AttnMoeModel, AttnMoeSpec, AttnSpec, MoeSpec};
use crate::executor::routing::{ExpertSplit, Gating as RouterGating, Router};
use crate::executor::step::{AttnShape, ModelDims};
use crate::weights::n_vocab;

const ARCH: &str = "qwen3moe";

/// Hyperparameters of a Qwen3-MoE model, read from GGUF metadata (`qwen3moe.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3MoeParams {
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
    /// Hidden size of each expert.
    pub n_ff_exp: usize,
    /// Expert routing (top-k, renormalised).
    pub routing: Routing,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// RoPE context scaling (YaRN for long-context variants).
    pub rope_scaling: RopeScaling,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
}

impl Qwen3MoeParams {
    /// Reads the hyperparameters; `n_vocab` comes from the embedding tensor.
    pub fn from_metadata(
        meta: &hmoe_gguf::Metadata,
        n_vocab: usize,
    ) -> Result<Qwen3MoeParams, ModelError> {
        if meta.architecture() != Some(ARCH) {
            return Err(ModelError::UnsupportedArch(
                meta.architecture().unwrap_or("").to_string(),
            ));
        }
        let m = ArchMeta { meta, arch: ARCH };
        let WholeHeads {
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
        } = m.whole_heads()?;
        let n_expert = m.usize("expert_count")?;
        let k = m.usize("expert_used_count")?;
        if n_expert == 0 || k == 0 || k > n_expert {
            return Err(m.bad("expert_used_count", k, "must be 1..=expert_count"));
        }
        let n_ff_exp = match m.usize_or("expert_feed_forward_length", 0) {
            0 => m.usize("feed_forward_length")? / k,
            v => v,
        };
        let n_ctx_train = m.usize("context_length")?;
        let p = Qwen3MoeParams {
            n_layer: m.usize("block_count")?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            n_expert,
            n_ff_exp,
            // llama.cpp always renormalises for qwen3moe and does not read the scale (0).
            routing: Routing {
                k,
                groups: None,
                norm: true,
                scale: 0.0,
            },
            rms_eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: m.f32_or("rope.freq_base", 10000.0),
            rope_scaling: RopeScaling::from_metadata(meta, ARCH, n_ctx_train as u32)?,
            n_ctx_train,
        };
        check_heads(&m, p.n_layer, p.n_head, p.n_head_kv, p.head_dim)?;
        Ok(p)
    }

    /// The placement planner's shape of the model: GQA heads of `head_dim` for keys and
    /// values, routed experts, no shared experts, no dense FFN and no sliding window.
    pub fn shape(&self) -> ModelShape {
        let heads = WholeHeads {
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
        };
        ModelShape {
            n_expert: self.n_expert as u64,
            n_expert_used: self.routing.k as u64,
            n_ff_exp: self.n_ff_exp as u64,
            ..heads.shape(ARCH, self.n_layer, self.n_vocab, self.n_ctx_train)
        }
    }
}

/// The SiLU experts' activation as the contract's `moe` op takes it.
const EXPERT_ACT: GatedAct = GatedAct::Silu;

/// Qwen3-MoE's layers of `gguf` on `dev` (every tensor checked against the hyperparameters;
/// the routed experts are the executor's): each layer is the attention block (per-head q/k
/// norms, NeoX RoPE, GQA, no biases or sinks, one token's values summed in the four chains of
/// `vec_dot`) and the routed-MoE block (`ffn_norm`, softmax over every expert, top-k
/// renormalised, bias-less SiLU experts; a sequence's rows multiplied together by F32 experts
/// as the host experts do).
pub(crate) fn load<B: Backend>(gguf: GgufModel, dev: &B) -> Result<AttnMoeModel<B>, ModelError> {
    let p = Qwen3MoeParams::from_metadata(gguf.metadata(), n_vocab(&gguf)?)?;
    // The contract's attention (`AttnParams::head_dim`), where the CPU's scores of a
    // batch also take tinyBLAS's 16-lane order.
    if !p.head_dim.is_multiple_of(16) || p.head_dim > 256 {
        return Err(ModelError::Placement(format!(
            "attention heads of {} values: the device takes multiples of 16 up to 256",
            p.head_dim
        )));
    }
    let rope = (Rope::scaled(p.head_dim, p.rope_freq_base, p.rope_scaling).device_params())
        .ok_or_else(|| ModelError::Placement("RoPE frequency factors".into()))?;
    let attn = AttnSpec {
        n_embd: p.n_embd,
        shape: AttnShape {
            n_head: p.n_head,
            n_head_kv: p.n_head_kv,
            head_dim: p.head_dim,
            window: None,
            scale: 1.0 / (p.head_dim as f32).sqrt(),
            value_chains: hmoe_backend::numerics::VEC_DOT_CHAINS,
        },
        rope,
        rms_eps: p.rms_eps,
    };
    let moe = MoeSpec {
        n_embd: p.n_embd,
        router: Router {
            n_expert: p.n_expert,
            k: p.routing.k,
            gating: RouterGating::Scored(Gating::Softmax, p.routing),
        },
        act: EXPERT_ACT,
        split: ExpertSplit::PerSequence,
        rms_eps: p.rms_eps,
    };
    let mut layers = AttnMoeLayers::with_capacity(p.n_layer);
    for l in 0..p.n_layer {
        for norm in ["attn_q_norm.weight", "attn_k_norm.weight"] {
            let name = format!("blk.{l}.{norm}");
            if gguf.tensor_info(&name).is_none() {
                return Err(ModelError::MissingTensor(name));
            }
        }
        let spec = AttnMoeSpec {
            attn,
            moe,
            moe_norm: "ffn_norm.weight",
            n_ff: p.n_ff_exp,
            expert_biases: false,
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
