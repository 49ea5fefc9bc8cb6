//! gpt-oss (OpenAI's open-weight MoE), as in OpenAI's reference `torch/model.py` with the
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
//! This file holds gpt-oss's CPU forward ([`GptOss`]) and its layer over the device contract
//! ([`DeviceGptOss`], run by [`crate::DeviceModel`] where the placement puts it).

mod batch;

use std::ops::Range;

use hmoe_backend::{Backend, GatedAct};
use hmoe_gguf::{GgufModel, Metadata};

use crate::executor::blocks::{AttnBlock, AttnMoeLayers, AttnSpec, MoeBlock, MoeSpec};
use crate::executor::{
    AttnShape, DeviceLayers, ExecError, ExpertSplit, Gating, ModelDims, Router, Step,
};
use crate::hybrid::{
    host_experts, ExpertBatch, ExpertDeviceError, ExpertKernels, ExpertScratch, ExpertTensors,
};
use crate::kv_cache::{KvCache, KvType};
use crate::ops::{add_bias, rms_norm, softmax, top_k, QuantizedActs, Rope};
use crate::ubatch::Ubatches;
use crate::weights::{load_f32, project, Mat};
use crate::{LogitsWanted, ModelError};
use hmoe_cpu::attention::{attention, AttnShape as CpuAttnShape};

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

struct Block {
    attn_norm: Vec<f32>,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    bq: Vec<f32>,
    bk: Vec<f32>,
    bv: Vec<f32>,
    bo: Vec<f32>,
    sinks: Vec<f32>,
    ffn_norm: Vec<f32>,
    router: Mat,
    router_b: Vec<f32>,
    gate_exps: Mat,
    up_exps: Mat,
    down_exps: Mat,
    gate_b: Vec<f32>,
    up_b: Vec<f32>,
    down_b: Vec<f32>,
}

impl Block {
    /// The block's routed experts as stored in the file.
    fn experts<'g>(&'g self, g: &'g GgufModel, n_expert: usize) -> ExpertTensors<'g> {
        ExpertTensors {
            n_expert,
            gate: self.gate_exps.expert_matrix(g),
            up: self.up_exps.expert_matrix(g),
            down: self.down_exps.expert_matrix(g),
            gate_bias: &self.gate_b,
            up_bias: &self.up_b,
            down_bias: &self.down_b,
        }
    }

    /// The kernels chosen at load for the expert matrices.
    fn expert_kernels(&self) -> ExpertKernels {
        ExpertKernels::new(
            self.gate_exps.kernel,
            self.up_exps.kernel,
            self.down_exps.kernel,
        )
    }
}

/// A loaded gpt-oss model: hyperparameters plus views of its weights in the file mapping.
pub struct GptOss {
    params: GptOssParams,
    rope: Rope,
    tok_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    blocks: Vec<Block>,
    gguf: GgufModel,
}

