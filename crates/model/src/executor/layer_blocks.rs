//! The blocks the architectures' device layers are made of, written once over the contract:
//! the attention block, the routed-MoE block and the dense SwiGLU FFN. Each loads its weights by the usual GGUF
//! names of layer `l` (optional tensors used when the file has them) and runs over one
//! micro-batch through the executor's [`Step`].

use hmoe_backend::{Backend, GatedAct, RopeParams};
use hmoe_gguf::GgufModel;

use hmoe_backend::ExpertTensors;
use hmoe_backend::KvType;

use super::device_kv::KvWidths;
use super::device_weights::{buf_bytes, upload_f32, upload_f32_opt, upload_matrix, DevMat};
use super::routing::{ExpertSplit, Routed, Router};
use super::step::{AttnShape, DeviceLayers, ModelDims, Residual, Step};
use crate::archs::rope::RopeMode;
use crate::error::ModelError;
use crate::sequence::KvCache;
use crate::weights::{ExpertShape, ExpertWeights};

/// Bytes of the optional f32 tensors `bufs`.
fn bufs_bytes<B: Backend>(bufs: &[Option<&B::Buf<f32>>]) -> u64 {
    bufs.iter().flatten().map(|b| buf_bytes::<B>(b)).sum()
}

/// What an attention block is, beside its weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttnSpec {
    /// Hidden size.
    pub n_embd: usize,
    /// Heads, window and scale of the attention.
    pub shape: AttnShape,
    /// RoPE (NeoX layout unless [`AttnBlock::with_rope_mode`] says otherwise).
    pub rope: RopeParams,
    /// Epsilon of the block's norms.
    pub rms_eps: f32,
}

/// Grouped-query self-attention of one layer with its residual add:
/// `x += Wo · attention(rope(qnorm(Wq·h + bq)), rope(knorm(Wk·h + bk)), Wv·h + bv; sinks) + bo`,
/// `h = rmsnorm(x) · attn_norm`. Biases, the per-head q/k norms and the sinks are optional.
pub(crate) struct AttnBlock<B: Backend> {
    spec: AttnSpec,
    norm: B::Buf<f32>,
    wq: DevMat<B>,
    wk: DevMat<B>,
    wv: DevMat<B>,
    wo: DevMat<B>,
    bq: Option<B::Buf<f32>>,
    bk: Option<B::Buf<f32>>,
    bv: Option<B::Buf<f32>>,
    bo: Option<B::Buf<f32>>,
    q_norm: Option<B::Buf<f32>>,
    k_norm: Option<B::Buf<f32>>,
    sinks: Option<B::Buf<f32>>,
    rope_mode: RopeMode,
}

impl<B: Backend> AttnBlock<B> {
    /// The block with q and k rotated in `mode`'s layout over whole heads (NeoX when not
    /// set).
    pub(crate) fn with_rope_mode(mut self, mode: RopeMode) -> AttnBlock<B> {
        self.rope_mode = mode;
        self
    }

