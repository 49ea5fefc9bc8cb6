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

use hmoe_backend::{Backend, GatedAct, RowCopy};
use hmoe_placement::{ring_max_slice, ring_slice_for};

use super::expert_boundary::{compact_ids, experts_of, PREFETCH_ROUTES_PER_EXPERT};
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
    /// The pairs of the tokens `tokens` of a batch of normed hidden states `h` (width `d`)
    /// routed with weights `w` (`k` slots a token).
    fn new(
        dev: &B,
        h: &B::Buf<f32>,
        w: &B::Buf<f32>,
        tokens: Range<usize>,
        d: usize,
        k: usize,
    ) -> Result<PairRows<B>, ModelError> {
        let len = tokens.len();
        // Scratch: the `k` copies write every row. `out` is summed into, so it is zeroed.
        let mut x = dev.alloc_scratch::<f32>(len * k * d)?;
        for j in 0..k {
            let c = RowCopy {
                n_rows: len,
                width: d,
                src_stride: d,
                src_offset: tokens.start * d,
                dst_stride: k * d,
                dst_offset: j * d,
            };
            dev.copy_rows(h, &mut x, &c)?;
        }
        let wts = dev.copy_range(w, tokens.start * k..tokens.end * k)?;
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
        act: GatedAct,
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
        let mut y = dev.alloc_scratch::<f32>(B::buf_len(&self.out))?;
        dev.moe(w, act, &self.x, &sel, &self.wts, 1, &mut y)?;
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
        // `acc` sums from zero; `slot` is written whole by each copy.
        let mut acc = dev.alloc::<f32>(len * d)?;
        let mut slot = dev.alloc_scratch::<f32>(len * d)?;
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
            self.prefetch_after(layer, r.router.k)?;
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
            let mut o = dev.alloc_scratch::<f32>(g.len() * d)?;
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
        let whole = std::iter::once(0..self.n_tokens()).collect::<Vec<_>>();
        let mut rows = (parts.unwrap_or(&whole).iter())
            .map(|g| PairRows::new(dev, r.h, r.wts, g.clone(), d, k))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cur = first;
        let mut lo = 0;
        for (j, ids) in slices.iter().enumerate() {
            for p in &mut rows {
                p.run_slice(dev, r.act, &cur, pos, lo..lo + ids.len(), k)?;
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
    /// overlapping the layers in between; not where that layer is the last and its rows
    /// ([`Step::last_layer_rows`], `k` routes each) stay on the host or route too few pairs
    /// to upload every expert.
    fn prefetch_after(&mut self, layer: usize, k: usize) -> Result<(), ModelError> {
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
        if nl + 1 == e.homes.len()
            && (!self.offload_last
                || self.last_layer_rows() * k < PREFETCH_ROUTES_PER_EXPERT * t.n_expert)
        {
            return Ok(());
        }
        let slice = self.ring_slice(t.n_expert, t.expert_bytes());
        let ids: Vec<usize> = (0..slice.min(t.n_expert)).collect();
        let w = self.upload_slice(nl, &ids)?;
        self.ring_held(B::moe_bytes(&w));
        self.prefetched = Some((nl, ids.len(), w));
        self.st.stats.prefetched_layers += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmoe_backend::{ExpertMatrix, ExpertTensors, Ref0};
    use hmoe_quant::GgmlType;

    /// A value in [-1, 1) from a seed (a plain LCG: no dependency).
    fn noise(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The ring's slices, summed per pair and then in slot order, give the whole `moe`'s bits
    /// for every slice size, activation and weight type whose order varies with the rows
    /// (F32: `vec_dot` order for an expert one row routes to, 16 lanes for more), with sums
    /// of four slot outputs of very different sizes, where any other order shows.
    #[test]
    fn slices_give_the_whole_moes_bits() {
        let (n, d, ff, n_expert, k) = (9usize, 32usize, 48usize, 7usize, 4usize);
        let mut seed = 5;
        let mut floats = |len: usize, scale: f32| -> Vec<f32> {
            (0..len).map(|_| noise(&mut seed) * scale).collect()
        };
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let gate = bytes(&floats(n_expert * ff * d, 0.5));
        let up = bytes(&floats(n_expert * ff * d, 0.5));
        let down = bytes(&floats(n_expert * d * ff, 0.5));
        let (gb, ub, db) = (
            floats(n_expert * ff, 0.1),
            floats(n_expert * ff, 0.1),
            floats(n_expert * d, 0.1),
        );
        let t = ExpertTensors {
            n_expert,
            gate: m(&gate, d, ff),
            up: m(&up, d, ff),
            down: m(&down, ff, d),
            gate_bias: &gb,
            up_bias: &ub,
            down_bias: &db,
        };
        let h = floats(n * d, 3.0);
        // Distinct experts per token (one expert gets a single row), weights of very
        // different sizes.
        let sel: Vec<i32> = (0..n)
            .flat_map(|t| (0..k).map(move |j| ((t * 3 + j * (1 + t % 2)) % n_expert) as i32))
            .collect();
        let wts: Vec<f32> = (0..n * k).map(|i| [1.0, 1e-3, 7.5, 0.03][i % k]).collect();
        let dev = Ref0::new();
        let (hb, sb, wb) = (
            dev.upload(&h).unwrap(),
            dev.upload(&sel).unwrap(),
            dev.upload(&wts).unwrap(),
        );
        let all = dev.upload_moe(&t, None).unwrap();
        for act in [
            GatedAct::Silu,
            GatedAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
        ] {
            let mut want = dev.alloc::<f32>(n * d).unwrap();
            dev.moe(&all, act, &hb, &sb, &wb, k, &mut want).unwrap();
            let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
            for slice in 1..=n_expert {
                let mut rows = PairRows::new(&dev, &hb, &wb, 0..n, d, k).unwrap();
                for lo in (0..n_expert).step_by(slice) {
                    let ids: Vec<usize> = (lo..(lo + slice).min(n_expert)).collect();
                    let w = dev.upload_moe(&t, Some(&ids)).unwrap();
                    rows.run_slice(&dev, act, &w, &sel, lo..lo + ids.len(), k)
                        .unwrap();
                }
                let mut got = dev.alloc::<f32>(n * d).unwrap();
                rows.sum_into(&dev, d, k, &mut got).unwrap();
                let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                assert!(got == want, "{act:?}, {slice} experts a slice");
            }
        }
    }

    /// F32 expert matrices of `n_out` rows of `n_in`.
    fn m(data: &[u8], n_in: usize, n_out: usize) -> ExpertMatrix<'_> {
        ExpertMatrix {
            ty: GgmlType::F32,
            n_in,
            n_out,
            data,
        }
    }
}
