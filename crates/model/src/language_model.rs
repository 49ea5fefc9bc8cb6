//! What the engine needs from a model ([`LanguageModel`]) and what it passes in and gets
//! back: the logits it wants, one sequence's share of a batched step, the device memory.

use crate::error::ModelError;
use crate::kv_snapshot::KvSnapshot;
use crate::sequence::KvCache;
use hmoe_backend::{KvType, TransferCounts};

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last token of the batch (generation).
    Last,
    /// Every token of the batch (teacher forcing, perplexity).
    All,
    /// No logits: every token's final hidden state after the output norm (the head's input),
    /// `n_embd` floats each (embeddings, which the server pools).
    Hidden,
}

/// One sequence's share of a multi-sequence forward pass ([`LanguageModel::forward_multi`]).
pub struct SeqBatch<'c, 't> {
    /// The sequence's cache; `tokens` go to its next positions.
    pub cache: &'c mut KvCache,
    /// Tokens to run (a prompt chunk or one decode token).
    pub tokens: &'t [u32],
    /// Whether to return the logits of the last token (`n_vocab` floats); when false an
    /// empty vector is returned for this sequence.
    pub logits: bool,
}

/// A token's logits as [`LanguageModel::forward_multi_top`] returns them.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenLogits {
    /// The whole row, `n_vocab` floats (empty for a sequence that wanted none).
    Full(Vec<f32>),
    /// The `k` best `(id, logit)` pairs the sequence asked for (all of them for a smaller
    /// vocabulary), best first in [`hmoe_backend::top_k_key`]'s order: by value with
    /// `f32::total_cmp`, ties to the lower id. Only for a row whose best logit is a number
    /// other than zero (a NaN or a zero at the top brings the whole row down instead).
    Top(Vec<(u32, f32)>),
}

impl TokenLogits {
    /// The whole row, or `None` for the best logits alone.
    pub fn into_full(self) -> Option<Vec<f32>> {
        match self {
            TokenLogits::Full(v) => Some(v),
            TokenLogits::Top(_) => None,
        }
    }
}

/// Memory a model holds on its device now ([`LanguageModel::device_memory`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device (`CUDA0`, `REF0`).
    pub device: String,
    /// Weights uploaded at load.
    pub weight_bytes: u64,
    /// The K/V caches of every sequence it holds.
    pub kv_bytes: u64,
    /// What the device reports free (`None`: a device with no limit to report).
    pub free_bytes: Option<u64>,
}

