//! What the engine needs from a model ([`LanguageModel`]) and what it passes in and gets
//! back: the logits it wants, one sequence's share of a batched step, the device memory.

use crate::error::ModelError;
use crate::executor::{ExecStats, MoeCacheStats};
use crate::sequence::KvCache;
use hmoe_backend::KvType;

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last token of the batch (generation).
    Last,
    /// Every token of the batch (teacher forcing, perplexity).
    All,
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
    /// Context length the model was trained for.
    fn n_ctx_train(&self) -> usize;
    /// A fresh KV cache for `n_ctx` positions and micro-batches of `n_ubatch` tokens.
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache;
    /// Runs `tokens` at the next positions of `cache`; returns `n_vocab` logits per wanted token.
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
    /// Runs several sequences in one pass (continuous batching): each sequence's tokens go to
    /// the next positions of its own cache, and every sequence's result is exactly what
    /// [`LanguageModel::forward`] would return for it alone (batch invariance).
    fn forward_multi(&self, seqs: &mut [SeqBatch<'_, '_>]) -> Result<Vec<Vec<f32>>, ModelError>;
}
