//! The device executor (issue #5, moved below the devices by issue #15): gpt-oss with the
//! dense part of every layer on a device of the contract ([`hmoe_backend::Backend`]: a CUDA
//! GPU, or the reference device `REF0`) and each layer's routed experts where the placement
//! puts them.
//!
//! This file holds the architecture's side of device execution; the devices know no
//! architecture. (It is still gpt-oss only, beside the CPU forward in `gpt_oss.rs`; issue #15
//! folds both into one forward over the contract.)
//!
//! Per micro-batch the token ids and positions go up (two small copies), then, per layer, on
//! the device: RMSNorm, Q/K/V with their biases, NeoX RoPE with YaRN ([`rope_params`]), the K/V
//! store into the layer's K/V rings (of the cache's `-ctk`/`-ctv` types, [`device_kv_layouts`]),
//! attention with sinks (sliding window on even layers),
//! the output projection with its bias and the residual add, RMSNorm, the router with its
//! bias and the top-k softmax; then the layer's experts:
//!
//! - [`ExpertHome::Device`]: the `moe` op over the layer's experts, uploaded at load;
//! - [`ExpertHome::Host`]: one round trip. The normed hidden state, the chosen experts and
//!   their weights come down into the device's staging buffers (pinned on CUDA), the host runs
//!   the layer's experts over the file mapping with the CPU engine's own code
//!   ([`GptOss::run_host_experts`]), and the weighted sum goes back up.
//!
//! After the last layer: output norm and head on the device, and the logits come down. With
//! every layer's experts on the device nothing crosses the bus between the ids and the logits.
//!
//! Numerics: the CPU engine's. Products convert activations as ggml does (Q8_0 blocks for
//! Q8_0/MXFP4 weights, f16/bf16 for F16/BF16) and sum Q8_0, MXFP4 and F32 products in the CPU
//! engine's order; attention stores and reads the K/V rings as the CPU engine's cache does
//! (f32, f16, bf16 and the block types, rotated as llama.cpp rotates quantized heads) and
//! takes its path for the value type (the row kernel over float values, flash attention over
//! block-quantized ones). On [`hmoe_backend::Ref0`] the logits are the CPU engine's
//! bit for bit on the gpt-oss fixtures. On a GPU what still differs is cuBLAS's order for
//! batches of F16/BF16 weights, the GPU's `cosf`/`sinf` in RoPE, and F16/BF16 summation
//! orders; on models whose routing is that sensitive (the synthetic Q8_0/MXFP4 fixtures) a
//! last bit can still flip an expert choice.
//!
//! Several sequences at once ([`LanguageModel::forward_multi`], continuous batching): each
//! sequence has its own K/V cache on the device, and one micro-batch carries every sequence's
//! tokens, so a CPU-expert layer still makes one round trip per micro-batch. The result is
//! batch-invariant, as the CPU engine's (`gpt_oss/batch.rs`): row-wise ops (embedding, norms,
//! biases, RoPE with each token's position, routing, Q8_0/MXFP4/F16/BF16 products) run over
//! the whole micro-batch, attention runs per sequence over its cache, and the products the CPU
//! engine sums in another order for a batch than for one token (F32 weights, and the experts
//! of a layer with F32 experts, which the `moe` op sums by how many tokens route to each) run
//! per sequence on exactly the rows the sequence alone would have. On
//! [`hmoe_backend::Ref0`] every sequence's logits are then the CPU engine's bit for bit.
//!
//! Device caches: the [`KvCache`] that [`LanguageModel::new_cache`] hands out holds positions
//! only (see [`GptOss::new_position_cache`]); the executor keeps one device cache per handle,
//! told apart by the handle's own allocation (which stays put while the handle lives, even
//! when the handle moves). A handle at position 0 starts a new sequence (its device cache is
//! reallocated when its size differs); one that went back ([`KvCache::truncate`]) continues
//! from there; one ahead of what the device holds is an error. A dropped handle cannot be
//! seen, so device caches are freed by need: before a new sequence's cache is allocated, the
//! least recently used caches of sequences outside the step are freed until the device has
//! room for it and a micro-batch's scratch buffers ([`DeviceGptOss::scratch_bytes`]), and
//! again if the allocation still runs out of memory. A handle whose cache was freed can
//! only start again from position 0 ([`LanguageModel::cache_held`] tells). An owner of every
//! live handle (the server's slots) names them with [`LanguageModel::retain_caches`]: the
//! caches of other handles are freed then, and those of busy sequences are never freed to
//! make room for another.
//!
//! Limits of this executor:
//! - **K/V types the device keeps** ([`Backend::supports_kv`]; REF0 every `-ctk`/`-ctv` pair):
//!   a cache of another type is an error (the CLI chooses the CPU engine then).
//! - **Op offload overlaps large batches only**: a micro-batch of at least the placement's
//!   `op_offload_min_batch` tokens runs a host layer on the device with the experts it routes
//!   to uploaded from the file mapping for that batch (on CUDA through pinned buffers that the
//!   CPU pool fills while the copy engine drains them, on the device's copy stream). When the
//!   batch routes to nearly every expert ([`PREFETCH_ROUTES_PER_EXPERT`]) every expert is
//!   uploaded, and the next host layer's upload starts as soon as this layer's MoE is queued,
//!   so that it overlaps this layer's compute; the device then holds two layers' experts,
//!   which it does only while its free memory has room for them ([`PREFETCH_RESERVE_BYTES`]
//!   more). Smaller batches wait for the routing and upload the chosen experts only.

