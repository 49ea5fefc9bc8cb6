//! DeepSeek-V2/V3/R1 (GGUF arch `deepseek2`), as transformers' `DeepseekV3ForCausalLM`
//! computes it, in the absorbed multi-head latent attention (MLA) form of llama.cpp's current
//! deepseek2 graph and with the numerics of its CPU backend:
//!
//! ```text
//! x = embed(tokens)
//! for each block l:
//!     h = rmsnorm(x) · attn_norm
//!     q = Wqb · (rmsnorm(Wqa·h) · q_a_norm)        (or Wq·h without a q LoRA: V2-Lite)
//!     q_nope, q_pe = q[head][..nope], q[head][nope..]                  (per head)
//!     c, k_pe = Wkva·h                              (latent c: kv_lora, k_pe: rope dims, shared)
//!     c = rmsnorm(c) · kv_a_norm;   q_pe, k_pe = rope_norm(q_pe, k_pe, pos)
//!     q_lat = Wkb_head · q_nope                     (absorbed key up-projection, kv_lora)
//!     o_lat = Σ_j softmax_j([q_lat, q_pe] · [c_j, k_pe_j] · s) c_j     (MQA over the latent cache)
//!     x += Wo · concat_heads(Wvb_head · o_lat)      (absorbed value up-projection)
//!     h = rmsnorm(x) · ffn_norm
//!     l < leading_dense_block_count:  x += Wd · (silu(Wg·h) ⊙ Wu·h)
//!     otherwise:
//!         p = sigmoid(Wr·h)   (softmax for V2)
//!         top = top_k(p + exp_probs_b) within the best expert_group_used_count groups
//!               (a group scores the sum of its two best p + exp_probs_b)
//!         w = p[top] / Σ p[top] (expert_weights_norm) · expert_weights_scale
//!         x += Σ_k w_k · expert_{top_k}(h) + shared_expert(h)
//! logits = Wout · (rmsnorm(x) · output_norm)
//! s = mscale² / √(nope + rope),  mscale = 1 + 0.1 · mscale_all_dim · ln(yarn factor)
//! ```
//!
//! The cache holds only `[c, k_pe]` per position (kv_lora + rope dims): values are the first
//! kv_lora elements of each key, as in llama.cpp's K-only MLA cache.

use hmoe_backend::{Backend, ExpertTensors, GatedAct, KOnlyAttnParams, RopeParams, RowCopy};
use hmoe_gguf::GgufModel;
use hmoe_placement::ModelShape;

use hmoe_backend::routing::{Gating, Routing};
use hmoe_backend::KvType;

use super::hparams::{ArchMeta, WholeHeads};
use super::rope::{Rope, RopeScaling};
use crate::error::ModelError;
use crate::executor::device_kv::KvWidths;
use crate::executor::device_weights::{upload_f32, upload_f32_opt, upload_matrix, DevMat};
use crate::executor::layer_blocks::SwiGluFfn;
use crate::executor::routing::{ExpertSplit, Gating as RouterGating, Routed, Router};
use crate::executor::step::{DeviceLayers, ModelDims, Residual, Step};
use crate::sequence::KvCache;
use crate::weights::{n_vocab, ExpertShape, ExpertWeights};

const ARCH: &str = "deepseek2";

/// Hyperparameters of a DeepSeek-V2/V3 model, read from GGUF metadata (`deepseek2.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Deepseek2Params {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Vocabulary size (rows of the embedding).
    pub n_vocab: usize,
    /// Rank of the query LoRA (`None`: a plain query projection, as DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// Rank of the key/value latent (what the cache stores per position, plus the rope dims).
    pub kv_lora_rank: usize,
    /// Query/key dims per head without RoPE.
    pub qk_nope_dim: usize,
    /// Query/key dims per head with RoPE (shared by all heads for keys).
    pub qk_rope_dim: usize,
    /// Value dims per head.
    pub v_head_dim: usize,
    /// Hidden size of the dense feed-forward blocks.
    pub n_ff: usize,
    /// Leading blocks with a dense feed-forward network instead of experts.
    pub n_layer_dense_lead: usize,
    /// Routed experts per MoE block.
    pub n_expert: usize,
    /// Shared experts per MoE block (their FFNs are concatenated into one).
    pub n_expert_shared: usize,
    /// Hidden size of each expert.
    pub n_ff_exp: usize,
    /// Softmax (V2) or sigmoid (V3) gate.
    pub gating: Gating,
    /// Expert routing (groups, renormalisation, routed scaling).
    pub routing: Routing,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// RoPE context scaling (YaRN for V2/V3).
    pub rope_scaling: RopeScaling,
    /// YaRN's `mscale_all_dim`: `rope.scaling.yarn_log_multiplier / 0.1` (0 when absent).
    pub yarn_log_mul: f32,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
}

