//! The device executor (issues #5 and #15): a model with the dense part of every layer on a
//! device of the contract ([`hmoe_backend::Backend`]: the CPU, a CUDA GPU, or the reference
//! device `REF0`) and each layer's routed experts where the placement puts them, for every
//! architecture. On the CPU ([`hmoe_cpu::Cpu`], [`crate::load`]) every layer's experts are
//! the device's and nothing crosses a bus.
//!
//! This file is the architecture-neutral part: [`DeviceModel`] (loaded by
//! [`DeviceModel::load`], which dispatches on `general.architecture`), the per-sequence device
//! K/V caches, micro-batching, batch invariance, the expert boundary, op offload and the
//! logits. Each architecture writes its layer in its own file over the contract's ops and the
//! shared blocks of [`blocks`] (the attention block, the routed-MoE block, the dense SwiGLU
//! FFN), and hands it to the executor as a [`DeviceLayers`] (`gpt_oss.rs`, `qwen3_moe.rs`,
//! `deepseek2.rs`, and `llama.rs` for the dense `llama`/`qwen2` files, which have no experts: every layer runs on
//! the device and nothing crosses the bus between the ids and the logits). The devices know no
//! architecture.
//!
//! Per micro-batch the token ids and positions go up (two small copies), the embedding rows
//! are gathered on the device, then every layer runs ([`DeviceLayers::layer`]); a layer's
//! routed experts run ([`Step::experts`]):
//!
//! - [`ExpertHome::Device`]: the `moe` op over the layer's experts, uploaded at load;
//! - [`ExpertHome::Host`]: one round trip. The normed hidden state, the chosen experts and
//!   their weights come down into the device's staging buffers (pinned on CUDA), the host runs
//!   the layer's experts over the file mapping with the CPU engine's own code
//!   ([`DeviceLayers::run_host_experts`]), and the weighted sum goes back up.
//!
//! After the last layer: output norm and head on the device, and the logits come down. With
//! every layer's experts on the device nothing crosses the bus between the ids and the logits.
//!
//! Numerics: the CPU engine's. Products convert activations as ggml does (Q8_0 blocks for
//! Q8_0/MXFP4 weights, f16/bf16 for F16/BF16) and sum Q8_0, MXFP4 and F32 products in the CPU
//! engine's order (REF0 multiplies the other types with the CPU engine's own kernels);
//! attention rounds the query and the probabilities to f16 and sums in the
//! CPU's orders with ggml's `expf` (one token's values in one 16-lane chain as its gpt-oss
//! attention, or in `vec_dot`'s four as its Qwen3/Llama-style attention: each architecture's
//! [`AttnShape::value_chains`]). On [`hmoe_backend::Ref0`] the logits are the CPU engine's
//! bit for bit on the fixtures. On a GPU what still differs is cuBLAS's order for batches of
//! F16/BF16 weights, the GPU's `cosf`/`sinf` in RoPE, the f64-rounded `expf` where the CPU
//! calls libm's, and F16/BF16 summation orders; on models whose routing is that sensitive
//! (the synthetic Q8_0/MXFP4 fixtures) a last bit can still flip an expert choice. With
//! flash attention (`-fa on`, and `auto`, the default) over f32/f16/bf16 values the CPU engine and REF0 run the chunked
//! flash kernel ([`AttnParams::flash`]), while the CUDA attention kernel still runs the row
//! kernel's algorithm for those values: the same softmax in another order, so GPU attention
//! differs there in the last bits as well (compared within 5e-3, never bit for bit).
//!
//! Several sequences at once ([`LanguageModel::forward_multi`], continuous batching): each
//! sequence has its own K/V cache on the device, and one micro-batch carries every sequence's
//! tokens, so a CPU-expert layer still makes one round trip per micro-batch. The result is
//! batch-invariant, as the CPU engine's: row-wise ops (embedding, norms, biases, RoPE with each
//! token's position, routing, Q8_0/MXFP4/F16/BF16 products) run over the whole micro-batch,
//! attention runs per sequence over its cache ([`Step::attend`]), and the products the CPU
//! engine sums in another order for a batch than for one token (F32 weights, Q4_0 and K-quant
//! weights, whose order depends on the batch's size: [`batch_order_varies`], and the experts
//! of a layer with F32 or K-quant experts, which the `moe` op sums by how many tokens route to
//! each: [`expert_order_varies`]) run
//! on exactly the rows the CPU engine gives them together ([`Step::matmul`],
//! [`ExpertSplit`]). On [`hmoe_backend::Ref0`] every sequence's logits are then the CPU
//! engine's bit for bit.
//!
//! Device caches: the [`KvCache`] that [`LanguageModel::new_cache`] hands out holds positions
//! and the ring geometry of the architecture's cache, no keys or values
//! ([`DeviceLayers::new_cache`]); the executor keeps one device cache per handle, told apart
//! by the handle's [`KvCache::id`], with the handle's cells per layer. A handle at position 0
//! starts a new sequence (its device cache is reallocated when its size differs); one that
//! went back ([`KvCache::truncate`]) continues from there; one ahead of what the device holds
//! is an error. The cache of a dropped handle is freed at the next step
//! ([`KvCache::watch`]). Beyond that, caches are freed by need: before a new sequence's cache
//! is allocated, the least recently used caches of sequences outside the step are freed until
//! the device has room for it and a micro-batch's scratch buffers
//! ([`DeviceModel::scratch_bytes`]), and again if the allocation still runs out of memory. A
//! handle whose cache was freed can only start again from position 0
//! ([`LanguageModel::cache_held`] tells). An owner of every live handle (the server's slots)
//! names them with [`LanguageModel::retain_caches`]: the caches of other handles are freed
//! then, and those of busy sequences are never freed to make room for another.
//!
//! Limits of this executor:
//! - **K/V types the device keeps** ([`Backend::supports_kv`]; REF0 every `-ctk`/`-ctv` pair),
//!   stored and read as the CPU engine's cache does ([`device_kv_layouts`]); a K-only cache
//!   (DeepSeek's latent cache) is f16. A cache of another type is an error (the CLI chooses
//!   the CPU engine then).
//! - **Op offload overlaps large batches only**: a micro-batch of at least the placement's
//!   `op_offload_min_batch` tokens runs a host layer on the device with the experts it routes
//!   to uploaded from the file mapping for that batch (on CUDA through pinned buffers that the
//!   CPU pool fills while the copy engine drains them, on the device's copy stream). When the
//!   batch routes to nearly every expert ([`PREFETCH_ROUTES_PER_EXPERT`]) every expert is
//!   uploaded, and the next host layer's upload starts as soon as this layer's MoE is queued,
//!   so that it overlaps this layer's compute; the device then holds two layers' experts,
//!   which it does only while its free memory has room for them ([`PREFETCH_RESERVE_BYTES`]
//!   more). Smaller batches wait for the routing and upload the chosen experts only.

pub(crate) mod blocks;
mod moe_cache;

pub use moe_cache::MoeCacheStats;

use std::ops::Range;
use std::sync::{Mutex, PoisonError, Weak};

use hmoe_backend::{
    AttnParams, Backend, BackendError, GatedAct, KOnlyAttnParams, KvLayout, KvRing, SharedBytes,
    TransferCounts,
};
use hmoe_gguf::GgufModel;
use hmoe_quant::GgmlType;

use crate::hybrid::ExpertTensors;
use crate::kv_cache::CacheType;
use crate::weights::{expect_tensor, load_f32};
use crate::{
    DeviceMemory, ExpertBatch, ExpertDeviceError, ExpertHome, ExpertPlacement, KvCache, KvType,
    LanguageModel, LogitsWanted, ModelError, SeqBatch,
};

/// What can go wrong loading or running a model on a device.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The device failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The model (its file, or the host experts) failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A placement this executor cannot run.
    #[error("placement: {0}")]
    Placement(String),
    /// A cache that does not stand for the sequence on the device, or of a type it cannot
    /// hold.
    #[error("device KV cache: {0}")]
    Cache(String),
}

impl From<ExecError> for ModelError {
    fn from(e: ExecError) -> ModelError {
        match e {
            ExecError::Model(m) => m,
            ExecError::Backend(b) => ModelError::ExpertDevice(ExpertDeviceError::Device(b)),
            ExecError::Placement(p) => ModelError::ExpertDevice(ExpertDeviceError::Placement(p)),
            cache @ ExecError::Cache(_) => ModelError::ExpertDevice(ExpertDeviceError::Backend {
                device: "executor".into(),
                message: cache.to_string(),
            }),
        }
    }
}

