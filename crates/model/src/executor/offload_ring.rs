//! Op offload in slices: a host layer's routed experts run on the device for a large
//! micro-batch, streamed from the file mapping through a small ring of device buffers instead
//! of the whole layer at once.
//!
//! **The ring.** The experts to upload (every one when the batch routes to nearly all,
//! [`super::PREFETCH_ROUTES_PER_EXPERT`]; else the ones it routes to, in ascending id order once
//! the routing is down) are cut into slices of `s` experts. The ring holds
//! [`hmoe_placement::RING_SLOTS`] = 2 slices: while the device's `moe` runs on one slice, the
//! next one is uploaded (on CUDA the CPU pool fills pinned buffers that the copy engine
//! drains on the device's copy stream, so the copy overlaps the product). After the last slice
//! of a layer that uploads every expert, the first slice of the next host layer goes up, so
//! that it overlaps the dense part of the layers in between. `s` comes from the ring's size in
//! bytes, which the placement plan chooses and `--fit` shrinks to what the device has left
//! ([`hmoe_placement::ring_slice_for`]; [`crate::executor::DeviceModel::set_op_offload_ring`]);
//! without a size, [`hmoe_placement::ring_max_slice`] (at most 32 experts, at most half a
//! layer). A layer whose experts fit in one slice runs as one `moe` over the batch.
//!
//! **The same bits.** The `moe` op adds every token's slot outputs `w·expert(h)` in slot order
//! from zero, and multiplies each expert's routed rows together (the order of some products
//! depends on how many rows an expert gets). A slice runs the `moe` op over the batch's
//! routed `(token, slot)` pairs, one row each (one slot per row, the rows in pair order), with
//! the pairs routed outside the slice given no expert: each expert still multiplies exactly the
//! rows it gets from the whole batch, in the same order, and each pair's weighted output
//! `0 + w·expert(h)` lands in a buffer of every pair's output (pairs of other slices add zero).
//! The slot sums are then made as the `moe` op makes them, slot 0 first, from zero. A layer
//! whose experts' order varies with the rows runs each sequence's pairs apart, as the whole
//! `moe` does. On REF0 the logits are the CPU's bit for bit, whatever the ring's size.

use std::ops::Range;

use hmoe_backend::{Backend, RowCopy};
use hmoe_placement::{ring_max_slice, ring_slice_for};

use super::expert_boundary::{compact_ids, experts_of};
use super::routing::Routed;
use super::step::Step;
use crate::error::ModelError;
use crate::expert_placement::ExpertHome;

/// One part of a micro-batch (a sequence's tokens, or all) as routed pairs: every
/// `(token, slot)` a row of its own.
struct PairRows<B: Backend> {
    /// The part's tokens.
    tokens: Range<usize>,
    /// Each pair's input, its token's normed hidden state: `len·k × d`.
    x: B::Buf<f32>,
    /// Each pair's routing weight, `len·k`.
    wts: B::Buf<f32>,
    /// Each pair's weighted expert output (written by the slice holding its expert; the
    /// others add zero), `len·k × d`.
    out: B::Buf<f32>,
}

impl<B: Backend> PairRows<B> {
    /// The pairs of the tokens `tokens` of the routed batch `r` (`k` slots, width `d`).
    fn new(
        dev: &B,
        r: &Routed<'_, B>,
        tokens: Range<usize>,
        d: usize,
        k: usize,
    ) -> Result<PairRows<B>, ModelError> {
        let len = tokens.len();
        let mut x = dev.alloc::<f32>(len * k * d)?;
        for j in 0..k {
            let c = RowCopy {
                n_rows: len,
                width: d,
                src_stride: d,
                src_offset: tokens.start * d,
                dst_stride: k * d,
                dst_offset: j * d,
            };
            dev.copy_rows(r.h, &mut x, &c)?;
        }
        let wts = dev.copy_range(r.wts, tokens.start * k..tokens.end * k)?;
        let out = dev.alloc::<f32>(len * k * d)?;
        Ok(PairRows {
            tokens,
            x,
            wts,
            out,
        })
    }

