//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder), as transformers'
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
//! The attention block is [`crate::llama::SelfAttention`] with its q/k norms.
//!
//! On a device ([`crate::DeviceModel`]) each layer is the executor's shared attention block
//! (per-head q/k RMSNorm, NeoX RoPE, GQA without sinks, the value sum of one token in
//! `vec_dot`'s four chains as `attention_ext` sums it) and its routed-MoE block (softmax gate
//! over every expert, top-k renormalised by the contract's `route` op, bias-less SiLU experts),
//! with host experts run by this file's own expert code.

use hmoe_backend::{Backend, ExpertTensors, GatedAct};
use hmoe_gguf::GgufModel;

use crate::executor::blocks::{AttnBlock, AttnMoeLayers, AttnSpec, MoeBlock, MoeSpec};
use crate::executor::{
    AttnShape, DeviceLayers, ExecError, ExpertSplit, Gating as RouterGating, ModelDims, Router,
    Step,
};
use crate::kv_cache::{KvCache, KvType};
use crate::llama::{check_heads, SelfAttention};
use crate::ops::{
    embed, final_logits, gate_probs, moe_swiglu, moe_swiglu_per_seq, output_head, rms_norm,
    ArchMeta, Gating, QuantizedActs, Rope, RopeMode, RopeScaling, Routing,
};
use crate::ubatch::Ubatches;
use crate::weights::{load_f32, project, Mat};
use crate::{ExpertBatch, LanguageModel, LogitsWanted, ModelError};

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
        let n_embd = m.usize("embedding_length")?;
        let n_head = m.usize("attention.head_count")?;
        let head_dim = m.usize_or("attention.key_length", n_embd / n_head.max(1));
        if m.usize_or("attention.value_length", head_dim) != head_dim {
            return Err(m.bad(
                "attention.value_length",
                m.usize_or("attention.value_length", 0),
                "must equal key_length",
            ));
        }
        if m.usize_or("rope.dimension_count", head_dim) != head_dim {
            return Err(m.bad(
                "rope.dimension_count",
                m.usize_or("rope.dimension_count", 0),
                "partial RoPE is not supported",
            ));
        }
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
            n_head_kv: m.usize_or("attention.head_count_kv", n_head),
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
}

struct Block {
    attn_norm: Vec<f32>,
    attn: SelfAttention,
    ffn_norm: Vec<f32>,
    router: Mat,
    gate_exps: Mat,
    up_exps: Mat,
    down_exps: Mat,
}

impl Block {
    /// The stacked experts `[gate, up, down]`.
    fn experts(&self) -> [&Mat; 3] {
        [&self.gate_exps, &self.up_exps, &self.down_exps]
    }
}

/// A loaded Qwen3-MoE model: hyperparameters plus views of its weights in the file mapping.
pub struct Qwen3Moe {
    params: Qwen3MoeParams,
    rope: Rope,
    tok_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    blocks: Vec<Block>,
    gguf: GgufModel,
}

