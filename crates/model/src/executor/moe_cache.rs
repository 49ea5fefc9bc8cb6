//! The device expert cache (`--moe-cache MiB`): for layers whose routed experts
//! live on the host ([`ExpertHome::Host`]), the device keeps the most recently used experts.
//!
//! **One LRU per layer.** The budget is split evenly over the cacheable layers and each layer
//! keeps its most recently used experts within its share. Every layer sees the same traffic
//! (`k` routed pairs per token), so an even split loses little against one global LRU, and it
//! keeps one layer's burst (a prefill touching every expert of a layer) from evicting the
//! experts every other layer reuses; it also makes the memory bound simple to state and test
//! (each layer within its share, whatever the expert sizes). Every layer whose experts are on
//! the host is cacheable.
//!
//! **A micro-batch over a cached layer** (in the one round trip the layer already makes): the
//! normed hidden state, the chosen experts and their weights come down as before; each routed
//! `(token, slot)` pair whose expert the layer caches is a hit and runs on the device (the
//! `moe` op over that expert, one weighted contribution `w·expert(h)` per pair, brought down
//! in one copy), the others are misses and run on the host as one-slot rows (the CPU's expert code, the
//! same rows per expert and per sequence as without the cache, so the same bits).
//! A layer of F32 or K-quant experts, whose products the CPU sums in an order that
//! depends on how many rows go to the expert together, runs each
//! sequence's hit pairs of an expert in a `moe` call of their own, as the CPU groups
//! them.
//! The host then sums each token's contributions in slot order from zero, exactly as the CPU
//! sums them, and the sum goes up as before. Results are therefore those of the run
//! without a cache, bit for bit (on REF0, the CPU's).
//!
//! **Uploads.** The experts that missed are uploaded after the micro-batch's logits are down
//! (the most recently missed ones, at most what the layer's share holds, evicting its least
//! recently used), so a token never waits for an upload it did not need. [`Backend::upload_moe`]
//! is synchronous on REF0; on CUDA it goes through the pinned staging ring on the device's copy
//! stream (as op offload's uploads do), and the next micro-batch's kernels wait for it on the
//! device. The host thread still fills the ring before it returns, so on CUDA the next
//! micro-batch starts after the missed experts' bytes have been staged (about their size over
//! the host's copy bandwidth); handing that to a background thread is left to later GPU work. An upload that runs out of
//! device memory is skipped (the expert stays a miss); K/V caches take precedence: a new
//! sequence's cache evicts cached experts when the device is short ([`MoeCache::evict_one`]).
//! Micro-batches that op offload runs on the device (large prefills) do not use the cache.

use std::collections::BTreeMap;

use hmoe_backend::{Backend, BackendError};

use hmoe_backend::ExpertTensors;

use super::host_experts::{HostBatch, HostExperts};
use super::routing::Routed;
use super::scratch_arena::span;
use crate::error::ModelError;
use crate::expert_placement::ExpertHome;
use crate::language_model::MoeCacheStats;

/// The per-layer share of `budget` bytes and how many experts each cacheable layer keeps:
/// `expert_bytes[l]` is the device size of one expert of layer `l` (`None`: a layer that is
/// not cached). The budget is split evenly over the cacheable layers; a layer keeps
/// `min(share / expert_bytes, n_expert)` experts. Returns `(share, capacity per layer)`.
pub(crate) fn layer_capacities(
    budget: u64,
    expert_bytes: &[Option<(u64, usize)>],
) -> (u64, Vec<usize>) {
    let n = expert_bytes.iter().flatten().count() as u64;
    let share = budget.checked_div(n).unwrap_or(0);
    let caps = expert_bytes
        .iter()
        .map(|e| match e {
            Some((bytes, n_expert)) if *bytes > 0 => {
                usize::try_from(share / bytes).map_or(*n_expert, |c| c.min(*n_expert))
            }
            _ => 0,
        })
        .collect();
    (share, caps)
}

/// One cached expert on the device.
struct Cached<B: Backend> {
    expert: usize,
    moe: B::Moe,
    bytes: u64,
    last_used: u64,
}

