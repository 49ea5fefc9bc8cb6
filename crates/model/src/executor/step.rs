//! The contract between the executor and an architecture: the layers an architecture writes
//! ([`DeviceLayers`], with the sizes the executor needs, [`ModelDims`]) and the micro-batch in
//! flight that a layer runs its ops through ([`Step`]: the device, the batch's rows per
//! sequence, their positions and device caches).

use std::ops::Range;

use hmoe_backend::KvType;
use hmoe_backend::{AttnParams, Backend, ExpertTensors, KOnlyAttnParams};
use hmoe_gguf::GgufModel;

use super::device_kv::{KvWidths, LayerKv};
use super::device_weights::DevMat;
use super::layer_experts::LayerExperts;
use super::micro_batches::StepState;
use super::routing::{Gating, Router};
use super::scratch_arena::{span, ArenaElem, Scratch, ScratchArena};
use super::segments::Segments;
use crate::error::ModelError;
use crate::language_model::LogitsWanted;
use crate::sequence::KvCache;

/// One sequence's share of a micro-batch.
pub(crate) struct Member<'t> {
    /// Its device cache's index in the state's `kvs`.
    pub(crate) kv: usize,
    /// The position of its first token.
    pub(crate) pos0: usize,
    pub(crate) tokens: &'t [u32],
    /// The logits it wants (`None`: none).
    pub(crate) want: Option<LogitsWanted>,
    /// For a last token's logits: its `k` best alone will do (`Backend::top_k`).
    pub(crate) top: Option<usize>,
}

/// A block's output not yet added to the hidden state it was computed from: the next block's
/// norm adds it ([`Step::rms_norm`]), so that a device can run the residual add and the norm
/// as one kernel.
#[must_use = "a block's output must be added to the hidden state"]
pub(crate) struct Residual<'s, B: Backend>(pub(crate) Scratch<'s, B, f32>);

/// One architecture's layers on a device, written in the architecture's file over the
/// contract's ops and the shared blocks of `layer_blocks`; the executor runs them.
pub(crate) trait DeviceLayers<B: Backend>: Send + Sync {
    /// The sizes the executor needs.
    fn dims(&self) -> ModelDims;
    /// The file(s) the weights live in.
    fn gguf(&self) -> &GgufModel;
    /// A cache handle for the device: positions and the ring geometry (cells per
    /// layer), no keys or values.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache;
    /// Floats of K and of V per cell of layer `layer`'s cache.
    fn kv_widths(&self, layer: usize) -> KvWidths;
    /// Layer `layer` over the micro-batch's hidden state `x` (`n × n_embd`), in place, the
    /// previous layer's output `pending` added first (by its first norm, [`Step::rms_norm`]):
    /// returns its own output, for the next layer (or, after the last, the executor) to add;
    /// `None` where the last layer added it to the rows it narrowed to ([`Step::feed_forward`]).
    fn layer<'s>(
        &self,
        cx: &mut Step<'s, B>,
        layer: usize,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
    ) -> Result<Option<Residual<'s, B>>, ModelError>;
    /// The routed experts of layer `layer` as the file stores them (`None`: a layer without).
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>>;
    /// Bytes of the layers' weights on the device (the routed experts not included).
    fn weight_bytes(&self) -> u64;
}

/// The sizes of a model the executor needs from its architecture.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ModelDims {
    /// Layers.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    /// Epsilon of the output norm.
    pub rms_eps: f32,
    /// Floats of one layer's scratch buffers per token of a micro-batch.
    pub scratch_per_token: usize,
    /// Values per K/V head in the cache (what quantized caches rotate and must hold whole
    /// blocks of).
    pub kv_head_dim: usize,
}

