//! Model architectures over GGUF weights: hyperparameters, KV cache and the CPU forward pass.
//!
//! Each architecture lives in one file that reads like its math (`gpt_oss.rs`); the numeric
//! building blocks (norms, RoPE, attention, matmul over quantized weights) live in `ops`.

mod attention;
pub mod deepseek2;
mod error;
pub mod gpt_oss;
pub mod kv_cache;
pub mod llama;
pub mod ops;
pub mod qwen3_moe;
mod weights;

pub use deepseek2::{Deepseek2, Deepseek2Params};
pub use error::ModelError;
pub use gpt_oss::{GptOss, GptOssParams};
pub use kv_cache::{KvCache, KvType};
pub use llama::{Dense, DenseArch, DenseParams};
pub use qwen3_moe::{Qwen3Moe, Qwen3MoeParams};

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last token of the batch (generation).
    Last,
    /// Every token of the batch (teacher forcing, perplexity).
    All,
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
}

impl LanguageModel for GptOss {
    fn n_vocab(&self) -> usize {
        self.params().n_vocab
    }
    fn n_ctx_train(&self) -> usize {
        self.params().n_ctx_train
    }
    fn new_cache(&self, ty: KvType, n_ctx: usize, n_ubatch: usize) -> KvCache {
        GptOss::new_cache(self, ty, n_ctx, n_ubatch)
    }
    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        GptOss::forward(self, cache, tokens, wanted)
    }
    fn gguf(&self) -> &hmoe_gguf::GgufModel {
        GptOss::gguf(self)
    }
}

/// Builds the architecture named by the file's `general.architecture`.
pub fn load(gguf: hmoe_gguf::GgufModel) -> Result<Box<dyn LanguageModel>, ModelError> {
    match gguf.metadata().architecture() {
        Some("gpt-oss") => Ok(Box::new(GptOss::load(gguf)?)),
        Some("qwen3moe") => Ok(Box::new(Qwen3Moe::load(gguf)?)),
        Some("deepseek2") => Ok(Box::new(Deepseek2::load(gguf)?)),
        Some("llama") | Some("qwen2") => Ok(Box::new(Dense::load(gguf)?)),
        other => Err(ModelError::UnsupportedArch(
            other.unwrap_or("<missing general.architecture>").to_string(),
        )),
    }
}
