//! The shapes of an attention call: [`AttnShape`] (equal key and value heads) and
//! [`AttnLayout`] (key and value heads of their own sizes, values inside the keys).

/// Shape of one attention call.
pub struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (GQA: each serves `n_head / n_head_kv` query heads).
    pub n_head_kv: usize,
    /// Elements of each head.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f32,
}

/// Shape of an attention call whose key and value heads may differ in size.
pub struct AttnLayout {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Elements of each query/key head.
    pub k_dim: usize,
    /// Elements of each value head.
    pub v_dim: usize,
    /// Values are the first `v_dim` elements of each key head (multi-head latent attention's
    /// K-only cache) instead of a separate V store.
    pub v_in_k: bool,
    /// Score scale.
    pub scale: f32,
}