/// One layer's cache.
struct LayerLru<B: Backend> {
    /// Experts it keeps at most.
    capacity: usize,
    /// Device bytes it may hold.
    share: u64,
    entries: Vec<Cached<B>>,
    /// Experts that missed in the micro-batch under way, with the tick of their last miss.
    missed: BTreeMap<usize, u64>,
}

impl<B: Backend> LayerLru<B> {
    fn held(&self) -> u64 {
        self.entries.iter().map(|c| c.bytes).sum()
    }

    /// Drops the least recently used entry; false when empty.
    fn evict_lru(&mut self) -> bool {
        let lru = (self.entries.iter().enumerate())
            .min_by_key(|(_, c)| c.last_used)
            .map(|(i, _)| i);
        lru.map(|i| self.entries.swap_remove(i)).is_some()
    }
}

/// Where a routed pair runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PairHome {
    /// On the device, with the layer's cache entry `usize`.
    Device(usize),
    /// On the host.
    Host,
}

/// The device expert cache of the device model (see the module docs).
pub(crate) struct MoeCache<B: Backend> {
    layers: Vec<Option<LayerLru<B>>>,
    tick: u64,
    stats: MoeCacheStats,
}

impl<B: Backend> Default for MoeCache<B> {
    fn default() -> Self {
        MoeCache {
            layers: Vec::new(),
            tick: 0,
            stats: MoeCacheStats::default(),
        }
    }
}

