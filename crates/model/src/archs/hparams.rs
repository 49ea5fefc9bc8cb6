//! Reading an architecture's hyperparameters from GGUF metadata (`ARCH.*` keys), the checks
//! the attention hyperparameters of every architecture share, and the start of the placement
//! planner's [`ModelShape`] that each architecture's parameters build.

use hmoe_placement::ModelShape;

use crate::error::ModelError;

/// Reads `ARCH.*` hyperparameters from GGUF metadata.
pub(crate) struct ArchMeta<'a> {
    pub meta: &'a hmoe_gguf::Metadata,
    pub arch: &'a str,
}

impl ArchMeta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// A required non-negative integer.
    pub fn usize(&self, k: &str) -> Result<usize, ModelError> {
        let key = self.key(k);
        self.meta
            .get_u64(&key)
            .map(|v| v as usize)
            .ok_or(ModelError::MissingKey(key))
    }

    /// An optional non-negative integer.
    pub fn usize_or(&self, k: &str, default: usize) -> usize {
        self.meta
            .get_u64(&self.key(k))
            .map_or(default, |v| v as usize)
    }

    /// A required number.
    pub fn f32(&self, k: &str) -> Result<f32, ModelError> {
        let key = self.key(k);
        self.meta.get_f32(&key).ok_or(ModelError::MissingKey(key))
    }

    /// An optional number.
    pub fn f32_or(&self, k: &str, default: f32) -> f32 {
        self.meta.get_f32(&self.key(k)).unwrap_or(default)
    }

    /// A `BadParam` error for key `k`.
    pub fn bad(&self, k: &str, value: impl ToString, why: &'static str) -> ModelError {
        ModelError::BadParam {
            key: self.key(k),
            value: value.to_string(),
            why,
        }
    }
}

/// The attention sizes of an architecture whose heads are whole: keys, values and RoPE span
/// every dim of a head (Llama, Qwen2, Qwen3-MoE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WholeHeads {
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (the query heads when the file does not say).
    pub n_head_kv: usize,
    /// Dims per head (`n_embd / n_head` when the file does not say).
    pub head_dim: usize,
}

impl ArchMeta<'_> {
    /// Reads [`WholeHeads`]; a value length other than the key length or a partial RoPE is an
    /// error.
    pub fn whole_heads(&self) -> Result<WholeHeads, ModelError> {
        let n_embd = self.usize("embedding_length")?;
        let n_head = self.usize("attention.head_count")?;
        let head_dim = self.usize_or("attention.key_length", n_embd / n_head.max(1));
        if self.usize_or("attention.value_length", head_dim) != head_dim {
            return Err(self.bad(
                "attention.value_length",
                self.usize_or("attention.value_length", 0),
                "must equal key_length",
            ));
        }
        if self.usize_or("rope.dimension_count", head_dim) != head_dim {
            return Err(self.bad(
                "rope.dimension_count",
                self.usize_or("rope.dimension_count", 0),
                "partial RoPE is not supported",
            ));
        }
        Ok(WholeHeads {
            n_embd,
            n_head,
            n_head_kv: self.usize_or("attention.head_count_kv", n_head),
            head_dim,
        })
    }
}

impl WholeHeads {
    /// The planner's shape of a model of `n_layer` layers with these heads (keys, values and
    /// queries of `head_dim`) and its vocabulary and trained context: no sliding window, no
    /// experts, no FFN sizes. Each architecture's `shape` fills in the rest.
    pub fn shape(
        self,
        arch: &str,
        n_layer: usize,
        n_vocab: usize,
        n_ctx_train: usize,
    ) -> ModelShape {
        let n_layer = saturating_u32(n_layer);
        let u = |v: usize| v as u64;
        ModelShape {
            arch: arch.to_string(),
            n_layer,
            n_embd: u(self.n_embd),
            n_head: u(self.n_head),
            n_head_kv: u(self.n_head_kv),
            head_dim_k: u(self.head_dim),
            head_dim_v: u(self.head_dim),
            head_dim_q: u(self.head_dim),
            mla: false,
            n_vocab: u(n_vocab),
            n_ctx_train: saturating_u32(n_ctx_train),
            sliding_window: 0,
            swa_layers: vec![false; n_layer as usize],
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            n_ff: 0,
            n_ff_shexp: 0,
        }
    }
}

/// `v` as the planner's `u32` (layer counts, context and window lengths), `u32::MAX` if larger.
pub(crate) fn saturating_u32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Shared sanity checks of the attention hyperparameters.
pub(crate) fn check_heads(
    m: &ArchMeta,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
) -> Result<(), ModelError> {
    if n_layer == 0 || n_layer > 4096 {
        return Err(m.bad("block_count", n_layer, "must be 1..=4096"));
    }
    if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
        return Err(m.bad(
            "attention.head_count_kv",
            n_head_kv,
            "must divide head_count",
        ));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(m.bad("attention.key_length", head_dim, "must be even and nonzero"));
    }
    Ok(())
}