impl Qwen3Moe {
    /// Checks every tensor against the hyperparameters and builds the model.
    pub fn load(gguf: GgufModel) -> Result<Qwen3Moe, ModelError> {
        let embd = gguf
            .tensor_info("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let p = Qwen3MoeParams::from_metadata(gguf.metadata(), n_vocab)?;
        let g = &gguf;
        let (d, ff, ne) = (p.n_embd as u64, p.n_ff_exp as u64, p.n_expert as u64);
        let blocks = (0..p.n_layer)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}");
                let attn = SelfAttention::load(g, l, p.n_embd, p.n_head, p.n_head_kv, p.head_dim)?;
                if !attn.has_qk_norm() {
                    return Err(ModelError::MissingTensor(n("attn_q_norm.weight")));
                }
                Ok(Block {
                    attn_norm: load_f32(g, &n("attn_norm.weight"), &[d])?,
                    attn,
                    ffn_norm: load_f32(g, &n("ffn_norm.weight"), &[d])?,
                    router: Mat::load(g, &n("ffn_gate_inp.weight"), &[d, ne])?,
                    gate_exps: Mat::load(g, &n("ffn_gate_exps.weight"), &[d, ff, ne])?,
                    up_exps: Mat::load(g, &n("ffn_up_exps.weight"), &[d, ff, ne])?,
                    down_exps: Mat::load(g, &n("ffn_down_exps.weight"), &[ff, d, ne])?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Qwen3Moe {
            rope: Rope::scaled(p.head_dim, p.rope_freq_base, p.rope_scaling),
            tok_embd: Mat::load(g, "token_embd.weight", &[d, n_vocab as u64])?,
            output_norm: load_f32(g, "output_norm.weight", &[d])?,
            output: output_head(g, p.n_embd, n_vocab)?,
            blocks,
            params: p,
            gguf,
        })
    }

    /// The hyperparameters.
    pub fn params(&self) -> &Qwen3MoeParams {
        &self.params
    }

    fn forward_ubatch(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Option<LogitsWanted>,
    ) -> Vec<f32> {
        let p = &self.params;
        let g = &self.gguf;
        let pos0 = cache.n_past();
        let mut x = embed(g, &self.tok_embd, tokens);
        let rope_cs = self.rope.caches(pos0, tokens.len());
        let mut h = vec![0f32; x.len()];
        let mut acts = QuantizedActs::default();
        let scale = 1.0 / (p.head_dim as f32).sqrt();
        for (l, b) in self.blocks.iter().enumerate() {
            rms_norm(&x, &b.attn_norm, p.rms_eps, &mut h);
            let layer = &mut cache.layers[l];
            let attn = b.attn.forward(
                g,
                layer,
                &h,
                pos0,
                &self.rope,
                RopeMode::Neox,
                &rope_cs,
                p.rms_eps,
                scale,
                &mut acts,
            );
            x.iter_mut().zip(&attn).for_each(|(xv, a)| *xv += a);
            rms_norm(&x, &b.ffn_norm, p.rms_eps, &mut h);
            let moe = self.moe_block(b, &h, &mut acts);
            x.iter_mut().zip(&moe).for_each(|(xv, m)| *xv += m);
        }
        cache.advance(tokens.len());
        final_logits(
            g,
            &x,
            want,
            &self.output_norm,
            p.rms_eps,
            &self.output,
            &mut acts,
        )
    }

    /// `Σ_k w_k · expert_k(h)` with softmax routing over all experts, renormalised over the top k.
    fn moe_block(&self, b: &Block, h: &[f32], acts: &mut QuantizedActs) -> Vec<f32> {
        let p = &self.params;
        let k = p.routing.k;
        let mut probs = project(&self.gguf, &b.router, h, acts);
        let n = probs.len() / p.n_expert;
        let (mut selected, mut weights) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
        let (mut top, mut w) = (Vec::new(), Vec::new());
        for row in probs.chunks_exact_mut(p.n_expert) {
            gate_probs(Gating::Softmax, row);
            p.routing.select(row, None, &mut top, &mut w);
            selected.extend_from_slice(&top);
            weights.extend_from_slice(&w);
        }
        moe_swiglu(
            &self.gguf,
            &b.gate_exps,
            &b.up_exps,
            &b.down_exps,
            h,
            &selected,
            &weights,
            k,
            acts,
        )
    }
}

impl LanguageModel for Qwen3Moe {
    fn n_vocab(&self) -> usize {
        self.params.n_vocab
    }
    fn n_ctx_train(&self) -> usize {
        self.params.n_ctx_train
    }
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        let p = &self.params;
        KvCache::new(
            ty,
            n_ctx,
            n_ubatch.max(1),
            p.n_head_kv * p.head_dim,
            &vec![None; p.n_layer],
        )
        .with_head_dims(p.head_dim, p.head_dim)
    }
    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        cache.run_ubatches(tokens, wanted, self.params.n_vocab, |c, chunk, want| {
            self.forward_ubatch(c, chunk, want)
        })
    }
    fn gguf(&self) -> &GgufModel {
        &self.gguf
    }
}