use std::sync::{Mutex, PoisonError};

use std::ops::Range;

use hmoe_backend::{
    AttnParams, Backend, BackendError, GatedAct, KvLayout, KvRing, RopeParams, TransferCounts,
};
use hmoe_gguf::GgufModel;
use hmoe_quant::GgmlType;

use crate::hybrid::{ExpertTensors, SWIGLU_ALPHA, SWIGLU_LIMIT};
use crate::kv_cache::CacheType;
use crate::{
    DeviceMemory, ExpertBatch, ExpertDeviceError, ExpertHome, ExpertPlacement, GptOss,
    GptOssParams, KvCache, KvType, LanguageModel, LogitsWanted, ModelError, SeqBatch,
};

/// gpt-oss's expert activation as the contract's `moe` op takes it.
const EXPERT_ACT: GatedAct = GatedAct::ClampedSwiglu {
    alpha: SWIGLU_ALPHA,
    limit: SWIGLU_LIMIT,
};

/// What can go wrong loading or running gpt-oss on a device.
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

/// The RoPE parameters of a gpt-oss model in the kernel's form, equal to those of the CPU
/// engine's `Rope::new(head_dim, rope_freq_base, yarn)` (YaRN with beta_fast 32, beta_slow 1,
/// and llama.cpp's attention factor that cancels ggml's own magnitude factor).
pub fn rope_params(p: &GptOssParams) -> RopeParams {
    match p.yarn {
        None => RopeParams::plain(p.head_dim, p.rope_freq_base),
        Some((factor, n_ctx_orig)) => {
            let mscale = 0.1 * factor.ln() + 1.0;
            let attn_factor = mscale * (1.0 / (1.0 + 0.1 * factor.ln()));
            RopeParams::yarn(
                p.head_dim,
                p.rope_freq_base,
                factor,
                n_ctx_orig,
                attn_factor,
                32.0,
                1.0,
            )
        }
    }
}

/// Cells of each layer's K/V ring for a context of `n_ctx` and micro-batches of `n_ubatch`
/// tokens, as the CPU cache sizes them: a sliding layer keeps `window + n_ubatch` cells (at
/// most `n_ctx`), a full layer `n_ctx`.
pub fn kv_cells(p: &GptOssParams, n_ctx: usize, n_ubatch: usize) -> Vec<usize> {
    let n_ubatch = n_ubatch.max(1);
    (0..p.n_layer)
        .map(|l| p.window(l).map_or(n_ctx, |w| n_ctx.min(w + n_ubatch)))
        .collect()
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
/// sequences multiplies it per sequence: F32 weights, whose products the CPU engine sums in
/// one order for a single token and in another for several.
struct DevMat<B: Backend> {
    m: B::Matrix,
    rows: usize,
    cols: usize,
    per_seq: bool,
}

/// One layer's weights on the device.
struct LayerWeights<B: Backend> {
    attn_norm: B::Buf<f32>,
    wq: DevMat<B>,
    wk: DevMat<B>,
    wv: DevMat<B>,
    wo: DevMat<B>,
    bq: B::Buf<f32>,
    bk: B::Buf<f32>,
    bv: B::Buf<f32>,
    bo: B::Buf<f32>,
    sinks: B::Buf<f32>,
    ffn_norm: B::Buf<f32>,
    router: DevMat<B>,
    router_b: B::Buf<f32>,
    /// The routed experts, for a [`ExpertHome::Device`] layer.
    experts: Option<B::Moe>,
    /// Whether the experts are F32 (the `moe` op then runs per sequence of a micro-batch:
    /// it sums an expert's products in another order when several tokens route to it).
    experts_per_seq: bool,
}

/// A layer's expert inputs on the device for a micro-batch: normed hidden state, router
/// logits, chosen experts and their weights (of every token), the sequences' rows, and whether
/// the experts run per sequence (F32 experts, several sequences).
struct Routing<'a, B: Backend> {
    h: &'a B::Buf<f32>,
    scores: &'a B::Buf<f32>,
    sel: &'a B::Buf<i32>,
    wts: &'a B::Buf<f32>,
    groups: &'a [Range<usize>],
    per_seq: bool,
}