/// One micro-batch in flight: what a [`DeviceLayers::layer`] runs its ops through (the
/// device, the batch's rows per sequence, their positions and device caches, the experts).
pub(crate) struct Step<'s, B: Backend> {
    pub(crate) dev: &'s B,
    pub(crate) arch: &'s dyn DeviceLayers<B>,
    pub(crate) experts: &'s LayerExperts<B>,
    /// The executor's state: the step's own, or its group's turn of two micro-batches in
    /// flight (`micro_batches.rs`).
    pub(crate) st: StepState<'s, B>,
    pub(crate) members: &'s [Member<'s>],
    pub(crate) groups: Vec<Range<usize>>,
    /// Per member, the rows of the micro-batch whose final hidden state it wants
    /// ([`wanted_rows`] of the step's first `groups`).
    pub(crate) wanted: Vec<Option<Range<usize>>>,
    pub(crate) pos: Scratch<'s, B, i32>,
    /// Where the step's temporaries come from (`scratch_arena.rs`).
    pub(crate) arena: &'s ScratchArena<B>,
    /// Whether host layers run on the device for this batch (op offload).
    pub(crate) offload: bool,
    /// Whether the last layer's host experts run on the device: op offload decided by the
    /// rows that layer's feed-forward block multiplies ([`Step::last_layer_rows`]), as
    /// llama.cpp decides it per op by its batch.
    pub(crate) offload_last: bool,
    /// The first slice of the next host layer's experts (the layer, its experts), uploading
    /// while the layers before it run (op offload's ring, `offload_ring.rs`).
    pub(crate) prefetched: Option<(usize, usize, B::Moe)>,
    /// The step's recorded segments (`segments.rs`): a host layer closes one before its
    /// copy down and opens the next after its copy up.
    pub(crate) segments: Segments,
    /// The final hidden state of the rows the members want, where the last layer ran its
    /// feed-forward block on those rows alone ([`Step::narrow_to_outputs`]).
    pub(crate) narrowed: Option<Scratch<'s, B, f32>>,
}

/// The rows of a micro-batch (its members' `groups`) whose final hidden state the members
/// want: every row of one that wants [`LogitsWanted::All`] or [`LogitsWanted::Hidden`], the
/// last of one that wants [`LogitsWanted::Last`], none for one that wants nothing.
pub(crate) fn wanted_rows(
    members: &[Member<'_>],
    groups: &[Range<usize>],
) -> Vec<Option<Range<usize>>> {
    members
        .iter()
        .zip(groups)
        .map(|(m, g)| match m.want {
            None => None,
            Some(LogitsWanted::All | LogitsWanted::Hidden) => Some(g.clone()),
            Some(LogitsWanted::Last) => Some(g.end - 1..g.end),
        })
        .collect()
}

/// `wanted` ([`wanted_rows`]) packed one after another from row 0, in member order: where
/// the wanted rows lie once gathered.
pub(crate) fn packed_rows(wanted: &[Option<Range<usize>>]) -> Vec<Option<Range<usize>>> {
    let mut at = 0;
    wanted
        .iter()
        .map(|w| {
            w.as_ref().map(|r| {
                at += r.len();
                at - r.len()..at
            })
        })
        .collect()
}

/// The shape of one attention call, less the cache's cells (the executor's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// K/V heads.
    pub n_head_kv: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// Sliding window (`None`: causal over everything).
    pub window: Option<usize>,
    /// Score scale.
    pub scale: f32,
    /// Chains of one token's value sum ([`AttnParams::value_chains`]): 1 as the CPU's gpt-oss
    /// attention, 4 as its `attention_ext` (Llama-style blocks, Qwen3-MoE).
    pub value_chains: usize,
}