/// The SiLU experts' activation as the contract's `moe` op takes it.
const EXPERT_ACT: GatedAct = GatedAct::Silu;

/// Qwen3-MoE's layers on a device ([`crate::DeviceModel`]): each layer is the attention block
/// (per-head q/k norms, NeoX RoPE, GQA, no biases or sinks, one token's values summed in the
/// four chains of the CPU engine's `attention_ext`) and the routed-MoE block (`ffn_norm`,
/// softmax over every expert, top-k renormalised, bias-less SiLU experts; a sequence's rows
/// multiplied together by F32 experts as the host experts do).
pub(crate) struct DeviceQwen3Moe<B: Backend> {
    host: Qwen3Moe,
    layers: AttnMoeLayers<B>,
}

impl<B: Backend> DeviceQwen3Moe<B> {
    /// Loads `gguf` (checked as [`Qwen3Moe::load`] checks it) and uploads every layer's dense
    /// weights to `dev`.
    pub(crate) fn load(gguf: GgufModel, dev: &B) -> Result<DeviceQwen3Moe<B>, ExecError> {
        let host = Qwen3Moe::load(gguf)?;
        let p = &host.params;
        // The contract's attention (`AttnParams::head_dim`), where the CPU engine's scores
        // of a batch also take tinyBLAS's 16-lane order.
        if !p.head_dim.is_multiple_of(16) || p.head_dim > 256 {
            return Err(ExecError::Placement(format!(
                "attention heads of {} values: the device takes multiples of 16 up to 256",
                p.head_dim
            )));
        }
        let rope = (host.rope.device_params())
            .ok_or_else(|| ExecError::Placement("RoPE frequency factors".into()))?;
        let attn = AttnSpec {
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
            router: Router {
                n_expert: p.n_expert,
                k: p.routing.k,
                gating: RouterGating::Scored(Gating::Softmax, p.routing),
            },
            act: EXPERT_ACT,
            split: ExpertSplit::PerSequence,
            rms_eps: p.rms_eps,
        };
        let layers = (0..p.n_layer)
            .map(|l| {
                Ok((
                    AttnBlock::load(dev, &host.gguf, l, attn)?,
                    MoeBlock::load(dev, &host.gguf, l, "ffn_norm.weight", moe)?,
                ))
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        Ok(DeviceQwen3Moe {
            host,
            layers: AttnMoeLayers(layers),
        })
    }
}

impl<B: Backend> DeviceLayers<B> for DeviceQwen3Moe<B> {
    fn dims(&self) -> ModelDims {
        let p = &self.host.params;
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
        &self.host.gguf
    }
    /// Positions and the CPU cache's ring geometry (every layer full), no keys or values.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        KvCache::new(
            ty,
            n_ctx,
            n_ubatch.max(1),
            0,
            &vec![None; self.host.params.n_layer],
        )
    }
    fn kv_widths(&self, layer: usize) -> (usize, usize) {
        self.layers.kv_widths(layer)
    }
    fn layer(&self, cx: &mut Step<'_, B>, l: usize, x: &mut B::Buf<f32>) -> Result<(), ExecError> {
        self.layers.forward(cx, l, x)
    }
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>> {
        let b = self.host.blocks.get(layer)?;
        Some(Mat::expert_tensors(
            &self.host.gguf,
            self.host.params.n_expert,
            b.experts(),
        ))
    }
    fn run_host_experts(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let b = self.host.blocks.get(layer).ok_or_else(|| {
            ModelError::MissingTensor(format!("blk.{layer}.ffn_gate_exps.weight"))
        })?;
        moe_swiglu_per_seq(&self.host.gguf, b.experts(), batch, out);
        Ok(())
    }
    fn weight_bytes(&self) -> u64 {
        self.layers.bytes()
    }
}
