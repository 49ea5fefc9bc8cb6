//! Model architectures over GGUF weights: hyperparameters and each architecture's forward
//! pass, written once over the device contract (`hmoe-backend`).
//!
//! Each architecture lives in one file of [`archs`] that reads like its math
//! (`archs/gpt_oss.rs`), built from the executor's shared blocks (attention, routed MoE,
//! SwiGLU FFN); [`executor`] runs it on whichever device the placement chooses: the CPU
//! ([`hmoe_cpu::Cpu`], what [`load`] gives), a CUDA GPU, or the reference device `REF0`, with
//! each layer's routed experts on the device or on the host.
#![warn(missing_docs)]

pub mod archs;
mod error;
pub mod executor;
pub mod expert_placement;
mod kv_snapshot;
mod language_model;
mod sequence;
mod weights;

/// The sequence handle and the K/V element types.
pub mod kv_cache {
    pub use crate::sequence::KvCache;
    pub use hmoe_backend::{CacheType, FlashAttn, KvType, KvTypeError};
}

pub use archs::deepseek2::Deepseek2Params;
pub use archs::gpt_oss::GptOssParams;
pub use archs::llama::{DenseArch, DenseParams};
pub use archs::qwen3_moe::Qwen3MoeParams;
pub use archs::{arch_keeps_kv, DEVICE_ARCHS, K_ONLY_ARCHS};
pub use archs::{device_arch, model_shape, Arch, ARCHS};
pub use error::ModelError;
pub use executor::{DeviceModel, MICRO_BATCHES_ENV};
pub use expert_placement::{ExpertHome, ExpertPlacement, OP_OFFLOAD_MIN_BATCH};
pub use hmoe_backend::KvLayout;
pub use kv_cache::{KvCache, KvType};
pub use kv_snapshot::{KvSnapshot, LayerRows, RingRows};
pub use language_model::{
    DeviceMemory, ExecStats, LanguageModel, LogitsWanted, MoeCacheStats, SeqBatch, TokenLogits,
};

/// Builds the architecture named by the file's `general.architecture` on the CPU: the
/// executor over [`hmoe_cpu::Cpu`], every layer and its experts there.
pub fn load(gguf: hmoe_gguf::GgufModel) -> Result<Box<dyn LanguageModel>, ModelError> {
    Ok(Box::new(DeviceModel::load_whole(
        gguf,
        hmoe_cpu::Cpu::new(),
    )?))
}