impl Deepseek2Params {
    /// Reads the hyperparameters; `n_vocab` comes from the embedding tensor.
    pub fn from_metadata(
        meta: &hmoe_gguf::Metadata,
        n_vocab: usize,
    ) -> Result<Deepseek2Params, ModelError> {
        if meta.architecture() != Some(ARCH) {
            return Err(ModelError::UnsupportedArch(
                meta.architecture().unwrap_or("").to_string(),
            ));
        }
        let m = ArchMeta { meta, arch: ARCH };
        let n_head = m.usize("attention.head_count")?;
        let kv_lora_rank = m.usize("attention.kv_lora_rank")?;
        let qk_rope_dim = m.usize("rope.dimension_count")?;
        // Files converted for absorbed MLA carry the per-head sizes "after decompression" here;
        // key_length/value_length then describe the latent cache (kv_lora + rope, kv_lora).
        let k_mla = m
            .usize("attention.key_length_mla")
            .map_err(|_| m.bad("attention.key_length_mla", "missing", "re-convert the model: only GGUFs with absorbed MLA tensors (attn_k_b/attn_v_b) are supported"))?;
        let v_head_dim = m.usize("attention.value_length_mla")?;
        if k_mla <= qk_rope_dim || qk_rope_dim % 2 != 0 {
            return Err(m.bad(
                "rope.dimension_count",
                qk_rope_dim,
                "must be even and below key_length_mla",
            ));
        }
        let n_expert = m.usize("expert_count")?;
        let k = m.usize("expert_used_count")?;
        if n_expert == 0 || k == 0 || k > n_expert {
            return Err(m.bad("expert_used_count", k, "must be 1..=expert_count"));
        }
        let gating = match m.usize_or("expert_gating_func", 0) {
            0 | 1 => Gating::Softmax,
            2 => Gating::Sigmoid,
            other => {
                return Err(m.bad(
                    "expert_gating_func",
                    other,
                    "only softmax (1) and sigmoid (2) are supported",
                ))
            }
        };
        let n_groups = m.usize_or("expert_group_count", 0);
        let groups = if n_groups > 1 {
            let used = m.usize_or("expert_group_used_count", n_groups);
            if !n_expert.is_multiple_of(n_groups)
                || used == 0
                || used > n_groups
                || used * (n_expert / n_groups) < k
            {
                return Err(m.bad(
                    "expert_group_used_count",
                    used,
                    "groups must split the experts evenly and hold expert_used_count",
                ));
            }
            Some((n_groups, used))
        } else {
            None
        };
        let n_ctx_train = m.usize("context_length")?;
        let p = Deepseek2Params {
            n_layer: m.usize("block_count")?,
            n_embd: m.usize("embedding_length")?,
            n_head,
            n_vocab,
            q_lora_rank: Some(m.usize_or("attention.q_lora_rank", 0)).filter(|&r| r > 0),
            kv_lora_rank,
            qk_nope_dim: k_mla - qk_rope_dim,
            qk_rope_dim,
            v_head_dim,
            n_ff: m.usize("feed_forward_length")?,
            n_layer_dense_lead: m.usize_or("leading_dense_block_count", 0),
            n_expert,
            n_expert_shared: m.usize_or("expert_shared_count", 0),
            n_ff_exp: m.usize("expert_feed_forward_length")?,
            gating,
            routing: Routing {
                k,
                groups,
                norm: meta
                    .get_bool(&format!("{ARCH}.expert_weights_norm"))
                    .unwrap_or(false),
                scale: m.f32("expert_weights_scale")?,
            },
            rms_eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: m.f32_or("rope.freq_base", 10000.0),
            rope_scaling: RopeScaling::from_metadata(meta, ARCH, n_ctx_train as u32)?,
            // Stored as 0.1·mscale_all_dim by the converter; llama.cpp divides the 0.1 out.
            yarn_log_mul: m.f32_or("rope.scaling.yarn_log_multiplier", 0.0) / 0.1,
            n_ctx_train,
        };
        if p.n_layer == 0 || p.n_layer > 4096 {
            return Err(m.bad("block_count", p.n_layer, "must be 1..=4096"));
        }
        if p.n_head == 0 || p.kv_lora_rank == 0 || p.v_head_dim == 0 {
            return Err(m.bad(
                "attention.head_count",
                p.n_head,
                "heads, kv_lora_rank and value_length_mla must be nonzero",
            ));
        }
        Ok(p)
    }

