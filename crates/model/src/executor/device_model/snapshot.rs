//! A sequence's device K/V read out and written back ([`LanguageModel::export_kv`],
//! [`LanguageModel::import_kv`]) through the contract's row copies
//! ([`Backend::kv_read`], [`Backend::kv_write`]), so every device can save and restore.
//!
//! [`LanguageModel::export_kv`]: crate::LanguageModel::export_kv
//! [`LanguageModel::import_kv`]: crate::LanguageModel::import_kv

use hmoe_backend::{Backend, KvLayout, KvRing};

use super::DeviceModel;
use crate::error::ModelError;
use crate::executor::device_kv::{handle_of, kv_action, Geometry, KvAction};
use crate::kv_snapshot::{KvSnapshot, LayerRows, RingRows};
use crate::sequence::KvCache;

impl<B: Backend> DeviceModel<B> {
    /// The K/V of `cache`'s positions: each ring's first [`KvSnapshot::rows_of`] rows, read
    /// from the device. An error when the device no longer holds them (an idle sequence's
    /// cache freed to make room).
    pub fn export_kv(&self, cache: &KvCache) -> Result<KvSnapshot, ModelError> {
        let n_past = cache.n_past();
        if n_past == 0 {
            return Ok(KvSnapshot::default());
        }
        let st = self.lock();
        let kv = (st.kvs.iter())
            .find(|kv| kv.handle == handle_of(cache) && kv.ty == cache.kv_type())
            .filter(|kv| {
                kv_action(Some((kv.geometry, kv.held)), Geometry::of(cache), n_past)
                    == KvAction::Continue
            })
            .ok_or_else(|| {
                ModelError::Cache("the device no longer holds this sequence's K/V".into())
            })?;
        let read = |ring: &KvRing<B>| -> Result<RingRows, ModelError> {
            let rows = KvSnapshot::rows_of(&ring.layout, n_past);
            Ok(RingRows {
                layout: ring.layout,
                data: self.dev.kv_read(ring, 0..rows)?,
            })
        };
        let layers = (kv.layers.iter())
            .map(|l| {
                Ok(LayerRows {
                    k: read(&l.k)?,
                    v: l.v.as_ref().map(read).transpose()?,
                })
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(KvSnapshot { n_past, layers })
    }

    /// Puts `snap` into `cache` (see [`crate::LanguageModel::import_kv`]): checked against
    /// the rings of a cache of `cache`'s types and geometry first, then written into the
    /// handle's device cache (allocated as for a new sequence).
    pub fn import_kv(&self, cache: &mut KvCache, snap: &KvSnapshot) -> Result<(), ModelError> {
        self.check_snapshot(cache, snap)?;
        cache.clear();
        let mut st = self.lock();
        let handle = handle_of(cache);
        self.prepare_kv(&mut st, cache, &[handle])?;
        let i = st.slot_of(handle)?;
        let kv = &mut st.kvs[i];
        let written = (kv.layers.iter_mut().zip(&snap.layers)).try_for_each(|(ring, rows)| {
            self.dev.kv_write(&mut ring.k, 0, &rows.k.data)?;
            match (&mut ring.v, &rows.v) {
                (Some(v), Some(r)) => self.dev.kv_write(v, 0, &r.data),
                _ => Ok(()),
            }
        });
        written?;
        kv.held = snap.n_past;
        cache.advance(snap.n_past);
        Ok(())
    }

    /// Whether `snap` fits a cache of `cache`'s types and geometry: its positions within the
    /// context, one entry per layer, each ring's layout the expected one and its rows whole.
    fn check_snapshot(&self, cache: &KvCache, snap: &KvSnapshot) -> Result<(), ModelError> {
        let bad = |what: String| Err(ModelError::Cache(format!("saved K/V: {what}")));
        if snap.n_past > cache.n_ctx() {
            return bad(format!(
                "{} positions do not fit a context of {}",
                snap.n_past,
                cache.n_ctx()
            ));
        }
        let rings = self.rings_of(cache)?;
        if snap.n_past > 0 && snap.layers.len() != rings.len() {
            return bad(format!(
                "{} layers for a model of {}",
                snap.layers.len(),
                rings.len()
            ));
        }
        let fits = |want: &KvLayout, got: &RingRows| {
            got.layout == *want
                && got.data.len() == KvSnapshot::rows_of(want, snap.n_past) * want.row_bytes()
        };
        for (l, ((k, v), rows)) in rings.iter().zip(&snap.layers).enumerate() {
            let v_fits = match (v, &rows.v) {
                (Some(want), Some(got)) => fits(want, got),
                (None, None) => true,
                _ => false,
            };
            if !fits(k, &rows.k) || !v_fits {
                return bad(format!(
                    "layer {l} holds rings {:?} / {:?} where this cache has {k:?} / {v:?}",
                    rows.k.layout,
                    rows.v.as_ref().map(|r| r.layout)
                ));
            }
        }
        Ok(())
    }
}
