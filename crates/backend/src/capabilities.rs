//! What a kind of device keeps and computes ([`Capabilities`]), known without opening one.

use hmoe_quant::GgmlType;

/// What a kind of device keeps and computes, known without opening one (as ggml's
/// `supports_op` and `supports_buft` are): the engine asks this when it chooses a device and a
/// K/V type, instead of knowing each backend's abilities. Each backend crate publishes its own
/// (`hmoe_cuda::CAPABILITIES`, [`crate::REF0_CAPABILITIES`]); an open device answers the same through
/// [`crate::Backend::kv_types`], [`crate::Backend::supports_kv`] and [`crate::Backend::k_only_types`].
#[derive(Clone, Copy, Debug)]
pub struct Capabilities {
    /// The weight types its matmuls, row gathers and expert sets take.
    pub weight_types: &'static [GgmlType],
    /// The types of K/V rings it stores ([`crate::Backend::kv_types`]).
    pub kv_types: &'static [GgmlType],
    /// The types attention reads as keys and as values of a K/V pair
    /// ([`crate::Backend::supports_kv`]: both of these).
    pub kv_pair_types: &'static [GgmlType],
    /// The types of K-only (latent) rings it attends over ([`crate::Backend::k_only_types`]).
    pub k_only_types: &'static [GgmlType],
    /// Whether its RoPE applies per-pair frequency factors (`rope_freqs.weight` of Llama 3
    /// files, [`crate::RopeParams`]'s `freq_factors`).
    pub rope_freq_factors: bool,
}

impl Capabilities {
    /// Whether the device keeps a K/V cache of `k` keys and `v` values and attends over it.
    pub fn keeps_kv(&self, k: GgmlType, v: GgmlType) -> bool {
        self.kv_pair_types.contains(&k) && self.kv_pair_types.contains(&v)
    }

    /// Whether the device keeps and attends over a K-only (latent) cache of `k`.
    pub fn keeps_k_only(&self, k: GgmlType) -> bool {
        self.k_only_types.contains(&k)
    }

    /// Whether the device multiplies weights of `ty`.
    pub fn multiplies(&self, ty: GgmlType) -> bool {
        self.weight_types.contains(&ty)
    }
}