impl GptOss {
    /// Checks every tensor against the hyperparameters and builds the model.
    pub fn load(gguf: GgufModel) -> Result<GptOss, ModelError> {
        let embd = gguf
            .tensor_info("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let p = GptOssParams::from_metadata(gguf.metadata(), n_vocab)?;
        let (d, hd, ff, ne) = (
            p.n_embd as u64,
            p.head_dim as u64,
            p.n_ff_exp as u64,
            p.n_expert as u64,
        );
        let (nq, nkv) = (p.n_head as u64 * hd, p.n_head_kv as u64 * hd);
        let g = &gguf;
        let blocks = (0..p.n_layer)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}");
                Ok(Block {
                    attn_norm: load_f32(g, &n("attn_norm.weight"), &[d])?,
                    wq: Mat::load(g, &n("attn_q.weight"), &[d, nq])?,
                    wk: Mat::load(g, &n("attn_k.weight"), &[d, nkv])?,
                    wv: Mat::load(g, &n("attn_v.weight"), &[d, nkv])?,
                    wo: Mat::load(g, &n("attn_output.weight"), &[nq, d])?,
                    bq: load_f32(g, &n("attn_q.bias"), &[nq])?,
                    bk: load_f32(g, &n("attn_k.bias"), &[nkv])?,
                    bv: load_f32(g, &n("attn_v.bias"), &[nkv])?,
                    bo: load_f32(g, &n("attn_output.bias"), &[d])?,
                    sinks: load_f32(g, &n("attn_sinks.weight"), &[p.n_head as u64])?,
                    ffn_norm: load_f32(g, &n("post_attention_norm.weight"), &[d])?,
                    router: Mat::load(g, &n("ffn_gate_inp.weight"), &[d, ne])?,
                    router_b: load_f32(g, &n("ffn_gate_inp.bias"), &[ne])?,
                    gate_exps: Mat::load(g, &n("ffn_gate_exps.weight"), &[d, ff, ne])?,
                    up_exps: Mat::load(g, &n("ffn_up_exps.weight"), &[d, ff, ne])?,
                    down_exps: Mat::load(g, &n("ffn_down_exps.weight"), &[ff, d, ne])?,
                    gate_b: load_f32(g, &n("ffn_gate_exps.bias"), &[ff, ne])?,
                    up_b: load_f32(g, &n("ffn_up_exps.bias"), &[ff, ne])?,
                    down_b: load_f32(g, &n("ffn_down_exps.bias"), &[d, ne])?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(GptOss {
            rope: Rope::new(p.head_dim, p.rope_freq_base, p.yarn),
            tok_embd: Mat::load(g, "token_embd.weight", &[d, n_vocab as u64])?,
            output_norm: load_f32(g, "output_norm.weight", &[d])?,
            output: Mat::load(g, "output.weight", &[d, n_vocab as u64])?,
            blocks,
            params: p,
            gguf,
        })
    }

    /// The routed experts of layer `layer` as stored in the file (biases dequantized to f32),
    /// for a backend that uploads them elsewhere; `None` past the last layer.
    pub fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>> {
        let b = self.blocks.get(layer)?;
        Some(b.experts(&self.gguf, self.params.n_expert))
    }

    /// Runs the routed experts of layer `layer` on the host over the file mapping, exactly as
    /// the host path of [`GptOss::forward`] does: `out` (`n_tokens × n_embd`) gets
    /// `Σ_s w[t,s] · expert_{sel[t,s]}(h[t])`. For a backend that computes the dense part
    /// elsewhere and brings the normed hidden state and the router's choices to the host.
    pub fn run_host_experts(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let b = self.blocks.get(layer).ok_or_else(|| {
            ExpertDeviceError::Placement(format!(
                "layer {layer} of a {}-layer model",
                self.params.n_layer
            ))
        })?;
        host_experts(
            layer,
            &b.expert_kernels(),
            EXPERT_ACT,
            &b.experts(&self.gguf, self.params.n_expert),
            batch,
            &mut ExpertScratch::default(),
            out,
        )?;
        Ok(())
    }

    /// The hyperparameters.
    pub fn params(&self) -> &GptOssParams {
        &self.params
    }

    /// The underlying file(s).
    pub fn gguf(&self) -> &GgufModel {
        &self.gguf
    }

    /// A KV cache for `n_ctx` positions, processing batches `n_ubatch` tokens at a time.
    pub fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        let windows: Vec<_> = (0..self.params.n_layer)
            .map(|l| self.params.window(l))
            .collect();
        let width = self.params.n_head_kv * self.params.head_dim;
        let hd = self.params.head_dim;
        KvCache::new(ty, n_ctx, n_ubatch.max(1), width, &windows).with_head_dims(hd, hd)
    }

    /// A cache that holds positions and the ring geometry of [`GptOss::new_cache`] (windowed
    /// layers keep `window + n_ubatch` cells, so [`KvCache::truncate`] answers as for a real
    /// cache) but no keys or values: the handle of a backend that keeps K/V elsewhere (on a
    /// GPU). Such a cache must not be passed to [`GptOss::forward`].
    pub fn new_position_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        let windows: Vec<_> = (0..self.params.n_layer)
            .map(|l| self.params.window(l))
            .collect();
        KvCache::new(ty, n_ctx, n_ubatch.max(1), 0, &windows)
    }

    /// Records that a backend keeping K/V elsewhere stored `n` more positions of the sequence
    /// `cache` stands for (see [`GptOss::new_position_cache`]).
    pub fn advance_positions(cache: &mut KvCache, n: usize) {
        cache.advance(n);
    }

