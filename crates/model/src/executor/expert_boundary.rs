//! The expert boundary: where a layer's routed experts run for a micro-batch. The `moe` op
//! over the device's experts; op offload of a host layer (its experts uploaded for a large
//! batch, every one of them and the next layer's ahead when the batch routes to nearly all);
//! or one round trip to the host, where the experts run on the CPU (through the device
//! expert cache when it is on).

use std::ops::Range;

use hmoe_backend::{Backend, ExpertTensors};

use super::host_experts::{staging_for, HostBatch};
use super::routing::{ExpertSplit, Routed};
use super::state::State;
use super::step::{DeviceLayers, Step};
use crate::error::ModelError;

/// Expert choices per expert (`n_tokens × n_expert_used / n_expert`) from which an offloaded
/// micro-batch uploads every expert of each host layer instead of the routed ones: with 4,
/// about e^-4 ≈ 2% of the experts go unused, and since no routing is awaited, the next host
/// layer's upload starts before this layer's compute and overlaps it.
pub const PREFETCH_ROUTES_PER_EXPERT: usize = 4;

/// Device memory left free beside a prefetched layer's experts (the running layer's scratch
/// buffers come out of it); with less room the next layer is uploaded when it is reached.
pub const PREFETCH_RESERVE_BYTES: u64 = 512 << 20;