    /// Queues the products of one slice `w` of the ring, the experts at positions `slice` of
    /// the uploaded list: `pos` gives every pair of the batch its expert's position in that
    /// list (-1: none). Nothing when no pair of the part routes into the slice.
    fn run_slice(
        &mut self,
        dev: &B,
        r: &Routed<'_, B>,
        w: &B::Moe,
        pos: &[i32],
        slice: Range<usize>,
        k: usize,
    ) -> Result<(), ModelError> {
        let local = |p: i32| {
            usize::try_from(p)
                .ok()
                .filter(|p| slice.contains(p))
                .map_or(-1, |p| (p - slice.start) as i32)
        };
        let sel: Vec<i32> = pos[self.tokens.start * k..self.tokens.end * k]
            .iter()
            .map(|&p| local(p))
            .collect();
        if sel.iter().all(|&s| s < 0) {
            return Ok(());
        }
        let sel = dev.upload(&sel)?;
        let mut y = dev.alloc::<f32>(B::buf_len(&self.out))?;
        dev.moe(w, r.act, &self.x, &sel, &self.wts, 1, &mut y)?;
        dev.add_assign(&mut self.out, &y)?;
        Ok(())
    }

    /// Each token's slot outputs summed in slot order from zero (as the `moe` op sums them)
    /// into its row of `out`.
    fn sum_into(
        self,
        dev: &B,
        d: usize,
        k: usize,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let PairRows {
            tokens,
            x,
            wts,
            out: pairs,
        } = self;
        drop((x, wts));
        let len = tokens.len();
        let mut acc = dev.alloc::<f32>(len * d)?;
        let mut slot = dev.alloc::<f32>(len * d)?;
        for j in 0..k {
            let c = RowCopy {
                n_rows: len,
                width: d,
                src_stride: k * d,
                src_offset: j * d,
                dst_stride: d,
                dst_offset: 0,
            };
            dev.copy_rows(&pairs, &mut slot, &c)?;
            dev.add_assign(&mut acc, &slot)?;
        }
        dev.copy_into(&acc, out, tokens.start * d)?;
        Ok(())
    }
}