    /// Runs `tokens` at the next positions of `cache` and returns logits (`n_vocab` per
    /// returned token). Batches longer than the cache's micro-batch are split.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        let n_vocab = self.params.n_vocab;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab });
        }
        if cache.n_past() + tokens.len() > cache.n_ctx() {
            return Err(ModelError::ContextFull {
                pos: cache.n_past(),
                n_tokens: tokens.len(),
                n_ctx: cache.n_ctx(),
            });
        }
        cache.check_heads(self.params.head_dim, self.params.head_dim)?;
        let mut logits = Vec::new();
        let n_chunks = tokens.len().div_ceil(cache.n_ubatch());
        for (i, chunk) in tokens.chunks(cache.n_ubatch()).enumerate() {
            let want = match wanted {
                LogitsWanted::All => Some(LogitsWanted::All),
                LogitsWanted::Last if i + 1 == n_chunks => Some(LogitsWanted::Last),
                LogitsWanted::Last => None,
            };
            logits.extend(self.forward_ubatch(cache, chunk, want)?);
        }
        Ok(logits)
    }

    fn forward_ubatch(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Option<LogitsWanted>,
    ) -> Result<Vec<f32>, ModelError> {
        let p = &self.params;
        let g = &self.gguf;
        let (n, d) = (tokens.len(), p.n_embd);
        let pos0 = cache.n_past();
        let mut x = vec![0f32; n * d];
        for (t, &id) in tokens.iter().enumerate() {
            let row = &self.tok_embd.bytes(g)[id as usize * self.tok_embd.row_bytes..]
                [..self.tok_embd.row_bytes];
            hmoe_quant::dequantize_row(self.tok_embd.info.ty, row, &mut x[t * d..(t + 1) * d])
                .expect("embedding row size checked at load");
        }
        let rope_cs = self.rope.caches(pos0, n);
        let mut h = vec![0f32; n * d];
        let mut acts = QuantizedActs::default();
        for (l, b) in self.blocks.iter().enumerate() {
            rms_norm(&x, &b.attn_norm, p.rms_eps, &mut h);
            let attn = self.attention_block(cache, l, b, &h, pos0, &rope_cs, &mut acts);
            for (xv, av) in x.iter_mut().zip(&attn) {
                *xv += av;
            }
            rms_norm(&x, &b.ffn_norm, p.rms_eps, &mut h);
            let moe = self.moe_block(l, b, &h, std::slice::from_ref(&(0..n)), &mut acts)?;
            for (xv, mv) in x.iter_mut().zip(&moe) {
                *xv += mv;
            }
        }
        cache.advance(n);
        let rows = match want {
            None => return Ok(Vec::new()),
            Some(LogitsWanted::All) => &x[..],
            Some(LogitsWanted::Last) => &x[(n - 1) * d..],
        };
        let mut normed = vec![0f32; rows.len()];
        rms_norm(rows, &self.output_norm, p.rms_eps, &mut normed);
        Ok(project(g, &self.output, &normed, &mut acts))
    }

    /// `Wo · attention(q, k, v) + bo` for one block; appends the batch's K/V to the cache.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        cache: &mut KvCache,
        l: usize,
        b: &Block,
        h: &[f32],
        pos0: usize,
        rope_cs: &[Vec<(f32, f32)>],
        acts: &mut QuantizedActs,
    ) -> Vec<f32> {
        let p = &self.params;
        let g = &self.gguf;
        let hd = p.head_dim;
        let mut q = project(g, &b.wq, h, acts);
        add_bias(&mut q, &b.bq);
        let mut k = project(g, &b.wk, h, acts);
        add_bias(&mut k, &b.bk);
        let mut v = project(g, &b.wv, h, acts);
        add_bias(&mut v, &b.bv);
        let (q_width, kv_width) = (p.n_head * hd, p.n_head_kv * hd);
        for (t, cs) in rope_cs.iter().enumerate() {
            self.rope
                .apply_neox(&mut q[t * q_width..(t + 1) * q_width], hd, cs);
            self.rope
                .apply_neox(&mut k[t * kv_width..(t + 1) * kv_width], hd, cs);
        }
        let layer = &mut cache.layers[l];
        for t in 0..rope_cs.len() {
            let cell = ((pos0 + t) % layer.cells) * kv_width;
            layer.k.store(cell, &k[t * kv_width..(t + 1) * kv_width]);
            layer.v.store(cell, &v[t * kv_width..(t + 1) * kv_width]);
        }
        let shape = CpuAttnShape {
            n_head: p.n_head,
            n_head_kv: p.n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut out = vec![0f32; q.len()];
        attention(layer, &shape, &q, pos0, Some(&b.sinks), &mut out);
        let mut o = project(g, &b.wo, &out, acts);
        add_bias(&mut o, &b.bo);
        o
    }

    /// `Σ_k w_k · expert_k(h)` for every token of the batch (rows `groups` belong to separate
    /// sequences): the router, then the routed experts over the file mapping.
    fn moe_block(
        &self,
        l: usize,
        b: &Block,
        h: &[f32],
        groups: &[Range<usize>],
        acts: &mut QuantizedActs,
    ) -> Result<Vec<f32>, ModelError> {
        let p = &self.params;
        let g = &self.gguf;
        let (d, k_used) = (p.n_embd, p.n_expert_used);
        let n = h.len() / d;
        let mut scores = batch::project_grouped(g, &b.router, h, groups, acts);
        add_bias(&mut scores, &b.router_b);
        let mut selected = vec![0u32; n * k_used];
        let mut weights = vec![0f32; n * k_used];
        let mut top = Vec::new();
        for t in 0..n {
            let s = &scores[t * p.n_expert..(t + 1) * p.n_expert];
            top_k(s, k_used, &mut top);
            let w = &mut weights[t * k_used..(t + 1) * k_used];
            for (i, &e) in top.iter().enumerate() {
                selected[t * k_used + i] = e as u32;
                w[i] = s[e];
            }
            softmax(w);
        }
        let batch = ExpertBatch {
            h,
            selected: &selected,
            weights: &weights,
            n_used: k_used,
            groups,
        };
        let mut out = vec![0f32; n * d];
        host_experts(
            l,
            &b.expert_kernels(),
            EXPERT_ACT,
            &b.experts(g, p.n_expert),
            &batch,
            &mut ExpertScratch::default(),
            &mut out,
        )?;
        Ok(out)
    }
}