impl<B: Backend> MoeCache<B> {
    /// A cache of `budget` bytes over the host layers (of `homes`) whose experts are
    /// `experts(l)`. A budget of 0 disables it; a budget that holds no expert of any host
    /// layer is an error naming what one expert needs.
    pub(crate) fn new<'t>(
        experts: impl Fn(usize) -> Option<ExpertTensors<'t>>,
        homes: &[ExpertHome],
        budget: u64,
    ) -> Result<MoeCache<B>, ModelError> {
        if budget == 0 {
            return Ok(MoeCache::default());
        }
        let sizes: Vec<Option<(u64, usize)>> = (homes.iter().enumerate())
            .map(|(l, home)| {
                let t = experts(l)?;
                (*home == ExpertHome::Host).then(|| (t.expert_bytes(), t.n_expert))
            })
            .collect();
        if sizes.iter().all(Option::is_none) {
            return Err(ModelError::Placement(
                "--moe-cache: no layer has its experts on the host, so there is nothing to \
                 cache; use --moe-cache 0"
                    .into(),
            ));
        }
        let (share, caps) = layer_capacities(budget, &sizes);
        if caps.iter().all(|&c| c == 0) {
            let need = sizes.iter().flatten().map(|s| s.0).min().unwrap_or(0);
            let n = sizes.iter().flatten().count() as u64;
            return Err(ModelError::Placement(format!(
                "--moe-cache {:.1} MiB is too small: split over {n} host layers it gives \
                 {:.2} MiB a layer, and one expert takes {:.2} MiB (give at least {:.1} MiB, or \
                 0 to disable the cache)",
                budget as f64 / MIB,
                share as f64 / MIB,
                need as f64 / MIB,
                (need * n) as f64 / MIB
            )));
        }
        let layers = caps
            .iter()
            .map(|&capacity| {
                (capacity > 0).then(|| LayerLru {
                    capacity,
                    share,
                    entries: Vec::new(),
                    missed: BTreeMap::new(),
                })
            })
            .collect();
        Ok(MoeCache {
            layers,
            tick: 0,
            stats: MoeCacheStats {
                budget_bytes: budget,
                capacity: caps.iter().map(|&c| c as u64).sum(),
                ..MoeCacheStats::default()
            },
        })
    }

    /// Whether any layer is cached (the cache is on).
    pub(crate) fn enabled(&self) -> bool {
        self.layers.iter().any(Option::is_some)
    }

    /// Whether layer `layer` is cached.
    pub(crate) fn caches(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(Option::is_some)
    }

    /// What the cache counted and holds.
    pub(crate) fn stats(&self) -> MoeCacheStats {
        MoeCacheStats {
            held_bytes: self.layers.iter().flatten().map(LayerLru::held).sum(),
            ..self.stats
        }
    }

    /// Frees one cached expert (the least recently used of the layer holding the most bytes):
    /// room for a K/V cache. False when the cache holds nothing.
    pub(crate) fn evict_one(&mut self) -> bool {
        let fullest = (self.layers.iter_mut().flatten()).max_by_key(|l| l.held());
        let evicted = fullest.is_some_and(LayerLru::evict_lru);
        if evicted {
            self.stats.evictions += 1;
        }
        evicted
    }

    /// Where each routed pair of `sel` (`n × k`, experts of layer `layer`) runs, counting
    /// hits and misses and touching the hit entries; `None` when the layer is not cached or
    /// an id is out of range (the plain path reports it).
    fn split(&mut self, layer: usize, sel: &[i32], n_expert: usize) -> Option<Vec<PairHome>> {
        let lru = self.layers.get_mut(layer)?.as_mut()?;
        if sel
            .iter()
            .any(|&e| usize::try_from(e).map_or(true, |e| e >= n_expert))
        {
            return None;
        }
        let mut homes = Vec::with_capacity(sel.len());
        for &e in sel {
            self.tick += 1;
            let e = e as usize;
            match lru.entries.iter_mut().position(|c| c.expert == e) {
                Some(i) => {
                    lru.entries[i].last_used = self.tick;
                    self.stats.hits += 1;
                    homes.push(PairHome::Device(i));
                }
                None => {
                    lru.missed.insert(e, self.tick);
                    self.stats.misses += 1;
                    homes.push(PairHome::Host);
                }
            }
        }
        Some(homes)
    }

    /// Uploads the experts that missed in the micro-batch just run (per layer the most
    /// recently missed, at most the layer's capacity), evicting the least recently used;
    /// an upload the device has no memory for is skipped.
    pub(crate) fn upload_missed<'t>(
        &mut self,
        dev: &B,
        experts: impl Fn(usize) -> Option<ExpertTensors<'t>>,
    ) -> Result<(), ModelError> {
        for (l, lru) in self.layers.iter_mut().enumerate() {
            let Some(lru) = lru.as_mut() else {
                continue;
            };
            if lru.missed.is_empty() {
                continue;
            }
            let mut missed: Vec<(usize, u64)> =
                std::mem::take(&mut lru.missed).into_iter().collect();
            // Most recent first; those beyond the capacity would only evict each other.
            missed.sort_by_key(|&(_, t)| std::cmp::Reverse(t));
            missed.truncate(lru.capacity);
            let Some(t) = experts(l) else {
                continue;
            };
            // Oldest first, so that the most recent miss is the last evicted.
            for &(e, last_used) in missed.iter().rev() {
                while lru.entries.len() >= lru.capacity && lru.evict_lru() {
                    self.stats.evictions += 1;
                }
                let moe = match dev.upload_moe(&t, Some(&[e])) {
                    Ok(m) => m,
                    Err(BackendError::OutOfMemory { .. }) => break,
                    Err(other) => return Err(other.into()),
                };
                let bytes = B::moe_bytes(&moe) as u64;
                while lru.held() + bytes > lru.share && lru.evict_lru() {
                    self.stats.evictions += 1;
                }
                if bytes > lru.share {
                    // An expert larger on the device than the layer's share: not kept.
                    break;
                }
                lru.entries.push(Cached {
                    expert: e,
                    moe,
                    bytes,
                    last_used,
                });
                self.stats.uploads += 1;
            }
        }
        Ok(())
    }
}

const MIB: f64 = (1u64 << 20) as f64;

/// The device's share of a cached layer's routed pairs: each pair's weighted contribution
/// (`w·expert(h)`, `d` floats) in `ys`, row `j` for pair `order[j]`.
struct DeviceHits<B: Backend> {
    ys: B::Buf<f32>,
    order: Vec<usize>,
}