    /// Uploads layer `l`'s `attn_norm`, `attn_{q,k,v,output}` (weights and any biases),
    /// `attn_{q,k}_norm` and `attn_sinks` when present, each checked against `spec`'s shapes.
    pub(crate) fn load(
        dev: &B,
        g: &GgufModel,
        l: usize,
        spec: AttnSpec,
    ) -> Result<AttnBlock<B>, ModelError> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let s = &spec.shape;
        let (d, hd) = (spec.n_embd as u64, s.head_dim as u64);
        let (nq, nkv) = (s.n_head as u64 * hd, s.n_head_kv as u64 * hd);
        let m = |name: &str, shape: &[u64]| upload_matrix(dev, g, &n(name), shape);
        let o = |name: &str, len: u64| upload_f32_opt(dev, g, &n(name), &[len]);
        Ok(AttnBlock {
            norm: upload_f32(dev, g, &n("attn_norm.weight"), &[d])?,
            wq: m("attn_q.weight", &[d, nq])?,
            wk: m("attn_k.weight", &[d, nkv])?,
            wv: m("attn_v.weight", &[d, nkv])?,
            wo: m("attn_output.weight", &[nq, d])?,
            bq: o("attn_q.bias", nq)?,
            bk: o("attn_k.bias", nkv)?,
            bv: o("attn_v.bias", nkv)?,
            bo: o("attn_output.bias", d)?,
            q_norm: o("attn_q_norm.weight", hd)?,
            k_norm: o("attn_k_norm.weight", hd)?,
            sinks: o("attn_sinks.weight", s.n_head as u64)?,
            spec,
            rope_mode: RopeMode::Neox,
        })
    }

    /// Bytes of its weights on the device.
    pub(crate) fn bytes(&self) -> u64 {
        let mats = [&self.wq, &self.wk, &self.wv, &self.wo];
        mats.iter().map(|m| m.bytes()).sum::<u64>()
            + bufs_bytes::<B>(&[
                Some(&self.norm),
                self.bq.as_ref(),
                self.bk.as_ref(),
                self.bv.as_ref(),
                self.bo.as_ref(),
                self.q_norm.as_ref(),
                self.k_norm.as_ref(),
                self.sinks.as_ref(),
            ])
    }

    /// Floats per token of the block's scratch buffers.
    pub(crate) fn scratch_per_token(&self, n_embd: usize) -> usize {
        let s = &self.spec.shape;
        let (qw, kvw) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
        3 * n_embd + 2 * qw + 2 * kvw
    }

    /// Floats of K and of V per cell of the block's cache.
    pub(crate) fn kv_widths(&self) -> KvWidths {
        let s = &self.spec.shape;
        let w = s.n_head_kv * s.head_dim;
        KvWidths { k: w, v: w }
    }

    /// The block over the micro-batch `x` of layer `layer`, the previous block's output
    /// `pending` added to `x` first (by its norm): its own output, which the next block's norm
    /// adds to `x` (the residual add).
    pub(crate) fn forward<'s>(
        &self,
        cx: &mut Step<'s, B>,
        layer: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Residual<'s, B>, ModelError> {
        let dev = cx.dev();
        let AttnSpec { shape, rope, .. } = self.spec;
        let hd = shape.head_dim;
        let (qw, kvw) = (shape.n_head * hd, shape.n_head_kv * hd);
        let d = x_width::<B>(x, cx);
        let mut h = cx.alloc(d)?;
        let (mut q, mut k, mut v) = (cx.alloc(qw)?, cx.alloc(kvw)?, cx.alloc(kvw)?);
        let qkv = [&self.wq, &self.wk, &self.wv];
        let biases = [self.bq.as_ref(), self.bk.as_ref(), self.bv.as_ref()];
        let norm = (&self.norm, self.spec.rms_eps);
        let out = &mut [&mut *q, &mut *k, &mut *v];
        // h = rmsnorm(x) · attn_norm; q, k, v = Wq·h + bq, Wk·h + bk, Wv·h + bv.
        cx.norm_matmul_shared(x, pending, norm, &mut h, &qkv, &biases, out)?;
        // Per-head RMSNorm: rows of the weight's length (one head), into a new buffer that
        // then stands for the raw one.
        for (t, norm, width) in [(&mut q, &self.q_norm, qw), (&mut k, &self.k_norm, kvw)] {
            if let Some(norm) = norm {
                let mut normed = cx.alloc(width)?;
                dev.rms_norm(&**t, norm, self.spec.rms_eps, &mut normed)?;
                *t = normed;
            }
        }
        let heads = (shape.n_head, shape.n_head_kv);
        match self.rope_mode {
            RopeMode::Neox => dev.rope_neox_qk(&mut q, &mut k, cx.positions(), heads, hd, &rope)?,
            RopeMode::Norm => {
                dev.rope_norm(&mut q, cx.positions(), heads.0, hd, 0, &rope)?;
                dev.rope_norm(&mut k, cx.positions(), heads.1, hd, 0, &rope)?;
            }
        }
        let mut att = cx.alloc(qw)?;
        cx.attend(layer, &shape, &q, &k, &v, self.sinks.as_ref(), &mut att)?;
        let mut o = cx.alloc(d)?;
        cx.matmul_shared(&[&self.wo], &[self.bo.as_ref()], &att, &mut [&mut o])?;
        Ok(Residual(o))
    }
}

/// Floats per token of the micro-batch's hidden state `x`.
fn x_width<B: Backend>(x: &B::Buf<f32>, cx: &Step<'_, B>) -> usize {
    B::buf_len(x) / cx.n_tokens().max(1)
}