impl<B: Backend> Step<'_, B> {
    /// The rows the `moe` op of layer `layer` runs on together: the whole batch, or, for
    /// experts whose products' order varies with the rows, each part of [`ExpertSplit`] alone (`None`: the
    /// whole batch).
    fn moe_parts(&self, layer: usize, split: ExpertSplit) -> Option<Vec<Range<usize>>> {
        if !self.experts.split.get(layer).copied().unwrap_or(false) {
            return None;
        }
        match split {
            ExpertSplit::PerSequence if self.groups.len() > 1 => Some(self.groups.clone()),
            _ => None,
        }
    }

    /// The weighted sum of layer `layer`'s routed experts for the batch into `out`, wherever
    /// the placement puts them: the `moe` op over the device's experts; a host layer's
    /// experts uploaded for the batch (op offload; every expert, with the next host layer's
    /// upload queued behind, when the batch routes to nearly all); or one round trip to the
    /// host.
    pub(crate) fn experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let parts = self.moe_parts(layer, r.split);
        if let Some(Some(experts)) = self.experts.device.get(layer) {
            return self.device_moe(experts, r, parts.as_deref(), out);
        }
        let n = self.n_tokens();
        let upload_all =
            self.offload && n * r.router.k >= PREFETCH_ROUTES_PER_EXPERT * r.router.n_expert;
        if upload_all {
            let w = match self.prefetched.take() {
                Some((pl, w)) if pl == layer => w,
                _ => self.upload_offloaded(layer, None)?,
            };
            self.device_moe(&w, r, parts.as_deref(), out)?;
            // Queued behind this layer's work: the next host layer's upload, which the CPU
            // pool gathers while the device computes.
            let device = &self.experts.device;
            let next = (layer + 1..device.len()).find(|&j| device[j].is_none());
            if let Some(nl) = next.filter(|&nl| self.room_for_experts(nl)) {
                self.prefetched = Some((nl, self.upload_offloaded(nl, None)?));
                self.st.stats.prefetched_layers += 1;
            }
            return Ok(());
        }
        if self.offload {
            return self.offloaded_experts(layer, r, parts.as_deref(), out);
        }
        self.host_experts(layer, r, out)
    }

    /// The `moe` op of a layer over the whole micro-batch, or, with `parts`, over each part
    /// alone with its own routing.
    fn device_moe(
        &self,
        w: &B::Moe,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let dev = self.dev();
        let d = self.arch.dims().n_embd;
        let (ne, k) = (r.router.n_expert, r.router.k);
        let Some(parts) = parts else {
            return Ok(dev.moe(w, r.act, r.h, r.sel, r.wts, k, out)?);
        };
        for g in parts {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let ss = dev.copy_range(r.scores, g.start * ne..g.end * ne)?;
            let mut sel = dev.alloc::<i32>(g.len() * k)?;
            let mut wts = dev.alloc::<f32>(g.len() * k)?;
            r.router.route(dev, &ss, r.bias, &mut sel, &mut wts)?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(w, r.act, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// Whether the device has room for every expert of host layer `layer` beside what it holds
    /// now and [`PREFETCH_RESERVE_BYTES`] (always, on a backend without a limit; never, if the
    /// free memory cannot be read).
    fn room_for_experts(&self, layer: usize) -> bool {
        let Ok(t) = experts_of(self.arch, layer) else {
            return false;
        };
        let need = t.n_expert as u64 * t.expert_bytes() + PREFETCH_RESERVE_BYTES;
        match self.dev().free_memory() {
            Ok(free) => free.is_none_or(|free| free >= need),
            Err(_) => false,
        }
    }

    /// The experts `ids` (every one when `None`) of host layer `layer` on the device, uploaded
    /// from the file mapping for op offload and counted in the stats.
    fn upload_offloaded(
        &mut self,
        layer: usize,
        ids: Option<&[usize]>,
    ) -> Result<B::Moe, ModelError> {
        let t = experts_of(self.arch, layer)?;
        let w = self.dev().upload_moe(&t, ids)?;
        let n = ids.map_or(t.n_expert, <[usize]>::len) as u64;
        let stats = &mut self.st.stats;
        stats.offloaded_layers += 1;
        stats.offloaded_experts += n;
        stats.offload_bytes += n * t.expert_bytes();
        Ok(w)
    }

    /// Op offload of a host layer for a large micro-batch: the chosen experts come down (one
    /// small copy), the experts they name are uploaded from the file mapping (each once, in
    /// ascending id order) with the ids renumbered to match, and the layer runs on the device
    /// (on each of `parts` alone when given, each with its share of the renumbered ids).
    fn offloaded_experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let dev = self.dev();
        let d = self.arch.dims().n_embd;
        let k = r.router.k;
        let chosen = dev.download(r.sel)?;
        let (ids, remapped) = compact_ids(&chosen, r.router.n_expert);
        let w = self.upload_offloaded(layer, Some(&ids))?;
        let Some(parts) = parts else {
            let sel = dev.upload(&remapped)?;
            dev.moe(&w, r.act, r.h, &sel, r.wts, k, out)?;
            return Ok(());
        };
        for g in parts {
            let hs = dev.copy_range(r.h, g.start * d..g.end * d)?;
            let wts = dev.copy_range(r.wts, g.start * k..g.end * k)?;
            let sel = dev.upload(&remapped[g.start * k..g.end * k])?;
            let mut o = dev.alloc::<f32>(g.len() * d)?;
            dev.moe(&w, r.act, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_into(&o, out, g.start * d)?;
        }
        Ok(())
    }

    /// The round trip of a host layer: the normed hidden state and the routing of every
    /// token of the micro-batch down through the staging buffers in one copy, the layer's
    /// experts on the CPU (each sequence's rows as the CPU multiplies them; hits of the device
    /// expert cache on the device), the sum up into `out`.
    fn host_experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let dev = self.dev;
        let d = self.arch.dims().n_embd;
        let k = r.router.k;
        let n = self.n_tokens();
        let State {
            io,
            moe_cache,
            stats,
            ..
        } = &mut *self.st;
        let io = staging_for(io, dev, n, d, k)?;
        dev.stage_down(io, r.h, r.sel, r.wts)?;
        let staged = dev.staged(io)?;
        let batch = HostBatch {
            h: staged.h,
            sel: staged.sel,
            w: staged.w,
            k,
            groups: &self.groups,
        };
        let host = &self.experts.host;
        let (down, up) = match moe_cache.caches(layer) {
            true => moe_cache.run(dev, layer, r, &batch, host, staged.out)?,
            false => {
                host.run(layer, r.act, &batch, staged.out)?;
                (0, 0)
            }
        };
        dev.stage_up(io, out)?;
        stats.host_round_trips += 1;
        stats.bytes_to_host += 4 * (n * d + 2 * n * k) as u64 + down;
        stats.bytes_to_device += 4 * (n * d) as u64 + up;
        Ok(())
    }
}

/// The routed experts of layer `layer`, or a placement error for a layer without.
fn experts_of<B: Backend>(
    arch: &dyn DeviceLayers<B>,
    layer: usize,
) -> Result<ExpertTensors<'_>, ModelError> {
    arch.layer_experts(layer)
        .ok_or_else(|| ModelError::Placement(format!("layer {layer} has no experts")))
}

/// The distinct valid expert ids of `chosen` (ascending) and `chosen` renumbered to positions
/// in that list; ids outside `0..n_expert` become -1 (the `moe` kernel gives them zero rows).
pub(crate) fn compact_ids(chosen: &[i32], n_expert: usize) -> (Vec<usize>, Vec<i32>) {
    let valid = |e: i32| usize::try_from(e).ok().filter(|&e| e < n_expert);
    let mut ids: Vec<usize> = chosen.iter().filter_map(|&e| valid(e)).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut slot = vec![-1i32; n_expert];
    for (i, &e) in ids.iter().enumerate() {
        slot[e] = i as i32;
    }
    let remapped = chosen
        .iter()
        .map(|&e| valid(e).map_or(-1, |e| slot[e]))
        .collect();
    (ids, remapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_offload_renumbers_the_routed_experts() {
        let (ids, remapped) = compact_ids(&[7, 2, 7, 5, 2, 9, -1, 8], 8);
        assert_eq!(ids, vec![2, 5, 7]);
        assert_eq!(remapped, vec![2, 0, 2, 1, 0, -1, -1, -1]);
        let (ids, remapped) = compact_ids(&[], 4);
        assert!(ids.is_empty() && remapped.is_empty());
    }
}