/// What the device cache must do before a forward pass on a cache handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvAction {
    /// Keep the device cache; the sequence continues at the handle's position (equal to or
    /// before what the device holds).
    Continue,
    /// Allocate a fresh device cache (a new sequence, or the first).
    Allocate,
    /// The handle is ahead of the device cache or of another size: not the sequence on the device.
    Mismatch,
}

/// The decision of [`KvAction`]: `gpu` is the device cache's `((n_ctx, n_ubatch), positions
/// held)`, `handle` the cache's `(n_ctx, n_ubatch)` and `n_past` its position.
pub(crate) fn kv_action(
    gpu: Option<((usize, usize), usize)>,
    handle: (usize, usize),
    n_past: usize,
) -> KvAction {
    match gpu {
        Some((geometry, held)) if geometry == handle && n_past <= held => KvAction::Continue,
        _ if n_past == 0 => KvAction::Allocate,
        _ => KvAction::Mismatch,
    }
}

/// Transfers at the expert boundary, counted by the executor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Micro-batches run.
    pub ubatches: u64,
    /// Round trips to the host experts (one per host layer per micro-batch).
    pub host_round_trips: u64,
    /// Bytes brought down for them: hidden state, expert ids and weights.
    pub bytes_to_host: u64,
    /// Bytes sent back up: the expert sums.
    pub bytes_to_device: u64,
    /// Host layers run on the device by op offload (one per such layer per micro-batch).
    pub offloaded_layers: u64,
    /// Experts uploaded for them (each routed expert once per offloaded layer).
    pub offloaded_experts: u64,
    /// Bytes of those uploads (weights and biases).
    pub offload_bytes: u64,
    /// Offloaded layers whose upload (of every expert) was started while the host layer
    /// before them ran (see [`PREFETCH_ROUTES_PER_EXPERT`]).
    pub prefetched_layers: u64,
    /// Every host ↔ device copy the device counted (weights at load included), for a device
    /// that counts them ([`Backend::transfers`]).
    pub transfers: Option<TransferCounts>,
}

/// Expert choices per expert (`n_tokens × n_expert_used / n_expert`) from which an offloaded
/// micro-batch uploads every expert of each host layer instead of the routed ones: with 4,
/// about e^-4 ≈ 2% of the experts go unused, and since no routing is awaited, the next host
/// layer's upload starts before this layer's compute and overlaps it.
pub const PREFETCH_ROUTES_PER_EXPERT: usize = 4;

/// Device memory left free beside a prefetched layer's experts (the running layer's scratch
/// buffers come out of it); with less room the next layer is uploaded when it is reached.
pub const PREFETCH_RESERVE_BYTES: u64 = 512 << 20;

/// A weight matrix on the device, `rows × cols`, and whether a micro-batch of several
/// sequences multiplies it per sequence: weights whose products the CPU engine sums in an
/// order that depends on how many tokens it multiplies together ([`batch_order_varies`]).
pub(crate) struct DevMat<B: Backend> {
    m: B::Matrix,
    rows: usize,
    cols: usize,
    per_seq: bool,
}

impl<B: Backend> DevMat<B> {
    /// Bytes it occupies on the device.
    pub(crate) fn bytes(&self) -> u64 {
        B::matrix_bytes(&self.m) as u64
    }
}

/// Whether the CPU engine sums a batch's products by weights of type `ty` in an order that
/// depends on the batch's size: F32 (one token in `vec_dot` order, several in tinyBLAS's
/// lanes), the K-quants (tiled from 8 tokens) and Q4_0 (repacked rows, grouped by 4 tokens).
pub(crate) fn batch_order_varies(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | Q4_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K)
}

/// Whether the CPU engine sums an expert's products by weights of type `ty` in an order that
/// depends on how many rows route to the expert together: F32 (gpt-oss's experts: 16 lanes
/// for several rows) and the K-quants (tiled from 8 rows).
pub(crate) fn expert_order_varies(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K)
}

/// Bytes of an f32 buffer on the device.
pub(crate) fn buf_bytes<B: Backend>(b: &B::Buf<f32>) -> u64 {
    4 * B::buf_len(b) as u64
}

/// How a routed-MoE block turns router logits into chosen experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Gating {
    /// The top `k` logits (ties to the lower id), softmax over them (gpt-oss).
    TopKSoftmax,
    /// Gate probabilities of every expert (softmax or sigmoid), then the contract's
    /// [`hmoe_backend::Routing`] (a selection-only bias, expert groups, renormalised and
    /// scaled weights; the `route` op).
    Scored(hmoe_backend::Gating, hmoe_backend::Routing),
}

/// A layer's router as the executor runs it: `n_expert` logits per token, `k` chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Router {
    /// Experts of the layer.
    pub n_expert: usize,
    /// Experts per token.
    pub k: usize,
    /// How the choice and the weights come from the logits.
    pub gating: Gating,
}

impl Router {
    /// The chosen experts `sel` and their weights `wts` (`k` per token) of router logits
    /// `scores`, on the device (`bias`: the selection bias of [`Gating::Scored`]).
    pub(crate) fn route<B: Backend>(
        &self,
        dev: &B,
        scores: &B::Buf<f32>,
        bias: Option<&B::Buf<f32>>,
        sel: &mut B::Buf<i32>,
        wts: &mut B::Buf<f32>,
    ) -> Result<(), BackendError> {
        match self.gating {
            Gating::TopKSoftmax => dev.router_top_k(scores, self.n_expert, self.k, sel, wts),
            Gating::Scored(gating, routing) => {
                dev.route(scores, bias, gating, &routing, self.n_expert, sel, wts)
            }
        }
    }
}

/// Which rows the CPU engine multiplies together by a layer's experts whose products it sums
/// in another order when several rows route to one expert ([`expert_order_varies`]): the
/// `moe` op then runs on each such set of rows alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertSplit {
    /// One sequence's tokens (gpt-oss's host experts group a sequence's rows per expert).
    PerSequence,
}

/// A layer's expert inputs on the device for a micro-batch: normed hidden state, router
/// logits, chosen experts and their weights (of every token), the router, the experts'
/// activation, and how F32 experts split the batch.
pub(crate) struct Routed<'a, B: Backend> {
    /// Normed hidden state, `n × n_embd`.
    pub h: &'a B::Buf<f32>,
    /// Router logits, `n × n_expert` (routed again per part when the batch is split).
    pub scores: &'a B::Buf<f32>,
    /// The router's selection bias ([`Gating::Scored`]).
    pub bias: Option<&'a B::Buf<f32>>,
    /// Chosen experts, `n × k`.
    pub sel: &'a B::Buf<i32>,
    /// Their weights, `n × k`.
    pub wts: &'a B::Buf<f32>,
    /// The layer's router.
    pub router: Router,
    /// The experts' gated activation.
    pub act: GatedAct,
    /// How F32 experts split the batch.
    pub split: ExpertSplit,
}

/// One layer's K and V rings on the device (each of its [`KvLayout`]'s type and cells); a
/// K-only cache has no V ring.
struct LayerKv<B: Backend> {
    k: KvRing<B>,
    v: Option<KvRing<B>>,
}

/// The layouts of one layer's K and V rings of `cells` cells for K/V types `ty`: rows of
/// `k_width` and `v_width` values (no V ring for a width of 0, a K-only cache), heads of
/// `head_dim` rotated as the CPU engine's cache rotates them ([`KvLayout::rotation`]; a
/// K-only cache, DeepSeek's latent cache, not at all).
pub fn device_kv_layouts(
    ty: KvType,
    cells: usize,
    (k_width, v_width): (usize, usize),
    head_dim: usize,
) -> Result<(KvLayout, Option<KvLayout>), BackendError> {
    let layout = |t: CacheType, width: usize, key: bool| {
        let ty = t.ggml_type();
        let rot = match v_width {
            0 => 0,
            _ => KvLayout::rotation(ty, head_dim, key),
        };
        KvLayout::new(ty, width, cells, rot)
    };
    let v = (v_width > 0)
        .then(|| layout(ty.v(), v_width, false))
        .transpose()?;
    Ok((layout(ty.k(), k_width, true)?, v))
}

/// Bytes of K/V rings.
fn rings_bytes(rings: &[(KvLayout, Option<KvLayout>)]) -> u64 {
    (rings.iter())
        .map(|(k, v)| k.bytes() + v.as_ref().map_or(0, KvLayout::bytes))
        .sum::<usize>() as u64
}

/// One sequence's K/V cache on the device.
struct DeviceKv<B: Backend> {
    /// The handle it stands for ([`handle_of`]).
    handle: usize,
    /// Whether that handle is still alive ([`KvCache::watch`]).
    alive: Weak<()>,
    /// `(n_ctx, n_ubatch)` of the handle it was made for.
    geometry: (usize, usize),
    /// Positions stored.
    held: usize,
    /// When it was last used ([`State::clock`]).
    last_used: u64,
    /// Its K/V types.
    ty: KvType,
    /// Bytes of its K/V buffers.
    bytes: u64,
    layers: Vec<LayerKv<B>>,
}