    /// Elements per head of the absorbed query and of each cached key: `[latent, rope]`.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_dim
    }

    /// The placement planner's shape of the model: the K-only latent cache (one "head" of
    /// [`Deepseek2Params::latent_dim`] per position, values its first `kv_lora_rank`
    /// elements), query heads of `key_length_mla`, the dense FFN of the leading layers (0
    /// without any), routed experts and the shared experts' total width.
    pub fn shape(&self) -> ModelShape {
        let u = |v: usize| v as u64;
        let heads = WholeHeads {
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_head_kv: 1,
            head_dim: self.latent_dim(),
        };
        ModelShape {
            head_dim_v: u(self.kv_lora_rank),
            head_dim_q: u(self.qk_nope_dim + self.qk_rope_dim),
            mla: true,
            n_expert: u(self.n_expert),
            n_expert_used: u(self.routing.k),
            n_ff_exp: u(self.n_ff_exp),
            n_ff: if self.n_layer_dense_lead > 0 {
                u(self.n_ff)
            } else {
                0
            },
            n_ff_shexp: u(self.n_expert_shared * self.n_ff_exp),
            ..heads.shape(ARCH, self.n_layer, self.n_vocab, self.n_ctx_train)
        }
    }

    /// The attention scale `mscale² / √(nope + rope)` of llama.cpp's deepseek2 graph: the YaRN
    /// magnitude ggml leaves out of the rotation (`attn_factor` undone, times
    /// `1 + 0.1·mscale_all_dim·ln(factor)`) is applied to the scores instead.
    pub fn kq_scale(&self) -> f32 {
        let (factor, attn_factor) = match self.rope_scaling {
            RopeScaling::Yarn {
                factor,
                attn_factor,
                ..
            } => (factor, attn_factor),
            RopeScaling::Linear { factor } => (factor, 1.0),
            RopeScaling::None => (1.0, 1.0),
        };
        let freq_scale = 1.0 / factor;
        let attn_factor_org = attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln());
        let mscale = attn_factor_org * (1.0 + 0.1 * self.yarn_log_mul * (1.0 / freq_scale).ln());
        mscale * mscale / ((self.qk_nope_dim + self.qk_rope_dim) as f32).sqrt()
    }
}

/// The query path of a layer on the device.
enum DevQuery<B: Backend> {
    Lora {
        wq_a: DevMat<B>,
        q_a_norm: B::Buf<f32>,
        wq_b: DevMat<B>,
    },
    Plain(DevMat<B>),
}

/// A layer's multi-head latent attention on the device.
struct DevMla<B: Backend> {
    norm: B::Buf<f32>,
    q: DevQuery<B>,
    wkv_a: DevMat<B>,
    kv_a_norm: B::Buf<f32>,
    wk_b: DevMat<B>,
    wv_b: DevMat<B>,
    wo: DevMat<B>,
}

/// A layer's feed-forward part on the device (the routed experts are the executor's).
enum DevFfn<B: Backend> {
    Dense(SwiGluFfn<B>),
    Moe {
        router: DevMat<B>,
        probs_bias: Option<B::Buf<f32>>,
        shared: Option<SwiGluFfn<B>>,
    },
}

struct DevLayer<B: Backend> {
    attn: DevMla<B>,
    ffn_norm: B::Buf<f32>,
    ffn: DevFfn<B>,
}

/// DeepSeek-V2/V3's layers on a device ([`crate::DeviceModel`]), the math above over the
/// contract's ops: the absorbed MLA over a K-only ring of `[c, k_pe]` (normal RoPE over the rope dims, the key up-projection per head on the
/// strided `q_nope`, the value up-projection per head on the latent output), then a dense
/// SwiGLU FFN (leading layers) or the routed SiLU experts (gate scores, selection bias,
/// expert groups, renormalised scaled weights; wherever the placement puts them) plus the
/// shared experts.
pub(crate) struct Deepseek2<B: Backend> {
    params: Deepseek2Params,
    gguf: GgufModel,
    rope: RopeParams,
    kq_scale: f32,
    layers: Vec<DevLayer<B>>,
    /// The routed experts of each MoE layer (`None`: a leading dense layer).
    experts: Vec<Option<ExpertWeights>>,
}