impl<B: Backend> MoeCache<B> {
    /// The expert sum of a cached host layer for the round trip's `batch` into `out` (see the
    /// module docs): hit pairs run on the device and their weighted contributions come down,
    /// missed pairs run on the host (`host`), and each token's contributions are summed in slot
    /// order from zero; when nothing hits, the host sums the whole batch as the plain round
    /// trip does. Returns the extra bytes brought down and sent up.
    pub(crate) fn run(
        &mut self,
        dev: &B,
        layer: usize,
        r: &Routed<'_, B>,
        batch: &HostBatch<'_>,
        host: &HostExperts,
        out: &mut [f32],
    ) -> Result<(u64, u64), ModelError> {
        let homes = self.split(layer, batch.sel, r.router.n_expert);
        let Some(homes) = homes.filter(|h| h.iter().any(|&p| p != PairHome::Host)) else {
            // Nothing hits (or an id the plain path reports): the plain host sum.
            host.run(layer, r.act, batch, out)?;
            return Ok((0, 0));
        };
        let (k, d) = (
            batch.k,
            out.len() / batch.groups.last().map_or(1, |g| g.end.max(1)),
        );
        // Contributions `w·expert(h)` of every pair, `n·k × d`.
        let mut contrib = vec![0f32; homes.len() * d];
        // Device: queued now and brought down after the host has run the misses (so that both
        // sides work at once on a device that queues).
        // Experts whose order varies with the rows: each sequence's pairs apart.
        let per_seq = host.order_varies(layer);
        let (hits, up_bytes) = self.device_hits(dev, layer, r, batch, &homes, per_seq, d)?;
        let misses: Vec<usize> = (0..homes.len())
            .filter(|&i| homes[i] == PairHome::Host)
            .collect();
        host_misses(layer, r, batch, host, &misses, d, &mut contrib)?;
        let mut down_bytes = 0u64;
        if let Some(DeviceHits { ys, order }) = hits {
            let ys = dev.download(&ys)?;
            down_bytes += 4 * ys.len() as u64;
            for (row, &i) in ys.chunks_exact(d).zip(&order) {
                contrib[i * d..(i + 1) * d].copy_from_slice(row);
            }
        }
        // Each token's sum in slot order from zero, as the CPU adds them.
        for (t, o) in out.chunks_exact_mut(d).enumerate() {
            o.fill(0.0);
            for s in 0..k {
                let c = &contrib[(t * k + s) * d..(t * k + s + 1) * d];
                for (ov, &cv) in o.iter_mut().zip(c) {
                    *ov += cv;
                }
            }
        }
        Ok((down_bytes, up_bytes))
    }

    /// Queues the hit pairs of `homes` on the device, grouped by cache entry (and by sequence
    /// when `per_seq`), each entry's pairs in token order; `None` when nothing hits. Returns
    /// the bytes sent up for them too.
    #[allow(clippy::too_many_arguments)]
    fn device_hits(
        &self,
        dev: &B,
        layer: usize,
        r: &Routed<'_, B>,
        batch: &HostBatch<'_>,
        homes: &[PairHome],
        per_seq: bool,
        d: usize,
    ) -> Result<(Option<DeviceHits<B>>, u64), ModelError> {
        let (k, groups) = (batch.k, batch.groups);
        let n = groups.last().map_or(0, |g| g.end);
        let hits: Vec<usize> = (0..homes.len())
            .filter(|&i| homes[i] != PairHome::Host)
            .collect();
        if hits.is_empty() {
            return Ok((None, 0));
        }
        let Some(lru) = self.layers.get(layer).and_then(Option::as_ref) else {
            return Err(ModelError::Cache("expert cache layer vanished".into()));
        };
        let seq_of = |t: usize| groups.iter().position(|g| g.contains(&t)).unwrap_or(0);
        let mut by_entry: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
        for &i in &hits {
            if let PairHome::Device(c) = homes[i] {
                let seq = if per_seq { seq_of(i / k) } else { 0 };
                by_entry.entry((c, seq)).or_default().push(i);
            }
        }
        let mut up_bytes = 0u64;
        // Scratch: every hit's row is written below.
        let mut ys = dev.alloc_scratch::<f32>(hits.len() * d)?;
        let mut order = Vec::with_capacity(hits.len());
        for ((c, _), pairs) in &by_entry {
            let m = pairs.len();
            let xs = if m == n && pairs.iter().enumerate().all(|(j, &i)| i / k == j) {
                None
            } else {
                let mut xs = dev.alloc_scratch::<f32>(m * d)?;
                for (j, &i) in pairs.iter().enumerate() {
                    dev.copy_rows(r.h, &mut xs, &span((i / k) * d, d, j * d))?;
                }
                Some(xs)
            };
            let sel = dev.upload(&vec![0i32; m])?;
            let wts: Vec<f32> = pairs.iter().map(|&i| batch.w[i]).collect();
            let wts = dev.upload(&wts)?;
            up_bytes += 8 * m as u64;
            let mut y = dev.alloc_scratch::<f32>(m * d)?;
            let x = xs.as_ref().unwrap_or(r.h);
            dev.moe(&lru.entries[*c].moe, r.act, x, &sel, &wts, 1, &mut y)?;
            dev.copy_into(&y, &mut ys, order.len() * d)?;
            order.extend_from_slice(pairs);
        }
        Ok((Some(DeviceHits { ys, order }), up_bytes))
    }
}