/// The identity of a cache handle ([`KvCache::id`]).
fn handle_of(cache: &KvCache) -> usize {
    cache.id()
}

/// One sequence's share of a micro-batch.
struct Member<'t> {
    /// Its device cache's index in [`State::kvs`].
    kv: usize,
    /// The position of its first token.
    pos0: usize,
    tokens: &'t [u32],
    /// The logits it wants (`None`: none).
    want: Option<LogitsWanted>,
}

/// Staging buffers of the host round trip, for micro-batches of `n` tokens.
struct HostIo<B: Backend> {
    n: usize,
    io: B::Staging,
}

/// What changes while running.
struct State<B: Backend> {
    /// The device caches of the sequences seen, in no order.
    kvs: Vec<DeviceKv<B>>,
    /// Counts cache uses, for freeing the least recently used.
    clock: u64,
    /// Handles of sequences under way ([`LanguageModel::retain_caches`]), never freed to
    /// make room.
    busy: Vec<usize>,
    io: Option<HostIo<B>>,
    stats: ExecStats,
    /// The device expert cache of the host layers (`--moe-cache`; empty: disabled).
    moe_cache: moe_cache::MoeCache<B>,
}

impl<B: Backend> Default for State<B> {
    fn default() -> Self {
        State {
            kvs: Vec::new(),
            clock: 0,
            busy: Vec::new(),
            io: None,
            stats: ExecStats::default(),
            moe_cache: moe_cache::MoeCache::default(),
        }
    }
}

impl<B: Backend> State<B> {
    /// Frees the least recently used device cache whose handle is neither in `keep` nor busy;
    /// false when there is none.
    fn evict_idle(&mut self, keep: &[usize]) -> bool {
        let lru = (self.kvs.iter().enumerate())
            .filter(|(_, kv)| !keep.contains(&kv.handle) && !self.busy.contains(&kv.handle))
            .min_by_key(|(_, kv)| kv.last_used)
            .map(|(i, _)| i);
        lru.map(|i| self.kvs.swap_remove(i)).is_some()
    }

    /// The index in `kvs` of the device cache of `handle`.
    fn slot_of(&self, handle: usize) -> Result<usize, ExecError> {
        (self.kvs.iter().position(|kv| kv.handle == handle))
            .ok_or_else(|| ExecError::Cache("no device cache for this handle".into()))
    }
}

/// One architecture's layers on a device, written in the architecture's file over the
/// contract's ops and the shared [`blocks`]; the executor runs them.
pub(crate) trait DeviceLayers<B: Backend>: Send + Sync {
    /// The sizes the executor needs.
    fn dims(&self) -> ModelDims;
    /// The file(s) the weights live in.
    fn gguf(&self) -> &GgufModel;
    /// A cache handle for the device: positions and the CPU cache's ring geometry (cells per
    /// layer), no keys or values.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache;
    /// Floats of K and of V per cell of layer `layer`'s cache.
    fn kv_widths(&self, layer: usize) -> (usize, usize);
    /// Layer `layer` over the micro-batch's hidden state `x` (`n × n_embd`), in place.
    fn layer(
        &self,
        cx: &mut Step<'_, B>,
        layer: usize,
        x: &mut B::Buf<f32>,
    ) -> Result<(), ExecError>;
    /// The routed experts of layer `layer` as the file stores them (`None`: a layer without).
    fn layer_experts(&self, layer: usize) -> Option<ExpertTensors<'_>>;
    /// Runs the routed experts of layer `layer` on the host over the file mapping as the CPU
    /// engine does (`out = Σ_s w · expert(h)` per token; `batch.groups` are the sequences).
    fn run_host_experts(
        &self,
        layer: usize,
        batch: &ExpertBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), ModelError>;
    /// Bytes of the layers' weights on the device (the routed experts not included).
    fn weight_bytes(&self) -> u64;
}

