//! The model hyperparameters the planner needs. The model crate reads them from a GGUF file
//! (`hmoe_model::model_shape`), with the defaults and checks of its forward pass.

use crate::error::PlacementError;

/// The hyperparameters that decide KV cache and compute-buffer sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// GGUF architecture string (`gpt-oss`, `qwen3moe`, `deepseek2`, `llama`, `qwen2`).
    pub arch: String,
    /// Repeating layers (`block_count`).
    pub n_layer: u32,
    /// Hidden size.
    pub n_embd: u64,
    /// Query heads.
    pub n_head: u64,
    /// Key/value heads as stored in the KV cache (1 for DeepSeek's MLA latent cache).
    pub n_head_kv: u64,
    /// Elements per head of a cached key (`attention.key_length`; for MLA files this is
    /// `kv_lora_rank + rope dims`, e.g. 576).
    pub head_dim_k: u64,
    /// Elements per head of a value (`head_dim_k` for GQA models; for MLA the latent rank).
    pub head_dim_v: u64,
    /// Query head size used by the attention math (`key_length_mla` for MLA, else `head_dim_k`).
    pub head_dim_q: u64,
    /// Multi-head latent attention (DeepSeek files with `key_length_mla` and
    /// `value_length_mla`): llama.cpp then caches K only, V being a view of it.
    pub mla: bool,
    /// Vocabulary size (the rows of the token embedding).
    pub n_vocab: u64,
    /// Trained context (`context_length`), what `-c 0` means.
    pub n_ctx_train: u32,
    /// Sliding-window size in tokens, 0 if the model has none.
    pub sliding_window: u32,
    /// Per layer: whether it uses the sliding window (length `n_layer`).
    pub swa_layers: Vec<bool>,
    /// Routed experts per MoE layer (0 for a dense model).
    pub n_expert: u64,
    /// Experts used per token.
    pub n_expert_used: u64,
    /// Hidden size of one routed expert.
    pub n_ff_exp: u64,
    /// Hidden size of a dense FFN (DeepSeek's leading dense layers), 0 if none.
    pub n_ff: u64,
    /// Total hidden size of the shared experts of a layer, 0 if none.
    pub n_ff_shexp: u64,
}

impl ModelShape {
    /// Elements of one token's key in one layer.
    pub fn n_embd_k_gqa(&self) -> u64 {
        self.n_head_kv * self.head_dim_k
    }

    /// Elements of one token's cached value in one layer (0 for MLA: no V cache).
    pub fn n_embd_v_gqa(&self) -> u64 {
        if self.mla {
            0
        } else {
            self.n_head_kv * self.head_dim_v
        }
    }

    /// Whether layer `il` uses the sliding window.
    pub fn is_swa(&self, il: u32) -> bool {
        self.sliding_window > 0 && self.swa_layers.get(il as usize).copied().unwrap_or(false)
    }

    /// Checks the fields are consistent enough to plan with.
    pub fn validate(&self) -> Result<(), PlacementError> {
        let bad = |m: &str| Err(PlacementError::Shape(m.to_string()));
        if self.n_layer == 0 || self.n_embd == 0 || self.n_vocab == 0 {
            return bad("n_layer, n_embd and n_vocab must be positive");
        }
        if self.n_head == 0 || self.n_head_kv == 0 || self.head_dim_k == 0 || self.head_dim_v == 0 {
            return bad("head counts and head sizes must be positive");
        }
        if self.n_ctx_train == 0 {
            return bad("the trained context length is 0");
        }
        if self.swa_layers.len() != self.n_layer as usize {
            return bad("swa_layers must have one entry per layer");
        }
        if self.n_expert_used > self.n_expert {
            return bad("more experts used than exist");
        }
        Ok(())
    }
}
