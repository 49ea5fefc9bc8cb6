//! The K/V caches the executor keeps on its device, one per live sequence handle: what a
//! handle asks of them before a step ([`kv_action`]), the ring layouts of a layer
//! ([`device_kv_layouts`]) and one sequence's rings ([`DeviceKv`]).

use std::sync::Weak;

use hmoe_backend::{Backend, BackendError, KvLayout, KvRing};
use hmoe_backend::{CacheType, KvType};

use crate::sequence::KvCache;

/// The size of a cache handle: the context and the micro-batch its rings were sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Positions.
    pub n_ctx: usize,
    /// Tokens per micro-batch.
    pub n_ubatch: usize,
}

impl Geometry {
    /// The geometry of `cache`.
    pub(crate) fn of(cache: &KvCache) -> Geometry {
        Geometry {
            n_ctx: cache.n_ctx(),
            n_ubatch: cache.n_ubatch(),
        }
    }
}

/// Floats per cell of one layer's K and V rings (`v` 0: a K-only cache).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvWidths {
    /// Floats of K per cell.
    pub k: usize,
    /// Floats of V per cell.
    pub v: usize,
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

/// The decision of [`KvAction`]: `gpu` is the device cache's geometry and positions held,
/// `handle` the cache's geometry and `n_past` its position.
pub(crate) fn kv_action(
    gpu: Option<(Geometry, usize)>,
    handle: Geometry,
    n_past: usize,
) -> KvAction {
    match gpu {
        Some((geometry, held)) if geometry == handle && n_past <= held => KvAction::Continue,
        _ if n_past == 0 => KvAction::Allocate,
        _ => KvAction::Mismatch,
    }
}

/// One layer's K and V rings on the device (each of its [`KvLayout`]'s type and cells); a
/// K-only cache has no V ring.
pub(crate) struct LayerKv<B: Backend> {
    pub(crate) k: KvRing<B>,
    pub(crate) v: Option<KvRing<B>>,
}

/// The layouts of one layer's K and V rings of `cells` cells for K/V types `ty`: rows of
/// `widths` values (no V ring for a V width of 0, a K-only cache), heads of
/// `head_dim` rotated as the CPU's cache rotates them ([`KvLayout::rotation`]; a
/// K-only cache, DeepSeek's latent cache, not at all).
pub fn device_kv_layouts(
    ty: KvType,
    cells: usize,
    widths: KvWidths,
    head_dim: usize,
) -> Result<(KvLayout, Option<KvLayout>), BackendError> {
    let layout = |t: CacheType, width: usize, key: bool| {
        let ty = t.ggml_type();
        let rot = match widths.v {
            0 => 0,
            _ => KvLayout::rotation(ty, head_dim, key),
        };
        KvLayout::new(ty, width, cells, rot)
    };
    let v = (widths.v > 0)
        .then(|| layout(ty.v(), widths.v, false))
        .transpose()?;
    Ok((layout(ty.k(), widths.k, true)?, v))
}

/// Bytes of K/V rings.
pub(crate) fn rings_bytes(rings: &[(KvLayout, Option<KvLayout>)]) -> u64 {
    (rings.iter())
        .map(|(k, v)| k.bytes() + v.as_ref().map_or(0, KvLayout::bytes))
        .sum::<usize>() as u64
}

/// One sequence's K/V cache on the device.
pub(crate) struct DeviceKv<B: Backend> {
    /// The handle it stands for ([`handle_of`]).
    pub(crate) handle: usize,
    /// Whether that handle is still alive ([`KvCache::watch`]).
    pub(crate) alive: Weak<()>,
    /// The geometry of the handle it was made for.
    pub(crate) geometry: Geometry,
    /// Positions stored.
    pub(crate) held: usize,
    /// When it was last used (the executor's clock).
    pub(crate) last_used: u64,
    /// Its K/V types.
    pub(crate) ty: KvType,
    /// Bytes of its K/V buffers.
    pub(crate) bytes: u64,
    pub(crate) layers: Vec<LayerKv<B>>,
}

/// The identity of a cache handle ([`KvCache::id`]).
pub(crate) fn handle_of(cache: &KvCache) -> usize {
    cache.id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_cache_actions() {
        use KvAction::*;
        let g = Geometry {
            n_ctx: 4096,
            n_ubatch: 512,
        };
        let small = Geometry {
            n_ctx: 512,
            n_ubatch: 512,
        };
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
        assert_eq!(kv_action(Some((g, 10)), small, 0), Allocate, "new size");
        assert_eq!(kv_action(Some((g, 10)), small, 3), Mismatch);
    }
}