/// What the engine needs from any architecture.
pub trait LanguageModel: Send + Sync {
    /// Vocabulary size (length of each logits row).
    fn n_vocab(&self) -> usize;
    /// Width of the hidden state (length of each [`LogitsWanted::Hidden`] row).
    fn n_embd(&self) -> usize;
    /// Context length the model was trained for.
    fn n_ctx_train(&self) -> usize;
    /// A fresh KV cache for `n_ctx` positions and micro-batches of `n_ubatch` tokens.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache;
    /// Runs `tokens` at the next positions of `cache`; returns `n_vocab` logits per wanted token
    /// (`n_embd` hidden floats per token for [`LogitsWanted::Hidden`]).
    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError>;
    /// The file(s) the weights live in (metadata for tokenizer and chat template).
    fn gguf(&self) -> &hmoe_gguf::GgufModel;
    /// Bytes of K/V a cache of `cache`'s types and geometry holds on the device once its
    /// positions are filled.
    fn kv_bytes(&self, cache: &KvCache) -> u64;
    /// What the executor counted (micro-batches, round trips at the expert boundary, the
    /// device's transfers), for a model on a GPU or REF0; `None` on the CPU.
    fn device_stats(&self) -> Option<ExecStats>;
    /// The memory the model holds on its device, for a model on a GPU or REF0; `None` on the
    /// CPU.
    fn device_memory(&self) -> Option<DeviceMemory>;
    /// What the device expert cache (`--moe-cache`) counted and holds, for a model on a
    /// device with the cache enabled; `None` otherwise.
    fn moe_cache_stats(&self) -> Option<MoeCacheStats>;
    /// The handles that are alive, from an owner that holds every live handle of this model
    /// (a server's slots). The K/V of `busy` sequences (under way) is never freed to make room
    /// for another sequence; that of `idle` ones may be (see [`LanguageModel::cache_held`]);
    /// that of any other handle is freed now.
    fn retain_caches(&self, busy: &[&KvCache], idle: &[&KvCache]);
    /// Whether the K/V of `cache`'s positions is still there: false when the executor freed an
    /// idle sequence's cache to make room, after which the handle can only start again from
    /// position 0 ([`KvCache::clear`]).
    fn cache_held(&self, cache: &KvCache) -> bool;
    /// The K/V of `cache`'s positions, read from the device (a slot saved to a file).
    fn export_kv(&self, cache: &KvCache) -> Result<KvSnapshot, ModelError>;
    /// Puts `snap` into `cache`: the handle then stands at `snap.n_past` with those keys and
    /// values, as if it had computed them. A snapshot whose layers or ring layouts are not
    /// those of a cache of `cache`'s types and geometry on this model is refused
    /// ([`ModelError::Cache`]) before anything changes; a failure after that leaves the
    /// handle empty (position 0).
    fn import_kv(&self, cache: &mut KvCache, snap: &KvSnapshot) -> Result<(), ModelError>;
    /// Runs several sequences in one pass (continuous batching): each sequence's tokens go to
    /// the next positions of its own cache, and every sequence's result is exactly what
    /// [`LanguageModel::forward`] would return for it alone (batch invariance).
    fn forward_multi(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError>;
    /// [`LanguageModel::forward_multi`] where a sequence `i` with `top[i] = Some(k)` (`1 ≤ k ≤
    /// hmoe_backend::TOP_K_MAX`) may get only its `k` best logits ([`TokenLogits::Top`]),
    /// ranked on the device so that the rest of the row does not cross the bus; the others
    /// get [`TokenLogits::Full`], and so may these (a step where another sequence wants the
    /// whole row, a row whose best is NaN or zero). `top` holds one entry per sequence.
    fn forward_multi_top(
        &self,
        seqs: &mut [SeqBatch<'_, '_>],
        top: &[Option<usize>],
    ) -> Result<Vec<TokenLogits>, ModelError>;
}

/// Transfers at the expert boundary, counted by the executor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Micro-batches run.
    pub ubatches: u64,
    /// Round trips to the host experts (one per host layer per micro-batch).
    pub host_round_trips: u64,
    /// Steps of several sequences run as two micro-batches in flight (each counted in
    /// `ubatches`; see [`crate::DeviceModel::set_micro_batches`]).
    pub split_steps: u64,
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
    /// before them ran, by the first slice of the op-offload ring (see
    /// `PREFETCH_ROUTES_PER_EXPERT`).
    pub prefetched_layers: u64,
    /// Slices of experts uploaded through the op-offload ring (one upload each).
    pub offload_slices: u64,
    /// The most bytes of ring slices the device held at once (at most the ring's size).
    pub ring_peak_bytes: u64,
    /// Every host ↔ device copy the device counted (weights at load included), for a device
    /// that counts them ([`Backend::transfers`]).
    pub transfers: Option<TransferCounts>,
}

/// What the expert cache counted and holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoeCacheStats {
    /// Routed `(token, slot)` pairs of cacheable host layers whose expert was on the device.
    pub hits: u64,
    /// Routed pairs of cacheable host layers that ran on the host.
    pub misses: u64,
    /// Experts uploaded into the cache.
    pub uploads: u64,
    /// Experts evicted from it (least recently used first).
    pub evictions: u64,
    /// Device bytes the cached experts occupy now.
    pub held_bytes: u64,
    /// The cache's budget in bytes (0: disabled).
    pub budget_bytes: u64,
    /// Experts the cache can hold over all its layers.
    pub capacity: u64,
}

impl MoeCacheStats {
    /// `hits / (hits + misses)`, or 0 before any routed pair.
    pub fn hit_rate(&self) -> f64 {
        let all = self.hits + self.misses;
        if all == 0 {
            0.0
        } else {
            self.hits as f64 / all as f64
        }
    }
}