/// What a routed-MoE block is, beside its weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct MoeSpec {
    /// Hidden size.
    pub n_embd: usize,
    /// The router: experts, top-k and gating.
    pub router: Router,
    /// The experts' gated activation.
    pub act: GatedAct,
    /// Which rows the CPU multiplies together by F32 experts.
    pub split: ExpertSplit,
    /// Epsilon of the block's norm.
    pub rms_eps: f32,
}

/// The routed experts of one layer with their norm, router and residual add:
/// `x += Σ_k w_k · expert_k(h)`, `h = rmsnorm(x) · norm`, the experts and weights chosen by the
/// router from `Wr·h + br`; the experts run wherever the placement puts them ([`Step::experts`]).
pub(crate) struct MoeBlock<B: Backend> {
    spec: MoeSpec,
    norm: B::Buf<f32>,
    router: DevMat<B>,
    router_b: Option<B::Buf<f32>>,
}

impl<B: Backend> MoeBlock<B> {
    /// Uploads layer `l`'s norm `norm_name` and `ffn_gate_inp` (weight and any bias), checked
    /// against `spec`'s shapes; the experts are the executor's.
    pub(crate) fn load(
        dev: &B,
        g: &GgufModel,
        l: usize,
        norm_name: &str,
        spec: MoeSpec,
    ) -> Result<MoeBlock<B>, ModelError> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let (d, ne) = (spec.n_embd as u64, spec.router.n_expert as u64);
        Ok(MoeBlock {
            norm: upload_f32(dev, g, &n(norm_name), &[d])?,
            router: upload_matrix(dev, g, &n("ffn_gate_inp.weight"), &[d, ne])?,
            router_b: upload_f32_opt(dev, g, &n("ffn_gate_inp.bias"), &[ne])?,
            spec,
        })
    }

    /// Bytes of its weights on the device (the experts not included).
    pub(crate) fn bytes(&self) -> u64 {
        self.router.bytes() + bufs_bytes::<B>(&[Some(&self.norm), self.router_b.as_ref()])
    }

    /// Floats per token of the block's scratch buffers.
    pub(crate) fn scratch_per_token(&self, n_embd: usize) -> usize {
        2 * n_embd + self.spec.router.n_expert + 2 * self.spec.router.k
    }

    /// The block over the micro-batch `x` of layer `layer`, the previous block's output
    /// `pending` added to `x` first (by its norm): its own output, for the next block to add.
    pub(crate) fn forward<'s>(
        &self,
        cx: &mut Step<'s, B>,
        layer: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Residual<'s, B>, ModelError> {
        let MoeSpec {
            router,
            act,
            split,
            rms_eps,
            ..
        } = self.spec;
        let n = cx.n_tokens();
        let d = x_width::<B>(x, cx);
        let mut h = cx.alloc(d)?;
        cx.rms_norm(x, pending, &self.norm, rms_eps, &mut h)?;
        let mut scores = cx.alloc(router.n_expert)?;
        let mut sel = cx.scratch::<i32>(n * router.k)?;
        let mut wts = cx.scratch::<f32>(n * router.k)?;
        let wr = (&self.router, self.router_b.as_ref());
        cx.route(&router, wr, &h, &mut scores, (&mut sel, &mut wts))?;
        let routed = Routed {
            h: &*h,
            scores: &*scores,
            bias: None,
            sel: &*sel,
            wts: &*wts,
            router,
            act,
            split,
        };
        let mut moe = cx.alloc(d)?;
        cx.experts(layer, &routed, &mut moe)?;
        Ok(Residual(moe))
    }
}

/// What one layer of an [`AttnMoeLayers`] stack is: its attention block, its MoE block with
/// the name of the MoE block's norm, and the size of its routed experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttnMoeSpec<'n> {
    /// The attention block.
    pub attn: AttnSpec,
    /// The MoE block.
    pub moe: MoeSpec,
    /// The tensor name of the MoE block's norm in the layer (`ffn_norm.weight`).
    pub moe_norm: &'n str,
    /// Hidden values of each expert.
    pub n_ff: usize,
    /// Whether the experts have biases.
    pub expert_biases: bool,
}

