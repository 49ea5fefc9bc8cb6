//! The handle of one sequence ([`KvCache`]): what the engine and the server hold per
//! sequence and pass to [`crate::LanguageModel::forward`]. It keeps positions and the ring
//! geometry of the architecture's cache (cells per layer, sliding windows), no keys or values:
//! the executor keeps those on its device, one cache per live handle, told apart by
//! [`KvCache::id`] and freed once [`KvCache::watch`] says the handle is gone.

use std::sync::{Arc, Weak};

use hmoe_backend::KvType;

/// The ring of one layer: how many cells it has and whether it slides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayerRing {
    /// Cells in the ring; position `p` lives in cell `p % cells`.
    pub cells: usize,
    /// `Some(w)`: a query at `p` sees keys `p-w+1 ..= p`.
    pub window: Option<usize>,
}

/// The handle of one sequence: its position, context size, micro-batch size, K/V types and
/// the cells of each layer's ring on the device.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerRing>,
    ty: KvType,
    k_only: bool,
    n_ctx: usize,
    n_ubatch: usize,
    n_past: usize,
    /// This handle's identity, alive while the handle is ([`KvCache::id`], [`KvCache::watch`]).
    alive: Arc<()>,
}

impl KvCache {
    /// A handle for `n_ctx` positions in micro-batches of `n_ubatch` tokens: layer `l` keeps
    /// `n_ctx` cells, or `windows[l] + n_ubatch` when it slides (at most `n_ctx`).
    pub(crate) fn new(
        ty: KvType,
        n_ctx: usize,
        n_ubatch: usize,
        windows: &[Option<usize>],
    ) -> KvCache {
        let n_ubatch = n_ubatch.max(1);
        let layers = (windows.iter())
            .map(|&window| LayerRing {
                cells: window.map_or(n_ctx, |w| n_ctx.min(w + n_ubatch)),
                window,
            })
            .collect();
        KvCache {
            layers,
            ty,
            k_only: false,
            n_ctx,
            n_ubatch,
            n_past: 0,
            alive: Arc::new(()),
        }
    }

    /// A handle of a cache that stores keys only, in `n_layer` full-attention layers: for
    /// multi-head latent attention, whose values are the first elements of each key
    /// (DeepSeek's latent cache; `-ctv` is not used).
    pub(crate) fn new_k_only(ty: KvType, n_ctx: usize, n_ubatch: usize, n_layer: usize) -> Self {
        KvCache {
            k_only: true,
            ..KvCache::new(ty, n_ctx, n_ubatch, &vec![None; n_layer])
        }
    }

    /// The ring of each layer.
    pub(crate) fn layers(&self) -> &[LayerRing] {
        &self.layers
    }

    /// A number that tells this handle apart from every other live handle, and from every
    /// dropped one whose [`KvCache::watch`] is still held.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.alive) as usize
    }

    /// A watch on this handle: [`Weak::strong_count`] drops to 0 when the handle is dropped,
    /// so that whoever keeps K/V for it elsewhere can free it.
    pub fn watch(&self) -> Weak<()> {
        Arc::downgrade(&self.alive)
    }

    /// Positions already in the cache (the next token goes to this position).
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Context size.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Micro-batch size the sliding-window rings were sized for.
    pub fn n_ubatch(&self) -> usize {
        self.n_ubatch
    }

    /// Element types and attention mode.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// Whether the cache holds keys only (values are read from the keys).
    pub fn is_k_only(&self) -> bool {
        self.k_only
    }

    /// Forgets everything (a new sequence).
    pub fn clear(&mut self) {
        self.n_past = 0;
    }

    /// Drops positions from `pos` on, so the sequence continues from there. Sliding-window
    /// layers cannot go back further than their ring holds; returns false then (and changes
    /// nothing), so the caller re-evaluates from scratch.
    pub fn truncate(&mut self, pos: usize) -> bool {
        if pos >= self.n_past {
            return true;
        }
        let back = self.n_past - pos;
        let ok = (self.layers.iter()).all(|l| l.window.is_none_or(|w| back + w <= l.cells));
        if ok {
            self.n_past = pos;
        }
        ok
    }

    /// Moves the sequence on by `n` positions (after a forward pass stored them).
    pub(crate) fn advance(&mut self, n: usize) {
        self.n_past += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_layers_limit_how_far_back_a_handle_goes() {
        let mut c = KvCache::new(KvType::F16, 64, 4, &[None, Some(8)]);
        assert_eq!(
            c.layers().iter().map(|l| l.cells).collect::<Vec<_>>(),
            [64, 12]
        );
        c.advance(20);
        assert!(
            !c.truncate(10),
            "10 back from 20 with a window of 8 in 12 cells"
        );
        assert_eq!(c.n_past(), 20);
        assert!(c.truncate(16));
        assert_eq!(c.n_past(), 16);
        assert!(c.truncate(30), "past the end: nothing to drop");
        c.clear();
        assert_eq!(c.n_past(), 0);
        let k = KvCache::new_k_only(KvType::F16, 32, 0, 3);
        assert!(k.is_k_only() && k.n_ubatch() == 1 && k.layers().len() == 3);
        assert_ne!(c.id(), k.id());
    }
}