/// One layer's K and V rings on the device (each of its [`KvLayout`]'s type and cells).
struct LayerKv<B: Backend> {
    k: KvRing<B>,
    v: KvRing<B>,
}

/// The layouts of one layer's K and V rings of `cells` cells for K/V types `ty`: rows of
/// `n_head_kv × head_dim` values, rotated as the CPU engine's cache rotates them
/// ([`KvLayout::rotation`]).
pub fn device_kv_layouts(
    p: &GptOssParams,
    ty: KvType,
    cells: usize,
) -> Result<(KvLayout, KvLayout), BackendError> {
    let (hd, width) = (p.head_dim, p.n_head_kv * p.head_dim);
    let layout = |t: CacheType, key: bool| {
        let ty = t.ggml_type();
        KvLayout::new(ty, width, cells, KvLayout::rotation(ty, hd, key))
    };
    Ok((layout(ty.k(), true)?, layout(ty.v(), false)?))
}

/// One sequence's K/V cache on the device.
struct DeviceKv<B: Backend> {
    /// The handle it stands for ([`handle_of`]).
    handle: usize,
    /// `(n_ctx, n_ubatch)` of the handle it was made for.
    geometry: (usize, usize),
    /// Its K/V types.
    ty: KvType,
    /// Positions stored.
    held: usize,
    /// When it was last used ([`State::clock`]).
    last_used: u64,
    /// Bytes of its K/V buffers.
    bytes: u64,
    layers: Vec<LayerKv<B>>,
}

/// The identity of a cache handle: the address of its layer list, which is allocated with the
/// handle and stays put while the handle lives (moving a [`KvCache`] does not move it).
fn handle_of(cache: &KvCache) -> usize {
    cache.layers.as_ptr() as usize
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
}