/// A stack of layers that are each an [`AttnBlock`] then a [`MoeBlock`] (gpt-oss, Qwen3-MoE),
/// with each layer's routed experts as the file stores them: what their layers share.
pub(crate) struct AttnMoeLayers<B: Backend> {
    layers: Vec<(AttnBlock<B>, MoeBlock<B>)>,
    experts: Vec<ExpertWeights>,
}

impl<B: Backend> AttnMoeLayers<B> {
    /// No layers yet, room for `n`.
    pub(crate) fn with_capacity(n: usize) -> AttnMoeLayers<B> {
        AttnMoeLayers {
            layers: Vec::with_capacity(n),
            experts: Vec::with_capacity(n),
        }
    }

    /// Loads layer `l` (the next) as `spec` says, every tensor checked against its shapes.
    pub(crate) fn push(
        &mut self,
        dev: &B,
        g: &GgufModel,
        l: usize,
        spec: &AttnMoeSpec<'_>,
    ) -> Result<(), ModelError> {
        let moe = spec.moe;
        let shape = ExpertShape {
            n_embd: moe.n_embd,
            n_ff: spec.n_ff,
            n_expert: moe.router.n_expert,
            biases: spec.expert_biases,
        };
        self.experts.push(ExpertWeights::load(g, l, &shape)?);
        self.layers.push((
            AttnBlock::load(dev, g, l, spec.attn)?,
            MoeBlock::load(dev, g, l, spec.moe_norm, moe)?,
        ));
        Ok(())
    }

    /// The routed experts of layer `layer` as the file stores them.
    pub(crate) fn experts<'g>(
        &'g self,
        g: &'g GgufModel,
        layer: usize,
    ) -> Option<ExpertTensors<'g>> {
        Some(self.experts.get(layer)?.tensors(g))
    }

    /// Floats per token of one layer's scratch buffers (every layer has the same shapes).
    pub(crate) fn scratch_per_token(&self, n_embd: usize) -> usize {
        self.layers.first().map_or(0, |(a, m)| {
            a.scratch_per_token(n_embd) + m.scratch_per_token(n_embd)
        })
    }

    /// K and V row widths of layer `layer` (0, 0 past the last).
    pub(crate) fn kv_widths(&self, layer: usize) -> KvWidths {
        self.layers
            .get(layer)
            .map_or(KvWidths::default(), |(a, _)| a.kv_widths())
    }

    /// Layer `l` over the micro-batch `x`: attention, then the routed experts; in the last
    /// layer over the rows whose logits the members want alone ([`Step::feed_forward`]). As
    /// [`DeviceLayers::layer`]: `pending` the previous layer's output, returns its own.
    pub(crate) fn forward<'s>(
        &self,
        cx: &mut Step<'s, B>,
        l: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Option<Residual<'s, B>>, ModelError> {
        let (attn, moe) = &self.layers[l];
        let attn_out = attn.forward(cx, l, x, pending)?;
        let last = l + 1 == self.layers.len();
        cx.feed_forward(last, x, attn_out, |cx, x, attn_out| {
            moe.forward(cx, l, x, attn_out)
        })
    }

    /// Device bytes of every layer's weights.
    pub(crate) fn bytes(&self) -> u64 {
        self.layers.iter().map(|(a, m)| a.bytes() + m.bytes()).sum()
    }
}

/// A model whose every layer is an [`AttnBlock`] then a [`MoeBlock`] (gpt-oss, Qwen3-MoE),
/// as the executor runs it: its file, its sizes and its layers.
pub(crate) struct AttnMoeModel<B: Backend> {
    gguf: GgufModel,
    dims: ModelDims,
    layers: AttnMoeLayers<B>,
}

impl<B: Backend> AttnMoeModel<B> {
    /// The model of `layers` loaded from `gguf`, of sizes `dims`.
    pub(crate) fn new(gguf: GgufModel, dims: ModelDims, layers: AttnMoeLayers<B>) -> Self {
        AttnMoeModel { gguf, dims, layers }
    }
}