impl<B: Backend> Deepseek2<B> {
    /// Checks every tensor of `gguf` against the hyperparameters and uploads every layer's
    /// dense weights to `dev` (the routed experts are the executor's).
    pub(crate) fn load(gguf: GgufModel, dev: &B) -> Result<Deepseek2<B>, ModelError> {
        let p = Deepseek2Params::from_metadata(gguf.metadata(), n_vocab(&gguf)?)?;
        let rope = (Rope::scaled(p.qk_rope_dim, p.rope_freq_base, p.rope_scaling).device_params())
            .ok_or_else(|| ModelError::Placement("RoPE frequency factors".into()))?;
        let g = &gguf;
        let u = |v: usize| v as u64;
        let (d, nh, kvl) = (u(p.n_embd), u(p.n_head), u(p.kv_lora_rank));
        let q_width = nh * u(p.qk_nope_dim + p.qk_rope_dim);
        let mut layers = Vec::with_capacity(p.n_layer);
        let mut experts = Vec::with_capacity(p.n_layer);
        for l in 0..p.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let m = |s: &str, shape: &[u64]| upload_matrix(dev, g, &n(s), shape);
            let f = |s: &str, len: u64| upload_f32(dev, g, &n(s), &[len]);
            let q = match p.q_lora_rank.map(u) {
                Some(r) => DevQuery::Lora {
                    wq_a: m("attn_q_a.weight", &[d, r])?,
                    q_a_norm: f("attn_q_a_norm.weight", r)?,
                    wq_b: m("attn_q_b.weight", &[r, q_width])?,
                },
                None => DevQuery::Plain(m("attn_q.weight", &[d, q_width])?),
            };
            let attn = DevMla {
                norm: f("attn_norm.weight", d)?,
                q,
                wkv_a: m("attn_kv_a_mqa.weight", &[d, u(p.latent_dim())])?,
                kv_a_norm: f("attn_kv_a_norm.weight", kvl)?,
                wk_b: m("attn_k_b.weight", &[u(p.qk_nope_dim), kvl, nh])?,
                wv_b: m("attn_v_b.weight", &[kvl, u(p.v_head_dim), nh])?,
                wo: m("attn_output.weight", &[nh * u(p.v_head_dim), d])?,
            };
            let (ffn, routed) = if l < p.n_layer_dense_lead {
                let ffn = SwiGluFfn::load(dev, g, l, "", p.n_embd, p.n_ff)?;
                (DevFfn::Dense(ffn), None)
            } else {
                let ne = u(p.n_expert);
                let shared_ff = p.n_ff_exp * p.n_expert_shared;
                let ffn = DevFfn::Moe {
                    router: m("ffn_gate_inp.weight", &[d, ne])?,
                    probs_bias: upload_f32_opt(dev, g, &n("exp_probs_b.bias"), &[ne])?,
                    shared: (p.n_expert_shared > 0)
                        .then(|| SwiGluFfn::load(dev, g, l, "_shexp", p.n_embd, shared_ff))
                        .transpose()?,
                };
                let shape = ExpertShape {
                    n_embd: p.n_embd,
                    n_ff: p.n_ff_exp,
                    n_expert: p.n_expert,
                    biases: false,
                };
                (ffn, Some(ExpertWeights::load(g, l, &shape)?))
            };
            layers.push(DevLayer {
                attn,
                ffn_norm: f("ffn_norm.weight", d)?,
                ffn,
            });
            experts.push(routed);
        }
        Ok(Deepseek2 {
            kq_scale: p.kq_scale(),
            params: p,
            gguf,
            rope,
            layers,
            experts,
        })
    }

    /// The absorbed MLA of one layer over the micro-batch `x`, the previous layer's output
    /// `pending` added to `x` first (by its norm): its output, which the feed-forward part's
    /// norm adds to `x`.
    fn attention<'s>(
        &self,
        a: &DevMla<B>,
        cx: &mut Step<'s, B>,
        layer: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Residual<'s, B>, ModelError> {
        let p = &self.params;
        let dev = cx.dev();
        let n = cx.n_tokens();
        let (nh, nope, rd, kvl, vd) = (
            p.n_head,
            p.qk_nope_dim,
            p.qk_rope_dim,
            p.kv_lora_rank,
            p.v_head_dim,
        );
        let (qd, ld) = (nope + rd, p.latent_dim());
        // h = rmsnorm(x) · attn_norm; the compressed KV (ckv = Wkv_a·h) and the queries'
        // first product (Wq_a·h or Wq·h) in one op with the norm.
        let mut h = cx.alloc(p.n_embd)?;
        let norm = (&a.norm, p.rms_eps);
        let mut q = cx.alloc(nh * qd)?;
        let mut ckv = cx.alloc(ld)?;
        let no_bias = [None, None];
        match &a.q {
            DevQuery::Lora {
                wq_a,
                q_a_norm,
                wq_b,
            } => {
                let r = p.q_lora_rank.unwrap_or(0);
                let mut cq = cx.alloc(r)?;
                let (ws, out) = ([wq_a, &a.wkv_a], &mut [&mut *cq, &mut *ckv]);
                cx.norm_matmul_shared(x, pending, norm, &mut h, &ws, &no_bias, out)?;
                let mut cq_n = cx.alloc(r)?;
                dev.rms_norm(&cq, q_a_norm, p.rms_eps, &mut cq_n)?;
                cx.matmul(wq_b, &cq_n, &mut q)?;
            }
            DevQuery::Plain(wq) => {
                let (ws, out) = ([wq, &a.wkv_a], &mut [&mut *q, &mut *ckv]);
                cx.norm_matmul_shared(x, pending, norm, &mut h, &ws, &no_bias, out)?;
            }
        }
        // Keys: [rmsnorm(c) · kv_a_norm, rope(k_pe)] per token.
        let rows = |n_rows, width, (src_stride, src_offset), (dst_stride, dst_offset)| RowCopy {
            n_rows,
            width,
            src_stride,
            src_offset,
            dst_stride,
            dst_offset,
        };
        let mut c = cx.alloc(kvl)?;
        dev.copy_rows(&ckv, &mut c, &rows(n, kvl, (ld, 0), (kvl, 0)))?;
        let mut c_n = cx.alloc(kvl)?;
        dev.rms_norm(&c, &a.kv_a_norm, p.rms_eps, &mut c_n)?;
        let mut keys = cx.alloc(ld)?;
        dev.copy_rows(&c_n, &mut keys, &rows(n, kvl, (kvl, 0), (ld, 0)))?;
        dev.copy_rows(&ckv, &mut keys, &rows(n, rd, (ld, kvl), (ld, kvl)))?;
        dev.rope_norm(&mut keys, cx.positions(), 1, ld, kvl, &self.rope)?;
        // Queries: [Wkb_head · q_nope, rope(q_pe)] per token and head.
        let mut q_lat = cx.alloc(nh * kvl)?;
        cx.matmul_heads(&a.wk_b, &q, nh, qd, &mut q_lat)?;
        let mut queries = cx.alloc(nh * ld)?;
        let heads = n * nh;
        dev.copy_rows(&q_lat, &mut queries, &rows(heads, kvl, (kvl, 0), (ld, 0)))?;
        dev.copy_rows(&q, &mut queries, &rows(heads, rd, (qd, nope), (ld, kvl)))?;
        dev.rope_norm(&mut queries, cx.positions(), nh, ld, kvl, &self.rope)?;
        let shape = KOnlyAttnParams {
            n_head: nh,
            k_dim: ld,
            v_dim: kvl,
            cells: 0,
            scale: self.kq_scale,
        };
        let mut o_lat = cx.alloc(nh * kvl)?;
        cx.attend_k_only(layer, &shape, &queries, &keys, &mut o_lat)?;
        // Values: Wvb_head · o_lat per head, laid out [token][head][v_head_dim].
        let mut v = cx.alloc(nh * vd)?;
        cx.matmul_heads(&a.wv_b, &o_lat, nh, kvl, &mut v)?;
        let mut o = cx.alloc(p.n_embd)?;
        cx.matmul(&a.wo, &v, &mut o)?;
        Ok(Residual(o))
    }

    /// The feed-forward part of one layer over the micro-batch `x`, the attention's output
    /// `attn_out` (where not added yet) added first: its own output, for the next layer to
    /// add.
    fn ffn<'s>(
        &self,
        l: &DevLayer<B>,
        cx: &mut Step<'s, B>,
        layer: usize,
        x: &mut B::Buf<f32>,
        attn_out: Option<Residual<'s, B>>,
    ) -> Result<Residual<'s, B>, ModelError> {
        let p = &self.params;
        let dev = cx.dev();
        let n = cx.n_tokens();
        let mut out = cx.alloc(p.n_embd)?;
        let norm = (&l.ffn_norm, p.rms_eps);
        match &l.ffn {
            DevFfn::Dense(f) => f.forward_normed(cx, x, attn_out, norm, &mut out)?,
            DevFfn::Moe {
                router,
                probs_bias,
                shared,
            } => {
                let mut h = cx.alloc(p.n_embd)?;
                cx.rms_norm(x, attn_out, norm.0, norm.1, &mut h)?;
                let r = Router {
                    n_expert: p.n_expert,
                    k: p.routing.k,
                    gating: RouterGating::Scored(p.gating, p.routing),
                };
                let mut scores = cx.alloc(p.n_expert)?;
                cx.matmul(router, &h, &mut scores)?;
                let mut sel = cx.scratch::<i32>(n * r.k)?;
                let mut wts = cx.scratch::<f32>(n * r.k)?;
                r.route(dev, &scores, probs_bias.as_ref(), &mut sel, &mut wts)?;
                let routed = Routed {
                    h: &*h,
                    scores: &*scores,
                    bias: probs_bias.as_ref(),
                    sel: &*sel,
                    wts: &*wts,
                    router: r,
                    act: GatedAct::Silu,
                    split: ExpertSplit::PerSequence,
                };
                // The shared experts run on the device beside the routed ones (on a host
                // layer, while the CPU runs those); added after them, as the CPU does.
                let mut s = None;
                cx.experts_beside(layer, &routed, &mut out, &mut |cx| {
                    if let Some(f) = shared {
                        let mut b = cx.alloc(p.n_embd)?;
                        f.forward(cx, &h, &mut b)?;
                        s = Some(b);
                    }
                    Ok(())
                })?;
                if let Some(s) = &s {
                    dev.add_assign(&mut out, s)?;
                }
            }
        }
        Ok(Residual(out))
    }

    /// Floats per token of one layer's scratch buffers (the larger of attention and FFN).
    fn scratch_per_token(&self) -> usize {
        let p = &self.params;
        let (nh, kvl, ld) = (p.n_head, p.kv_lora_rank, p.latent_dim());
        let qd = p.qk_nope_dim + p.qk_rope_dim;
        let attn = 2 * p.n_embd
            + nh * qd
            + 2 * p.q_lora_rank.unwrap_or(0)
            + 2 * ld
            + 2 * kvl
            + nh * (2 * kvl + ld + p.v_head_dim);
        let ffn = self.layers.iter().map(|l| match &l.ffn {
            DevFfn::Dense(f) => f.scratch_per_token(),
            DevFfn::Moe { shared, .. } => {
                p.n_expert
                    + 2 * p.routing.k
                    + p.n_embd
                    + shared.as_ref().map_or(0, |f| f.scratch_per_token())
            }
        });
        attn.max(2 * p.n_embd + ffn.max().unwrap_or(0))
    }
}