impl<B: Backend> Default for State<B> {
    fn default() -> Self {
        State {
            kvs: Vec::new(),
            clock: 0,
            busy: Vec::new(),
            io: None,
            stats: ExecStats::default(),
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

/// gpt-oss with its dense part on a device `B` and each layer's routed experts where an
/// [`ExpertPlacement`] puts them (see the module docs for the data flow and the limits).
pub struct DeviceGptOss<B: Backend> {
    host: GptOss,
    dev: B,
    rope: RopeParams,
    tok_embd: DevMat<B>,
    output_norm: B::Buf<f32>,
    output: DevMat<B>,
    layers: Vec<LayerWeights<B>>,
    homes: Vec<ExpertHome>,
    op_offload_min_batch: Option<usize>,
    weight_bytes: u64,
    state: Mutex<State<B>>,
}

/// Uploads the matrix `name` (`[cols, rows…]` in ggml order) in its file encoding.
fn upload_matrix<B: Backend>(dev: &B, g: &GgufModel, name: &str) -> Result<DevMat<B>, ExecError> {
    let info = g
        .tensor_info(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let cols = info.dims.first().copied().unwrap_or(0) as usize;
    let rows = info.dims.iter().skip(1).product::<u64>() as usize;
    Ok(DevMat {
        m: dev.upload_matrix(info.ty, rows, cols, g.data_of(info))?,
        rows,
        cols,
        per_seq: info.ty == GgmlType::F32,
    })
}

/// Uploads the small tensor `name` (norm, bias, sinks) dequantized to f32.
fn upload_f32<B: Backend>(dev: &B, g: &GgufModel, name: &str) -> Result<B::Buf<f32>, ExecError> {
    let info = g
        .tensor_info(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let mut v = vec![0f32; info.n_elements as usize];
    hmoe_quant::dequantize_row(info.ty, g.data_of(info), &mut v).map_err(ModelError::from)?;
    Ok(dev.upload(&v)?)
}

impl<B: Backend> DeviceGptOss<B> {
    /// Loads `gguf` (checked as [`GptOss::load`] checks it) onto `dev`: every dense weight,
    /// and the routed experts of the layers `placement` puts on the device. The experts of the
    /// other layers stay in the file mapping and run on the host.
    pub fn load(
        gguf: GgufModel,
        dev: B,
        placement: &ExpertPlacement,
    ) -> Result<DeviceGptOss<B>, ExecError> {
        let host = GptOss::load(gguf)?;
        let p = host.params().clone();
        if placement.layers.len() != p.n_layer {
            return Err(ExecError::Placement(format!(
                "{} layer homes for a {}-layer model",
                placement.layers.len(),
                p.n_layer
            )));
        }
        let g = host.gguf();
        let mut weight_bytes = 0u64;
        let mut layers = Vec::with_capacity(p.n_layer);
        for (l, home) in placement.layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{l}.{s}");
            let m = |s: &str| upload_matrix(&dev, g, &n(s));
            let f = |s: &str| upload_f32(&dev, g, &n(s));
            let experts = match home {
                ExpertHome::Host => None,
                ExpertHome::Device => Some(dev.upload_moe(&experts_of(&host, l)?, None)?),
            };
            let lw = LayerWeights {
                attn_norm: f("attn_norm.weight")?,
                wq: m("attn_q.weight")?,
                wk: m("attn_k.weight")?,
                wv: m("attn_v.weight")?,
                wo: m("attn_output.weight")?,
                bq: f("attn_q.bias")?,
                bk: f("attn_k.bias")?,
                bv: f("attn_v.bias")?,
                bo: f("attn_output.bias")?,
                sinks: f("attn_sinks.weight")?,
                ffn_norm: f("post_attention_norm.weight")?,
                router: m("ffn_gate_inp.weight")?,
                router_b: f("ffn_gate_inp.bias")?,
                experts,
                experts_per_seq: host
                    .layer_experts(l)
                    .is_some_and(|t| t.gate.ty == GgmlType::F32),
            };
            weight_bytes += layer_bytes::<B>(&lw);
            layers.push(lw);
        }
        let tok_embd = upload_matrix(&dev, g, "token_embd.weight")?;
        let output = upload_matrix(&dev, g, "output.weight")?;
        let output_norm = upload_f32(&dev, g, "output_norm.weight")?;
        weight_bytes += (B::matrix_bytes(&tok_embd.m)
            + B::matrix_bytes(&output.m)
            + 4 * B::buf_len(&output_norm)) as u64;
        dev.synchronize()?;
        Ok(DeviceGptOss {
            rope: rope_params(&p),
            dev,
            tok_embd,
            output_norm,
            output,
            layers,
            homes: placement.layers.clone(),
            op_offload_min_batch: placement.op_offload_min_batch,
            weight_bytes,
            state: Mutex::new(State::default()),
            host,
        })
    }

    /// The hyperparameters.
    pub fn params(&self) -> &GptOssParams {
        self.host.params()
    }

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
    /// [`LanguageModel::new_cache`]) and returns `n_vocab` logits per wanted token, as
    /// [`GptOss::forward`] does.
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
            GptOss::advance_positions(cache, chunk.len());
            st.kvs[kv].held = cache.n_past();
        }
        Ok(logits)
    }

    /// Runs several sequences in one pass: every sequence's tokens in one micro-batch (one
    /// round trip per CPU-expert layer for all of them), each at the next positions of its own
    /// cache; returns the last token's logits of the sequences that want them (empty vectors
    /// for the others). Each result equals [`DeviceGptOss::forward`] with
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
            GptOss::advance_positions(s.cache, s.tokens.len());
            st.kvs[m.kv].held = s.cache.n_past();
        }
        Ok(out)
    }

    /// Checks a sequence's tokens and cache before anything runs: token ids, room in the
    /// context, K/V types the device keeps ([`Backend::supports_kv`]) with heads of whole blocks.
    fn check_input(&self, cache: &KvCache, tokens: &[u32]) -> Result<(), ExecError> {
        let n_vocab = self.host.params().n_vocab;
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
        let hd = self.host.params().head_dim;
        if !self.dev.supports_kv(ty.k().ggml_type(), ty.v().ggml_type()) {
            return Err(ExecError::Cache(format!(
                "K {} / V {}: {} does not keep this K/V cache",
                ty.k(),
                ty.v(),
                self.dev.name()
            )));
        }
        for (which, t) in [("K", ty.k()), ("V", ty.v())] {
            if !hd.is_multiple_of(t.block_elems()) {
                return Err(ExecError::Cache(format!(
                    "{which} {t}: attention heads of {hd} are not whole blocks of {} (llama.cpp \
                     refuses this too)",
                    t.block_elems()
                )));
            }
        }
        Ok(())
    }