impl<B: Backend> DeviceLayers<B> for AttnMoeModel<B> {
    fn dims(&self) -> ModelDims {
        self.dims
    }
    fn gguf(&self) -> &GgufModel {
        &self.gguf
    }
    /// Positions and the ring geometry: a layer with a window keeps `window + n_ubatch` cells.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        let windows: Vec<_> = (self.layers.layers.iter())
            .map(|(a, _)| a.spec.shape.window)
            .collect();
        KvCache::new(ty, n_ctx, n_ubatch, &windows)
    }
    fn kv_widths(&self, layer: usize) -> KvWidths {
        self.layers.kv_widths(layer)
    }
    fn layer<'s>(
        &self,
        cx: &mut Step<'s, B>,
        l: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Option<Residual<'s, B>>, ModelError> {
        self.layers.forward(cx, l, x, pending)
    }
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>> {
        self.layers.experts(&self.gguf, layer)
    }
    fn weight_bytes(&self) -> u64 {
        self.layers.bytes()
    }
}

/// A dense SwiGLU feed-forward network, `Wd · (silu(Wg·h) ⊙ Wu·h)` (a dense layer's FFN, a
/// MoE layer's shared experts), as the CPU's `ffn_swiglu` computes it.
pub(crate) struct SwiGluFfn<B: Backend> {
    gate: DevMat<B>,
    up: DevMat<B>,
    down: DevMat<B>,
}

impl<B: Backend> SwiGluFfn<B> {
    /// Uploads layer `l`'s `ffn_{gate,up,down}{suffix}.weight` (`suffix`: `""`, or `"_shexp"`
    /// for shared experts) of `n_embd` inputs and `n_ff` hidden values.
    pub(crate) fn load(
        dev: &B,
        g: &GgufModel,
        l: usize,
        suffix: &str,
        n_embd: usize,
        n_ff: usize,
    ) -> Result<SwiGluFfn<B>, ModelError> {
        let (d, ff) = (n_embd as u64, n_ff as u64);
        let m = |s: &str, shape: &[u64]| {
            upload_matrix(dev, g, &format!("blk.{l}.ffn_{s}{suffix}.weight"), shape)
        };
        Ok(SwiGluFfn {
            gate: m("gate", &[d, ff])?,
            up: m("up", &[d, ff])?,
            down: m("down", &[ff, d])?,
        })
    }

    /// Bytes of its weights on the device.
    pub(crate) fn bytes(&self) -> u64 {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }

    /// Floats per token of its scratch buffers.
    pub(crate) fn scratch_per_token(&self) -> usize {
        2 * self.gate.rows + self.down.rows
    }

    /// `out = Wd · (silu(Wg·h) ⊙ Wu·h)` over the micro-batch.
    pub(crate) fn forward(
        &self,
        cx: &Step<'_, B>,
        h: &B::Buf<f32>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let ff = self.gate.rows;
        let (mut up, mut gate) = (cx.alloc(ff)?, cx.alloc(ff)?);
        cx.matmul_shared(
            &[&self.up, &self.gate],
            &[None, None],
            h,
            &mut [&mut up, &mut gate],
        )?;
        self.down(cx, &mut gate, &up, out)
    }

    /// [`SwiGluFfn::forward`] of `h = rmsnorm(x) · norm.0` (epsilon `norm.1`), the block output
    /// `pending` added to `x` first where there is one: a layer's norm and dense FFN, the norm
    /// and the up and gate products one op ([`Step::norm_matmul_shared`]).
    pub(crate) fn forward_normed<'s>(
        &self,
        cx: &Step<'s, B>,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
        norm: (&B::Buf<f32>, f32),
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let ff = self.gate.rows;
        let mut h = cx.alloc(self.gate.cols)?;
        let (mut up, mut gate) = (cx.alloc(ff)?, cx.alloc(ff)?);
        cx.norm_matmul_shared(
            x,
            pending,
            norm,
            &mut h,
            &[&self.up, &self.gate],
            &[None, None],
            &mut [&mut up, &mut gate],
        )?;
        self.down(cx, &mut gate, &up, out)
    }

    /// `out = Wd · (silu(gate) ⊙ up)`, `gate` overwritten.
    fn down(
        &self,
        cx: &Step<'_, B>,
        gate: &mut B::Buf<f32>,
        up: &B::Buf<f32>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        cx.dev().swiglu(gate, up, self.gate.rows)?;
        cx.matmul(&self.down, gate, out)
    }
}