impl<B: Backend> Step<'_, B> {
    /// Experts per slice of the ring for a layer of `n_expert` experts of `expert_bytes`.
    fn ring_slice(&self, n_expert: usize, expert_bytes: u64) -> usize {
        let n = n_expert as u64;
        let s = match self.st.ring {
            Some(ring) => ring_slice_for(ring, n, expert_bytes),
            None => ring_max_slice(n),
        };
        usize::try_from(s).unwrap_or(1).max(1)
    }

    /// Uploads the experts `ids` of host layer `layer` (one slice of the ring), counted in
    /// the stats.
    fn upload_slice(&mut self, layer: usize, ids: &[usize]) -> Result<B::Moe, ModelError> {
        let t = experts_of(self.arch, layer)?;
        let w = self.dev().upload_moe(&t, Some(ids))?;
        let stats = &mut self.st.stats;
        stats.offload_slices += 1;
        stats.offloaded_experts += ids.len() as u64;
        stats.offload_bytes += ids.len() as u64 * t.expert_bytes();
        Ok(w)
    }

    /// Records `bytes` of ring slices held at once.
    fn ring_held(&mut self, bytes: usize) {
        let s = &mut self.st.stats;
        s.ring_peak_bytes = s.ring_peak_bytes.max(bytes as u64);
    }

    /// Op offload of host layer `layer` for the micro-batch into `out` (see the module docs):
    /// every expert when `upload_all`, else the ones the batch routes to; on each of `parts`
    /// alone when given.
    pub(super) fn offloaded(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        upload_all: bool,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let dev = self.dev();
        let t = experts_of(self.arch, layer)?;
        let n_expert = t.n_expert;
        let slice = self.ring_slice(n_expert, t.expert_bytes());
        self.st.stats.offloaded_layers += 1;
        // The experts to upload, ascending, and (once the routing is down) each routed pair's
        // position among them.
        let (ids, pos) = match upload_all {
            true => ((0..n_expert).collect::<Vec<_>>(), None),
            false => {
                let (ids, pos) = compact_ids(&dev.download(r.sel)?, n_expert);
                (ids, Some(pos))
            }
        };
        let slices: Vec<&[usize]> = match ids.is_empty() {
            true => vec![&[]],
            false => ids.chunks(slice).collect(),
        };
        let first = match self.prefetched.take() {
            Some((pl, m, w)) if pl == layer && upload_all && m == slices[0].len() => w,
            _ => self.upload_slice(layer, slices[0])?,
        };
        let pairs = if slices.len() == 1 {
            self.ring_held(B::moe_bytes(&first));
            self.one_slice(&first, r, parts, pos.as_deref(), out)?;
            None
        } else {
            // Every expert: a pair's position is its expert.
            let pos = match pos {
                Some(p) => p,
                None => dev.download(r.sel)?,
            };
            Some(self.sliced(layer, first, &slices, r, parts, &pos)?)
        };
        if upload_all {
            self.prefetch_after(layer)?;
        }
        let (d, k) = (self.arch.dims().n_embd, r.router.k);
        for p in pairs.into_iter().flatten() {
            p.sum_into(dev, d, k, out)?;
        }
        Ok(())
    }

    /// A layer whose uploaded experts `w` are one slice: the `moe` op over the batch (over
    /// each of `parts` alone when given), the routed ids renumbered by `pos` when only the
    /// routed experts were uploaded.
    fn one_slice(
        &self,
        w: &B::Moe,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        pos: Option<&[i32]>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let Some(pos) = pos else {
            return self.device_moe(w, r, parts, out);
        };
        let dev = self.dev();
        let (d, k) = (self.arch.dims().n_embd, r.router.k);
        let Some(parts) = parts else {
            let sel = dev.upload(pos)?;
            return Ok(dev.moe(w, r.act, r.h, &sel, r.wts, k, out)?);
        };
        for g in parts {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let wts = dev.copy_range(r.wts, g.start * k..g.end * k)?;
            let sel = dev.upload(&pos[g.start * k..g.end * k])?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(w, r.act, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// The slices of layer `layer` through the ring, `first` already up: each slice's
    /// products queued, then the next slice uploaded while they run. Returns every part's
    /// pairs with their outputs, to be summed.
    fn sliced(
        &mut self,
        layer: usize,
        first: B::Moe,
        slices: &[&[usize]],
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        pos: &[i32],
    ) -> Result<Vec<PairRows<B>>, ModelError> {
        let dev = self.dev();
        let (d, k) = (self.arch.dims().n_embd, r.router.k);
        let whole = [0..self.n_tokens()];
        let mut rows = (parts.unwrap_or(&whole).iter())
            .map(|g| PairRows::new(dev, r, g.clone(), d, k))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cur = first;
        let mut lo = 0;
        for (j, ids) in slices.iter().enumerate() {
            for p in &mut rows {
                p.run_slice(dev, r, &cur, pos, lo..lo + ids.len(), k)?;
            }
            lo += ids.len();
            let Some(next_ids) = slices.get(j + 1) else {
                break;
            };
            let next = self.upload_slice(layer, next_ids)?;
            self.ring_held(B::moe_bytes(&cur) + B::moe_bytes(&next));
            cur = next;
        }
        Ok(rows)
    }

    /// After a layer that uploaded every expert: the first slice of the next host layer up,
    /// overlapping the layers in between.
    fn prefetch_after(&mut self, layer: usize) -> Result<(), ModelError> {
        let e = self.experts;
        let next = (layer + 1..e.homes.len()).find(|&j| {
            e.homes[j] == ExpertHome::Host
                && e.device.get(j).is_some_and(Option::is_none)
                && self.arch.layer_experts(j).is_some()
        });
        let Some(nl) = next else {
            return Ok(());
        };
        let t = experts_of(self.arch, nl)?;
        let slice = self.ring_slice(t.n_expert, t.expert_bytes());
        let ids: Vec<usize> = (0..slice.min(t.n_expert)).collect();
        let w = self.upload_slice(nl, &ids)?;
        self.ring_held(B::moe_bytes(&w));
        self.prefetched = Some((nl, ids.len(), w));
        self.st.stats.prefetched_layers += 1;
        Ok(())
    }
}