impl<B: Backend> DeviceLayers<B> for Deepseek2<B> {
    fn dims(&self) -> ModelDims {
        let p = &self.params;
        ModelDims {
            n_layer: p.n_layer,
            n_embd: p.n_embd,
            n_vocab: p.n_vocab,
            n_ctx_train: p.n_ctx_train,
            rms_eps: p.rms_eps,
            scratch_per_token: self.scratch_per_token(),
            kv_head_dim: p.latent_dim(),
        }
    }
    fn gguf(&self) -> &GgufModel {
        &self.gguf
    }
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        // Positions and the ring's cells only: the latent cache lives on the device.
        KvCache::new_k_only(ty, n_ctx, n_ubatch, self.params.n_layer)
    }
    fn kv_widths(&self, _layer: usize) -> KvWidths {
        KvWidths {
            k: self.params.latent_dim(),
            v: 0,
        }
    }
    fn layer<'s>(
        &self,
        cx: &mut Step<'s, B>,
        l: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Option<Residual<'s, B>>, ModelError> {
        let layer = &self.layers[l];
        let attn_out = self.attention(&layer.attn, cx, l, x, pending)?;
        let last = l + 1 == self.layers.len();
        cx.feed_forward(last, x, attn_out, |cx, x, attn_out| {
            self.ffn(layer, cx, l, x, attn_out)
        })
    }
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>> {
        Some(self.experts.get(layer)?.as_ref()?.tensors(&self.gguf))
    }
    fn weight_bytes(&self) -> u64 {
        let buf = |b: &B::Buf<f32>| 4 * B::buf_len(b) as u64;
        self.layers
            .iter()
            .map(|l| {
                let a = &l.attn;
                let q = match &a.q {
                    DevQuery::Lora {
                        wq_a,
                        q_a_norm,
                        wq_b,
                    } => wq_a.bytes() + buf(q_a_norm) + wq_b.bytes(),
                    DevQuery::Plain(wq) => wq.bytes(),
                };
                let attn = q
                    + buf(&a.norm)
                    + a.wkv_a.bytes()
                    + buf(&a.kv_a_norm)
                    + a.wk_b.bytes()
                    + a.wv_b.bytes()
                    + a.wo.bytes();
                let ffn = match &l.ffn {
                    DevFfn::Dense(f) => f.bytes(),
                    DevFfn::Moe {
                        router,
                        probs_bias,
                        shared,
                    } => {
                        router.bytes()
                            + probs_bias.as_ref().map_or(0, buf)
                            + shared.as_ref().map_or(0, |f| f.bytes())
                    }
                };
                attn + ffn + buf(&l.ffn_norm)
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_backend::Backend;
    use hmoe_gguf::{MetaValue, Metadata};

    /// DeepSeek-V3's own hyperparameters (no weights needed for these).
    fn v3_metadata(yarn: bool) -> Metadata {
        let mut m = Metadata::new();
        m.insert("general.architecture", MetaValue::String(ARCH.into()));
        let ints = [
            ("block_count", 61),
            ("context_length", 163840),
            ("embedding_length", 7168),
            ("feed_forward_length", 18432),
            ("attention.head_count", 128),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 576),
            ("attention.value_length", 512),
            ("attention.key_length_mla", 192),
            ("attention.value_length_mla", 128),
            ("attention.q_lora_rank", 1536),
            ("attention.kv_lora_rank", 512),
            ("rope.dimension_count", 64),
            ("leading_dense_block_count", 3),
            ("expert_count", 256),
            ("expert_used_count", 8),
            ("expert_shared_count", 1),
            ("expert_feed_forward_length", 2048),
            ("expert_group_count", 8),
            ("expert_group_used_count", 4),
            ("expert_gating_func", 2),
            ("rope.scaling.original_context_length", 4096),
        ];
        for (k, v) in ints {
            m.insert(format!("{ARCH}.{k}"), MetaValue::U32(v));
        }
        m.insert(
            format!("{ARCH}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-6),
        );
        m.insert(format!("{ARCH}.rope.freq_base"), MetaValue::F32(10000.0));
        m.insert(format!("{ARCH}.expert_weights_scale"), MetaValue::F32(2.5));
        m.insert(format!("{ARCH}.expert_weights_norm"), MetaValue::Bool(true));
        if yarn {
            m.insert(
                format!("{ARCH}.rope.scaling.type"),
                MetaValue::String("yarn".into()),
            );
            m.insert(format!("{ARCH}.rope.scaling.factor"), MetaValue::F32(40.0));
            m.insert(
                format!("{ARCH}.rope.scaling.yarn_log_multiplier"),
                MetaValue::F32(0.1),
            );
        }
        m
    }

    #[test]
    fn v3_hyperparameters() {
        let p = Deepseek2Params::from_metadata(&v3_metadata(false), 129280).unwrap();
        assert_eq!(
            (p.qk_nope_dim, p.qk_rope_dim, p.v_head_dim, p.latent_dim()),
            (128, 64, 128, 576)
        );
        assert_eq!(p.q_lora_rank, Some(1536));
        assert_eq!(p.gating, Gating::Sigmoid);
        assert_eq!(
            p.routing,
            Routing {
                k: 8,
                groups: Some((8, 4)),
                norm: true,
                scale: 2.5
            }
        );
        assert_eq!(p.kq_scale(), 1.0 / 192f32.sqrt());
    }

    /// With YaRN the rotation keeps magnitude 1 and the scores take HF's
    /// `softmax_scale = mscale² / √192`, `mscale = 0.1·mscale_all_dim·ln(40) + 1`.
    #[test]
    fn v3_yarn_scales_scores_not_rotation() {
        let p = Deepseek2Params::from_metadata(&v3_metadata(true), 129280).unwrap();
        assert!((p.yarn_log_mul - 1.0).abs() < 1e-6);
        let RopeScaling::Yarn {
            attn_factor,
            factor,
            ..
        } = p.rope_scaling
        else {
            panic!("{:?}", p.rope_scaling)
        };
        assert!((attn_factor * (1.0 + 0.1 * factor.ln()) - 1.0).abs() < 1e-6);
        let mscale = 0.1f64 * 40f64.ln() + 1.0;
        let want = mscale * mscale / 192f64.sqrt();
        assert!(
            (p.kq_scale() as f64 - want).abs() < 1e-6,
            "{} vs {want}",
            p.kq_scale()
        );
    }

    #[test]
    fn old_mla_less_files_are_refused() {
        let mut m = v3_metadata(false);
        m.remove(&format!("{ARCH}.attention.key_length_mla"));
        assert!(matches!(
            Deepseek2Params::from_metadata(&m, 10),
            Err(ModelError::BadParam { .. })
        ));
    }

    /// The reference device's K-only attention equals the CPU device's latent attention
    /// (`attention_ext` with values inside the keys) bit for bit, for f16 keys and every other
    /// K/V type: one token (`vec_dot`'s four value chains over f32/f16) and batches, f16 keys
    /// a multiple of 16 long (tinyBLAS scores) or not (the fixture's 24), across more than
    /// one 16-position chunk and more than one run of the batch's value pass.
    #[test]
    fn ref0_k_only_attention_is_the_cpus_bit_for_bit() {
        use hmoe_backend::{Backend, KOnlyAttnParams, KvLayout, KvRing, Ref0};
        use hmoe_cpu::Cpu;
        use hmoe_quant::GgmlType;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    // Magnitudes over 2^-6 .. 2^6, so that sums of products round and
                    // the summation order shows.
                    let v = (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                    v * ((seed & 15) as f32 - 6.0).exp2()
                })
                .collect()
        };
        /// Stores `keys` at `pos0` in `ring` and attends `q` over it on `dev`.
        fn attend<B: Backend>(
            dev: &B,
            ring: &mut KvRing<B>,
            p: &KOnlyAttnParams,
            (keys, q): (&[f32], &[f32]),
            (n, pos0): (usize, usize),
        ) -> Vec<f32> {
            let kd_buf = dev.upload(keys).unwrap();
            dev.kv_store(&kd_buf, ring, n, pos0).unwrap();
            let qd = dev.upload(q).unwrap();
            let mut out = dev.alloc::<f32>(n * p.n_head * p.v_dim).unwrap();
            dev.attention_k_only(p, &qd, ring, n, pos0, &mut out)
                .unwrap();
            dev.download(&out).unwrap()
        }
        let (dev, cpu) = (Ref0::new(), Cpu::new());
        let short: &[usize] = &[5, 1, 17, 1, 9];
        // Batches over more than one run of 128 positions of the batch's value pass, values
        // longer than one of its 64-element blocks and not a multiple of it.
        let long: &[usize] = &[150, 1, 140];
        let cases = [
            ("f16", 24, 16, 4, 64, short),
            ("f16", 48, 32, 3, 40, short),
            ("f32", 24, 16, 2, 40, short),
            ("bf16", 48, 32, 2, 40, short),
            ("q8_0", 96, 64, 3, 40, short),
            ("q4_0", 64, 32, 2, 40, short),
            ("q5_1", 96, 64, 2, 40, short),
            ("f16", 96, 80, 2, 320, long),
            ("q8_0", 128, 96, 2, 320, long),
        ];
        for (ty, kd, vd, nh, cells, batches) in cases {
            let kv_ty = KvType::parse(ty).unwrap();
            let layout = KvLayout::new(kv_ty.k().ggml_type(), kd, cells, 0).unwrap();
            let mut ring = dev.kv_alloc(layout).unwrap();
            let mut cpu_ring = cpu.kv_alloc(layout).unwrap();
            let p = KOnlyAttnParams {
                n_head: nh,
                k_dim: kd,
                v_dim: vd,
                cells,
                scale: 0.01,
            };
            let mut pos0 = 0;
            for &n in batches {
                let keys = noise(n * kd);
                let q: Vec<f32> = noise(n * nh * kd).iter().map(|v| v * 0.05).collect();
                let want = attend(&cpu, &mut cpu_ring, &p, (&keys, &q), (n, pos0));
                let got = attend(&dev, &mut ring, &p, (&keys, &q), (n, pos0));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{ty} kd {kd} n {n} at {pos0} [{i}]: {g} vs {w}"
                    );
                }
                pos0 += n;
            }
        }
        // More positions than cells cannot be attended to.
        let p = KOnlyAttnParams {
            n_head: 1,
            k_dim: 24,
            v_dim: 16,
            cells: 4,
            scale: 1.0,
        };
        let q = dev.alloc::<f32>(24).unwrap();
        let ring = dev
            .kv_alloc(KvLayout::new(GgmlType::F16, 24, 4, 0).unwrap())
            .unwrap();
        let mut out = dev.alloc::<f32>(16).unwrap();
        assert!(dev.attention_k_only(&p, &q, &ring, 1, 4, &mut out).is_err());
        // Values that are not whole blocks of the ring's type are refused.
        let q8 = dev
            .kv_alloc(KvLayout::new(GgmlType::Q8_0, 32, 4, 0).unwrap())
            .unwrap();
        let p8 = KOnlyAttnParams { k_dim: 32, ..p };
        let q32 = dev.alloc::<f32>(32).unwrap();
        assert!(dev
            .attention_k_only(&p8, &q32, &q8, 1, 0, &mut out)
            .is_err());
    }

    fn tiny() -> GgufModel {
        let path = hmoe_testdata::fixture("deepseek2/deepseek2-tiny.gguf");
        GgufModel::open(&path, Default::default()).unwrap()
    }

    /// The routed SiLU experts of layer 1 (several slots per expert), the shared experts and
    /// the leading dense layer's SwiGLU FFN (`matmul`, `swiglu`, `matmul`) over the
    /// fixture's weights, on `dev`.
    fn silu_ffns<B: Backend>(dev: &B, g: &GgufModel, h: &[f32]) -> Vec<Vec<f32>> {
        let p = Deepseek2Params::from_metadata(g.metadata(), n_vocab(g).unwrap()).unwrap();
        let (d, ne, k) = (p.n_embd, p.n_expert, p.routing.k);
        let n = h.len() / d;
        let shape = ExpertShape {
            n_embd: d,
            n_ff: p.n_ff_exp,
            n_expert: ne,
            biases: false,
        };
        let e = ExpertWeights::load(g, 1, &shape).unwrap();
        let moe = dev.upload_moe(&e.tensors(g), None).unwrap();
        // Token t takes experts 3t .. 3t + k: neighbours share experts.
        let sel: Vec<i32> = (0..n)
            .flat_map(|t| (0..k).map(move |s| ((3 * t + s) % ne) as i32))
            .collect();
        let w: Vec<f32> = (0..n * k).map(|i| 0.1 + (i % 5) as f32 * 0.2).collect();
        let (hd, sd, wd) = (
            dev.upload(h).unwrap(),
            dev.upload(&sel).unwrap(),
            dev.upload(&w).unwrap(),
        );
        let mut out = dev.alloc::<f32>(n * d).unwrap();
        dev.moe(&moe, GatedAct::Silu, &hd, &sd, &wd, k, &mut out)
            .unwrap();
        let mut outs = vec![dev.download(&out).unwrap()];
        for (l, suffix) in [(1, "_shexp"), (0, "")] {
            let up_m = |m: &str| {
                let info = g
                    .tensor_info(&format!("blk.{l}.ffn_{m}{suffix}.weight"))
                    .unwrap();
                let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
                let m = dev.upload_matrix(info.ty, rows, cols, g.data_of(info));
                (m.unwrap(), rows)
            };
            let ((gm, ff), (um, _), (dm, _)) = (up_m("gate"), up_m("up"), up_m("down"));
            let mut gt = dev.alloc::<f32>(n * ff).unwrap();
            let mut ut = dev.alloc::<f32>(n * ff).unwrap();
            dev.matmul(&um, &hd, n, &mut ut).unwrap();
            dev.matmul(&gm, &hd, n, &mut gt).unwrap();
            dev.swiglu(&mut gt, &ut, ff).unwrap();
            let mut y = dev.alloc::<f32>(n * d).unwrap();
            dev.matmul(&dm, &gt, n, &mut y).unwrap();
            outs.push(dev.download(&y).unwrap());
        }
        outs
    }

    /// On the fixture's weights, the reference device's bias-less SiLU experts (F32
    /// products in `vec_dot` order, several slots per expert) and its dense SwiGLU FFN are
    /// the CPU's bit for bit.
    #[test]
    fn ref0_silu_experts_and_dense_swiglu_are_the_cpus_bit_for_bit() {
        let g = tiny();
        let d = g.metadata().get_u64("deepseek2.embedding_length").unwrap() as usize;
        let h: Vec<f32> = (0..7 * d)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.5)
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = silu_ffns(&hmoe_cpu::Cpu::new(), &g, &h);
        let got = silu_ffns(&hmoe_backend::Ref0::new(), &g, &h);
        for (i, what) in ["routed experts", "shared experts", "dense FFN"]
            .iter()
            .enumerate()
        {
            assert_eq!(bits(&got[i]), bits(&want[i]), "{what}");
        }
    }
}