impl<'s, B: Backend> Step<'s, B> {
    /// The device.
    pub(crate) fn dev(&self) -> &'s B {
        self.dev
    }

    /// Tokens in the micro-batch.
    pub(crate) fn n_tokens(&self) -> usize {
        self.groups.last().map_or(0, |g| g.end)
    }

    /// Each token's position.
    pub(crate) fn positions(&self) -> &B::Buf<i32> {
        &self.pos
    }

    /// Before the last layer's feed-forward block: where the members want the final hidden
    /// state of only some rows ([`wanted_rows`]: a prompt's last token), those rows of `x`
    /// (after attention and its residual add) gathered into a buffer, the step narrowed to
    /// them (one group per member that wants any: the groups no longer follow the members),
    /// as llama.cpp skips the unused rows of its
    /// last layer (`inp_out_ids`, `ggml_get_rows` before the FFN). The block then multiplies
    /// only those rows together, which gives llama.cpp's bits where the order of a product
    /// depends on the rows it multiplies (F32 routers in tinyBLAS's order for two rows or
    /// more, `vec_dot` for one). `None` (nothing changed) where every row is wanted or none.
    fn narrow_to_outputs(
        &mut self,
        x: &B::Buf<f32>,
    ) -> Result<Option<Scratch<'s, B, f32>>, ModelError> {
        let n = self.n_tokens();
        let n_rows = self.last_layer_rows();
        if n_rows == n {
            return Ok(None);
        }
        let d = B::buf_len(x) / n;
        let mut rows = self.arena.take::<f32>(self.dev, n_rows * d)?;
        let packed = packed_rows(&self.wanted);
        for (r, p) in self.wanted.iter().zip(&packed) {
            if let (Some(r), Some(p)) = (r, p) {
                self.dev
                    .copy_rows(x, &mut rows, &span(r.start * d, r.len() * d, p.start * d))?;
            }
        }
        self.groups = packed.into_iter().flatten().collect();
        Ok(Some(rows))
    }

    /// The rows the last layer's feed-forward block multiplies (before it narrows the step):
    /// the wanted ones ([`wanted_rows`]), or every row where the members want all or none.
    pub(crate) fn last_layer_rows(&self) -> usize {
        let wanted: usize = self.wanted.iter().flatten().map(|r| r.len()).sum();
        match wanted {
            0 => self.n_tokens(),
            w => w,
        }
    }

    /// Runs a layer's feed-forward block `ffn` over the hidden state `x`, handing it the
    /// attention block's output still to be added ([`Residual`], which its norm adds:
    /// [`Step::rms_norm`]); returns the block's output, for the next layer to add. In the
    /// model's last layer the attention's output is added to every row first; where the
    /// members want some rows alone ([`Step::narrow_to_outputs`]), the block runs over those,
    /// which the logits then read, and its output is added to them here (`None` returned).
    pub(crate) fn feed_forward(
        &mut self,
        last: bool,
        x: &mut B::Buf<f32>,
        attn_out: Residual<'s, B>,
        ffn: impl FnOnce(
            &mut Self,
            &mut B::Buf<f32>,
            Option<Residual<'s, B>>,
        ) -> Result<Residual<'s, B>, ModelError>,
    ) -> Result<Option<Residual<'s, B>>, ModelError> {
        if !last {
            return ffn(self, x, Some(attn_out)).map(Some);
        }
        self.dev.add_assign(x, &attn_out.0)?;
        if let Some(mut rows) = self.narrow_to_outputs(x)? {
            self.offload = self.offload_last;
            let out = ffn(self, &mut rows, None)?;
            self.dev.add_assign(&mut rows, &out.0)?;
            self.narrowed = Some(rows);
            return Ok(None);
        }
        ffn(self, x, None).map(Some)
    }

    /// RMSNorm of the hidden state `x` (times `weight`) into `out`, after adding the block
    /// output `pending` to it where there is one (one op: [`Backend::add_rms_norm`]).
    pub(crate) fn rms_norm(
        &self,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
        weight: &B::Buf<f32>,
        eps: f32,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        match pending {
            Some(y) => self.dev.add_rms_norm(x, &y.0, weight, eps, out)?,
            None => self.dev.rms_norm(x, weight, eps, out)?,
        }
        Ok(())
    }

    /// A scratch buffer of `width` floats per token, from the step's arena: its contents are
    /// unspecified, the op that writes it overwrites it whole.
    pub(crate) fn alloc(&self, width: usize) -> Result<Scratch<'s, B, f32>, ModelError> {
        self.scratch(self.n_tokens() * width)
    }

    /// A scratch buffer of `len` elements from the step's arena (contents unspecified).
    pub(crate) fn scratch<T: ArenaElem>(
        &self,
        len: usize,
    ) -> Result<Scratch<'s, B, T>, ModelError> {
        Ok(self.arena.take::<T>(self.dev, len)?)
    }

    /// `y = W·x` over the micro-batch, per sequence for weights that need it ([`DevMat`]).
    pub(crate) fn matmul(
        &self,
        w: &DevMat<B>,
        x: &B::Buf<f32>,
        y: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        w.mul(self.dev, self.arena, x, &self.groups, y)
    }

    /// `ys[i] = ws[i]·x + biases[i]` over the micro-batch for matrices of the same input
    /// ([`DevMat::mul_shared`]).
    pub(crate) fn matmul_shared(
        &self,
        ws: &[&DevMat<B>],
        biases: &[Option<&B::Buf<f32>>],
        x: &B::Buf<f32>,
        ys: &mut [&mut B::Buf<f32>],
    ) -> Result<(), ModelError> {
        DevMat::mul_shared(ws, biases, self.dev, self.arena, x, &self.groups, ys)
    }

    /// The router's logits `scores = w·h + bias` over the micro-batch, then `router`'s choice
    /// of experts `sel` and their weights `wts` from them: one op for top-k + softmax gating
    /// where the product runs over the whole batch ([`Backend::router_top_k_logits`], which a
    /// device may run as one kernel), else [`Step::matmul_shared`] then [`Router::route`].
    pub(crate) fn route(
        &self,
        router: &Router,
        (w, bias): (&DevMat<B>, Option<&B::Buf<f32>>),
        h: &B::Buf<f32>,
        scores: &mut B::Buf<f32>,
        (sel, wts): (&mut B::Buf<i32>, &mut B::Buf<f32>),
    ) -> Result<(), ModelError> {
        if matches!(router.gating, Gating::TopKSoftmax) && w.whole_batch(&self.groups) {
            let (n, shape) = (self.n_tokens(), (router.n_expert, router.k));
            let dev = self.dev;
            return Ok(dev.router_top_k_logits(&w.m, bias, h, n, shape, scores, sel, wts)?);
        }
        self.matmul_shared(&[w], &[bias], h, &mut [&mut *scores])?;
        Ok(router.route(self.dev, scores, None, sel, wts)?)
    }

    /// RMSNorm of the hidden state `x` (times `weight`, epsilon `eps`) into `h`, after adding
    /// the block output `pending` where there is one ([`Step::rms_norm`]), then `ys[i] =
    /// ws[i]·h + biases[i]` ([`Step::matmul_shared`]): one op
    /// ([`Backend::norm_matmul_shared`], whose device may convert the products' activations
    /// in the norm's kernel) where the product is one batch ([`DevMat::whole_batch`] of every
    /// matrix), else those two.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_matmul_shared(
        &self,
        x: &mut B::Buf<f32>,
        pending: Option<Residual<'s, B>>,
        (weight, eps): (&B::Buf<f32>, f32),
        h: &mut B::Buf<f32>,
        ws: &[&DevMat<B>],
        biases: &[Option<&B::Buf<f32>>],
        ys: &mut [&mut B::Buf<f32>],
    ) -> Result<(), ModelError> {
        if !ws.iter().all(|w| w.whole_batch(&self.groups)) {
            self.rms_norm(x, pending, weight, eps, h)?;
            return self.matmul_shared(ws, biases, h, ys);
        }
        let ms: Vec<&B::Matrix> = ws.iter().map(|w| &w.m).collect();
        let pending = pending.as_ref().map(|y| &*y.0);
        let n = self.n_tokens();
        let norm = (weight, eps);
        Ok((self.dev).norm_matmul_shared(x, pending, norm, h, &ms, biases, n, ys)?)
    }

    /// Stores the batch's keys `k` and values `v` in layer `layer`'s cache of each sequence
    /// and attends each sequence's queries `q` over it (with a sink logit per head when
    /// `sinks` is given) into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &mut self,
        layer: usize,
        shape: &AttnShape,
        q: &B::Buf<f32>,
        k: &B::Buf<f32>,
        v: &B::Buf<f32>,
        sinks: Option<&B::Buf<f32>>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let (dev, arena) = (self.dev(), self.arena);
        let hd = shape.head_dim;
        let (qw, kvw) = (shape.n_head * hd, shape.n_head_kv * hd);
        let single = self.members.len() == 1;
        for (m, g) in self.members.iter().zip(&self.groups) {
            let (kv, flash) = (self.st.kvs.get_mut(m.kv))
                .and_then(|kv| {
                    let flash = kv.ty.flash_attn();
                    kv.layers.get_mut(layer).map(|l| (l, flash))
                })
                .ok_or_else(|| ModelError::Cache("no device cache for this layer".into()))?;
            let LayerKv {
                k: k_ring,
                v: Some(v_ring),
            } = kv
            else {
                return Err(ModelError::Cache("a K-only cache for K/V attention".into()));
            };
            let ap = AttnParams {
                n_head: shape.n_head,
                n_head_kv: shape.n_head_kv,
                head_dim: hd,
                cells: k_ring.layout.cells,
                window: shape.window,
                scale: shape.scale,
                value_chains: shape.value_chains,
                flash,
            };
            // The member's first position is read on the device, from the step's positions.
            let (nt, pos, at) = (g.len(), &*self.pos, g.start);
            if single {
                dev.kv_store_pair_at((k, k_ring), (v, v_ring), nt, pos, at)?;
                dev.attention_at(&ap, q, k_ring, v_ring, sinks, nt, pos, at, out)?;
                continue;
            }
            let ks = arena.slice(dev, k, g.start * kvw..g.end * kvw)?;
            let vs = arena.slice(dev, v, g.start * kvw..g.end * kvw)?;
            let qs = arena.slice(dev, q, g.start * qw..g.end * qw)?;
            dev.kv_store_pair_at((&ks, k_ring), (&vs, v_ring), nt, pos, at)?;
            let mut a = arena.take::<f32>(dev, nt * qw)?;
            dev.attention_at(&ap, &qs, k_ring, v_ring, sinks, nt, pos, at, &mut a)?;
            dev.copy_rows(&a, out, &span(0, nt * qw, g.start * qw))?;
        }
        Ok(())
    }

    /// One matrix per head ([`Backend::matmul_heads`]) over the micro-batch: per sequence
    /// for weights whose products go per sequence ([`DevMat`]) when every head's input is its
    /// whole row (then the order depends on the rows multiplied together).
    pub(crate) fn matmul_heads(
        &self,
        w: &DevMat<B>,
        x: &B::Buf<f32>,
        n_heads: usize,
        x_stride: usize,
        y: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        w.mul_heads(self.dev, self.arena, x, &self.groups, n_heads, x_stride, y)
    }

    /// Stores the batch's keys `k` (`p.k_dim` a token) in layer `layer`'s K-only cache of
    /// each sequence and attends each sequence's queries `q` over it
    /// ([`Backend::attention_k_only`]; `p.cells` is taken from the cache) into `out`.
    pub(crate) fn attend_k_only(
        &mut self,
        layer: usize,
        p: &KOnlyAttnParams,
        q: &B::Buf<f32>,
        k: &B::Buf<f32>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let (dev, arena) = (self.dev(), self.arena);
        let (qw, kw, ow) = (p.n_head * p.k_dim, p.k_dim, p.n_head * p.v_dim);
        let single = self.members.len() == 1;
        for (m, g) in self.members.iter().zip(&self.groups) {
            let kv = (self.st.kvs.get_mut(m.kv))
                .and_then(|kv| kv.layers.get_mut(layer))
                .ok_or_else(|| ModelError::Cache("no device cache for this layer".into()))?;
            let ap = KOnlyAttnParams {
                cells: kv.k.layout.cells,
                ..*p
            };
            let (nt, pos, at) = (g.len(), &*self.pos, g.start);
            if single {
                dev.kv_store_at(k, &mut kv.k, nt, pos, at)?;
                dev.attention_k_only_at(&ap, q, &kv.k, nt, pos, at, out)?;
                continue;
            }
            let ks = arena.slice(dev, k, g.start * kw..g.end * kw)?;
            let qs = arena.slice(dev, q, g.start * qw..g.end * qw)?;
            dev.kv_store_at(&ks, &mut kv.k, nt, pos, at)?;
            let mut a = arena.take::<f32>(dev, nt * ow)?;
            dev.attention_k_only_at(&ap, &qs, &kv.k, nt, pos, at, &mut a)?;
            dev.copy_rows(&a, out, &span(0, nt * ow, g.start * ow))?;
        }
        Ok(())
    }
}