/// gpt-oss's expert activation as the contract's `moe` op takes it.
const EXPERT_ACT: GatedAct = GatedAct::ClampedSwiglu {
    alpha: crate::hybrid::SWIGLU_ALPHA,
    limit: crate::hybrid::SWIGLU_LIMIT,
};

/// gpt-oss's layers on a device ([`crate::DeviceModel`]): each layer is the attention block
/// (q/k/v/o biases, NeoX RoPE with YaRN, sinks, the sliding window on even layers) and the
/// routed-MoE block (router bias, top-k then softmax, the clamped SwiGLU experts with biases,
/// a sequence's rows multiplied together by F32 experts as the host experts do).
pub(crate) struct DeviceGptOss<B: Backend> {
    host: GptOss,
    layers: AttnMoeLayers<B>,
}

impl<B: Backend> DeviceGptOss<B> {
    /// Loads `gguf` (checked as [`GptOss::load`] checks it) and uploads every layer's dense
    /// weights to `dev`.
    pub(crate) fn load(gguf: GgufModel, dev: &B) -> Result<DeviceGptOss<B>, ExecError> {
        let host = GptOss::load(gguf)?;
        let p = &host.params;
        let rope = (host.rope.device_params())
            .ok_or_else(|| ExecError::Placement("RoPE frequency factors".into()))?;
        let layers = (0..p.n_layer)
            .map(|l| {
                let shape = AttnShape {
                    n_head: p.n_head,
                    n_head_kv: p.n_head_kv,
                    head_dim: p.head_dim,
                    window: p.window(l),
                    scale: 1.0 / (p.head_dim as f32).sqrt(),
                    // The CPU engine's `attention` sums one token's values in one chain.
                    value_chains: 1,
                };
                let attn = AttnSpec {
                    shape,
                    rope,
                    rms_eps: p.rms_eps,
                };
                let moe = MoeSpec {
                    router: Router {
                        n_expert: p.n_expert,
                        k: p.n_expert_used,
                        gating: Gating::TopKSoftmax,
                    },
                    act: EXPERT_ACT,
                    split: ExpertSplit::PerSequence,
                    rms_eps: p.rms_eps,
                };
                Ok((
                    AttnBlock::load(dev, &host.gguf, l, attn)?,
                    MoeBlock::load(dev, &host.gguf, l, "post_attention_norm.weight", moe)?,
                ))
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        Ok(DeviceGptOss {
            host,
            layers: AttnMoeLayers(layers),
        })
    }
}

impl<B: Backend> DeviceLayers<B> for DeviceGptOss<B> {
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
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        self.host.new_position_cache(ty, n_ctx, n_ubatch)
    }
    fn kv_widths(&self, layer: usize) -> (usize, usize) {
        self.layers.kv_widths(layer)
    }
    fn layer(&self, cx: &mut Step<'_, B>, l: usize, x: &mut B::Buf<f32>) -> Result<(), ExecError> {
        self.layers.forward(cx, l, x)
    }
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>> {
        self.host.layer_experts(layer)
    }
    fn run_host_experts(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        self.host.run_host_experts(layer, batch, out)
    }
    fn weight_bytes(&self) -> u64 {
        self.layers.bytes()
    }
}
