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

mod batch;

use hmoe_gguf::{GgufModel, Metadata};
use rayon::prelude::*;

use crate::attention::{attention, AttnShape};
use crate::kv_cache::{KvCache, KvType};
use crate::ops::{add_bias, matmul, rms_norm, softmax, top_k, QuantizedActs, Rope};
use crate::weights::{load_f32, project, Mat};
use crate::{LogitsWanted, ModelError};

/// SwiGLU constants of gpt-oss experts (fixed by the architecture, not stored in GGUF).
const SWIGLU_ALPHA: f32 = 1.702;
const SWIGLU_LIMIT: f32 = 7.0;

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
            logits.extend(self.forward_ubatch(cache, chunk, want));
        }
        Ok(logits)
    }

    fn forward_ubatch(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Option<LogitsWanted>,
    ) -> Vec<f32> {
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
            let moe = self.moe_block(b, &h, &mut acts);
            for (xv, mv) in x.iter_mut().zip(&moe) {
                *xv += mv;
            }
        }
        cache.advance(n);
        let rows = match want {
            None => return Vec::new(),
            Some(LogitsWanted::All) => &x[..],
            Some(LogitsWanted::Last) => &x[(n - 1) * d..],
        };
        let mut normed = vec![0f32; rows.len()];
        rms_norm(rows, &self.output_norm, p.rms_eps, &mut normed);
        project(g, &self.output, &normed, &mut acts)
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
        let shape = AttnShape {
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

    /// `Σ_k w_k · expert_k(h)` for every token of the batch, tokens grouped by expert.
    fn moe_block(&self, b: &Block, h: &[f32], acts: &mut QuantizedActs) -> Vec<f32> {
        let p = &self.params;
        let g = &self.gguf;
        let (d, ff, k_used) = (p.n_embd, p.n_ff_exp, p.n_expert_used);
        let n = h.len() / d;
        let mut scores = project(g, &b.router, h, acts);
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
        for e in 0..p.n_expert {
            let slots: Vec<usize> = (0..n * k_used).filter(|&i| selected[i] == e).collect();
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
        // Weighted sum in slot order (highest router score first), as llama.cpp adds them.
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

/// gpt-oss's clamped SwiGLU: `min(g,7)·σ(1.702·min(g,7))·(clamp(u,−7,7)+1)`.
fn swiglu_oai(gate: f32, up: f32) -> f32 {
    let x = gate.min(SWIGLU_LIMIT);
    let y = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT);
    x / (1.0 + (-SWIGLU_ALPHA * x).exp()) * (y + 1.0)
}