    /// Bytes of the scratch buffers of a micro-batch of `n_tokens` tokens with every token's
    /// logits: what a new sequence's cache leaves free on the device (see the module docs).
    /// The per-sequence copies of a batch of several sequences take at most as much again,
    /// which the estimate counts too.
    pub fn scratch_bytes(&self, n_tokens: usize) -> u64 {
        let p = self.host.params();
        let (qw, kvw) = (p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
        let k = p.n_expert_used;
        let per_token = 5 * p.n_embd + 2 * qw + 2 * kvw + p.n_expert + 2 * k;
        (4 * n_tokens * (2 * per_token + p.n_embd + p.n_vocab)) as u64
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
                let p = self.host.params();
                let cells = kv_cells(p, geometry.0, geometry.1);
                let layouts = |cells: usize| device_kv_layouts(p, ty, cells);
                let kv_bytes: usize = (cells.iter())
                    .map(|&c| layouts(c).map(|(k, v)| k.bytes() + v.bytes()))
                    .sum::<Result<_, _>>()?;
                let need = kv_bytes as u64 + self.scratch_bytes(geometry.1);
                while self.dev.free_memory()?.is_some_and(|free| free < need) && st.evict_idle(keep)
                {
                }
                let alloc = || {
                    cells
                        .iter()
                        .map(|&cells| {
                            let (k, v) = layouts(cells)?;
                            Ok(LayerKv {
                                k: self.dev.kv_alloc(k)?,
                                v: self.dev.kv_alloc(v)?,
                            })
                        })
                        .collect::<Result<Vec<_>, BackendError>>()
                };
                let layers = loop {
                    match alloc() {
                        Err(BackendError::OutOfMemory { .. }) if st.evict_idle(keep) => {}
                        other => break other?,
                    }
                };
                st.kvs.push(DeviceKv {
                    handle,
                    geometry,
                    ty,
                    held: 0,
                    last_used: clock,
                    bytes: kv_bytes as u64,
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
        let p = self.host.params();
        let (d, hd) = (p.n_embd, p.head_dim);
        let (qw, kvw) = (p.n_head * hd, p.n_head_kv * hd);
        let (ne, k_used) = (p.n_expert, p.n_expert_used);
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
        let mut x = dev.alloc::<f32>(n * d)?;
        dev.get_rows(&self.tok_embd.m, &ids, &mut x)?;
        let mut h = dev.alloc::<f32>(n * d)?;
        let mut q = dev.alloc::<f32>(n * qw)?;
        let mut k = dev.alloc::<f32>(n * kvw)?;
        let mut v = dev.alloc::<f32>(n * kvw)?;
        let mut att = dev.alloc::<f32>(n * qw)?;
        let mut o = dev.alloc::<f32>(n * d)?;
        let mut scores = dev.alloc::<f32>(n * ne)?;
        let mut sel = dev.alloc::<i32>(n * k_used)?;
        let mut wts = dev.alloc::<f32>(n * k_used)?;
        let mut moe = dev.alloc::<f32>(n * d)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let offload = self.op_offload_min_batch.is_some_and(|m| n >= m);
        let upload_all = offload && n * k_used >= PREFETCH_ROUTES_PER_EXPERT * ne;
        // The next host layer's experts, uploading while the layers before it run.
        let mut prefetched: Option<(usize, B::Moe)> = None;
        for (l, lw) in self.layers.iter().enumerate() {
            dev.rms_norm(&x, &lw.attn_norm, p.rms_eps, &mut h)?;
            self.matmul(&lw.wq, &h, &groups, &mut q)?;
            dev.add_bias(&mut q, &lw.bq)?;
            self.matmul(&lw.wk, &h, &groups, &mut k)?;
            dev.add_bias(&mut k, &lw.bk)?;
            self.matmul(&lw.wv, &h, &groups, &mut v)?;
            dev.add_bias(&mut v, &lw.bv)?;
            dev.rope_neox(&mut q, &pos, p.n_head, hd, &self.rope)?;
            dev.rope_neox(&mut k, &pos, p.n_head_kv, hd, &self.rope)?;
            for (m, g) in members.iter().zip(&groups) {
                let kv = st
                    .kvs
                    .get_mut(m.kv)
                    .and_then(|kv| kv.layers.get_mut(l))
                    .ok_or_else(|| ExecError::Cache("no device cache for this layer".into()))?;
                let ap = AttnParams {
                    n_head: p.n_head,
                    n_head_kv: p.n_head_kv,
                    head_dim: hd,
                    cells: kv.k.layout.cells,
                    window: p.window(l),
                    scale,
                };
                let nt = g.len();
                if members.len() == 1 {
                    dev.kv_store(&k, &mut kv.k, nt, m.pos0)?;
                    dev.kv_store(&v, &mut kv.v, nt, m.pos0)?;
                    dev.attention(&ap, &q, &kv.k, &kv.v, Some(&lw.sinks), nt, m.pos0, &mut att)?;
                    continue;
                }
                let ks = dev.copy_range(&k, g.start * kvw..g.end * kvw)?;
                let vs = dev.copy_range(&v, g.start * kvw..g.end * kvw)?;
                let qs = dev.copy_range(&q, g.start * qw..g.end * qw)?;
                dev.kv_store(&ks, &mut kv.k, nt, m.pos0)?;
                dev.kv_store(&vs, &mut kv.v, nt, m.pos0)?;
                let mut a = dev.alloc::<f32>(nt * qw)?;
                dev.attention(&ap, &qs, &kv.k, &kv.v, Some(&lw.sinks), nt, m.pos0, &mut a)?;
                dev.copy_into(&a, &mut att, g.start * qw)?;
            }
            self.matmul(&lw.wo, &att, &groups, &mut o)?;
            dev.add_bias(&mut o, &lw.bo)?;
            dev.add_assign(&mut x, &o)?;
            dev.rms_norm(&x, &lw.ffn_norm, p.rms_eps, &mut h)?;
            self.matmul(&lw.router, &h, &groups, &mut scores)?;
            dev.add_bias(&mut scores, &lw.router_b)?;
            dev.router_top_k(&scores, ne, k_used, &mut sel, &mut wts)?;
            let per_seq = lw.experts_per_seq && groups.len() > 1;
            let routed = Routing {
                h: &h,
                scores: &scores,
                sel: &sel,
                wts: &wts,
                groups: &groups,
                per_seq,
            };
            match &lw.experts {
                Some(experts) => self.device_moe(experts, &routed, &mut moe)?,
                None if upload_all => {
                    let w = match prefetched.take() {
                        Some((pl, w)) if pl == l => w,
                        _ => self.upload_offloaded(st, l, None)?,
                    };
                    self.device_moe(&w, &routed, &mut moe)?;
                    // Queued behind this layer's work: the next host layer's upload, which
                    // the CPU pool gathers while the device computes.
                    let next =
                        (l + 1..self.layers.len()).find(|&j| self.layers[j].experts.is_none());
                    if let Some(nl) = next.filter(|&nl| self.room_for_experts(nl)) {
                        prefetched = Some((nl, self.upload_offloaded(st, nl, None)?));
                        st.stats.prefetched_layers += 1;
                    }
                }
                None if offload => self.offloaded_experts(st, l, &routed, &mut moe)?,
                None => self.host_experts(st, l, &routed, &mut moe)?,
            }
            dev.add_assign(&mut x, &moe)?;
        }
        st.stats.ubatches += 1;
        self.logits(members, &groups, x)
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
        let p = self.host.params();
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
        let mut og = out_groups.iter();
        Ok(wanted
            .iter()
            .map(|w| match w.as_ref().and_then(|_| og.next()) {
                Some(g) => all[g.start * p.n_vocab..g.end * p.n_vocab].to_vec(),
                None => Vec::new(),
            })
            .collect())
    }

    /// The `moe` op of a layer over the whole micro-batch, or, when the routing says so
    /// ([`Routing::per_seq`]), per sequence: each sequence's rows with its own routing.
    fn device_moe(
        &self,
        w: &B::Moe,
        r: &Routing<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let dev = &self.dev;
        let p = self.host.params();
        let (d, ne, k) = (p.n_embd, p.n_expert, p.n_expert_used);
        if !r.per_seq {
            return Ok(dev.moe(w, EXPERT_ACT, r.h, r.sel, r.wts, k, out)?);
        }
        for g in r.groups {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let ss = dev.copy_range(r.scores, g.start * ne..g.end * ne)?;
            let mut sel = dev.alloc::<i32>(g.len() * k)?;
            let mut wts = dev.alloc::<f32>(g.len() * k)?;
            dev.router_top_k(&ss, ne, k, &mut sel, &mut wts)?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(w, EXPERT_ACT, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// Whether the device has room for every expert of host layer `layer` beside what it holds
    /// now and [`PREFETCH_RESERVE_BYTES`] (always, on a backend without a limit; never, if the
    /// free memory cannot be read).
    fn room_for_experts(&self, layer: usize) -> bool {
        let Ok(t) = experts_of(&self.host, layer) else {
            return false;
        };
        let need = t.n_expert as u64 * t.expert_bytes() + PREFETCH_RESERVE_BYTES;
        match self.dev.free_memory() {
            Ok(free) => free.is_none_or(|free| free >= need),
            Err(_) => false,
        }
    }

    /// The experts `ids` (every one when `None`) of host layer `layer` on the device, uploaded
    /// from the file mapping for op offload and counted in the stats.
    fn upload_offloaded(
        &self,
        st: &mut State<B>,
        layer: usize,
        ids: Option<&[usize]>,
    ) -> Result<B::Moe, ExecError> {
        let t = experts_of(&self.host, layer)?;
        let w = self.dev.upload_moe(&t, ids)?;
        let n = ids.map_or(t.n_expert, <[usize]>::len) as u64;
        st.stats.offloaded_layers += 1;
        st.stats.offloaded_experts += n;
        st.stats.offload_bytes += n * t.expert_bytes();
        Ok(w)
    }

    /// Op offload of a host layer for a large micro-batch: the chosen experts come down (one
    /// small copy), the experts they name are uploaded from the file mapping (each once, in
    /// ascending id order) with the ids renumbered to match, and the layer runs on the device
    /// (per sequence when [`Routing::per_seq`], each with its share of the renumbered ids).
    fn offloaded_experts(
        &self,
        st: &mut State<B>,
        layer: usize,
        r: &Routing<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let dev = &self.dev;
        let p = self.host.params();
        let (d, k) = (p.n_embd, p.n_expert_used);
        let chosen = dev.download(r.sel)?;
        let (ids, remapped) = compact_ids(&chosen, p.n_expert);
        let w = self.upload_offloaded(st, layer, Some(&ids))?;
        if !r.per_seq {
            let sel = dev.upload(&remapped)?;
            dev.moe(&w, EXPERT_ACT, r.h, &sel, r.wts, k, out)?;
            return Ok(());
        }
        for g in r.groups {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let wts = dev.copy_range(r.wts, g.start * k..g.end * k)?;
            let sel = dev.upload(&remapped[g.start * k..g.end * k])?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(&w, EXPERT_ACT, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// The round trip of a host layer: the normed hidden state and the routing of every
    /// token of the micro-batch down through pinned buffers in one copy, the layer's experts
    /// on the host (F32 products per sequence, as the CPU engine computes them), the sum up
    /// into `out`.
    fn host_experts(
        &self,
        st: &mut State<B>,
        layer: usize,
        r: &Routing<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ExecError> {
        let dev = &self.dev;
        let p = self.host.params();
        let (d, k_used) = (p.n_embd, p.n_expert_used);
        let n = r.groups.last().map_or(0, |g| g.end);
        if st.io.as_ref().is_none_or(|io| io.n != n) {
            st.io = None;
            st.io = Some(HostIo {
                n,
                io: dev.staging(n * d, n * k_used)?,
            });
        }
        let Some(HostIo { io, .. }) = st.io.as_mut() else {
            return Err(ExecError::Cache("no staging buffers".into()));
        };
        dev.stage_down(io, r.h, r.sel, r.wts)?;
        let staged = dev.staged(io)?;
        let selected: Vec<u32> = staged.sel.iter().map(|&e| e as u32).collect();
        let batch = ExpertBatch {
            h: staged.h,
            selected: &selected,
            weights: staged.w,
            n_used: k_used,
            groups: r.groups,
        };
        self.host.run_host_experts(layer, &batch, staged.out)?;
        dev.stage_up(io, out)?;
        st.stats.host_round_trips += 1;
        st.stats.bytes_to_host += 4 * (n * d + 2 * n * k_used) as u64;
        st.stats.bytes_to_device += 4 * (n * d) as u64;
        Ok(())
    }
}

/// The routed experts of layer `layer` of `host`, or a placement error for a layer without.
fn experts_of(host: &GptOss, layer: usize) -> Result<ExpertTensors<'_>, ExecError> {
    host.layer_experts(layer)
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

/// Bytes of one layer's weights on the device.
fn layer_bytes<B: Backend>(lw: &LayerWeights<B>) -> u64 {
    let mats = [&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.router]
        .iter()
        .map(|m| B::matrix_bytes(&m.m))
        .sum::<usize>();
    let vecs = [
        &lw.attn_norm,
        &lw.bq,
        &lw.bk,
        &lw.bv,
        &lw.bo,
        &lw.sinks,
        &lw.ffn_norm,
        &lw.router_b,
    ]
    .iter()
    .map(|v| 4 * B::buf_len(*v))
    .sum::<usize>();
    let experts = lw.experts.as_ref().map_or(0, B::moe_bytes);
    (mats + vecs + experts) as u64
}

impl<B: Backend> LanguageModel for DeviceGptOss<B> {
    fn n_vocab(&self) -> usize {
        self.host.params().n_vocab
    }
    fn n_ctx_train(&self) -> usize {
        self.host.params().n_ctx_train
    }
    /// A handle of the device cache: positions only (see the module docs).
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        self.host.new_position_cache(ty, n_ctx, n_ubatch)
    }
    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(DeviceGptOss::<B>::forward(self, cache, tokens, wanted)?)
    }
    fn gguf(&self) -> &GgufModel {
        self.host.gguf()
    }
    fn device_stats(&self) -> Option<ExecStats> {
        Some(self.stats())
    }
    fn device_memory(&self) -> Option<DeviceMemory> {
        DeviceGptOss::<B>::device_memory(self).ok()
    }
    fn retain_caches(&self, busy: &[&KvCache], idle: &[&KvCache]) {
        DeviceGptOss::<B>::retain_caches(self, busy, idle)
    }
    fn cache_held(&self, cache: &KvCache) -> bool {
        DeviceGptOss::<B>::cache_held(self, cache)
    }
    /// Every sequence's tokens in one micro-batch, each over its own device cache (see
    /// [`DeviceGptOss::forward_multi`]).
    fn forward_multi(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        Ok(DeviceGptOss::<B>::forward_multi(self, seqs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Rope;

    fn params(yarn: Option<(f32, u32)>) -> GptOssParams {
        GptOssParams {
            n_layer: 4,
            n_embd: 2880,
            n_head: 64,
            n_head_kv: 8,
            head_dim: 64,
            n_vocab: 201_088,
            n_expert: 128,
            n_expert_used: 4,
            n_ff_exp: 2880,
            sliding_window: 128,
            rms_eps: 1e-5,
            rope_freq_base: 150_000.0,
            yarn,
            n_ctx_train: 131_072,
        }
    }

    /// The kernel's cos/sin (computed on the host as the kernel does) are the CPU engine's,
    /// bit for bit, for gpt-oss's YaRN and for plain RoPE.
    #[test]
    fn rope_params_match_the_cpu_engine() {
        for yarn in [Some((32.0, 4096)), None] {
            let p = params(yarn);
            let rp = rope_params(&p);
            let rope = Rope::new(p.head_dim, p.rope_freq_base, p.yarn);
            let mut cs = Vec::new();
            for pos in [0usize, 1, 2, 17, 127, 128, 4095, 4096, 70_000, 131_071] {
                rope.cache(pos, &mut cs);
                assert_eq!(cs.len(), p.head_dim / 2);
                for (pair, &(c, s)) in cs.iter().enumerate() {
                    let (gc, gs) = rp.cos_sin(pos as i32, pair);
                    assert_eq!(
                        (gc.to_bits(), gs.to_bits()),
                        (c.to_bits(), s.to_bits()),
                        "yarn {yarn:?} pos {pos} pair {pair}: ({gc}, {gs}) vs ({c}, {s})"
                    );
                }
            }
        }
    }

    #[test]
    fn kv_rings_are_sized_as_the_cpu_cache() {
        let p = params(None);
        assert_eq!(kv_cells(&p, 4096, 512), vec![640, 4096, 640, 4096]);
        assert_eq!(kv_cells(&p, 300, 512), vec![300; 4], "never above n_ctx");
        assert_eq!(kv_cells(&p, 4096, 0), vec![129, 4096, 129, 4096]);
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