/// The missed pairs `misses` of a cached layer on the host, as one-slot rows in token order,
/// each sequence's rows together as its tokens were; each pair's contribution goes to its row
/// of `contrib`.
fn host_misses<B: Backend>(
    layer: usize,
    r: &Routed<'_, B>,
    batch: &HostBatch<'_>,
    host: &HostExperts,
    misses: &[usize],
    d: usize,
    contrib: &mut [f32],
) -> Result<(), ModelError> {
    if misses.is_empty() {
        return Ok(());
    }
    let k = batch.k;
    let mut h = Vec::with_capacity(misses.len() * d);
    let mut sel = Vec::with_capacity(misses.len());
    let mut w = Vec::with_capacity(misses.len());
    for &i in misses {
        let t = i / k;
        h.extend_from_slice(&batch.h[t * d..(t + 1) * d]);
        sel.push(batch.sel[i]);
        w.push(batch.w[i]);
    }
    let mut pair_groups = Vec::with_capacity(batch.groups.len());
    let mut start = 0;
    for g in batch.groups {
        let len = misses.iter().filter(|&&i| g.contains(&(i / k))).count();
        if len > 0 {
            pair_groups.push(start..start + len);
        }
        start += len;
    }
    let rows = HostBatch {
        h: &h,
        sel: &sel,
        w: &w,
        k: 1,
        groups: &pair_groups,
    };
    let mut ys = vec![0f32; misses.len() * d];
    host.run(layer, r.act, &rows, &mut ys)?;
    for (row, &i) in ys.chunks_exact(d).zip(misses) {
        contrib[i * d..(i + 1) * d].copy_from_slice(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_split_evenly_over_cacheable_layers() {
        let mib = 1u64 << 20;
        let sizes = [None, Some((mib, 16)), Some((2 * mib, 16)), None];
        let (share, caps) = layer_capacities(10 * mib, &sizes);
        assert_eq!(share, 5 * mib);
        assert_eq!(caps, vec![0, 5, 2, 0]);
        // Never more than the layer's experts.
        let (_, caps) = layer_capacities(1000 * mib, &sizes);
        assert_eq!(caps, vec![0, 16, 16, 0]);
        // Too small for one expert anywhere.
        let (_, caps) = layer_capacities(mib, &sizes);
        assert_eq!(caps, vec![0, 0, 0, 0]);
        // No cacheable layer.
        assert_eq!(layer_capacities(mib, &[None, None]), (0, vec![0, 0]));
    }

    #[test]
    fn hit_rate() {
        let s = MoeCacheStats {
            hits: 3,
            misses: 1,
            ..MoeCacheStats::default()
        };
        assert_eq!(s.hit_rate(), 0.75);
        assert_eq!(MoeCacheStats::default().hit_rate(), 0.0);
    }
}