/// A cache handle of positions and ring geometry with no keys or values
/// ([`DeviceLayers::new_cache`]): layer `l` keeps `n_ctx` cells, or `windows[l] + n_ubatch`
/// when it slides, so that [`KvCache::truncate`] answers as for a cache that holds them.
pub(crate) fn position_cache(
    ty: KvType,
    n_ctx: usize,
    n_ubatch: usize,
    windows: &[Option<usize>],
) -> KvCache {
    KvCache::new(ty, n_ctx, n_ubatch.max(1), 0, windows)
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

/// A model with its dense part on a device `B` and each layer's routed experts where an
/// [`ExpertPlacement`] puts them (see the module docs for the data flow and the limits).
pub struct DeviceModel<B: Backend> {
    arch: Box<dyn DeviceLayers<B>>,
    dev: B,
    tok_embd: DevMat<B>,
    output_norm: B::Buf<f32>,
    output: DevMat<B>,
    /// The routed experts of each [`ExpertHome::Device`] layer.
    experts: Vec<Option<B::Moe>>,
    /// Whether each layer's routed experts have a matrix whose products' order varies with
    /// the rows routed together ([`expert_order_varies`], [`ExpertSplit`]).
    split_experts: Vec<bool>,
    homes: Vec<ExpertHome>,
    op_offload_min_batch: Option<usize>,
    weight_bytes: u64,
    state: Mutex<State<B>>,
}

/// Uploads every expert of layer `layer` (`t`, read from `g`): without a copy
/// ([`Backend::upload_moe_shared`]) when `t`'s matrices are the file's
/// `blk.N.ffn_{gate,up,down}_exps.weight` tensors in the mapping, else a copy.
fn upload_experts<B: Backend>(
    dev: &B,
    g: &GgufModel,
    layer: usize,
    t: &ExpertTensors<'_>,
) -> Result<B::Moe, BackendError> {
    let shared = |m: &str, data: &[u8]| {
        let info = g.tensor_info(&format!("blk.{layer}.ffn_{m}_exps.weight"))?;
        let s = g
            .shared_data_of(info)
            .and_then(|(o, r)| SharedBytes::new(o, r))?;
        // A device that copies the experts (the CPU's interleaved sets) gives the pages back.
        let s = match g.page_releaser(info) {
            Some(release) => s.with_page_release(release),
            None => s,
        };
        let b = s.bytes();
        (b.as_ptr() == data.as_ptr() && b.len() == data.len()).then_some(s)
    };
    let all = (|| {
        Some([
            shared("gate", t.gate.data)?,
            shared("up", t.up.data)?,
            shared("down", t.down.data)?,
        ])
    })();
    match all {
        Some(data) => dev.upload_moe_shared(t, &data, None),
        None => dev.upload_moe(t, None),
    }
}

/// Uploads the matrix `name` in its file encoding, checking that its shape is `shape`
/// (`[cols, rows…]` in ggml order).
pub(crate) fn upload_matrix<B: Backend>(
    dev: &B,
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<DevMat<B>, ExecError> {
    let info = expect_tensor(g, name, shape)?;
    let cols = info.dims.first().copied().unwrap_or(0) as usize;
    let rows = info.dims.iter().skip(1).product::<u64>() as usize;
    let m = match g
        .shared_data_of(&info)
        .and_then(|(o, r)| SharedBytes::new(o, r))
    {
        Some(shared) => dev.upload_matrix_shared(info.ty, rows, cols, &shared)?,
        None => dev.upload_matrix(info.ty, rows, cols, g.data_of(&info))?,
    };
    Ok(DevMat {
        m,
        rows,
        cols,
        per_seq: batch_order_varies(info.ty),
    })
}

/// Uploads the small tensor `name` (norm, bias, sinks) dequantized to f32, checking that its
/// shape is `shape`.
pub(crate) fn upload_f32<B: Backend>(
    dev: &B,
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<B::Buf<f32>, ExecError> {
    Ok(dev.upload(&load_f32(g, name, shape)?)?)
}

/// [`upload_f32`] of `name` if the file has it.
pub(crate) fn upload_f32_opt<B: Backend>(
    dev: &B,
    g: &GgufModel,
    name: &str,
    shape: &[u64],
) -> Result<Option<B::Buf<f32>>, ExecError> {
    match g.tensor_info(name) {
        Some(_) => upload_f32(dev, g, name, shape).map(Some),
        None => Ok(None),
    }
}

/// The device layers of the architecture `gguf` names, loaded onto `dev`.
fn load_layers<B: Backend + 'static>(
    gguf: GgufModel,
    dev: &B,
) -> Result<Box<dyn DeviceLayers<B>>, ExecError> {
    match gguf.metadata().architecture() {
        Some("gpt-oss") => Ok(Box::new(crate::gpt_oss::GptOss::load(gguf, dev)?)),
        Some("deepseek2") => Ok(Box::new(crate::deepseek2::Deepseek2::load(gguf, dev)?)),
        Some("qwen3moe") => Ok(Box::new(crate::qwen3_moe::Qwen3Moe::load(gguf, dev)?)),
        Some("llama" | "qwen2") => Ok(Box::new(crate::llama::Dense::load(gguf, dev)?)),
        other => Err(ModelError::UnsupportedArch(format!(
            "{} (no device executor for it)",
            other.unwrap_or("<missing general.architecture>")
        ))
        .into()),
    }
}

/// The architectures (`general.architecture`) that have a device layer.
pub const DEVICE_ARCHS: &[&str] = &["gpt-oss", "deepseek2", "qwen3moe", "llama", "qwen2"];

/// Whether [`DeviceModel::load`] runs the architecture `arch` (`general.architecture`).
pub fn device_arch(arch: Option<&str>) -> bool {
    arch.is_some_and(|a| DEVICE_ARCHS.contains(&a))
}

/// Architectures whose device cache is K-only (DeepSeek's latent cache: `-ctk` is its type,
/// `-ctv` is not used).
pub const K_ONLY_ARCHS: &[&str] = &["deepseek2"];

/// Whether the device executor keeps a cache of K type `k` for architecture `arch` on a
/// device whose K-only attention reads `k_only_types` ([`Backend::k_only_types`]; a device
/// that keeps the K/V pair, [`Backend::supports_kv`]): any for an architecture with K and V,
/// one of `k_only_types` for a K-only cache.
pub fn arch_keeps_kv(arch: Option<&str>, k: CacheType, k_only_types: &[GgmlType]) -> bool {
    !arch.is_some_and(|a| K_ONLY_ARCHS.contains(&a)) || k_only_types.contains(&k.ggml_type())
}

impl<B: Backend + 'static> DeviceModel<B> {
    /// Loads `gguf` (every tensor checked against the hyperparameters) onto `dev`, whichever
    /// architecture it is ([`device_arch`]): every dense weight, and the routed experts of the layers
    /// `placement` puts on the device. The experts of the other layers stay in the file
    /// mapping and run on the host.
    pub fn load(
        gguf: GgufModel,
        dev: B,
        placement: &ExpertPlacement,
    ) -> Result<DeviceModel<B>, ExecError> {
        let arch = load_layers(gguf, &dev)?;
        Self::with_layers(arch, dev, placement)
    }

    /// Loads `gguf` onto `dev` with every layer's routed experts on the device and no op
    /// offload: how the CPU engine runs a model ([`crate::load`] over [`hmoe_cpu::Cpu`]).
    pub fn load_whole(gguf: GgufModel, dev: B) -> Result<DeviceModel<B>, ExecError> {
        let arch = load_layers(gguf, &dev)?;
        let placement =
            ExpertPlacement::all(arch.dims().n_layer, ExpertHome::Device).with_op_offload(None);
        Self::with_layers(arch, dev, &placement)
    }

    fn with_layers(
        arch: Box<dyn DeviceLayers<B>>,
        dev: B,
        placement: &ExpertPlacement,
    ) -> Result<DeviceModel<B>, ExecError> {
        let dims = arch.dims();
        if placement.layers.len() != dims.n_layer {
            return Err(ExecError::Placement(format!(
                "{} layer homes for a {}-layer model",
                placement.layers.len(),
                dims.n_layer
            )));
        }
        let mut weight_bytes = arch.weight_bytes();
        let mut experts = Vec::with_capacity(dims.n_layer);
        let mut split_experts = Vec::with_capacity(dims.n_layer);
        for (l, home) in placement.layers.iter().enumerate() {
            let t = arch.layer_experts(l);
            split_experts.push(t.is_some_and(|t| {
                [t.gate.ty, t.up.ty, t.down.ty]
                    .into_iter()
                    .any(expert_order_varies)
            }));
            let moe = match (home, t) {
                (ExpertHome::Device, Some(t)) => Some(upload_experts(&dev, arch.gguf(), l, &t)?),
                _ => None,
            };
            weight_bytes += moe.as_ref().map_or(0, |m| B::moe_bytes(m) as u64);
            experts.push(moe);
        }
        let g = arch.gguf();
        let (d, n_vocab) = (dims.n_embd as u64, dims.n_vocab as u64);
        let tok_embd = upload_matrix(&dev, g, "token_embd.weight", &[d, n_vocab])?;
        // Tied embeddings: the head is the embedding.
        let head = match g.tensor_info("output.weight") {
            Some(_) => "output.weight",
            None => "token_embd.weight",
        };
        let output = upload_matrix(&dev, g, head, &[d, n_vocab])?;
        let output_norm = upload_f32(&dev, g, "output_norm.weight", &[d])?;
        weight_bytes += tok_embd.bytes() + output.bytes() + buf_bytes::<B>(&output_norm);
        dev.synchronize()?;
        Ok(DeviceModel {
            arch,
            dev,
            tok_embd,
            output_norm,
            output,
            experts,
            split_experts,
            homes: placement.layers.clone(),
            op_offload_min_batch: placement.op_offload_min_batch,
            weight_bytes,
            state: Mutex::new(State::default()),
        })
    }
}

impl<B: Backend> DeviceModel<B> {
    /// The device.
    pub fn device(&self) -> &B {
        &self.dev
    }

    /// Where each layer's routed experts run.
    pub fn expert_homes(&self) -> &[ExpertHome] {
        &self.homes
    }

    /// The op offload threshold of the placement: micro-batches of at least this many tokens
    /// run host layers on the device with their routed experts uploaded (`None`: never).
    pub fn op_offload_min_batch(&self) -> Option<usize> {
        self.op_offload_min_batch
    }

    /// Bytes of weights uploaded at load.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Transfers at the expert boundary so far.
    pub fn stats(&self) -> ExecStats {
        ExecStats {
            transfers: self.dev.transfers(),
            ..self.lock().stats
        }
    }

    /// Sets the device expert cache of the host layers to `budget_bytes` (0 disables it),
    /// dropping what the previous cache held; see the `moe_cache` module docs. Layers whose
    /// experts are on the device are not cached. A budget too small for one expert of a host
    /// layer, or a placement with no host layer, is an error (the cache is then disabled).
    pub fn set_moe_cache(&self, budget_bytes: u64) -> Result<MoeCacheStats, ExecError> {
        let mut st = self.lock();
        st.moe_cache = moe_cache::MoeCache::default();
        let cache = moe_cache::MoeCache::new(self.arch.as_ref(), &self.homes, budget_bytes)?;
        st.moe_cache = cache;
        Ok(st.moe_cache.stats())
    }

    /// What the device expert cache counted and holds (a budget of 0: disabled).
    pub fn moe_cache_stats(&self) -> MoeCacheStats {
        self.lock().moe_cache.stats()
    }

    /// The device's name, the weights, the K/V caches held now and the free memory.
    pub fn device_memory(&self) -> Result<DeviceMemory, ExecError> {
        let kv_bytes = self.lock().kvs.iter().map(|kv| kv.bytes).sum();
        Ok(DeviceMemory {
            device: self.dev.name(),
            weight_bytes: self.weight_bytes,
            kv_bytes,
            free_bytes: self.dev.free_memory()?,
        })
    }

    /// Keeps the device caches of `busy` and `idle` handles only (see
    /// [`LanguageModel::retain_caches`]); those of `busy` are not freed to make room.
    pub fn retain_caches(&self, busy: &[&KvCache], idle: &[&KvCache]) {
        let mut st = self.lock();
        st.busy = busy.iter().map(|c| handle_of(c)).collect();
        let idle: Vec<usize> = idle.iter().map(|c| handle_of(c)).collect();
        let State { kvs, busy, .. } = &mut *st;
        kvs.retain(|kv| busy.contains(&kv.handle) || idle.contains(&kv.handle));
    }

    /// Whether the device holds the positions of `cache` (a handle at position 0 always
    /// can start).
    pub fn cache_held(&self, cache: &KvCache) -> bool {
        let st = self.lock();
        let held = (st.kvs.iter().find(|kv| kv.handle == handle_of(cache)))
            .map(|kv| (kv.geometry, kv.held));
        cache.n_past() == 0
            || kv_action(held, (cache.n_ctx(), cache.n_ubatch()), cache.n_past())
                == KvAction::Continue
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `tokens` at the next positions of `cache` (a handle from
    /// [`LanguageModel::new_cache`]) and returns `n_vocab` logits per wanted token (the
    /// batch split into the cache's micro-batches).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ExecError> {
        self.check_input(cache, tokens)?;
        let mut st = self.lock();
        let handle = handle_of(cache);
        self.prepare_kv(&mut st, cache, &[handle])?;
        let kv = st.slot_of(handle)?;
        let mut logits = Vec::new();
        let n_ubatch = cache.n_ubatch().max(1);
        let n_chunks = tokens.len().div_ceil(n_ubatch);
        for (i, chunk) in tokens.chunks(n_ubatch).enumerate() {
            let want = match wanted {
                LogitsWanted::All => Some(LogitsWanted::All),
                LogitsWanted::Last if i + 1 == n_chunks => Some(LogitsWanted::Last),
                LogitsWanted::Last => None,
            };
            let member = Member {
                kv,
                pos0: cache.n_past(),
                tokens: chunk,
                want,
            };
            let out = self.step(&mut st, std::slice::from_ref(&member))?;
            logits.extend(out.into_iter().flatten());
            cache.advance(chunk.len());
            st.kvs[kv].held = cache.n_past();
        }
        Ok(logits)
    }

    /// Runs several sequences in one pass: every sequence's tokens in one micro-batch (one
    /// round trip per CPU-expert layer for all of them), each at the next positions of its own
    /// cache; returns the last token's logits of the sequences that want them (empty vectors
    /// for the others). Each result equals [`DeviceModel::forward`] with
    /// [`LogitsWanted::Last`] on that sequence alone (see the module docs). As in the CPU
    /// engine, a step with a sequence of no tokens or of more than its cache's micro-batch
    /// runs the sequences one after the other. Every input is checked before anything runs.
    pub fn forward_multi(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        for s in seqs.iter() {
            self.check_input(s.cache, s.tokens)?;
        }
        // A sequence of no tokens or of more than one micro-batch runs alone (split as
        // `forward` splits it), and so do the others then.
        let one_ubatch = seqs
            .iter()
            .all(|s| (1..=s.cache.n_ubatch()).contains(&s.tokens.len()));
        if !one_ubatch {
            let mut out = Vec::with_capacity(seqs.len());
            for s in seqs.iter_mut() {
                let logits = self.forward(s.cache, s.tokens, LogitsWanted::Last)?;
                out.push(if s.logits { logits } else { Vec::new() });
            }
            return Ok(out);
        }
        let mut st = self.lock();
        let handles: Vec<usize> = seqs.iter().map(|s| handle_of(s.cache)).collect();
        for s in seqs.iter() {
            self.prepare_kv(&mut st, s.cache, &handles)?;
        }
        let members = seqs
            .iter()
            .zip(&handles)
            .map(|(s, &h)| {
                Ok(Member {
                    kv: st.slot_of(h)?,
                    pos0: s.cache.n_past(),
                    tokens: s.tokens,
                    want: s.logits.then_some(LogitsWanted::Last),
                })
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        let out = self.step(&mut st, &members)?;
        for (s, m) in seqs.iter_mut().zip(&members) {
            s.cache.advance(s.tokens.len());
            st.kvs[m.kv].held = s.cache.n_past();
        }
        Ok(out)
    }

    /// Checks a sequence's tokens and cache before anything runs: token ids, room in the
    /// context, K/V types the device keeps ([`Backend::supports_kv`]) with heads of whole
    /// blocks (a K-only cache: its K type one of [`Backend::k_only_types`], `-ctv` unused).
    fn check_input(&self, cache: &KvCache, tokens: &[u32]) -> Result<(), ExecError> {
        let n_vocab = self.arch.dims().n_vocab;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::BadToken { id, n_vocab }.into());
        }
        if cache.n_past() + tokens.len() > cache.n_ctx() {
            return Err(ModelError::ContextFull {
                pos: cache.n_past(),
                n_tokens: tokens.len(),
                n_ctx: cache.n_ctx(),
            }
            .into());
        }
        let ty = cache.kv_type();
        let (k_width, v_width) = self.arch.kv_widths(0);
        let k_only = v_width == 0 && k_width > 0;
        if k_only && !self.dev.k_only_types().contains(&ty.k().ggml_type()) {
            return Err(ExecError::Cache(format!(
                "K {}: {} does not keep a K-only (latent) cache of this type",
                ty.k(),
                self.dev.name()
            )));
        }
        if !k_only && !self.dev.supports_kv(ty.k().ggml_type(), ty.v().ggml_type()) {
            return Err(ExecError::Cache(format!(
                "K {} / V {}: {} does not keep this K/V cache",
                ty.k(),
                ty.v(),
                self.dev.name()
            )));
        }
        let hd = self.arch.dims().kv_head_dim;
        // A K-only cache has no V (`-ctv` is not used).
        let checked = if k_only {
            &[("K", ty.k())][..]
        } else {
            &[("K", ty.k()), ("V", ty.v())]
        };
        for &(which, t) in checked {
            if !hd.is_multiple_of(t.block_elems()) {
                return Err(ModelError::BadParam {
                    key: format!("{which} cache type"),
                    value: format!("{t} (head size {hd}, block size {})", t.block_elems()),
                    why: "attention heads must be a whole number of blocks of the cache type \
                          (llama.cpp refuses this too)",
                }
                .into());
            }
        }
        Ok(())
    }

    /// Bytes of the scratch buffers of a micro-batch of `n_tokens` tokens with every token's
    /// logits: what a new sequence's cache leaves free on the device (see the module docs).
    /// The per-sequence copies of a batch of several sequences take at most as much again,
    /// which the estimate counts too.
    pub fn scratch_bytes(&self, n_tokens: usize) -> u64 {
        let d = self.arch.dims();
        (4 * n_tokens * (2 * d.scratch_per_token + d.n_embd + d.n_vocab)) as u64
    }

    /// The K (and V) ring layouts of each layer of a cache of `cache`'s types and geometry:
    /// the handle's cells per layer.
    fn rings_of(&self, cache: &KvCache) -> Result<Vec<(KvLayout, Option<KvLayout>)>, ExecError> {
        let hd = self.arch.dims().kv_head_dim;
        (cache.layers.iter().enumerate())
            .map(|(l, layer)| {
                device_kv_layouts(cache.kv_type(), layer.cells, self.arch.kv_widths(l), hd)
            })
            .collect::<Result<_, _>>()
            .map_err(ExecError::from)
    }

    /// Bytes of the K/V a cache of `cache`'s types and geometry takes on the device (0 for
    /// types the device cannot keep).
    pub fn kv_bytes(&self, cache: &KvCache) -> u64 {
        self.rings_of(cache).map_or(0, |r| rings_bytes(&r))
    }

    /// Makes a device cache stand for `cache` (see [`kv_action`]); the caches of the handles
    /// in `keep` (the step's) are never freed to make room.
    fn prepare_kv(
        &self,
        st: &mut State<B>,
        cache: &KvCache,
        keep: &[usize],
    ) -> Result<(), ExecError> {
        let handle = handle_of(cache);
        let geometry = (cache.n_ctx(), cache.n_ubatch());
        // The caches of dropped handles go first.
        st.kvs.retain(|kv| kv.alive.strong_count() > 0);
        st.clock += 1;
        let clock = st.clock;
        let at = st.kvs.iter().position(|kv| kv.handle == handle);
        let ty = cache.kv_type();
        // A cache of other K/V types (a new handle at a freed one's address) is not this one.
        let held =
            (at.filter(|&i| st.kvs[i].ty == ty)).map(|i| (st.kvs[i].geometry, st.kvs[i].held));
        match kv_action(held, geometry, cache.n_past()) {
            KvAction::Continue => {
                if let Some(kv) = at.map(|i| &mut st.kvs[i]) {
                    kv.held = cache.n_past();
                    kv.last_used = clock;
                }
                Ok(())
            }
            KvAction::Allocate => {
                // Free the old cache before the new one takes its memory.
                if let Some(i) = at {
                    st.kvs.swap_remove(i);
                }
                let rings = self.rings_of(cache)?;
                let kv_bytes = rings_bytes(&rings);
                let need = kv_bytes + self.scratch_bytes(geometry.1);
                // Idle sequences' caches first, then cached experts.
                while self.dev.free_memory()?.is_some_and(|free| free < need)
                    && (st.evict_idle(keep) || st.moe_cache.evict_one())
                {}
                let alloc = || {
                    rings
                        .iter()
                        .map(|(k, v)| {
                            Ok(LayerKv {
                                k: self.dev.kv_alloc(*k)?,
                                v: v.map(|v| self.dev.kv_alloc(v)).transpose()?,
                            })
                        })
                        .collect::<Result<Vec<_>, BackendError>>()
                };
                let layers = loop {
                    match alloc() {
                        Err(BackendError::OutOfMemory { .. })
                            if st.evict_idle(keep) || st.moe_cache.evict_one() => {}
                        other => break other?,
                    }
                };
                st.kvs.push(DeviceKv {
                    handle,
                    alive: cache.watch(),
                    geometry,
                    held: 0,
                    last_used: clock,
                    ty,
                    bytes: kv_bytes,
                    layers,
                });
                Ok(())
            }
            KvAction::Mismatch => Err(ExecError::Cache(format!(
                "a cache at position {} (n_ctx {}, n_ubatch {}) is not a sequence on the device \
                 ({}); a new sequence, or one whose device cache was freed, starts at 0",
                cache.n_past(),
                geometry.0,
                geometry.1,
                match held {
                    Some(((c, u), h)) =>
                        format!("its device cache: n_ctx {c}, n_ubatch {u}, {h} positions"),
                    None => "no device cache for it".into(),
                }
            ))),
        }
    }

    /// `y = W·x` for the rows of `groups` (consecutive, from row 0): one product over every
    /// row, or one per group for weights whose products go per sequence ([`DevMat`]).
    fn matmul(
        &self,
        w: &DevMat<B>,
        x: &B::Buf<f32>,
        groups: &[Range<usize>],
        y: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let dev = &self.dev;
        let n = groups.last().map_or(0, |g| g.end);
        if !w.per_seq || groups.len() == 1 {
            return Ok(dev.matmul(&w.m, x, n, y)?);
        }
        for g in groups {
            let xs = dev.copy_range(x, g.start * w.cols..g.end * w.cols)?;
            let mut ys = dev.alloc::<f32>(g.len() * w.rows)?;
            dev.matmul(&w.m, &xs, g.len(), &mut ys)?;
            dev.copy_into(&ys, y, g.start * w.rows)?;
        }
        Ok(())
    }

    /// One micro-batch of the `members`' tokens (each at its positions, over its device
    /// cache): every layer, then the logits each member wants (empty for `None`).
    fn step(&self, st: &mut State<B>, members: &[Member<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        let dev = &self.dev;
        let dims = self.arch.dims();
        let mut groups = Vec::with_capacity(members.len());
        let mut n = 0;
        for m in members {
            groups.push(n..n + m.tokens.len());
            n += m.tokens.len();
        }
        let i32_of = |v: usize| {
            i32::try_from(v).map_err(|_| ExecError::Cache(format!("position {v} exceeds i32")))
        };
        let mut ids = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for m in members {
            for (t, &tok) in m.tokens.iter().enumerate() {
                ids.push(i32_of(tok as usize)?);
                positions.push(i32_of(m.pos0 + t)?);
            }
        }
        let ids = dev.upload(&ids)?;
        let pos = dev.upload(&positions)?;
        let mut x = dev.alloc::<f32>(n * dims.n_embd)?;
        dev.get_rows(&self.tok_embd.m, &ids, &mut x)?;
        let offload = self.op_offload_min_batch.is_some_and(|m| n >= m);
        let mut cx = Step {
            model: self,
            st,
            members,
            groups,
            pos,
            offload,
            prefetched: None,
        };
        for l in 0..dims.n_layer {
            self.arch.layer(&mut cx, l, &mut x)?;
        }
        let Step { st, groups, .. } = cx;
        st.stats.ubatches += 1;
        let logits = self.logits(members, &groups, x)?;
        // After the token's logits: the experts that missed go up for the next micro-batch.
        st.moe_cache.upload_missed(&self.dev, self.arch.as_ref())?;
        Ok(logits)
    }

    /// The output norm and head over the rows the members want of the final hidden state `x`
    /// (every row of a member that wants [`LogitsWanted::All`], the last of one that wants
    /// [`LogitsWanted::Last`]), brought down in one copy and split per member.
    fn logits(
        &self,
        members: &[Member<'_>],
        groups: &[Range<usize>],
        x: B::Buf<f32>,
    ) -> Result<Vec<Vec<f32>>, ExecError> {
        let dev = &self.dev;
        let p = self.arch.dims();
        let d = p.n_embd;
        // Rows of `x` wanted, per member.
        let wanted: Vec<Option<Range<usize>>> = members
            .iter()
            .zip(groups)
            .map(|(m, g)| match m.want {
                None => None,
                Some(LogitsWanted::All) => Some(g.clone()),
                Some(LogitsWanted::Last) => Some(g.end - 1..g.end),
            })
            .collect();
        let mut out_groups = Vec::new();
        let mut n_rows = 0;
        for r in wanted.iter().flatten() {
            out_groups.push(n_rows..n_rows + r.len());
            n_rows += r.len();
        }
        if n_rows == 0 {
            dev.synchronize()?;
            return Ok(vec![Vec::new(); members.len()]);
        }
        let rows = match wanted.as_slice() {
            [Some(r)] if r.len() * d == B::buf_len(&x) => x,
            [Some(r)] => dev.copy_range(&x, r.start * d..r.end * d)?,
            _ => {
                let mut rows = dev.alloc::<f32>(n_rows * d)?;
                for (r, og) in wanted.iter().flatten().zip(&out_groups) {
                    let part = dev.copy_range(&x, r.start * d..r.end * d)?;
                    dev.copy_into(&part, &mut rows, og.start * d)?;
                }
                rows
            }
        };
        let mut normed = dev.alloc::<f32>(n_rows * d)?;
        dev.rms_norm(&rows, &self.output_norm, p.rms_eps, &mut normed)?;
        let mut logits = dev.alloc::<f32>(n_rows * p.n_vocab)?;
        self.matmul(&self.output, &normed, &out_groups, &mut logits)?;
        let all = dev.download(&logits)?;
        // One member's logits (a decode step): the download itself, not a copy of it.
        if let [_] = out_groups.as_slice() {
            let mut all = Some(all);
            return Ok((wanted.iter())
                .map(|w| match w {
                    Some(_) => all.take().unwrap_or_default(),
                    None => Vec::new(),
                })
                .collect());
        }
        let mut og = out_groups.iter();
        Ok(wanted
            .iter()
            .map(|w| match w.as_ref().and_then(|_| og.next()) {
                Some(g) => all[g.start * p.n_vocab..g.end * p.n_vocab].to_vec(),
                None => Vec::new(),
            })
            .collect())
    }
}

/// One micro-batch in flight: what a [`DeviceLayers::layer`] runs its ops through (the
/// device, the batch's rows per sequence, their positions and device caches, the experts).
pub(crate) struct Step<'s, B: Backend> {
    model: &'s DeviceModel<B>,
    st: &'s mut State<B>,
    members: &'s [Member<'s>],
    groups: Vec<Range<usize>>,
    pos: B::Buf<i32>,
    /// Whether host layers run on the device for this batch (op offload).
    offload: bool,
    /// The next host layer's experts, uploading while the layers before it run.
    prefetched: Option<(usize, B::Moe)>,
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
    /// Chains of one token's value sum ([`AttnParams::value_chains`]): 1 as the CPU engine's
    /// gpt-oss attention, 4 as its `attention_ext` (Llama-style blocks, Qwen3-MoE).
    pub value_chains: usize,
}

impl<'s, B: Backend> Step<'s, B> {
    /// The device.
    pub(crate) fn dev(&self) -> &'s B {
        &self.model.dev
    }

    /// Tokens in the micro-batch.
    pub(crate) fn n_tokens(&self) -> usize {
        self.groups.last().map_or(0, |g| g.end)
    }

    /// Each token's position.
    pub(crate) fn positions(&self) -> &B::Buf<i32> {
        &self.pos
    }

    /// A zeroed buffer of `width` floats per token.
    pub(crate) fn alloc(&self, width: usize) -> Result<B::Buf<f32>, ExecError> {
        Ok(self.dev().alloc::<f32>(self.n_tokens() * width)?)
    }

    /// `y = W·x` over the micro-batch, per sequence for weights that need it ([`DevMat`]).
    pub(crate) fn matmul(
        &self,
        w: &DevMat<B>,
        x: &B::Buf<f32>,
        y: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        self.model.matmul(w, x, &self.groups, y)
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
    ) -> Result<(), ExecError> {
        let dev = self.dev();
        let hd = shape.head_dim;
        let (qw, kvw) = (shape.n_head * hd, shape.n_head_kv * hd);
        let single = self.members.len() == 1;
        for (m, g) in self.members.iter().zip(&self.groups) {
            let (kv, flash) = (self.st.kvs.get_mut(m.kv))
                .and_then(|kv| {
                    let flash = kv.ty.flash_attn();
                    kv.layers.get_mut(layer).map(|l| (l, flash))
                })
                .ok_or_else(|| ExecError::Cache("no device cache for this layer".into()))?;
            let LayerKv {
                k: k_ring,
                v: Some(v_ring),
            } = kv
            else {
                return Err(ExecError::Cache("a K-only cache for K/V attention".into()));
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
            let nt = g.len();
            if single {
                dev.kv_store(k, k_ring, nt, m.pos0)?;
                dev.kv_store(v, v_ring, nt, m.pos0)?;
                dev.attention(&ap, q, k_ring, v_ring, sinks, nt, m.pos0, out)?;
                continue;
            }
            let ks = dev.copy_range(k, g.start * kvw..g.end * kvw)?;
            let vs = dev.copy_range(v, g.start * kvw..g.end * kvw)?;
            let qs = dev.copy_range(q, g.start * qw..g.end * qw)?;
            dev.kv_store(&ks, k_ring, nt, m.pos0)?;
            dev.kv_store(&vs, v_ring, nt, m.pos0)?;
            let mut a = dev.alloc::<f32>(nt * qw)?;
            dev.attention(&ap, &qs, k_ring, v_ring, sinks, nt, m.pos0, &mut a)?;
            dev.copy_into(&a, out, g.start * qw)?;
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
    ) -> Result<(), ExecError> {
        let dev = self.dev();
        let contiguous = x_stride == w.cols;
        if !(w.per_seq && contiguous) || self.groups.len() == 1 {
            return Ok(dev.matmul_heads(&w.m, x, self.n_tokens(), n_heads, x_stride, y)?);
        }
        for g in &self.groups {
            let xs = dev.copy_range(x, g.start * n_heads * x_stride..g.end * n_heads * x_stride)?;
            let mut ys = dev.alloc::<f32>(g.len() * w.rows)?;
            dev.matmul_heads(&w.m, &xs, g.len(), n_heads, x_stride, &mut ys)?;
            dev.copy_into(&ys, y, g.start * w.rows)?;
        }
        Ok(())
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
    ) -> Result<(), ExecError> {
        let dev = self.dev();
        let (qw, kw, ow) = (p.n_head * p.k_dim, p.k_dim, p.n_head * p.v_dim);
        let single = self.members.len() == 1;
        for (m, g) in self.members.iter().zip(&self.groups) {
            let kv = (self.st.kvs.get_mut(m.kv))
                .and_then(|kv| kv.layers.get_mut(layer))
                .ok_or_else(|| ExecError::Cache("no device cache for this layer".into()))?;
            let ap = KOnlyAttnParams {
                cells: kv.k.layout.cells,
                ..*p
            };
            let nt = g.len();
            if single {
                dev.kv_store(k, &mut kv.k, nt, m.pos0)?;
                dev.attention_k_only(&ap, q, &kv.k, nt, m.pos0, out)?;
                continue;
            }
            let ks = dev.copy_range(k, g.start * kw..g.end * kw)?;
            let qs = dev.copy_range(q, g.start * qw..g.end * qw)?;
            dev.kv_store(&ks, &mut kv.k, nt, m.pos0)?;
            let mut a = dev.alloc::<f32>(nt * ow)?;
            dev.attention_k_only(&ap, &qs, &kv.k, nt, m.pos0, &mut a)?;
            dev.copy_into(&a, out, g.start * ow)?;
        }
        Ok(())
    }

    /// The rows the `moe` op of layer `layer` runs on together: the whole batch, or, for
    /// experts of [`expert_order_varies`], each part of [`ExpertSplit`] alone (`None`: the
    /// whole batch).
    fn moe_parts(&self, layer: usize, split: ExpertSplit) -> Option<Vec<Range<usize>>> {
        if !self
            .model
            .split_experts
            .get(layer)
            .copied()
            .unwrap_or(false)
        {
            return None;
        }
        match split {
            ExpertSplit::PerSequence if self.groups.len() > 1 => Some(self.groups.clone()),
            _ => None,
        }
    }

    /// The weighted sum of layer `layer`'s routed experts for the batch into `out`, wherever
    /// the placement puts them: the `moe` op over the device's experts; a host layer's
    /// experts uploaded for the batch (op offload; every expert, with the next host layer's
    /// upload queued behind, when the batch routes to nearly all); or one round trip to the
    /// host.
    pub(crate) fn experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let model = self.model;
        let parts = self.moe_parts(layer, r.split);
        if let Some(Some(experts)) = model.experts.get(layer) {
            return self.device_moe(experts, r, parts.as_deref(), out);
        }
        let n = self.n_tokens();
        let upload_all =
            self.offload && n * r.router.k >= PREFETCH_ROUTES_PER_EXPERT * r.router.n_expert;
        if upload_all {
            let w = match self.prefetched.take() {
                Some((pl, w)) if pl == layer => w,
                _ => self.upload_offloaded(layer, None)?,
            };
            self.device_moe(&w, r, parts.as_deref(), out)?;
            // Queued behind this layer's work: the next host layer's upload, which the CPU
            // pool gathers while the device computes.
            let next = (layer + 1..model.homes.len()).find(|&j| model.experts[j].is_none());
            if let Some(nl) = next.filter(|&nl| self.room_for_experts(nl)) {
                self.prefetched = Some((nl, self.upload_offloaded(nl, None)?));
                self.st.stats.prefetched_layers += 1;
            }
            return Ok(());
        }
        if self.offload {
            return self.offloaded_experts(layer, r, parts.as_deref(), out);
        }
        self.host_experts(layer, r, out)
    }

    /// The `moe` op of a layer over the whole micro-batch, or, with `parts`, over each part
    /// alone with its own routing.
    fn device_moe(
        &self,
        w: &B::Moe,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let dev = self.dev();
        let d = self.model.arch.dims().n_embd;
        let (ne, k) = (r.router.n_expert, r.router.k);
        let Some(parts) = parts else {
            return Ok(dev.moe(w, r.act, r.h, r.sel, r.wts, k, out)?);
        };
        for g in parts {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let ss = dev.copy_range(r.scores, g.start * ne..g.end * ne)?;
            let mut sel = dev.alloc::<i32>(g.len() * k)?;
            let mut wts = dev.alloc::<f32>(g.len() * k)?;
            r.router.route(dev, &ss, r.bias, &mut sel, &mut wts)?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(w, r.act, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// Whether the device has room for every expert of host layer `layer` beside what it holds
    /// now and [`PREFETCH_RESERVE_BYTES`] (always, on a backend without a limit; never, if the
    /// free memory cannot be read).
    fn room_for_experts(&self, layer: usize) -> bool {
        let Ok(t) = experts_of(self.model.arch.as_ref(), layer) else {
            return false;
        };
        let need = t.n_expert as u64 * t.expert_bytes() + PREFETCH_RESERVE_BYTES;
        match self.dev().free_memory() {
            Ok(free) => free.is_none_or(|free| free >= need),
            Err(_) => false,
        }
    }

    /// The experts `ids` (every one when `None`) of host layer `layer` on the device, uploaded
    /// from the file mapping for op offload and counted in the stats.
    fn upload_offloaded(
        &mut self,
        layer: usize,
        ids: Option<&[usize]>,
    ) -> Result<B::Moe, ExecError> {
        let t = experts_of(self.model.arch.as_ref(), layer)?;
        let w = self.dev().upload_moe(&t, ids)?;
        let n = ids.map_or(t.n_expert, <[usize]>::len) as u64;
        let stats = &mut self.st.stats;
        stats.offloaded_layers += 1;
        stats.offloaded_experts += n;
        stats.offload_bytes += n * t.expert_bytes();
        Ok(w)
    }

    /// Op offload of a host layer for a large micro-batch: the chosen experts come down (one
    /// small copy), the experts they name are uploaded from the file mapping (each once, in
    /// ascending id order) with the ids renumbered to match, and the layer runs on the device
    /// (on each of `parts` alone when given, each with its share of the renumbered ids).
    fn offloaded_experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let dev = self.dev();
        let d = self.model.arch.dims().n_embd;
        let k = r.router.k;
        let chosen = dev.download(r.sel)?;
        let (ids, remapped) = compact_ids(&chosen, r.router.n_expert);
        let w = self.upload_offloaded(layer, Some(&ids))?;
        let Some(parts) = parts else {
            let sel = dev.upload(&remapped)?;
            dev.moe(&w, r.act, r.h, &sel, r.wts, k, out)?;
            return Ok(());
        };
        for g in parts {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let wts = dev.copy_range(r.wts, g.start * k..g.end * k)?;
            let sel = dev.upload(&remapped[g.start * k..g.end * k])?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(&w, r.act, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// The round trip of a host layer: the normed hidden state and the routing of every
    /// token of the micro-batch down through pinned buffers in one copy, the layer's experts
    /// on the host (as the CPU engine computes them for each sequence), the sum up into `out`.
    fn host_experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        if self.cached_host_experts(layer, r, out)? {
            return Ok(());
        }
        let dev = self.dev();
        let d = self.model.arch.dims().n_embd;
        let k_used = r.router.k;
        let n = self.n_tokens();
        let st = &mut *self.st;
        let io = staging_for(&mut st.io, dev, n, d, k_used)?;
        dev.stage_down(io, r.h, r.sel, r.wts)?;
        let staged = dev.staged(io)?;
        let selected: Vec<u32> = staged.sel.iter().map(|&e| e as u32).collect();
        let batch = ExpertBatch {
            h: staged.h,
            selected: &selected,
            weights: staged.w,
            n_used: k_used,
            groups: &self.groups,
        };
        self.model
            .arch
            .run_host_experts(layer, &batch, staged.out)?;
        dev.stage_up(io, out)?;
        st.stats.host_round_trips += 1;
        st.stats.bytes_to_host += 4 * (n * d + 2 * n * k_used) as u64;
        st.stats.bytes_to_device += 4 * (n * d) as u64;
        Ok(())
    }
}

/// The staging buffers of the host round trip for `n` tokens of width `d` and `k` slots,
/// made anew when the batch size changed.
fn staging_for<'a, B: Backend>(
    io: &'a mut Option<HostIo<B>>,
    dev: &B,
    n: usize,
    d: usize,
    k: usize,
) -> Result<&'a mut B::Staging, ExecError> {
    if io.as_ref().is_none_or(|io| io.n != n) {
        *io = None;
        *io = Some(HostIo {
            n,
            io: dev.staging(n * d, n * k)?,
        });
    }
    match io.as_mut() {
        Some(HostIo { io, .. }) => Ok(io),
        None => Err(ExecError::Cache("no staging buffers".into())),
    }
}

/// The routed experts of layer `layer`, or a placement error for a layer without.
fn experts_of<B: Backend>(
    arch: &dyn DeviceLayers<B>,
    layer: usize,
) -> Result<ExpertTensors<'_>, ExecError> {
    arch.layer_experts(layer)
        .ok_or_else(|| ExecError::Placement(format!("layer {layer} has no experts")))
}

/// The distinct valid expert ids of `chosen` (ascending) and `chosen` renumbered to positions
/// in that list; ids outside `0..n_expert` become -1 (the `moe` kernel gives them zero rows).
pub(crate) fn compact_ids(chosen: &[i32], n_expert: usize) -> (Vec<usize>, Vec<i32>) {
    let valid = |e: i32| usize::try_from(e).ok().filter(|&e| e < n_expert);
    let mut ids: Vec<usize> = chosen.iter().filter_map(|&e| valid(e)).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut slot = vec![-1i32; n_expert];
    for (i, &e) in ids.iter().enumerate() {
        slot[e] = i as i32;
    }
    let remapped = chosen
        .iter()
        .map(|&e| valid(e).map_or(-1, |e| slot[e]))
        .collect();
    (ids, remapped)
}

impl<B: Backend> LanguageModel for DeviceModel<B> {
    fn n_vocab(&self) -> usize {
        self.arch.dims().n_vocab
    }
    fn n_ctx_train(&self) -> usize {
        self.arch.dims().n_ctx_train
    }
    /// A handle of the device cache: positions only (see the module docs).
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        self.arch.new_cache(ty, n_ctx, n_ubatch)
    }
    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(DeviceModel::<B>::forward(self, cache, tokens, wanted)?)
    }
    fn gguf(&self) -> &GgufModel {
        self.arch.gguf()
    }
    fn kv_bytes(&self, cache: &KvCache) -> u64 {
        DeviceModel::<B>::kv_bytes(self, cache)
    }
    /// `None` on the CPU: nothing crosses a bus.
    fn device_stats(&self) -> Option<ExecStats> {
        (!self.dev.is_host()).then(|| self.stats())
    }
    /// `None` on the CPU, whose K/V and weights are RAM.
    fn device_memory(&self) -> Option<DeviceMemory> {
        (!self.dev.is_host())
            .then(|| DeviceModel::<B>::device_memory(self).ok())
            .flatten()
    }
    fn moe_cache_stats(&self) -> Option<MoeCacheStats> {
        Some(DeviceModel::<B>::moe_cache_stats(self)).filter(|s| s.budget_bytes > 0)
    }
    fn retain_caches(&self, busy: &[&KvCache], idle: &[&KvCache]) {
        DeviceModel::<B>::retain_caches(self, busy, idle)
    }
    fn cache_held(&self, cache: &KvCache) -> bool {
        DeviceModel::<B>::cache_held(self, cache)
    }
    /// Every sequence's tokens in one micro-batch, each over its own device cache (see
    /// [`DeviceModel::forward_multi`]).
    fn forward_multi(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        Ok(DeviceModel::<B>::forward_multi(self, seqs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{Rope, RopeScaling};

    /// The kernel's cos/sin (computed on the host as the kernel does) are the CPU engine's,
    /// bit for bit, for gpt-oss's YaRN, for Qwen3's long-context YaRN, for linear scaling,
    /// for plain RoPE and for llama 3's frequency factors.
    #[test]
    fn device_rope_params_match_the_cpu_engine() {
        let yarn_qwen = RopeScaling::Yarn {
            factor: 4.0,
            n_ctx_orig: 32_768,
            attn_factor: 1.0 / (1.0 + 0.1 * 4f32.ln()) * (0.1 * 4f32.ln() + 1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let ropes = [
            Rope::new(64, 150_000.0, Some((32.0, 4096))),
            Rope::new(64, 150_000.0, None),
            Rope::scaled(128, 1e6, yarn_qwen),
            Rope::scaled(64, 10_000.0, RopeScaling::Linear { factor: 2.0 }),
            Rope::new(64, 500_000.0, None)
                .with_freq_factors((0..32).map(|i| 1.0 + i as f32 * 0.75).collect()),
        ];
        for rope in &ropes {
            let rp = rope.device_params().expect("factors the contract holds");
            let mut cs = Vec::new();
            for pos in [0usize, 1, 2, 17, 127, 128, 4095, 4096, 70_000, 131_071] {
                rope.cache(pos, &mut cs);
                assert_eq!(cs.len(), rp.n_dims / 2);
                for (pair, &(c, s)) in cs.iter().enumerate() {
                    let (gc, gs) = rp.cos_sin(pos as i32, pair);
                    assert_eq!(
                        (gc.to_bits(), gs.to_bits()),
                        (c.to_bits(), s.to_bits()),
                        "{rope:?} pos {pos} pair {pair}: ({gc}, {gs}) vs ({c}, {s})"
                    );
                }
            }
        }
        let too_many = Rope::new(512, 10_000.0, None).with_freq_factors(vec![1.0; 256]);
        assert!(
            too_many.device_params().is_none(),
            "more factors than the contract holds"
        );
    }

    #[test]
    fn device_cache_actions() {
        use KvAction::*;
        let g = (4096, 512);
        assert_eq!(kv_action(None, g, 0), Allocate, "first sequence");
        assert_eq!(kv_action(None, g, 5), Mismatch, "nothing on the GPU yet");
        assert_eq!(kv_action(Some((g, 10)), g, 10), Continue, "next step");
        assert_eq!(kv_action(Some((g, 10)), g, 4), Continue, "truncated");
        assert_eq!(kv_action(Some((g, 10)), g, 0), Continue, "cleared");
        assert_eq!(
            kv_action(Some((g, 10)), g, 11),
            Mismatch,
            "ahead of the GPU"
        );
        assert_eq!(
            kv_action(Some((g, 10)), (512, 512), 0),
            Allocate,
            "new size"
        );
        assert_eq!(kv_action(Some((g, 10)), (512, 512), 3), Mismatch);
    }

    #[test]
    fn op_offload_renumbers_the_routed_experts() {
        let (ids, remapped) = compact_ids(&[7, 2, 7, 5, 2, 9, -1, 8], 8);
        assert_eq!(ids, vec![2, 5, 7]);
        assert_eq!(remapped, vec![2, 0, 2, 1, 0, -1, -1, -1]);
        let (ids, remapped) = compact_ids(&[], 4);
        assert!(ids.is_empty() && remapped.is_empty());
    }

    #[test]
    fn errors_become_model_errors() {
        let e: ModelError = ExecError::Cache("x".into()).into();
        assert!(e.to_string().contains("device KV cache: x"), "{e}");
        let e: ModelError = ExecError::Model(ModelError::MissingTensor("t".into())).into();
        assert!(matches!(e, ModelError::MissingTensor(_)));
        let oom = BackendError::OutOfMemory {
            device: "REF0".into(),
            what: "alloc",
            requested: 3 << 20,
            free: 1 << 20,
            total: 8 << 20,
        };
        let e: ModelError = ExecError::Backend(oom).into();
        assert!(e.to_string().starts_with("REF0: out of memory"), "{e}");
        assert!(e.to_string().contains("2.0 MiB missing"), "{e}");
    }
}
