//! The expert boundary: where a layer's routed experts run for a micro-batch. The `moe` op
//! over the device's experts; op offload of a host layer (its experts streamed through the
//! device's op-offload ring for a large batch, `offload_ring.rs`); or one round trip to the
//! host, where the experts run on the CPU (through the device expert cache when it is on).

use std::ops::Range;

use hmoe_backend::{Backend, ExpertTensors};

use super::host_experts::{staging_for, HostBatch};
use super::routing::{ExpertSplit, Routed};
use super::scratch_arena::span;
use super::state::State;
use super::step::{DeviceLayers, Step};
use crate::error::ModelError;

/// Expert choices per expert (`n_tokens × n_expert_used / n_expert`) from which an offloaded
/// micro-batch uploads every expert of each host layer instead of the routed ones: with 4,
/// about e^-4 ≈ 2% of the experts go unused, and since no routing is awaited, the first slice
/// of the next host layer's upload starts before this layer's last slice has run and
/// overlaps it.
pub const PREFETCH_ROUTES_PER_EXPERT: usize = 4;

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
        self.experts_beside(layer, r, out, &mut |_| Ok(()))
    }

    /// [`Step::experts`], with `beside` (device work that neither reads `out` nor writes
    /// what the experts read: a layer's shared experts) queued where it overlaps them: on a
    /// host layer, after the copy down and before the host waits for it, so that the device
    /// runs it while the CPU runs the routed experts; elsewhere after the experts.
    pub(crate) fn experts_beside(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        out: &mut B::Buf<f32>,
        beside: &mut dyn FnMut(&mut Self) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let parts = self.moe_parts(layer, r.split);
        if let Some(Some(experts)) = self.experts.device.get(layer) {
            self.device_moe(experts, r, parts.as_deref(), out)?;
            return beside(self);
        }
        let n = self.n_tokens();
        if self.offload {
            let upload_all = n * r.router.k >= PREFETCH_ROUTES_PER_EXPERT * r.router.n_expert;
            self.offloaded(layer, r, parts.as_deref(), upload_all, out)?;
            return beside(self);
        }
        self.host_experts(layer, r, out, beside)
    }

    /// The `moe` op of a layer over the whole micro-batch, or, with `parts`, over each part
    /// alone with its own routing.
    pub(super) fn device_moe(
        &self,
        w: &B::Moe,
        r: &Routed<'_, B>,
        parts: Option<&[Range<usize>]>,
        out: &mut B::Buf<f32>,
    ) -> Result<(), ModelError> {
        let (dev, arena) = (self.dev(), self.arena);
        let d = self.arch.dims().n_embd;
        let (ne, k) = (r.router.n_expert, r.router.k);
        let Some(parts) = parts else {
            return Ok(dev.moe(w, r.act, r.h, r.sel, r.wts, k, out)?);
        };
        for g in parts {
            let hs = arena.slice(dev, r.h, g.start * d..g.end * d)?;
            let ss = arena.slice(dev, r.scores, g.start * ne..g.end * ne)?;
            let mut sel = arena.take::<i32>(dev, g.len() * k)?;
            let mut wts = arena.take::<f32>(dev, g.len() * k)?;
            r.router.route(dev, &ss, r.bias, &mut sel, &mut wts)?;
            let mut o = arena.take::<f32>(dev, g.len() * d)?;
            dev.moe(w, r.act, &hs, &sel, &wts, k, &mut o)?;
            dev.copy_rows(&o, out, &span(0, g.len() * d, g.start * d))?;
        }
        Ok(())
    }

    /// The round trip of a host layer: the normed hidden state and the routing of every
    /// token of the micro-batch down through the staging buffers in one copy, the layer's
    /// experts on the CPU (each sequence's rows as the CPU multiplies them; hits of the device
    /// expert cache on the device), the sum up into `out`; `beside` is queued on the device
    /// behind the copy down, so that it runs while the CPU runs the experts, and so is the
    /// other micro-batch in flight's work up to its own copy down (`micro_batches.rs`).
    fn host_experts(
        &mut self,
        layer: usize,
        r: &Routed<'_, B>,
        out: &mut B::Buf<f32>,
        beside: &mut dyn FnMut(&mut Self) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let dev = self.dev;
        let d = self.arch.dims().n_embd;
        let k = r.router.k;
        let n = self.n_tokens();
        let group = self.st.group();
        self.segments.end(dev)?;
        dev.stage_down(
            staging_for(&mut self.st.io[group], dev, n, d, k)?,
            r.h,
            r.sel,
            r.wts,
        )?;
        beside(self)?;
        // The other micro-batch in flight queues its device work now, before the host waits
        // for this one's copy down (`micro_batches.rs`).
        self.st.hand_over();
        let State {
            io,
            moe_cache,
            stats,
            ..
        } = &mut *self.st;
        let io = staging_for(&mut io[group], dev, n, d, k)?;
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
        self.segments.begin(dev)?;
        stats.host_round_trips += 1;
        stats.bytes_to_host += 4 * (n * d + 2 * n * k) as u64 + down;
        stats.bytes_to_device += 4 * (n * d) as u64 + up;
        Ok(())
    }
}

/// The routed experts of layer `layer`, or a placement error for a layer without.
pub(super) fn experts_of<B: Backend>(
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
